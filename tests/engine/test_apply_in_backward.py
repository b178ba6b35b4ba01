"""With overlap, the window-end step's backward brings the previous host step's result back
(``ImageReturn.apply_in_backward``): the same values at the same point of the schedule as
the end-of-step apply, with the host->device copies moved under backward."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    MLP,
    engine_kw,
    gpt2_batches,
    make_config,
    mlp_batches,
    tiny_gpt2,
    train_engine,
)

from zenflow import ZenFlowEngine

ZF = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True,
      "select_strategy": "step", "select_interval": 4}  # fmt: skip


def _run(kind: str, accelerator: str, in_backward: bool, clip: float = 0.0, gas: int = 1):
    torch.manual_seed(0)
    model = MLP() if kind == "mlp" else tiny_gpt2()
    batches = mlp_batches(10) if kind == "mlp" else gpt2_batches(10)
    extra = {"gradient_accumulation_steps": gas} if gas > 1 else {}
    engine = ZenFlowEngine(model, make_config(ZF, clip=clip, **extra), min_numel=1000,
                           host_kernel="reference", **engine_kw(accelerator))  # fmt: skip
    if not in_backward:
        engine.impl.image_return.in_backward = False  # every result goes back at its step's end
    if gas == 1:
        stats = train_engine(engine, model, batches)
    else:  # MLP batches of 8, as two micro-batches of 4
        stats = []
        for x, y in batches:
            for half in (slice(0, 4), slice(4, 8)):
                loss = model(x[half], y[half]) / gas
                engine.backward(loss)
            stats.append(engine.step(loss))
            engine.zero_grad()
    done = engine.impl.applied_in_backward
    engine.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, stats, done


@pytest.mark.parametrize("accelerator", ["sim"])
@pytest.mark.parametrize("kind,clip", [("mlp", 0.0), ("mlp", 0.05), ("gpt2", 0.0)])
def test_in_backward_equals_end_of_step(accelerator, kind, clip):
    a, sa, done = _run(kind, accelerator, True, clip)
    b, sb, none = _run(kind, accelerator, False, clip)
    assert done > 0 and none == 0  # the path ran (windows 2..: a result in flight)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert [s.grad_norm for s in sa] == [s.grad_norm for s in sb]
    assert sum(s.host_update for s in sa) >= 3


def test_micro_batches_apply_at_the_last_one_only():
    """Two micro-batches: the first one's hooks must not write the weights the second one's
    forward reads; the result equals the end-of-step apply."""
    a, _, done = _run("mlp", "sim", True, gas=2)
    b, _, _ = _run("mlp", "sim", False, gas=2)
    assert done > 0
    for n in a:
        assert torch.equal(a[n], b[n]), n
