"""Save mid-window on a CUDA device, load into a fresh model and engine, continue: the same
weights and engine state as an uninterrupted run, bit for bit.

N = 7 with windows of 3 and overlap: the save happens with the host step of window 4..6 in
flight and window 7..9 one step in; the resumed engine must apply that step at the end of
window 7..9 (asynchronously), as the straight run does. The checkpoint goes through
``torch.save`` / ``torch.load(weights_only=True, map_location="cpu")``: plain CPU tensors,
loadable anywhere.
"""

from __future__ import annotations

import pytest
import torch
from cudahelp import CUDA_TIER, diff, engine_kw, make_config, mlp, mlp_batches, record

pytestmark = CUDA_TIER

N = 7
FIXED = {"topk_ratio": 0.1, "update_interval": 3, "select_interval": 10, "overlap_step": True}
AUTO = {"topk_ratio": 0.2, "update_interval": "auto", "select_interval": 5, "overlap_step": True,
        "full_warm_up_rounds": 2}  # fmt: skip


def _engine(zf: dict, bf16: bool, stream: bool):
    from zenflow import ZenFlowEngine

    model = mlp()
    cfg = make_config(zf, clip=1.0, bf16={"enabled": bf16},
                      zfctl={"stream_grads": stream})  # fmt: skip
    return model, ZenFlowEngine(model, cfg, **engine_kw(min_numel=1000))


def _train(engine, model, batches) -> None:
    for x, y in batches:
        with engine.autocast():
            loss = model(x, y)
        engine.backward(loss)
        engine.step(loss)
        engine.zero_grad()


def _final(model, engine) -> dict:
    engine.close()
    return {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "engine": engine.state_dict()}  # fmt: skip


def _cpu_only(tree, path: str = "") -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _cpu_only(v, f"{path}.{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            _cpu_only(v, f"{path}[{i}]")
    elif torch.is_tensor(tree):
        assert tree.device.type == "cpu", f"{path} is on {tree.device}: not a portable state"


def _assert_equal_tree(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_equal_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal_tree(x, y, f"{path}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), f"{path}: max |diff| {(a.float() - b.float()).abs().max():.3g}"
    else:
        assert a == b, path


@pytest.mark.parametrize(
    "zf,bf16,stream",
    [(FIXED, False, True), (FIXED, True, True), (FIXED, False, False), (AUTO, False, True)],
    ids=["overlap-fp32", "overlap-bf16", "overlap-whole-grads", "auto-warmup"],
)
def test_mid_window_resume_equals_straight_run(tmp_path, zf, bf16, stream):
    batches = mlp_batches(2 * N)
    model, engine = _engine(zf, bf16, stream)
    _train(engine, model, batches)
    straight = _final(model, engine)

    model, engine = _engine(zf, bf16, stream)
    _train(engine, model, batches[:N])
    state = {"model": model.state_dict(), "engine": engine.state_dict()}
    _cpu_only(state["engine"], "engine")
    path = tmp_path / "mid.pt"
    torch.save(state, path)
    engine.close()
    mid = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    del model, engine, state

    model, engine = _engine(zf, bf16, stream)
    loaded = torch.load(path, weights_only=True, map_location="cpu")
    model.load_state_dict(loaded["model"])
    engine.load_state_dict(loaded["engine"])
    _train(engine, model, batches[N:])
    resumed = _final(model, engine)

    assert resumed["engine"]["global_step"] == 2 * N
    d = diff(resumed["model"], straight["model"])
    record(f"mid_window_resume[{'auto' if zf is AUTO else 'fixed'}-"
           f"{'bf16' if bf16 else 'fp32'}-{'stream' if stream else 'whole'}]", **d)  # fmt: skip
    _assert_equal_tree(resumed, straight)
    # the second half really trained
    assert any(not torch.equal(mid[k], resumed["model"][k]) for k in mid)
