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
window end, exactly when the uninterrupted run would have. The zenflow mode's part
(``checkpoint_zenflow``) holds the host state as it is (the compact layout of the
non-selected columns, window sum included), so a checkpoint is independent of the
transport (summed in place on a CPU device, or piece by piece on the host) and of the
buffer slot.

Saving and loading go part by part, the same parts both ways: the header (format, mode,
dtype, counters, ranks), each mode's state (device: torch's optimizer; offload: the host
state per parameter; zenflow: per weight, the always-important parameters, the schedule's
counters and the pending host step). The file format is ``FORMAT``; change it only with a
new format number. ``share_host`` (every checkpoint a run writes) references the host state
instead of copying it; the caller must write the state before the engine steps again.
"""

from __future__ import annotations

import torch

from zenflow.engine.checkpoint_zenflow import load_zenflow, zenflow_state
from zenflow.errors import EngineError

# 5: the zenflow host state in the compact layout of the non-selected columns, as it is
# (compact window sum, the non-selected index); 4 (full-shape host state and window sum)
# still loads. 4: embeddings score their rows (tokens) as columns
# (``selection.column_axis``); a state saved by 3 indexes their other axis.
FORMAT = "zenflow-engine/5"
LOADABLE = {"zenflow-engine/5": 5, "zenflow-engine/4": 4}


def engine_state_dict(engine, share_host: bool = False) -> dict:
    """The engine's state as plain data. ``share_host``: host tensors (the fp32 master,
    moments, counts, the window sum) are referenced, not copied, and so are the zenflow
    mode's device tensors (``checkpoint_zenflow``): the caller must write the state before
    the engine steps, flushes or closes again (every checkpoint of a run: no second copy of
    the optimizer state in host memory). Without it everything is a host copy."""
    sd = _header(engine)
    if engine.mode == "device":
        sd.update(_device_mode_state(engine.impl, engine.accel))
    elif engine.mode == "offload":
        sd["offload"] = _offload_state(engine.impl, share_host)
    else:
        sd["zenflow"] = zenflow_state(engine, share_host)
    return sd


def load_engine_state(engine, sd: dict) -> None:
    fmt = _check_header(engine, sd)
    engine.global_step = int(sd["global_step"])
    engine.skipped_steps = int(sd["skipped_steps"])
    if engine.mode == "device":
        _load_device_mode(engine.impl, sd, engine.accel)
    elif engine.mode == "offload":
        _load_offload(engine.impl, sd["offload"])
    else:
        load_zenflow(engine, sd["zenflow"], fmt)


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


def _check_header(engine, sd: dict) -> int:
    """The saved state is of a loadable format and of an engine like this one (mode,
    training dtype, rank and number of ranks) -> the format number."""
    _check(
        sd.get("format") in LOADABLE,
        f"format {sd.get('format')!r}, expected {FORMAT!r} (or zenflow-engine/4).",
    )
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
    return LOADABLE[sd["format"]]


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
