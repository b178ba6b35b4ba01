"""Save after N steps, continue in a FRESH PROCESS for N more == 2N straight steps, bitwise,
on the CPU device and on the simulated separate device (strict), also across the two."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import MLP, make_config, mlp_batches, train_engine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {here!r})
    from conftest import MLP, make_config, mlp_batches, train_engine
    from zenflow import ZenFlowEngine
    phase, path, n, accel = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5]
    zf, bf16 = eval(sys.argv[4]), sys.argv[6] == "bf16"
    flags = sys.argv[7].split(",")
    zfctl = {{"stream_grads": True}} if "stream" in flags else {{}}
    if "sumlr" in flags:
        zfctl["window_lr"] = "sum"
    if "doubling" in flags:
        zfctl["select_schedule"] = "doubling"
    if "compact" in flags:
        zfctl["host_state"] = "compact"
    clip = 1.0
    if "storeoff" in flags:  # no step store, clipping that bites at every step
        zfctl["step_store"], clip = "off", 0.05
    if "storeq8" in flags:  # the 8-bit copies and the predicted coefficient
        zfctl["step_store"], clip = "q8", 0.05
    if "early" in flags:  # windows 1 (steps 1-6), then 2, over 10 early steps
        zfctl["early"] = {{"steps": 10, "overlap": "earlysync" not in flags}}
    torch.manual_seed(0)
    model = MLP()
    batches = mlp_batches(2 * n)
    kw = dict(host_kernel="reference", accelerator=accel, sim_strict=True, min_numel=1000)
    cfg = make_config(zf, clip=clip, bf16={{"enabled": bf16}}, zfctl=zfctl)
    engine = ZenFlowEngine(model, cfg, **kw)
    if phase == "first":
        train_engine(engine, model, batches[:n])
        torch.save({{"model": model.state_dict(), "engine": engine.state_dict()}}, path)
        engine.close()
    elif phase == "second":
        sd = torch.load(path, weights_only=True)
        model.load_state_dict(sd["model"])
        engine.load_state_dict(sd["engine"])
        train_engine(engine, model, batches[n:])
        engine.close()
        torch.save({{"model": model.state_dict(), "engine": engine.state_dict()}}, path)
    else:
        train_engine(engine, model, batches)
        engine.close()
        torch.save({{"model": model.state_dict(), "engine": engine.state_dict()}}, path)
    """
)


def _run(tmp_path, *args):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(here=str(HERE)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(script), *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


def _assert_equal_tree(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_equal_tree(a[k], b[k], f"{path}.{k}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


FIXED = {"topk_ratio": 0.1, "update_interval": 3, "select_interval": 10, "overlap_step": True}
AUTO = {"topk_ratio": 0.2, "update_interval": "auto", "select_interval": 5, "overlap_step": True,
        "full_warm_up_rounds": 2}  # fmt: skip
DOUBLING = {"topk_ratio": 0.1, "update_interval": 2, "select_interval": 100, "overlap_step": True}


@pytest.mark.parametrize(
    "zf,first,second,dtype",
    [
        # N=7 saves with the host step of window 4..6 in flight and window 7..9 one step in;
        # the resumed run must apply it at the end of window 7..9 (async), like the straight
        # run. "first"/"second": the accelerator of each half (the straight run uses second).
        (FIXED, "sim", "sim", "fp32"),
        (FIXED, "sim", "sim", "bf16"),
        (FIXED, "cpu", "cpu", "fp32"),
        (AUTO, "cpu", "cpu", "fp32"),
        (AUTO, "sim", "sim", "fp32"),
        # saved on one device type, continued on another; the CPU device streams too, so
        # that both halves sum the global norm from the same pieces (bitwise comparable)
        (FIXED, "sim", "cpu", "fp32-stream"),
        # zfctl.window_lr "sum": the saved window is one step in, its lr sum must resume
        (FIXED, "sim", "sim", "fp32-sumlr"),
        # zfctl.select_schedule "doubling" (S = 2: selections at 1, 4, 8, 16): saved after
        # two, the next is due 4 steps after step 4; a lost count would re-select at step 6
        (DOUBLING, "sim", "sim", "fp32-doubling"),
        # zfctl.host_state "compact": 8-bit moments and a bf16 window sum, saved as they are
        (FIXED, "sim", "sim", "fp32-compact"),
        (FIXED, "sim", "sim", "bf16-compact"),
        (AUTO, "cpu", "cpu", "fp32-compact"),
        # zfctl.early: saved one step into the ramp's first 2-step window (7-8), the host
        # step of window 6 in flight; with early overlap off, none in flight
        (FIXED, "sim", "sim", "fp32-early"),
        (FIXED, "sim", "sim", "fp32-early,earlysync"),
        # ... bf16: the in-flight host step wrote a bf16 image for the return
        # (zfctl.return_image "early"); the resumed run returns it from the master
        (FIXED, "sim", "sim", "bf16-early"),
        # zfctl.step_store "off" with clipping: the saved window's smallest coefficient so
        # far (step 7's) must resume, or its host step scales by steps 8-9's only
        (FIXED, "sim", "sim", "fp32-storeoff"),
        # zfctl.step_store "q8" with clipping: the prediction (step 7's coefficient) must
        # resume, or step 8's adds are scaled and corrected from another one
        (FIXED, "sim", "sim", "fp32-storeq8"),
        (FIXED, "sim", "sim", "bf16-storeq8"),
    ],
    ids=["sim-overlap", "sim-overlap-bf16", "cpu-overlap", "cpu-auto-warmup",
         "sim-auto-warmup", "sim-to-cpu", "sim-window-lr-sum", "sim-doubling",
         "sim-compact", "sim-compact-bf16", "cpu-auto-warmup-compact", "sim-early-ramp",
         "sim-early-ramp-sync", "sim-early-ramp-bf16", "sim-store-off-clipped",
         "sim-store-q8-clipped", "sim-store-q8-clipped-bf16"],
)  # fmt: skip
def test_resume_in_fresh_process(tmp_path, zf, first, second, dtype):
    n = 7
    a, b = tmp_path / "resumed.pt", tmp_path / "straight.pt"
    dtype, _, stream = dtype.partition("-")
    stream = stream or "-"
    _run(tmp_path, "first", a, n, repr(zf), first, dtype, stream)
    mid = torch.load(a, weights_only=True)
    _run(tmp_path, "second", a, n, repr(zf), second, dtype, stream)
    _run(tmp_path, "straight", b, n, repr(zf), second, dtype, stream)
    resumed, straight = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert resumed["engine"]["global_step"] == 2 * n
    _assert_equal_tree(resumed, straight)
    # the second half really trained
    assert any(not torch.equal(mid["model"][k], resumed["model"][k]) for k in mid["model"])


# ---------------------------------------------------------------------------- in-process


def _engine(accel: str = "sim", state: str = "exact", n: int = 7):
    from zenflow import ZenFlowEngine

    torch.manual_seed(0)
    model = MLP()
    cfg = make_config(FIXED, clip=1.0, zfctl={"host_state": state})
    return model, ZenFlowEngine(model, cfg, host_kernel="reference", accelerator=accel,
                                sim_strict=True, min_numel=1000)  # fmt: skip


def _format4(sd: dict, engine) -> dict:
    """``sd`` (format 5) as format 4 wrote it: every host array full shape, the window sum
    full shape with the selected columns zero. The selected columns' host values (never
    read) are NaN and their counts -1 here, so a loader that read them would show it."""
    out = copy.deepcopy(sd)
    out["format"] = "zenflow-engine/4"
    z = out["zenflow"]
    del z["host_state"]
    for w in engine.zweights:
        h = z["weights"][w.spec.name]["host"]
        cd, ns, shape = w.cd, h.pop("nonsel"), w.spec.param.shape
        assert h.pop("layout") == "compact"
        for key in ("master", "exp_avg", "exp_avg_sq"):
            full = torch.full(shape, float("nan"))
            full.index_copy_(cd, ns, h[key].view(w.compact_shape()))
            h[key] = full
        steps = torch.full((w.n_cols,), -1, dtype=torch.int64)
        steps[ns] = h["steps"]
        h["steps"] = steps
        acc = torch.zeros(shape)
        if h["grad_accum_sum"] is not None:
            acc.index_copy_(cd, ns, h["grad_accum_sum"].view(w.compact_shape()))
        h["grad_accum_sum"] = acc
    return out


def test_a_format4_checkpoint_resumes_exactly():
    """A checkpoint of format 4 (full-shape host state) loads into the compact layout and
    continues bit for bit like the straight run."""

    n = 7
    batches = mlp_batches(2 * n)
    model, e = _engine()
    with e:
        train_engine(e, model, batches[:n])
        assert e.impl.inflight is not None and e.impl.window_len > 0  # mid-window, in flight
        old = _format4(e.state_dict(), e)
        weights = copy.deepcopy(model.state_dict())
        train_engine(e, model, batches[n:])
        straight = copy.deepcopy(model.state_dict())
    model, e = _engine()
    with e:
        model.load_state_dict(weights)
        e.load_state_dict(old)
        train_engine(e, model, batches[n:])
    _assert_equal_tree(model.state_dict(), straight)


@pytest.mark.parametrize("saved,loading", [("exact", "compact"), ("compact", "exact")])
def test_a_checkpoint_resumes_only_with_its_host_state(saved, loading):

    from zenflow.errors import EngineError

    model, e = _engine(state=saved)
    with e:
        train_engine(e, model, mlp_batches(3))
        sd = e.state_dict()
    model, e = _engine(state=loading)
    with e, pytest.raises(EngineError) as err:
        e.load_state_dict(sd)
    msg = str(err.value)
    assert f"zfctl.host_state {saved!r}" in msg and repr(loading) in msg
    assert f"resume with zfctl.host_state {saved!r}" in msg and "start a new run" in msg


def test_the_device_counts_host_mirror_stays_equal_through_reselections_and_a_load():
    """``ColumnSteps.mirror`` (what says, without a read, whether a weight's device counts
    are uniform) equals the device counts after re-selections that mixed them, and after a
    checkpoint is loaded into a fresh engine."""
    model, engine = _engine()
    with engine:
        train_engine(engine, model, mlp_batches(24))
        assert len(engine.selection_steps) >= 3  # the first selection and re-selections
        mixed = 0
        for w in engine.zweights:
            steps = w.steps_dev
            assert torch.equal(steps.mirror, steps.counts.cpu()), w.spec.name
            lo, hi = int(steps.counts.min()), int(steps.counts.max())
            assert steps.uniform == (lo if lo == hi else None)
            mixed += lo != hi
        assert mixed  # host and device counts met in one weight's selected columns
        sd = engine.state_dict()
    model2, loaded = _engine()
    with loaded:
        loaded.load_state_dict(sd)
        for w, v in zip(loaded.zweights, engine.zweights, strict=True):
            assert torch.equal(w.steps_dev.mirror, v.steps_dev.counts.cpu()), w.spec.name
            assert w.steps_dev.uniform == v.steps_dev.uniform
