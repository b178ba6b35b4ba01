"""Engine state save/restore: everything needed to continue a run exactly, on any device.

The state is a plain nested dict of CPU tensors, ints, floats, bools, strings and None, so
``torch.save`` / ``torch.load(weights_only=True)`` round-trip it. The model's weights are
NOT included: save ``model.state_dict()`` beside it (the caller owns the model, like RNG).
Device tensors are copied to the host through the accelerator (waited for); loading
copies each piece to where it lives (device state to the device, host state to the host),
so a checkpoint saved on one device type loads on another.

In-flight host work is drained first (waited for, so the host master and moments are
final; every gradient piece on its way to the host is added). Its result is NOT applied
early: the state records it as "pending" and the loaded engine applies it at the next
window end, exactly when the uninterrupted run would have. Window sums are stored full
shape with the selected columns zeroed, so a checkpoint is independent of the transport
(summed in place on a CPU device, or piece by piece on the host in the compact layout of
the non-selected columns) and of the buffer slot.

Saving and loading go part by part, the same parts both ways: the header (format, mode,
dtype, counters, ranks), each mode's state (device: torch's optimizer; offload: the host
state per parameter; zenflow: per weight, the always-important parameters, the schedule's
counters and the pending host step). The file format is ``FORMAT``; change it only with a
new format number.
"""

from __future__ import annotations

import torch

from zenflow.engine.host import HostJob
from zenflow.errors import EngineError

# 4: embeddings score their rows (tokens) as columns (``selection.column_axis``); a state
# saved by 3 indexes their other axis.
FORMAT = "zenflow-engine/4"


def engine_state_dict(engine, share_host: bool = False) -> dict:
    """The engine's state as plain data. ``share_host``: host tensors (the fp32 master,
    moments, counts) are referenced, not copied: the caller must write the state before the
    engine steps, flushes or closes again (a final checkpoint saved at once: no second copy
    of 12+ bytes per parameter in host memory). Device tensors are always copied."""
    sd = _header(engine)
    if engine.mode == "device":
        sd.update(_device_mode_state(engine.impl, engine.accel))
    elif engine.mode == "offload":
        sd["offload"] = _offload_state(engine.impl, share_host)
    else:
        sd["zenflow"] = _zenflow_state(engine, share_host)
    return sd


def load_engine_state(engine, sd: dict) -> None:
    _check_header(engine, sd)
    engine.global_step = int(sd["global_step"])
    engine.skipped_steps = int(sd["skipped_steps"])
    if engine.mode == "device":
        _load_device_mode(engine.impl, sd, engine.accel)
    elif engine.mode == "offload":
        _load_offload(engine.impl, sd["offload"])
    else:
        _load_zenflow(engine, sd["zenflow"])


# ---------------------------------------------------------------------- helpers
def _host(t: torch.Tensor, share_host: bool) -> torch.Tensor:
    """``t`` on the host: referenced when it is there already and ``share_host``, else a
    copy."""
    return t.detach() if share_host and t.device.type == "cpu" else t.detach().to(
        "cpu", copy=True)  # fmt: skip


def _tree_to_host(obj, accel):
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _tree_to_host(v, accel) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_tree_to_host(v, accel) for v in obj)
    return obj


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise EngineError(f"Cannot load engine state: {msg}")


def _fill_device(dst: torch.Tensor, src: torch.Tensor, accel) -> None:
    """Copy host ``src`` into the existing device tensor ``dst`` and wait."""
    accel.compute_wait(accel.copy_h2d(dst, src.to(dst.dtype)))


# ---------------------------------------------------------------------- header
def _header(engine) -> dict:
    return {
        "format": FORMAT,
        "mode": engine.mode,
        "dtype": str(engine.dtype),
        "global_step": engine.global_step,
        "skipped_steps": engine.skipped_steps,
        "world_size": engine.dp.world,
        "rank": engine.dp.rank,
    }


def _check_header(engine, sd: dict) -> None:
    """The saved state is of this format and of an engine like this one (mode, training
    dtype, rank and number of ranks)."""
    _check(sd.get("format") == FORMAT, f"format {sd.get('format')!r}, expected {FORMAT!r}.")
    _check(
        sd["mode"] == engine.mode,
        f"it was saved in mode {sd['mode']!r} but this engine runs mode {engine.mode!r}.",
    )
    _check(
        sd.get("dtype") == str(engine.dtype),
        f"it was saved with training dtype {sd.get('dtype')} but this engine trains in "
        f"{engine.dtype} (bf16.enabled must match).",
    )
    _check(
        (sd.get("world_size", 1), sd.get("rank", 0)) == (engine.dp.world, engine.dp.rank),
        f"it is rank {sd.get('rank', 0)} of {sd.get('world_size', 1)} ranks but this engine is "
        f"rank {engine.dp.rank} of {engine.dp.world}: resume with the same number of ranks.",
    )


# ---------------------------------------------------------------------- the baselines
def _device_mode_state(impl, accel) -> dict:
    """torch's optimizer state (and the fp32 masters of mixed precision), on the host."""
    out = {"device_optimizer": _tree_to_host(impl.optimizer.state_dict(), accel)}
    if impl.mixed:
        out["device_masters"] = [accel.to_host(m.data) for m in impl.masters]
    return out


def _load_device_mode(impl, sd: dict, accel) -> None:
    if impl.mixed:
        for m, src in zip(impl.masters, sd["device_masters"], strict=True):
            _fill_device(m.data, src, accel)
    impl.optimizer.load_state_dict(sd["device_optimizer"])  # moves state to the params


def _offload_state(impl, share_host: bool) -> dict:
    return {
        name: {
            "master": _host(st.master, share_host),
            "exp_avg": _host(st.exp_avg, share_host),
            "exp_avg_sq": _host(st.exp_avg_sq, share_host),
            "step": int(st.steps),
        }
        for name, st in impl.states.items()
    }


def _load_offload(impl, saved: dict) -> None:
    _check(set(impl.states) == set(saved), "the offloaded parameters differ.")
    for name, st in impl.states.items():
        src = saved[name]
        st.master.copy_(src["master"])
        st.exp_avg.copy_(src["exp_avg"])
        st.exp_avg_sq.copy_(src["exp_avg_sq"])
        st.steps = int(src["step"])


# ---------------------------------------------------------------------- zenflow: saving
def _zenflow_state(engine, share_host: bool) -> dict:
    """Drains the in-flight host work first (its result stays pending, see above)."""
    accel = engine.accel
    impl = engine.impl
    impl.drain()
    pending = None
    if impl.inflight is not None:
        job = impl.inflight
        pending = {"window_start": job.window_start, "submit_step": job.submit_step}
    weights = {}
    for w in impl.zweights:
        weights[w.spec.name] = _weight_state(w, accel)
        if w.owned:
            weights[w.spec.name]["host"] = _weight_host_state(w, impl, share_host)
    return {
        "selected": impl.selected,
        "last_select_step": impl.last_select_step,
        "selections": impl.selections,
        "window_len": impl.window_len,
        "window_lr_sum": impl.window_lr_sum,
        "window_start": impl.window_start,
        "pending": pending,
        "topk_ratio": impl.topk_ratio,
        "weights": weights,
        "dense": {
            d.spec.name: {
                "master": None if d.master is None else accel.to_host(d.master),
                "exp_avg": accel.to_host(d.exp_avg),
                "exp_avg_sq": accel.to_host(d.exp_avg_sq),
                "step": d.step,
            }
            for d in engine.dense
        },
    }


def _weight_state(w, accel) -> dict:
    """A ZenFlow weight's selection, its selected columns' device state and its masses."""
    return {
        "selected": None if w.sel_host is None else w.sel_host.clone(),
        "master_sel": None if w.master_sel is None else accel.to_host(w.master_sel),
        "exp_avg_dev": accel.to_host(w.exp_avg_dev),
        "exp_avg_sq_dev": accel.to_host(w.exp_avg_sq_dev),
        "steps_dev": accel.to_host(w.steps_dev.counts),
        "sel_mass_sum": w.sel_mass_sum,
        "nonsel_mass_acc": w.nonsel_mass_acc,
        "owner": w.owner,
        "host": None,  # data parallel: the host state lives with the owner only
    }


def _weight_host_state(w, impl, share_host: bool) -> dict:
    """An owned weight's host state: fp32 master, moments, per-column counts, and the
    window's gradient sum (full shape, the selected columns zero)."""
    acc = torch.zeros(w.spec.param.shape, dtype=torch.float32)
    if impl.window_len > 0 and w.nonsel_host is not None:
        if impl.zero_copy:
            cur = _host(w.acc[impl.slot], share_host).index_select(w.cd, w.nonsel_host)
        elif w.fresh[impl.slot]:  # no gradient reached it this window yet: zero
            cur = torch.zeros(w.compact_shape())
        else:
            cur = w.acc[impl.slot].view(w.compact_shape())
        acc.index_copy_(w.cd, w.nonsel_host, cur)
    return {
        "master": _host(w.host.master, share_host),
        "exp_avg": _host(w.host.exp_avg, share_host),
        "exp_avg_sq": _host(w.host.exp_avg_sq, share_host),
        "steps": _host(w.host.steps.counts, share_host),
        "grad_accum_sum": acc,
    }


# ---------------------------------------------------------------------- zenflow: loading
def _load_zenflow(engine, z: dict) -> None:
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
    for w in impl.zweights:
        src = z["weights"][w.spec.name]
        _load_weight(w, src, engine.device, engine.accel)
        if w.owned:
            _load_weight_host(w, src["host"], impl, int(z["window_len"]), engine.accel)
    for d in engine.dense:
        src = z["dense"][d.spec.name]
        if d.master is not None:
            _fill_device(d.master, src["master"], engine.accel)
        _fill_device(d.exp_avg, src["exp_avg"], engine.accel)
        _fill_device(d.exp_avg_sq, src["exp_avg_sq"], engine.accel)
        d.step = int(src["step"])
    _load_schedule(impl, z)


def _load_weight(w, src: dict, dev: torch.device, accel) -> None:
    """A weight's selection, its selected columns' device state and its masses."""
    if src["selected"] is not None:
        w.set_selection(src["selected"].to(dev))
    else:
        w.sel_dev = w.sel_host = w.nonsel_dev = w.nonsel_host = None
    if w.master_sel is not None:
        _fill_device(w.master_sel, src["master_sel"], accel)
    _fill_device(w.exp_avg_dev, src["exp_avg_dev"], accel)
    _fill_device(w.exp_avg_sq_dev, src["exp_avg_sq_dev"], accel)
    _fill_device(w.steps_dev.counts, src["steps_dev"], accel)
    w.steps_dev.recheck()
    w.sel_mass_sum = float(src["sel_mass_sum"])
    w.nonsel_mass_acc = float(src["nonsel_mass_acc"])
    _check(int(src["owner"]) == w.owner, f"{w.spec.name} has another owner rank.")


def _load_weight_host(w, h: dict, impl, window_len: int, accel) -> None:
    """An owned weight's host state, and the window's gradient sum into slot 0 (the
    transport's own layout: full shape in place on a CPU device, else compact)."""
    w.host.master.copy_(h["master"])
    w.host.exp_avg.copy_(h["exp_avg"])
    w.host.exp_avg_sq.copy_(h["exp_avg_sq"])
    w.host.steps.counts.copy_(h["steps"])
    w.host.steps.recheck()
    if impl.zero_copy:
        for a in w.acc:
            a.zero_()
        _fill_device(w.acc[0], h["grad_accum_sum"], accel)
    else:
        w.fresh = [True] * len(w.acc)
        if w.nonsel_host is not None and window_len > 0:
            cols = h["grad_accum_sum"].index_select(w.cd, w.nonsel_host)
            w.acc[0].view(w.compact_shape()).copy_(cols)
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
    p = z["pending"]
    # a finished, not yet applied host step: applied at the next window end (its image is
    # packed again from the loaded master, exactly what the worker packed)
    impl.inflight = None
    impl.last_applied = None
    if p is not None:
        impl.inflight = HostJob(window_start=p["window_start"], submit_step=p["submit_step"])
        if not impl.zero_copy:
            for w in impl.zweights:
                if w.owned:
                    w.pack_image()
