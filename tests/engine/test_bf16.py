"""bf16 training (``bf16.enabled``): bf16 weights and gradients on the device, the fp32
master on the host (selected columns: an fp32 slice on the device), AdamW in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    ACCELERATORS,
    LR,
    MLP,
    engine_kw,
    make_config,
    mlp_batches,
    torch_style_kernel,
    train_engine,
)

from zenflow import ZenFlowEngine

STEPS = 10
BF16 = {"enabled": True}


def train_mixed_precision_adamw(model, batches, threads):
    """The textbook mixed-precision AdamW: bf16 model, fp32 master copies updated by torch's
    single-tensor AdamW from the bf16 gradients, cast back into the model after each step."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    model.bfloat16()
    opt = torch.optim.AdamW(masters, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            foreach=False)  # fmt: skip
    try:
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            for m, p in zip(masters, model.parameters(), strict=True):
                m.grad = p.grad.float()
                p.grad = None
            opt.step()
            with torch.no_grad():
                for m, p in zip(masters, model.parameters(), strict=True):
                    p.copy_(m)
    finally:
        torch.set_num_threads(before)
    return masters


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_weights_become_bf16_and_the_master_keeps_fp32(accelerator):
    torch.manual_seed(0)
    model = MLP()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = {}
    model.fc1.register_forward_hook(lambda m, a, out: seen.update(dtype=out.dtype))
    cfg = make_config({"topk_ratio": 0.1, "update_interval": 2}, bf16=BF16)
    with ZenFlowEngine(model, cfg, min_numel=1000, **engine_kw(accelerator)) as e:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        for w in e.zweights:  # the master is the fp32 model, not its bf16 rounding (held
            # until the first selection makes the host state of the non-selected columns)
            assert w.init_master.dtype == torch.float32
            assert torch.equal(w.init_master, init[w.spec.name])
        stats = train_engine(e, model, mlp_batches(4))
        assert all(p.grad is None for p in model.parameters())
    assert seen["dtype"] == torch.bfloat16
    assert all(s.loss == s.loss for s in stats)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_topk1_equals_mixed_precision_adamw(accelerator):
    """Every column selected: the device path is the fp32-master AdamW, bit for bit."""
    torch.manual_seed(0)
    model = MLP()
    ref, init = copy.deepcopy(model), copy.deepcopy(model)
    batches = mlp_batches(STEPS)
    cfg = make_config({"topk_ratio": 1.0, "update_interval": 3}, bf16=BF16)
    with ZenFlowEngine(model, cfg, host_kernel="reference", **engine_kw(accelerator)) as e:
        train_engine(e, model, batches)
        masters = {w.spec.name: w.master_sel for w in e.zweights}
        threads = e.training_threads
    ref_masters = train_mixed_precision_adamw(ref, batches, threads)
    names = [n for n, _ in model.named_parameters()]
    for n, p, q, m in zip(names, model.parameters(), ref.parameters(), ref_masters, strict=True):
        assert torch.equal(p, q), n
        if n in masters:
            assert torch.equal(masters[n], m.detach()), n
    moved = max((p.float() - q.float()).abs().max().item()
                for p, q in zip(model.parameters(), init.parameters(), strict=True))  # fmt: skip
    assert moved > LR  # and it did train


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_device_mode_is_mixed_precision_fused_adamw(accelerator):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    batches = mlp_batches(STEPS)
    cfg = make_config(None, bf16=BF16)
    with ZenFlowEngine(model, cfg, mode="device", **engine_kw(accelerator)) as e:
        train_engine(e, model, batches)
        assert e.resolved["device_adamw"].endswith("(fused)")
        threads = e.training_threads
    ref_masters = train_mixed_precision_adamw(ref, batches, threads)
    for p, q, m in zip(model.parameters(), ref.parameters(), ref_masters, strict=True):
        # fused AdamW differs from the single-tensor loop by float rounding only
        torch.testing.assert_close(p.float(), q.float(), atol=1e-2, rtol=0)
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_zenflow_bf16_matches_reference_kernel_one_step_windows(accelerator):
    """S=1, no overlap, topk 0.5, re-selection every 3 steps: each column takes exactly one
    fp32 AdamW step per step, on the device or on the host, so the bf16 run equals the
    mixed-precision AdamW (the host kernel has torch's op order)."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    batches = mlp_batches(STEPS)
    zf = {"topk_ratio": 0.5, "update_interval": 1, "overlap_step": False,
          "select_strategy": "step", "select_interval": 3}  # fmt: skip
    kw = engine_kw(accelerator)
    with ZenFlowEngine(model, make_config(zf, bf16=BF16), host_kernel=torch_style_kernel,
                       min_numel=1000, **kw) as e:  # fmt: skip
        stats = train_engine(e, model, batches)
        threads = e.training_threads
    train_mixed_precision_adamw(ref, batches, threads)
    assert sum(s.selection_changed for s in stats[1:]) > 0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bf16_auto_resolves_per_device():
    """bf16.enabled "auto" (the DeepSpeed/HF convention): on for sim, off for a CPU device,
    on for CUDA only where the GPU has bf16; explicit values pass through."""
    from zenflow.engine.engine_setup import resolve_bf16

    assert resolve_bf16("auto", "sim") is True
    assert resolve_bf16("auto", "cpu") is False
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    assert resolve_bf16("auto", "cuda") is cuda_bf16
    assert resolve_bf16(True, "cpu") is True and resolve_bf16(False, "sim") is False
