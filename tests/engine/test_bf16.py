"""bf16 autocast on the device (``bf16.enabled``): the forward runs in bf16, the weights,
gradients and optimizer state stay fp32, and the optimizer is still AdamW."""

from __future__ import annotations

import copy

import torch
from conftest import LR, MLP, assert_params_close, make_config, mlp_batches, train_engine

from zenflow import ZenFlowEngine

STEPS = 10


def train_adamw_autocast(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)  # fmt: skip
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_autocast_runs_the_forward_in_bf16():
    torch.manual_seed(0)
    model = MLP()
    seen = {}
    model.fc1.register_forward_hook(lambda m, a, out: seen.update(dtype=out.dtype))
    cfg = make_config({"topk_ratio": 1.0, "update_interval": 2}, bf16={"enabled": True})
    with ZenFlowEngine(model, cfg) as engine:
        assert engine.bf16
        stats = train_engine(engine, model, mlp_batches(2))
    assert seen["dtype"] == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s.loss is not None and s.loss == s.loss for s in stats)


def test_bf16_topk1_equals_adamw_under_the_same_autocast():
    torch.manual_seed(0)
    model = MLP()
    ref, init = copy.deepcopy(model), copy.deepcopy(model)
    batches = mlp_batches(STEPS)
    cfg = make_config({"topk_ratio": 1.0, "update_interval": 3}, bf16={"enabled": True})
    with ZenFlowEngine(model, cfg, host_kernel="reference") as engine:
        train_engine(engine, model, batches)
    train_adamw_autocast(ref, batches)
    assert_params_close(model, ref, atol=2e-6, rtol=1e-5)
    # and it did train: the weights moved by O(lr * steps)
    pairs = zip(model.parameters(), init.parameters(), strict=True)
    moved = max((p - q).abs().max().item() for p, q in pairs)
    assert moved > LR


def test_bf16_off_is_fp32_forward():
    torch.manual_seed(0)
    model = MLP()
    seen = {}
    model.fc1.register_forward_hook(lambda m, a, out: seen.update(dtype=out.dtype))
    with ZenFlowEngine(model, make_config({"topk_ratio": 1.0, "update_interval": 2})) as e:
        assert not e.bf16
        train_engine(e, model, mlp_batches(1))
    assert seen["dtype"] == torch.float32
