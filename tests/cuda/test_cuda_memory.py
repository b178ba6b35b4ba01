"""Device bytes on a real GPU: what the engine reports against the CUDA caching allocator's
own counters and against ``zfctl estimate``'s layout for the same model.

Three figures are compared over one streamed step (the second: the first selects):

- ``engine.accel.held()``: the engine's accounting per holder (weights, grads, optimizer,
  staging), and ``engine.last_peak_held``: the holders at the accounted peak of the step;
- ``StepStats.device_bytes`` / ``device_peak_bytes``: on cuda, ``torch.cuda.
  memory_allocated`` at the end of the step and ``max_memory_allocated`` over it
  (activations included);
- ``zenflow.hardware.estimate.layout``: the estimate's device buffers per category, and its
  activation estimate.

What the allocator holds that no engine owns (cuBLAS / cuBLASLt workspaces of the training
thread and of autograd's device thread, the batch) is measured first, by a plain
forward+backward before the engine exists: the *baseline*.

Tolerances (stated once, used below):

- accounting vs allocator between steps: ``allocated - baseline - held`` within
  ``[-1%, +2%]`` of ``held`` plus ``SLACK`` (16 MiB: scalars, index vectors, per-column
  scores, allocator rounding);
- accounting vs estimate per category at the step's accounted peak: 10% (the sim tier's);
- allocator peak vs estimate: ``peak - baseline`` at least 90% of the estimated state and at
  most 115% of state + activations, plus ``SLACK``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from cudahelp import CUDA_TIER, MIB, REAL_CUDA, engine_kw, make_config, record

pytestmark = [*CUDA_TIER, REAL_CUDA]

LAYERS, WIDTH, HEADS, VOCAB, BATCH, SEQ = 4, 768, 12, 8192, 2, 64
SLACK = 16 * MIB


def _model():
    """GPT-2-shaped LM, untied head (autograd's buffer for a tied head's share is not
    accounted: tests/engine/test_memory_layout.py), eager attention, on the GPU."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ,
        tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).float()


def _estimate(model, mode: str, cfg) -> tuple[dict[str, int], int]:
    """The estimate's device bytes per category (state) and its activation bytes."""
    from zenflow.hardware.census import ArchShape, census_of
    from zenflow.hardware.estimate import layout, settings_from_config

    arch = ArchShape(hidden=WIDTH, heads=HEADS, layers=LAYERS, vocab=VOCAB, num_labels=2,
                     causal_lm=True)  # fmt: skip
    census = census_of(model, name=f"gpt2-{LAYERS}x{WIDTH}", source="test", arch=arch)
    s = settings_from_config(cfg, micro_batch=BATCH, seq_len=SEQ)
    state: dict[str, int] = {}
    act = 0
    for it in layout(census, mode, s):
        if it.side != "device":
            continue
        if it.category == "activations":
            act += it.bytes
        else:
            state[it.category] = state.get(it.category, 0) + it.bytes
    return state, act


@pytest.mark.parametrize("mode", ["zenflow", "offload", "device"])
def test_device_bytes_match_the_allocator_and_the_estimate(mode):
    from zenflow import ZenFlowEngine
    from zenflow.engine.accelerator import Accelerator

    zf = {"topk_ratio": 0.1, "update_interval": 4} if mode == "zenflow" else None
    cfg = make_config(zf, bf16={"enabled": True})
    model = _model()
    est, est_act = _estimate(model, mode, cfg)
    model = model.cuda()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    # the baseline: a plain bf16 forward+backward starts cuBLAS(Lt) on this thread and on
    # autograd's device thread; their workspaces stay for the process
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    del loss
    # the engine of the test before (its weights, buckets, state) is held in reference
    # cycles until the collector runs; run it now, or it runs inside this test's steps and
    # frees memory the baseline counted (seen on an H200: offload's baseline held zenflow's
    # 150 MB, and its unaccounted bytes came out at -150 MB)
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated() - sum(
        p.numel() * p.element_size() for p in model.parameters()
    )
    params = sum(p.numel() for p in model.parameters())

    with ZenFlowEngine(model, cfg, mode=mode, **engine_kw()) as e:
        for step in range(2):
            if step == 1:
                # the accounted peak of this step only: CudaAccelerator.reset_peak resets
                # torch's counters but not the accounting (test_cuda_accelerator.py)
                Accelerator.reset_peak(e.accel)
            with e.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            e.backward(loss)
            torch.cuda.synchronize()
            fwd_bwd_peak = torch.cuda.max_memory_allocated()
            st = e.step(loss)
            peak_held = dict(e.last_peak_held)
            e.zero_grad()
            del loss
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        held = e.accel.held()
    held_total = sum(held.values())
    peak_held["optimizer"] = peak_held.get("optimizer", 0) + peak_held.pop("optimizer_state", 0)
    peak_held.pop("handover", None)
    est_state = sum(est.values())
    unaccounted = allocated - baseline - held_total
    numbers = {
        "params": params, "baseline": baseline, "held": held, "held_total": held_total,
        "allocated_between_steps": allocated, "unaccounted": unaccounted,
        "step_device_bytes": st.device_bytes, "step_device_peak_bytes": st.device_peak_bytes,
        "fwd_bwd_peak": fwd_bwd_peak, "peak_held": peak_held, "estimate_state": est,
        "estimate_state_total": est_state, "estimate_activations": est_act,
        "peak_minus_baseline_over_estimate": (st.device_peak_bytes - baseline)
        / (est_state + est_act),
        "device_bytes_per_param": st.device_bytes / params,
        "pinned_host_bytes": st.pinned_host_bytes, "host_bytes": st.host_bytes,
    }  # fmt: skip
    record(f"device_bytes[{mode}]", **numbers)

    # the engine's figures are the allocator's (cuda)
    assert st.device_peak_bytes >= fwd_bwd_peak, numbers
    assert st.device_peak_bytes >= 0.99 * sum(peak_held.values()), numbers
    # the accounting covers what the engine keeps on the device, and claims no more
    assert -0.01 * held_total <= unaccounted <= 0.02 * held_total + SLACK, numbers
    # per holder at the step's peak: the estimate's layout (10%)
    for cat in ("weights", "grads", "optimizer", "staging"):
        if est.get(cat, 0) == 0 and peak_held.get(cat, 0) == 0:
            continue
        assert peak_held.get(cat, 0) == pytest.approx(est.get(cat, 0), rel=0.10), (cat, numbers)
    # the allocator's peak over the step: the estimated state + activations
    real = st.device_peak_bytes - baseline
    assert real >= 0.9 * est_state, numbers
    assert real <= 1.15 * (est_state + est_act) + SLACK, numbers
