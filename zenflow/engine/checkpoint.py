"""Engine state save/restore: everything needed to continue a run exactly.

The state is a plain nested dict of CPU tensors, ints, floats, bools, strings and None, so
``torch.save`` / ``torch.load(weights_only=True)`` round-trip it. The model's weights are
NOT included: save ``model.state_dict()`` beside it (the caller owns the model, like RNG).

In-flight host work is drained first (waited for, so the host master and moments are
final). Its result is NOT applied early: the state records it as "pending" and the loaded
engine applies it at the next window end, exactly when the uninterrupted run would have.
Accumulators are stored full-shape with the selected columns zeroed, so a checkpoint is
independent of ``grad_accum`` and of the double-buffer slot.
"""

from __future__ import annotations

import torch

from zenflow.engine.host import HostJob
from zenflow.errors import EngineError

FORMAT = "zenflow-engine/1"


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def engine_state_dict(engine) -> dict:
    sd: dict = {
        "format": FORMAT,
        "mode": engine.mode,
        "global_step": engine.global_step,
        "skipped_steps": engine.skipped_steps,
    }
    if engine.mode == "device":
        sd["device_optimizer"] = engine.optimizer.state_dict()
        return sd
    if engine.mode == "offload":
        sd["offload"] = {
            name: {
                "master": _cpu(st.master),
                "exp_avg": _cpu(st.exp_avg),
                "exp_avg_sq": _cpu(st.exp_avg_sq),
                "step": st.step,
            }
            for name, st in engine.offload_states.items()
        }
        return sd
    pending = None
    job = engine._inflight
    if job is not None:
        if job.future is not None:
            engine.worker.wait(job)  # drain; keep it unapplied (see module docstring)
        pending = {"window_start": job.window_start, "submit_step": job.submit_step}
    weights = {}
    for w in engine.zweights:
        acc = torch.zeros(w.spec.param.shape, dtype=torch.float32)
        if engine.window_len > 0 and w.nonsel_host is not None:
            cur = w.acc[engine.slot].detach().cpu()
            if engine.grad_accum == "host":
                acc.index_copy_(w.cd, w.nonsel_host, cur)
            else:
                acc.index_copy_(w.cd, w.nonsel_host, cur.index_select(w.cd, w.nonsel_host))
        weights[w.spec.name] = {
            "selected": None if w.sel_host is None else w.sel_host.clone(),
            "exp_avg_dev": _cpu(w.exp_avg_dev),
            "exp_avg_sq_dev": _cpu(w.exp_avg_sq_dev),
            "step_dev": w.step_dev,
            "master": _cpu(w.host.master),
            "exp_avg_host": _cpu(w.host.exp_avg),
            "exp_avg_sq_host": _cpu(w.host.exp_avg_sq),
            "step_host": w.host.step,
            "grad_accum_sum": acc,
            "sel_mass_sum": w.sel_mass_sum,
            "nonsel_mass_acc": w.nonsel_mass_acc,
        }
    sd["zenflow"] = {
        "selected": engine.selected,
        "last_select_step": engine.last_select_step,
        "window_len": engine.window_len,
        "window_start": engine.window_start,
        "pending": pending,
        "topk_ratio": engine.topk_ratio,
        "weights": weights,
        "dense": {
            d.spec.name: {
                "exp_avg": _cpu(d.exp_avg),
                "exp_avg_sq": _cpu(d.exp_avg_sq),
                "step": d.step,
            }
            for d in engine.dense
        },
    }
    return sd


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise EngineError(f"Cannot load engine state: {msg}")


def load_engine_state(engine, sd: dict) -> None:
    _check(sd.get("format") == FORMAT, f"format {sd.get('format')!r}, expected {FORMAT!r}.")
    _check(
        sd["mode"] == engine.mode,
        f"it was saved in mode {sd['mode']!r} but this engine runs mode {engine.mode!r}.",
    )
    engine.global_step = int(sd["global_step"])
    engine.skipped_steps = int(sd["skipped_steps"])
    if engine.mode == "device":
        engine.optimizer.load_state_dict(sd["device_optimizer"])
        return
    if engine.mode == "offload":
        for name, st in engine.offload_states.items():
            src = sd["offload"][name]
            st.master.copy_(src["master"])
            st.exp_avg.copy_(src["exp_avg"])
            st.exp_avg_sq.copy_(src["exp_avg_sq"])
            st.step = int(src["step"])
        return
    z = sd["zenflow"]
    if engine._inflight is not None and engine._inflight.future is not None:
        engine.worker.wait(engine._inflight)
    names = {w.spec.name for w in engine.zweights}
    _check(
        names == set(z["weights"]),
        "the model's ZenFlow weights differ from the saved ones (different model or min_numel).",
    )
    _check(
        abs(z["topk_ratio"] - engine.topk_ratio) < 1e-12,
        f"topk_ratio {engine.topk_ratio} differs from the saved {z['topk_ratio']}.",
    )
    dev = engine.device
    for w in engine.zweights:
        src = z["weights"][w.spec.name]
        if src["selected"] is not None:
            w.set_selection(src["selected"].to(dev))
        else:
            w.sel_dev = w.sel_host = w.nonsel_dev = w.nonsel_host = None
        w.exp_avg_dev = src["exp_avg_dev"].to(dev, torch.float32).clone()
        w.exp_avg_sq_dev = src["exp_avg_sq_dev"].to(dev, torch.float32).clone()
        w.step_dev = int(src["step_dev"])
        w.host.master.copy_(src["master"])
        w.host.exp_avg.copy_(src["exp_avg_host"])
        w.host.exp_avg_sq.copy_(src["exp_avg_sq_host"])
        w.host.step = int(src["step_host"])
        w.sel_mass_sum = float(src["sel_mass_sum"])
        w.nonsel_mass_acc = float(src["nonsel_mass_acc"])
        acc = src["grad_accum_sum"]
        if engine.grad_accum == "host":
            if w.nonsel_host is not None:
                w.acc[0].copy_(acc.index_select(w.cd, w.nonsel_host))
        else:
            w.acc[0].copy_(acc)
    for d in engine.dense:
        src = z["dense"][d.spec.name]
        d.exp_avg.copy_(src["exp_avg"])
        d.exp_avg_sq.copy_(src["exp_avg_sq"])
        d.step = int(src["step"])
    engine.slot = 0
    engine.selected = bool(z["selected"])
    engine.last_select_step = int(z["last_select_step"])
    engine.window_len = int(z["window_len"])
    engine.window_start = int(z["window_start"])
    p = z["pending"]
    # a finished, not yet applied host step: applied at the next window end
    engine._inflight = (
        None if p is None else HostJob(window_start=p["window_start"], submit_step=p["submit_step"])
    )
