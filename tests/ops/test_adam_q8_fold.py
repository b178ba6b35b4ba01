"""The CPU Adams' correction (``zfctl.step_store`` "q8": a window's last correction taken in
as the step reads the window sum), ``adamw_step_``'s (the exact state, an fp32 sum) and
``adamw_q8_step_``'s (the compact state, a bf16 sum): bit for bit ``add_dequantized_i8_``
over each piece of the sum followed by the plain step, with the scalar step and per-column
steps (``col_inner`` 1 and > 1), pieces of any length and boundary (inside a 256-block, at
one, across a thread's 64K block), the bf16 image, 1-3 threads; the sum itself untouched;
the references the same; the arguments refused."""

from __future__ import annotations

import pytest
import torch

from zenflow.ops import (
    adamw_q8_step_,
    adamw_q8_step_reference_,
    adamw_step_,
    adamw_step_reference_,
    add_dequantized_i8_,
    add_dequantized_i8_reference_,
    i8_num_blocks,
    q8_num_blocks,
    quantize_q8_,
)

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
# (numel, piece lengths): boundaries inside a 256-block, on one, and past 64K elements
CASES = [
    (1000, [1000]),
    (1000, [300, 700]),
    (2048, [256, 1, 255, 1536]),
    (70000, [65530, 4470]),
    (140000, [100, 65636, 70000, 4264]),
]


def _state(numel: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=g)
    m = torch.randn(numel, generator=g) * 0.01
    v = torch.rand(numel, generator=g) * 1e-4
    total = torch.randn(numel, generator=g) * 3  # the window sum
    return master, m, v, total


def _copy(lengths: list[int], seed: int):
    """An 8-bit copy of pieces of these lengths: int8 codes, each piece's scales in turn."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (sum(lengths),), generator=g, dtype=torch.int8)
    scales = torch.rand(sum(i8_num_blocks(n) for n in lengths), generator=g) * 0.05
    if scales.numel() > 2:
        scales[1] = 0.0  # an all-zero block's scale
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return codes, scales, starts


def _passes(total, codes, scales, starts, delta, add) -> torch.Tensor:
    """The sum after the correction as passes of their own, piece by piece."""
    out = total.clone()
    bounds, b = starts.tolist(), 0
    for a, z in zip(bounds[:-1], bounds[1:], strict=True):
        nb = i8_num_blocks(z - a)
        add(out[a:z], codes[a:z], scales[b : b + nb], delta)
        b += nb
    return out


def _cols(numel: int, layout: str):
    """(col_steps, col_inner) for the scalar step, Linear-like and Conv1D-like columns."""
    if layout == "scalar":
        return None, 1
    cols = 10 if numel % 10 == 0 else 8
    inner = 1 if layout == "cols" else (numel // cols if numel // cols * cols == numel else 1)
    steps = torch.randint(1, 9, (cols,), generator=torch.Generator().manual_seed(cols),
                          dtype=torch.int64)  # fmt: skip
    return steps, inner


@pytest.mark.parametrize(("numel", "lengths"), CASES)
@pytest.mark.parametrize("layout", ["scalar", "cols", "runs"])
def test_the_folded_correction_is_the_pass_then_the_step(native, numel, lengths, layout):
    master, m, v, total = _state(numel, numel)
    codes, scales, starts = _copy(lengths, numel + 1)
    col_steps, col_inner = _cols(numel, layout)
    if numel % ((col_steps.numel() if col_steps is not None else 1) * col_inner):
        pytest.skip("no column layout of this size")
    kw = dict(step=5, grad_scale=0.25, col_steps=col_steps, col_inner=col_inner, **HP)
    want = [t.clone() for t in (master, m, v)]
    want_img = torch.empty(numel, dtype=torch.bfloat16)
    corrected = _passes(total, codes, scales, starts, -0.3, add_dequantized_i8_)
    adamw_step_(*want[:1], corrected, *want[1:], param_bf16=want_img, **kw)
    for threads in (1, 2, 3):
        got = [t.clone() for t in (master, m, v)]
        img = torch.empty(numel, dtype=torch.bfloat16)
        before = total.clone()
        adamw_step_(got[0], total, got[1], got[2], param_bf16=img, num_threads=threads,
                    corr_codes=codes, corr_scales=scales, corr_starts=starts, corr_delta=-0.3,
                    **kw)  # fmt: skip
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), threads
        assert torch.equal(img.view(torch.int16), want_img.view(torch.int16))
        assert torch.equal(total, before)  # the sum is read, not written


@pytest.mark.parametrize(("numel", "lengths"), CASES[:3])
def test_the_reference_folds_the_same_way(numel, lengths):
    master, m, v, total = _state(numel, 7)
    codes, scales, starts = _copy(lengths, 8)
    kw = dict(step=3, grad_scale=0.5, **HP)
    want = [t.clone() for t in (master, m, v)]
    corrected = _passes(total, codes, scales, starts, 0.2, add_dequantized_i8_reference_)
    adamw_step_reference_(want[0], corrected, want[1], want[2], **kw)
    got = [t.clone() for t in (master, m, v)]
    adamw_step_reference_(got[0], total, got[1], got[2], corr_codes=codes, corr_scales=scales,
                          corr_starts=starts, corr_delta=0.2, **kw)  # fmt: skip
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_a_bad_correction_is_refused(native):
    master, m, v, total = _state(1000, 1)
    codes, scales, starts = _copy([300, 700], 2)
    kw = dict(step=1, **HP)

    def call(**corr):
        adamw_step_(master.clone(), total, m.clone(), v.clone(), **kw, **corr)

    with pytest.raises(RuntimeError, match="go together"):
        call(corr_codes=codes, corr_scales=scales)
    with pytest.raises(RuntimeError, match="begin at 0 and end at numel"):
        call(corr_codes=codes, corr_scales=scales, corr_starts=starts[:-1])
    with pytest.raises(RuntimeError, match="must increase"):
        call(corr_codes=codes, corr_scales=scales,
             corr_starts=torch.tensor([0, 300, 300, 1000]))  # fmt: skip
    with pytest.raises(RuntimeError, match="one per 256-element block"):
        call(corr_codes=codes, corr_scales=scales[:-1], corr_starts=starts)
    with pytest.raises(RuntimeError, match="fp32 grad"):
        adamw_step_(master.clone(), total.bfloat16(), m.clone(), v.clone(), corr_codes=codes,
                    corr_scales=scales, corr_starts=starts, **kw)  # fmt: skip


def _q8_moments(m: torch.Tensor, v: torch.Tensor):
    n = m.numel()
    codes = [torch.empty(n, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.empty(q8_num_blocks(n)) for _ in range(2)]
    quantize_q8_(m, codes[0], scales[0], fmt="m")
    quantize_q8_(v.sqrt(), codes[1], scales[1], fmt="u")
    return codes, scales


@pytest.mark.parametrize(("numel", "lengths"), CASES)
@pytest.mark.parametrize("layout", ["scalar", "cols", "runs"])
@pytest.mark.parametrize("sum_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_compact_folded_correction_is_the_pass_then_the_step(native, numel, lengths, layout,
                                                                 sum_dtype):  # fmt: skip
    """``adamw_q8_step_``: a piece's 256-blocks do not line up with the moments' blocks,
    and a bf16 sum's corrected value is rounded to bf16 as the pass stores it."""
    master, m, v, total = _state(numel, numel + 2)
    total = total.to(sum_dtype)
    codes, scales, starts = _copy(lengths, numel + 3)
    col_steps, col_inner = _cols(numel, layout)
    if numel % ((col_steps.numel() if col_steps is not None else 1) * col_inner):
        pytest.skip("no column layout of this size")
    kw = dict(step=4, grad_scale=0.25, col_steps=col_steps, col_inner=col_inner, **HP)
    (mc, uc), (ms, us) = _q8_moments(m, v)
    want = [master.clone(), mc.clone(), ms.clone(), uc.clone(), us.clone()]
    want_img = torch.empty(numel, dtype=torch.bfloat16)
    corrected = _passes(total, codes, scales, starts, 0.45, add_dequantized_i8_)
    adamw_q8_step_(want[0], corrected, *want[1:], image=want_img, **kw)
    for threads in (1, 3):
        got = [master.clone(), mc.clone(), ms.clone(), uc.clone(), us.clone()]
        img = torch.empty(numel, dtype=torch.bfloat16)
        before = total.clone()
        adamw_q8_step_(got[0], total, *got[1:], image=img, num_threads=threads,
                       corr_codes=codes, corr_scales=scales, corr_starts=starts,
                       corr_delta=0.45, **kw)  # fmt: skip
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), threads
        assert torch.equal(img.view(torch.int16), want_img.view(torch.int16))
        assert torch.equal(total.view(torch.int16) if sum_dtype == torch.bfloat16 else total,
                           before.view(torch.int16) if sum_dtype == torch.bfloat16
                           else before)  # fmt: skip


def test_the_compact_reference_folds_the_same_way():
    numel, lengths = 2048, [256, 1, 255, 1536]
    master, m, v, total = _state(numel, 11)
    total = total.bfloat16()
    codes, scales, starts = _copy(lengths, 12)
    (mc, uc), (ms, us) = _q8_moments(m, v)
    kw = dict(step=2, grad_scale=0.5, **HP)
    want = [master.clone(), mc.clone(), ms.clone(), uc.clone(), us.clone()]
    corrected = _passes(total, codes, scales, starts, -0.2, add_dequantized_i8_reference_)
    adamw_q8_step_reference_(want[0], corrected, *want[1:], **kw)
    got = [master.clone(), mc.clone(), ms.clone(), uc.clone(), us.clone()]
    adamw_q8_step_reference_(got[0], total, *got[1:], corr_codes=codes, corr_scales=scales,
                             corr_starts=starts, corr_delta=-0.2, **kw)  # fmt: skip
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
