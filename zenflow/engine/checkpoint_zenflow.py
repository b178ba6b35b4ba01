"""The zenflow mode's part of an engine checkpoint: saved straight from the host state,
loaded back into it (formats 5 and 4).

Per ZenFlow weight: the selection, the selected columns' device state, the auto interval's
masses, and on its owner the host state AS IT IS (``zenflow.engine.zenflow.host_layout``):
after the first selection the compact arrays of the non-selected columns (fp32 master,
moments, counts) with the non-selected index that defines their layout, and the compact
window sum (None while no gradient reached it in the window); before it, warm-up's
full-shape state ("full") or the masters taken at set-up ("none"). With ``share_host``
every host tensor is the live one (no copy: the engine is drained and at a step boundary,
and the caller writes the state before the engine runs again); device tensors are passed
as they are where they are host memory already (cpu, sim) and on cuda (``torch.save``
copies a device storage with ``.cpu()`` one at a time, so the host holds at most the
largest one at once, where a copy here would hold all of them). Without it, everything is
copied to plain host tensors. The exception is a CPU device's window sum, full shape
where autograd writes it: its non-selected columns are gathered (one weight at a time).

Loading copies each part to where it lives. Format 4 (full-shape host state and window
sum) is converted by ``index_select`` on load, weight by weight. A checkpoint of the
compact host state never resumes as the exact one, nor the other way round.

Must not touch the other modes' state or the header (``checkpoint``).
"""

from __future__ import annotations

import torch

from zenflow.engine.host import HostJob
from zenflow.engine.zenflow.host_layout import compact_shape, new_compact, new_full
from zenflow.errors import EngineError


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise EngineError(f"Cannot load engine state: {msg}")


def _keep(t: torch.Tensor | None, share: bool, accel) -> torch.Tensor | None:
    """``t`` for the state: the tensor itself (``share``), else a host copy."""
    if t is None:
        return None
    if share:
        return t.detach()
    if t.device.type == "cpu":
        return t.detach().clone()
    return accel.to_host(t.detach())


def _fill(dst: torch.Tensor, src: torch.Tensor, accel) -> None:
    """Copy ``src`` (host) into ``dst`` (device or host) and wait."""
    src = src.to(dst.dtype)
    if dst.device.type == "cpu" and accel.shared_memory:
        dst.copy_(src)
        return
    accel.compute_wait(accel.copy_h2d(dst, src))


# ---------------------------------------------------------------------- saving
def zenflow_state(engine, share_host: bool) -> dict:
    """Drains the in-flight host work first (its result stays pending: the loaded engine
    applies it at the next window end, exactly when the uninterrupted run would have)."""
    accel = engine.accel
    impl = engine.impl
    impl.drain()
    pending = None
    if impl.inflight is not None:
        job = impl.inflight
        pending = {"window_start": job.window_start, "submit_step": job.submit_step}
    weights = {}
    for w in impl.zweights:
        weights[w.spec.name] = _weight_state(w, accel, share_host)
        if w.owned:
            weights[w.spec.name]["host"] = _host_state(w, impl, accel, share_host)
    return {
        "host_state": impl.host_state,
        "selected": impl.selected,
        "last_select_step": impl.last_select_step,
        "selections": impl.selections,
        "window_len": impl.window_len,
        "window_lr_sum": impl.window_lr_sum,
        "window_coef": impl.window_coef,
        # zfctl.step_store "q8": the coefficient the next step's adds predict
        "store_pred": impl.q8_store.pred if impl.q8_store is not None else 1.0,
        "window_start": impl.window_start,
        "pending": pending,
        "topk_ratio": impl.topk_ratio,
        "weights": weights,
        "dense": {
            d.spec.name: {
                "master": _keep(d.master, share_host, accel),
                "exp_avg": _keep(d.exp_avg, share_host, accel),
                "exp_avg_sq": _keep(d.exp_avg_sq, share_host, accel),
                "step": d.step,
            }
            for d in engine.dense
        },
    }


def _weight_state(w, accel, share: bool) -> dict:
    """A ZenFlow weight's selection, its selected columns' device state and its masses."""
    return {
        "selected": None if w.sel_host is None else w.sel_host.clone(),
        "master_sel": _keep(w.master_sel, share, accel),
        "exp_avg_dev": _keep(w.exp_avg_dev, share, accel),
        "exp_avg_sq_dev": _keep(w.exp_avg_sq_dev, share, accel),
        "steps_dev": _keep(w.steps_dev.counts, share, accel),
        "sel_mass_sum": w.sel_mass_sum,
        "nonsel_mass_acc": w.nonsel_mass_acc,
        "owner": w.owner,
        "host": None,  # data parallel: the host state lives with the owner only
    }


def _host_state(w, impl, accel, share: bool) -> dict:
    """An owned weight's host state as it is, and the window's gradient sum (compact)."""
    h = w.host
    if w.host_layout == "none":
        return {"layout": "none", "init_master": _keep(w.init_master, share, accel)}
    out = {
        "layout": w.host_layout,
        "master": _keep(h.master, share, accel),
        **{name: _keep(t, share, accel) for name, t in h.moment_tensors().items()},
        "steps": _keep(h.steps.counts, share, accel),
    }
    if w.host_layout == "compact":
        out["nonsel"] = w.nonsel_host.clone()
        out["grad_accum_sum"] = _window_sum(w, impl, accel, share)
    return out


def _window_sum(w, impl, accel, share: bool) -> torch.Tensor | None:
    """The window's gradient sum of the non-selected columns, compact, or None while none
    reached it (the window's first add overwrites it)."""
    if impl.window_len == 0:
        return None
    acc = w.acc[impl.slot]
    if impl.zero_copy:  # full shape where autograd writes: its non-selected columns
        return acc.index_select(w.cd, w.nonsel_dev).cpu().view(-1)
    if w.fresh[impl.slot]:
        return None
    return _keep(acc, share, accel)


# ---------------------------------------------------------------------- loading
def load_zenflow(engine, z: dict, fmt: int) -> None:
    impl = engine.impl
    impl.drain()
    names = {w.spec.name for w in impl.zweights}
    _check(
        names == set(z["weights"]),
        "the model's ZenFlow weights differ from the saved ones (different model or min_numel).",
    )
    _check(
        abs(z["topk_ratio"] - impl.topk_ratio) < 1e-12,
        f"topk_ratio {impl.topk_ratio} differs from the saved {z['topk_ratio']}.",
    )
    saved_state = z.get("host_state", "exact")
    _check(
        saved_state == impl.host_state,
        f"it was saved with zfctl.host_state {saved_state!r} but this run uses "
        f"{impl.host_state!r}: resume with zfctl.host_state {saved_state!r} (set it in the "
        "config's zfctl block, or with --set zfctl.host_state=...), or start a new run.",
    )
    for w in impl.zweights:
        src = z["weights"][w.spec.name]
        _load_weight(w, src, engine.device, engine.accel)
        if w.owned:
            host = src["host"] if fmt >= 5 else _from_format4(w, src["host"])
            _load_host(w, host, impl, int(z["window_len"]), engine.accel)
    for d in engine.dense:
        src = z["dense"][d.spec.name]
        if d.master is not None:
            _fill(d.master, src["master"], engine.accel)
        _fill(d.exp_avg, src["exp_avg"], engine.accel)
        _fill(d.exp_avg_sq, src["exp_avg_sq"], engine.accel)
        d.step = int(src["step"])
    _load_schedule(impl, z)


def _load_weight(w, src: dict, dev: torch.device, accel) -> None:
    """A weight's selection, its selected columns' device state and its masses."""
    if src["selected"] is not None:
        sel = src["selected"].to(torch.int64)
        w.set_selection(sel.to(dev), sel)
    else:
        w.clear_selection()
    if w.master_sel is not None:
        _fill(w.master_sel, src["master_sel"], accel)
    _fill(w.exp_avg_dev, src["exp_avg_dev"], accel)
    _fill(w.exp_avg_sq_dev, src["exp_avg_sq_dev"], accel)
    _fill(w.steps_dev.counts, src["steps_dev"], accel)
    w.steps_dev.mirror = src["steps_dev"].detach().to("cpu", torch.int64).clone()
    w.steps_dev.recheck()
    w.sel_mass_sum = float(src["sel_mass_sum"])
    w.nonsel_mass_acc = float(src["nonsel_mass_acc"])
    _check(int(src["owner"]) == w.owner, f"{w.spec.name} has another owner rank.")


def _from_format4(w, h: dict) -> dict:
    """A format-4 host state (full shape, window sum full shape with the selected columns
    zero) in format 5's layout: compact by ``index_select`` once columns were selected."""
    if w.sel_host is None:
        return {"layout": "full", "master": h["master"], "exp_avg": h["exp_avg"],
                "exp_avg_sq": h["exp_avg_sq"], "steps": h["steps"]}  # fmt: skip
    cd, ns = w.cd, w.nonsel_host
    return {
        "layout": "compact",
        "nonsel": ns,
        "master": h["master"].index_select(cd, ns),
        "exp_avg": h["exp_avg"].index_select(cd, ns),
        "exp_avg_sq": h["exp_avg_sq"].index_select(cd, ns),
        "steps": h["steps"][ns],
        "grad_accum_sum": h["grad_accum_sum"].index_select(cd, ns).reshape(-1),
    }


def _load_host(w, h: dict, impl, window_len: int, accel) -> None:
    """An owned weight's host state in its saved layout, and the window's gradient sum into
    slot 0 (the transport's own layout: full shape in place on a CPU device, else
    compact)."""
    layout = h["layout"]
    if layout == "none":
        w.host, w.host_layout = None, "none"
        w.init_master = None if h["init_master"] is None else h["init_master"].clone()
        return
    if layout == "full":
        if w.host_layout != "full":
            w.host, w.host_layout, w.init_master = new_full(w, accel), "full", None
        w.host.master.copy_(h["master"])
        w.host.exp_avg.copy_(h["exp_avg"])
        w.host.exp_avg_sq.copy_(h["exp_avg_sq"])
        w.host.steps.counts.copy_(h["steps"])
        w.host.steps.recheck()
        return
    _check(
        w.sel_host is not None and torch.equal(h["nonsel"], w.nonsel_host),
        f"{w.spec.name}: its host state's columns do not match its selection.",
    )
    if w.host_layout != "compact":
        w.host = new_compact(w, impl)
        w.host_layout = "compact"
        w.init_master = None
    w.host.master.copy_(h["master"].view(compact_shape(w)))
    w.host.load_moments(h)
    w.host.steps.counts.copy_(h["steps"])
    w.host.steps.recheck()
    w.window_buffers(impl)
    _load_window_sum(w, h.get("grad_accum_sum"), impl, window_len, accel)


def _load_window_sum(w, saved, impl, window_len: int, accel) -> None:
    if impl.zero_copy:
        for a in w.acc:
            a.zero_()
        if saved is not None and window_len > 0:
            full = torch.zeros(w.spec.param.shape, dtype=torch.float32)
            full.index_copy_(w.cd, w.nonsel_host, saved.view(compact_shape(w)).float())
            _fill(w.acc[0], full, accel)
        return
    w.fresh = [True] * len(w.acc)
    if saved is not None and window_len > 0:
        w.acc[0].copy_(saved.reshape(-1))
        w.fresh[0] = False


def _load_schedule(impl, z: dict) -> None:
    """The schedule's counters, and the pending host step."""
    impl.slot = 0
    impl.selected = bool(z["selected"])
    impl.last_select_step = int(z["last_select_step"])
    # older checkpoints (before zfctl.select_schedule) hold no count: "fixed" never reads it
    impl.selections = int(z.get("selections", 1 if impl.selected else 0))
    impl.window_len = int(z["window_len"])
    impl.window_start = int(z["window_start"])
    # older checkpoints (before zfctl.window_lr) hold no sum: "last" never reads it
    impl.window_lr_sum = float(z.get("window_lr_sum", 0.0))
    # older checkpoints (before clipping without the step store) hold none: 1.0 then
    impl.window_coef = float(z.get("window_coef", 1.0))
    if impl.q8_store is not None:  # older checkpoints (before the q8 store): 1.0
        impl.q8_store.pred = float(z.get("store_pred", 1.0))
    p = z["pending"]
    # a finished, not yet applied host step: applied at the next window end (its result
    # is the loaded master, exactly what the worker wrote)
    impl.inflight = None
    impl.last_applied = None
    if p is not None:
        impl.inflight = HostJob(window_start=p["window_start"], submit_step=p["submit_step"])
