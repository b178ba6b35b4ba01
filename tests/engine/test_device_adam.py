"""The device-side AdamW: the fused path (torch's fused kernel over a list of tensors) against
the plain reference (torch.optim.AdamW's single-tensor op order), element-wise, and the
engine with either one."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    ACCELERATORS,
    MLP,
    assert_params_close,
    engine_kw,
    make_config,
    mlp_batches,
    train_engine,
)

from zenflow import ZenFlowEngine
from zenflow.engine.device_adam import AdamHyper, adamw_dense_, adamw_fused_, fused_available
from zenflow.errors import EngineError


def _state(shape, seed, transposed=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g)
    grads = [torch.randn(shape, generator=g) * 10.0 ** float(k - 3) for k in range(4)]
    if transposed:  # a strided view, as a weight stored column-major would be
        p = p.t().contiguous().t()
    return p, grads


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "strided"])
def test_fused_matches_the_reference_element_wise(adamw_mode, transposed):
    """Several tensors in one fused call, four steps with gradients from 1e-3 to 1: every
    element of the parameters and moments agrees with the reference within float rounding."""
    hp = AdamHyper(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05,
                   adamw_mode=adamw_mode)  # fmt: skip
    shapes = [(37, 19), (64,), (5, 128)]
    states = [_state(s, i, transposed and len(s) == 2) for i, s in enumerate(shapes)]
    ref = [[p.clone(), torch.zeros_like(p), torch.zeros_like(p)] for p, _ in states]
    fus = [[p.clone(), torch.zeros_like(p), torch.zeros_like(p)] for p, _ in states]
    for step in range(1, 5):
        grads = [gs[step - 1] for _, gs in states]
        for (p, m, v), g in zip(ref, grads, strict=True):
            adamw_dense_(p, g, m, v, step, hp)
        adamw_fused_([f[0] for f in fus], grads, [f[1] for f in fus], [f[2] for f in fus],
                     step, hp)  # fmt: skip
    for (p, m, v), (pf, mf, vf), (p0, _) in zip(ref, fus, states, strict=True):
        torch.testing.assert_close(pf, p, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mf, m, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(vf, v, rtol=1e-6, atol=1e-12)
        assert not torch.equal(pf, p0)  # it did update


def test_fused_is_torchs_fused_adamw_bit_for_bit():
    """The fused path is the kernel behind torch.optim.AdamW(fused=True), so it reproduces
    it exactly, including the step count it is given (not a counter it keeps)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(33, 17))
    ours = w.detach().clone()
    m, v = torch.zeros_like(ours), torch.zeros_like(ours)
    opt = torch.optim.AdamW([w], lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1,
                            fused=True)  # fmt: skip
    hp = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1)
    for step in range(1, 7):
        g = torch.randn(33, 17)
        w.grad = g.clone()
        opt.step()
        adamw_fused_([ours], [g], [m], [v], step, hp)
        assert torch.equal(ours, w.detach()), step


def test_fused_available_on_the_engine_devices():
    assert fused_available(torch.device("cpu"))
    assert not fused_available(torch.device("meta"))


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_engine_fused_and_reference_agree(accelerator):
    """ZenFlow with overlap, topk 0.1 and 2-step windows: the engine with the fused device
    update (its default) and with the reference end element-wise close, on cpu and on the
    strict simulated device; ``resolved`` names the one in use."""
    torch.manual_seed(0)
    base = MLP()
    batches = mlp_batches(12)
    cfg = make_config({"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True})
    models = {}
    for impl in ("fused", "reference"):
        model = copy.deepcopy(base)
        with ZenFlowEngine(model, cfg, **engine_kw(accelerator, impl)) as e:
            assert e.resolved["device_update"].startswith(impl)
            train_engine(e, model, batches)
        models[impl] = model
    moved = [not torch.equal(p, q) for p, q in
             zip(models["fused"].parameters(), base.parameters(), strict=True)]  # fmt: skip
    assert all(moved)
    assert_params_close(models["fused"], models["reference"], atol=1e-6, rtol=1e-5)


def test_engine_default_is_fused_and_bad_choice_is_refused():
    model = MLP()
    with ZenFlowEngine(model, make_config({"topk_ratio": 0.1}), accelerator="cpu") as e:
        assert e.resolved["device_update"].startswith("fused")
    with pytest.raises(EngineError, match="device_adam='foreach' is not allowed"):
        ZenFlowEngine(model, make_config(None), accelerator="cpu", device_adam="foreach")


def test_reference_engine_never_calls_the_fused_kernel(monkeypatch):
    """``device_adam="reference"`` really takes the single-tensor path (the two can agree
    bit for bit on some inputs, so equal results alone would not show it), and the default
    really calls the fused kernel."""
    calls = []
    real = torch._fused_adamw_

    def spy(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    batches = mlp_batches(4)
    cfg = make_config({"topk_ratio": 0.1, "update_interval": 2})
    for impl, expect_calls in (("reference", False), ("fused", True)):
        calls.clear()
        torch.manual_seed(0)
        model = MLP()
        with ZenFlowEngine(model, cfg, **engine_kw("cpu", impl)) as e:
            train_engine(e, model, batches)
        assert bool(calls) == expect_calls, (impl, calls)
