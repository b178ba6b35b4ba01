"""On a CUDA device the engine equals torch.optim.AdamW where the algorithm says it must, and
streamed gradients give what whole gradients give (the CPU tier's identities, on a GPU).

Here the copies are real: two copy streams ordered against the compute stream by events,
pinned host buffers, gradients leaving the device from backward hooks on autograd's device
thread. A missing wait shows up as a large difference in many elements (a stale or half
written column), so the tolerances are tight and every comparison records how far apart the
two runs were and whether they were bit-identical.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cudahelp import (
    ACCEL,
    CUDA_TIER,
    LR,
    assert_close,
    assert_moved,
    dev,
    diff,
    engine_kw,
    gpt2_batches,
    make_config,
    mlp,
    mlp_batches,
    params_of,
    record,
    tiny_gpt2,
    train_adamw,
    train_engine,
    train_mixed_precision_adamw,
)

pytestmark = CUDA_TIER

STEPS = 12


def _engine(model, cfg, **kw):
    from zenflow import ZenFlowEngine

    e = ZenFlowEngine(model, cfg, **engine_kw(**kw))
    assert e.resolved["accelerator"] == ACCEL
    return e


def _model(kind: str):
    if kind == "mlp":
        return mlp(), mlp_batches(STEPS)
    return tiny_gpt2(), gpt2_batches(STEPS)


@pytest.mark.parametrize("device_adam", ["fused", "reference"])
@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
def test_topk1_equals_adamw(kind, device_adam):
    """topk 1.0: every column is updated on the device each step, so the run is torch's
    AdamW (fused kernel: ``AdamW(fused=True)``; reference: the single-tensor path). The first
    step's gradient goes to the host whole (the first selection) and back: no rounding.

    Tolerance: MLP at lr 1e-2, atol 2e-6 + 1e-5 relative (the CPU tier asserts bit
    equality; a GPU run records whether it was). GPT-2 at lr 1e-3, atol 1e-4: Adam turns
    rounding differences of its many near-zero gradients into O(lr) steps."""
    model, batches = _model(kind)
    ref, init = copy.deepcopy(model), params_of(model)
    lr, atol = (1e-3, 1e-4) if kind == "gpt2" else (LR, 2e-6)
    cfg = make_config({"topk_ratio": 1.0, "update_interval": 3}, lr=lr)
    with _engine(model, cfg, device_adam=device_adam) as e:
        assert e.resolved["stream_grads"] is True  # auto: on for a separate device
        assert e.zweights, "the test model must have ZenFlow weights"
        stats = train_engine(e, model, batches)
    train_adamw(ref, batches, lr=lr, fused=device_adam == "fused", threads=e.training_threads)
    assert all(p.device == dev() for p in model.parameters())
    d = assert_close(params_of(model), params_of(ref), atol, 1e-5, "engine vs AdamW")
    assert_moved(params_of(model), init)
    assert all(s.loss is not None and s.grad_norm > 0 for s in stats)
    record(f"topk1_equals_adamw[{kind}-{device_adam}]", **d)


def test_bf16_topk1_equals_mixed_precision_adamw():
    """bf16 weights and gradients, fp32 master of the selected columns on the device: with
    every column selected and the reference device AdamW, the run is the textbook
    mixed-precision AdamW (CPU tier: bit for bit). Masters within 1e-6 + 1e-5 relative,
    bf16 weights within one bf16 step of each other."""
    model, batches = mlp(), mlp_batches(STEPS)
    ref, init = copy.deepcopy(model), params_of(model)
    cfg = make_config({"topk_ratio": 1.0, "update_interval": 3}, bf16={"enabled": True})
    with _engine(model, cfg, device_adam="reference") as e:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        train_engine(e, model, batches)
        masters = {w.spec.name: w.master_sel.detach().clone() for w in e.zweights}
    masters_ref = train_mixed_precision_adamw(ref, batches, threads=e.training_threads)
    ref_masters = dict(zip([n for n, _ in ref.named_parameters()], masters_ref, strict=True))
    dm = assert_close(masters, {n: ref_masters[n].detach() for n in masters}, 1e-6, 1e-5,
                      "fp32 masters")  # fmt: skip
    dw = assert_close(params_of(model), params_of(ref), 1e-6, 2**-7, "bf16 weights")
    moved = max((p.float() - init[n].float()).abs().max().item()
                for n, p in model.named_parameters())  # fmt: skip
    assert moved > LR, "the bf16 run did not train"
    record("bf16_topk1_equals_mixed_precision_adamw", masters=dm, weights=dw)


@pytest.mark.parametrize("mode", ["offload", "device"])
def test_plain_modes_equal_adamw(mode):
    """ZeRO-Offload (every step: whole gradients to pinned host buffers, CPU AdamW, weights
    back) and plain device AdamW (torch's fused kernel) equal torch's single-tensor AdamW
    within float rounding (2e-6 + 1e-5 relative at lr 1e-2)."""
    model, batches = mlp(), mlp_batches(STEPS)
    ref, init = copy.deepcopy(model), params_of(model)
    with _engine(model, make_config(None), mode=mode) as e:
        stats = train_engine(e, model, batches)
    train_adamw(ref, batches, threads=e.training_threads)
    d = assert_close(params_of(model), params_of(ref), 2e-6, 1e-5, f"{mode} vs AdamW")
    assert_moved(params_of(model), init)
    assert all(s.mode == mode for s in stats)
    if mode == "offload":  # the whole gradient went down and the weights came back
        assert all(s.d2h_bytes > 0 and s.h2d_bytes > 0 for s in stats)
    record(f"plain_modes_equal_adamw[{mode}]", **d)


def test_bf16_device_mode_is_mixed_precision_fused_adamw():
    model, batches = mlp(), mlp_batches(STEPS)
    ref = copy.deepcopy(model)
    cfg = make_config(None, bf16={"enabled": True})
    with _engine(model, cfg, mode="device") as e:
        train_engine(e, model, batches)
        assert e.resolved["device_adamw"].endswith("(fused)")
    train_mixed_precision_adamw(ref, batches, fused=True, threads=e.training_threads)
    d = assert_close(params_of(model), params_of(ref), 1e-2, 0.0, "bf16 device mode")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    record("bf16_device_mode_is_mixed_precision_fused_adamw", **d)


# ---------------------------------------------------------------- streamed vs whole
CLIP = 0.05  # the MLP's and tiny GPT-2's gradient norms are 2..4: clipping every step
ZF = {"topk_ratio": 0.1, "update_interval": 3, "overlap_step": True,
      "select_strategy": "step", "select_interval": 4}  # fmt: skip


def _run(kind: str, stream: bool, gas: int, grad_acc: str, bf16: bool, steps: int = 12):
    """Train with ``zfctl.stream_grads`` = ``stream``; return weights, stats, selections."""
    model, batches = (mlp(), mlp_batches(steps)) if kind == "mlp" else \
        (tiny_gpt2(), gpt2_batches(steps, bs=4))  # fmt: skip
    init = params_of(model)
    extra = {"zfctl": {"stream_grads": stream, "grad_accumulation": grad_acc}}
    if gas > 1:
        extra["gradient_accumulation_steps"] = gas
    if bf16:
        extra["bf16"] = {"enabled": True}
    cfg = make_config(ZF, clip=CLIP, **extra)
    selections = []
    with _engine(model, cfg, min_numel=1000) as e:
        assert e.stream_grads is stream
        stats = []
        for b in batches:
            stats += train_engine(e, model, [b], gas=gas)
            selections.append([None if w.sel_host is None else w.sel_host.clone()
                               for w in e.zweights])  # fmt: skip
        windows = list(e.window_lengths)
        pinned = e.accel.pinned_bytes()
    return params_of(model), init, stats, selections, windows, pinned


@pytest.mark.parametrize(
    "kind,gas,grad_acc,bf16",
    [("mlp", 1, "host", False), ("mlp", 2, "host", False), ("mlp", 2, "device", False),
     ("gpt2", 2, "host", False), ("gpt2", 1, "host", True), ("gpt2", 2, "device", True)],
    ids=["mlp-gas1", "mlp-gas2-host", "mlp-gas2-device", "gpt2-gas2-host", "gpt2-bf16-gas1",
         "gpt2-bf16-gas2-device"],
)  # fmt: skip
def test_streamed_equals_whole_gradients(kind, gas, grad_acc, bf16):
    """topk 0.1, windows of 3 with the host step overlapping the next window, re-selection
    every 4 steps, clipping active on every step: gradients streamed off the device during
    backward (hooks on autograd's thread, pieces on the copy stream) give the run that
    routing whole gradients at the step gives. Same selections at every step and the same
    windows; grad norms within 1e-6 relative; weights within the CPU device's clipped
    tolerance (both paths sum the same pieces in the same per-weight order, so a GPU run is
    expected bit-identical, and records whether it was): at most lr * 5e-3 anywhere and
    1e-6 (fp32; bf16: one bf16 step) for all but 0.1% of the elements.

    Not compared: bf16 with micro-batches summed on the host, where the streamed run sums
    the bf16 micro-batch gradients in fp32 and the whole-gradient run can only route
    autograd's bf16 sum (a precision difference by design; tests/engine/test_streaming.py)."""
    a = _run(kind, True, gas, grad_acc, bf16)
    b = _run(kind, False, gas, grad_acc, bf16)
    (pa, init, sa, sel_a, win_a, pinned), (pb, _, sb, sel_b, win_b, _) = a, b
    assert pinned > 0, "a separate device pins the link buffers"
    for s in sa:
        assert s.grad_norm > 10 * CLIP, "clipping must be active on every step"
    assert [s.skipped for s in sa] == [s.skipped for s in sb] == [False] * len(sa)
    assert win_a == win_b and len(win_a) >= 3, (win_a, win_b)
    assert any(s.host_update for s in sa), "no host step was applied"
    for i, (x, y) in enumerate(zip(sel_a, sel_b, strict=True)):
        for u, v in zip(x, y, strict=True):
            assert (u is None and v is None) or torch.equal(u, v), f"selection at step {i + 1}"
    assert len({str(s) for s in sel_a[1:]}) > 1, "re-selection never moved a column"
    for i, (s, t) in enumerate(zip(sa, sb, strict=True)):
        assert s.grad_norm == pytest.approx(t.grad_norm, rel=1e-6), f"grad norm at step {i + 1}"
    total = off = 0
    for n in pa:
        dn = (pa[n].float() - pb[n].float()).abs()
        # bf16: one bf16 step of the value (2**-7 relative) on top of the fp32 criterion
        step = 2**-7 * pb[n].float().abs() if bf16 else torch.zeros_like(dn)
        assert bool((dn <= LR * 5e-3 + step).all()), f"{n}: max |diff| {dn.max():.3g}"
        total += dn.numel()
        off += int((dn > 1e-6 + step).sum())
    assert off <= 1e-3 * total, f"{off} of {total} elements differ by more than 1e-6"
    assert_moved(pa, init)
    record(f"streamed_equals_whole[{kind}-gas{gas}-{grad_acc}-{'bf16' if bf16 else 'fp32'}]",
           **diff(pa, pb), d2h_bytes_step_last=sa[-1].d2h_bytes,
           h2d_bytes_window_end=max(s.h2d_bytes for s in sa), pinned_host_bytes=pinned,
           stall_ms_mean=sum(s.stall_ms for s in sa) / len(sa))  # fmt: skip


def test_native_host_kernel_on_cuda():
    """The native CPU Adam beside a CUDA device (the configuration a real run uses): the
    streamed run trains, stays finite and agrees with the reference kernel within float
    rounding of the host AdamW (5e-5 at lr 1e-2 after 12 steps)."""
    import os
    import shutil

    from zenflow.ops import native_status

    if os.environ.get("ZENFLOW_OPS") == "reference":
        pytest.skip("ZENFLOW_OPS=reference: the native op is routed to the reference here")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on this machine: the native op cannot be built")
    model_n, batches = mlp(), mlp_batches(STEPS)
    model_r = copy.deepcopy(model_n)
    init = params_of(model_n)
    cfg = make_config(ZF, clip=1.0)
    with _engine(model_n, cfg, host_kernel="native", min_numel=1000) as e:
        assert e.resolved["host_kernel"] == "native", e.resolved["host_kernel"]
        train_engine(e, model_n, batches)
    with _engine(model_r, cfg, host_kernel="reference", min_numel=1000) as e:
        train_engine(e, model_r, batches)
    d = assert_close(params_of(model_n), params_of(model_r), 5e-5, 1e-4, "native vs reference")
    assert_moved(params_of(model_n), init)
    record("native_host_kernel_on_cuda", native=str(native_status()), **d)


def test_per_column_batches_equal_the_reference_weight_by_weight():
    """bf16 GPT-2, re-selection every 2 steps: once the selected columns carry their own
    counts, the batched per-column update (foreach calls with broadcast factors, the
    denominators in the spent scratch, the masters cast in one foreach copy) ends where
    ``adamw_columns_`` weight by weight ends, with the reference update everywhere else.
    CUDA's foreach kernels may round differently from the single-tensor ones: within one
    bf16 step of each value; the record says whether the two were bit-identical."""
    zf = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True,
          "select_strategy": "step", "select_interval": 2}  # fmt: skip
    out, mixed = {}, {}
    for batched in (True, False):
        model = tiny_gpt2()
        cfg = make_config(zf, bf16={"enabled": True})
        with _engine(model, cfg, device_adam="reference") as e:
            e.impl.device_step.batched_columns = batched
            train_engine(e, model, gpt2_batches(9))
            mixed[batched] = sum(w.steps_dev.uniform is None for w in e.zweights)
        out[batched] = params_of(model)
    assert mixed[True] == mixed[False] > 0, "no weight took the per-column update"
    for n, b in out[False].items():
        a = out[True][n]
        step = 2**-7 * b.float().abs() + 1e-6
        assert bool(((a.float() - b.float()).abs() <= step).all()), n
    record("per_column_batches", **diff(out[True], out[False]), per_column_weights=mixed[True])


def test_clipping_in_place_is_the_per_gradient_multiplication():
    """The clipping of what is still on the device (``clip_in_place``: one foreach call per
    dtype, the coefficient in that dtype on CUDA) gives exactly what each gradient's
    ``mul_`` by the 0-d fp32 coefficient gives, element-wise, in bf16, fp16 and fp32, mixed
    in one list. Recorded beside it: whether that equals fp32 arithmetic with the fp32
    coefficient (it does off CUDA, where a 0-d tensor is an fp32 scalar)."""
    from zenflow.engine.global_norm import clip_coefficient, clip_in_place

    g = torch.Generator().manual_seed(0)
    shapes = ((torch.bfloat16, 4099), (torch.float32, 37), (torch.float16, 5),
              (torch.bfloat16, 1 << 20), (torch.float32, 1 << 16))  # fmt: skip
    grads = [(torch.randn(n, generator=g) * 7.0).to(dtype).to(dev()) for dtype, n in shapes]
    _, coef_t = clip_coefficient(1.0, 3.7, dev())
    one_by_one = [t.clone().mul_(coef_t) for t in grads]
    fp32_coef = [(t.float() * coef_t).to(t.dtype) for t in grads]
    clip_in_place([*grads, None], coef_t)
    for got, one in zip(grads, one_by_one, strict=True):
        assert torch.equal(got, one), got.dtype
    record("clipping_in_place_is_the_per_gradient_multiplication", tensors=len(grads),
           equals_fp32_coefficient={str(t.dtype): bool(torch.equal(t, f))
                                    for t, f in zip(grads, fp32_coef, strict=True)})  # fmt: skip
