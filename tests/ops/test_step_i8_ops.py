"""The q8 step store's ops (``zfctl.step_store`` "q8"): ``accumulate_keep_i8_`` (the add of
a piece into its window sum and, in the same pass, the piece's 8-bit linear copy) and
``add_dequantized_i8_`` (the sum corrected from that copy), each bit for bit its plain
reference: fp32 and bf16 sums and pieces, partial blocks, sizes beyond one thread's block,
1-3 threads, an all-zero block, and the arguments refused. And what the copy is: each
value within half a code (absmax / 254) of its block, ties to even, the block's largest
value exact."""

from __future__ import annotations

import pytest
import torch

from zenflow.ops import (
    I8_BLOCK,
    accumulate_keep_i8_,
    accumulate_keep_i8_reference_,
    accumulate_reference_,
    add_dequantized_i8_,
    add_dequantized_i8_reference_,
    dequantized_i8_reference,
    i8_num_blocks,
)

THREADS = (1, 2, 3)
SIZES = [1, 7, 255, 256, 257, 65536 + 300, 200003]
DTYPES = [torch.float32, torch.bfloat16]


def _copy(numel: int):
    return torch.empty(numel, dtype=torch.int8), torch.empty(i8_num_blocks(numel))


def _piece(numel: int, seed: int, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(4) * 3
    if numel > 600:
        x[256:512] = 0.0  # a whole block of zeros: scale 0, codes 0
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else a.dtype),
                       b.view(torch.int16 if b.dtype == torch.bfloat16 else b.dtype))  # fmt: skip


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=["src32", "src16"])
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=["dst32", "dst16"])
def test_keep_matches_the_reference(native, numel, src_dtype, dst_dtype):
    src = _piece(numel, numel, src_dtype)
    start = torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(dst_dtype)
    want, (cw, sw) = start.clone(), _copy(numel)
    accumulate_keep_i8_reference_(want, src, 0.37, cw, sw)
    plain = start.clone()
    accumulate_reference_(plain, src, 0.37, False)
    assert _same(want, plain)  # the add is accumulate_'s add
    for threads in THREADS:
        got, (c, s) = start.clone(), _copy(numel)
        accumulate_keep_i8_(got, src, 0.37, c, s, num_threads=threads)
        assert _same(got, want)
        assert torch.equal(c, cw) and torch.equal(s, sw)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=["dst32", "dst16"])
def test_add_dequantized_matches_the_reference(native, numel, dst_dtype):
    src = _piece(numel, numel + 5, torch.float32)
    c, s = _copy(numel)
    accumulate_keep_i8_reference_(torch.zeros(numel), src, 1.0, c, s)
    start = torch.randn(numel, generator=torch.Generator().manual_seed(2)).to(dst_dtype)
    want = start.clone()
    add_dequantized_i8_reference_(want, c, s, -0.23)
    for threads in THREADS:
        got = start.clone()
        add_dequantized_i8_(got, c, s, -0.23, num_threads=threads)
        assert _same(got, want)
    # the product rounded to fp32 first, then added (no FMA): the reference's own terms
    decoded = dequantized_i8_reference(c, s)
    prod = decoded * torch.tensor(-0.23, dtype=torch.float32)
    assert _same(want, (start.float() + prod).to(dst_dtype))


@pytest.mark.parametrize("numel", [300, 65536 + 300])
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=["dst32", "dst16"])
@pytest.mark.parametrize("prev", [(1.0, -0.31), (0.43, 0.0)], ids=["delta", "mul"])
def test_keep_folds_the_previous_correction_bit_for_bit(native, numel, dst_dtype, prev):
    """``prev_delta``: the previous step's correction from the copy held, then the add and
    the new copy; ``prev_mul``: the sum times it first. Bit for bit the correction as its own
    pass (``add_dequantized_i8_`` / a multiply) and then the add, native and reference."""
    mul, delta = prev
    old = _piece(numel, 7, torch.float32)
    c0, s0 = _copy(numel)
    accumulate_keep_i8_reference_(torch.zeros(numel), old, 1.0, c0, s0)
    src = _piece(numel, 8, torch.bfloat16)
    start = torch.randn(numel, generator=torch.Generator().manual_seed(3)).to(dst_dtype)
    want, (cw, sw) = start.clone(), (c0.clone(), s0.clone())
    if delta:
        add_dequantized_i8_(want, cw, sw, delta)
    else:
        want.copy_(want.float() * torch.tensor(mul, dtype=torch.float32))
    accumulate_keep_i8_(want, src, 0.37, cw, sw)
    for op in (accumulate_keep_i8_, accumulate_keep_i8_reference_):
        got, c, s = start.clone(), c0.clone(), s0.clone()
        op(got, src, 0.37, c, s, 2, mul, delta)
        assert _same(got, want) and torch.equal(c, cw) and torch.equal(s, sw), op.__name__


def test_the_copy_is_within_half_a_code_of_its_block():
    x = _piece(4096 + 77, 3, torch.float32)
    c, s = _copy(x.numel())
    accumulate_keep_i8_reference_(torch.zeros(x.numel()), x, 1.0, c, s)
    back = dequantized_i8_reference(c, s)
    for b in range(i8_num_blocks(x.numel())):
        blk = slice(b * I8_BLOCK, (b + 1) * I8_BLOCK)
        absmax = x[blk].abs().max()
        assert s[b] == absmax / 127
        err = (x[blk] - back[blk]).abs()
        assert (err <= absmax / 254 * (1 + 1e-5)).all()
        if absmax > 0:
            top = x[blk].abs().argmax()
            assert abs(int(c[blk][top])) == 127 and back[blk][top] == pytest.approx(
                float(x[blk][top]), rel=1e-6)  # fmt: skip
        else:
            assert (c[blk] == 0).all()
    rel = (x - back).norm() / x.norm()
    assert 0 < rel < 0.02


def test_codes_round_half_to_even(native):
    """A block with absmax 127: the codes are x itself rounded, ties to even (2.5 -> 2,
    3.5 -> 4, -2.5 -> -2), the native op and the reference alike."""
    x = torch.zeros(I8_BLOCK)
    x[:6] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.49, -126.6])
    for op in (accumulate_keep_i8_, accumulate_keep_i8_reference_):
        c, s = _copy(I8_BLOCK)
        op(torch.zeros(I8_BLOCK), x, 1.0, c, s)
        assert c[:6].tolist() == [127, 2, 4, -2, 0, -127] and s.tolist() == [1.0]


def test_the_ops_refuse_bad_arguments(native):
    c, s = _copy(300)
    with pytest.raises(RuntimeError, match="codes must be Char"):
        accumulate_keep_i8_(torch.zeros(300), torch.zeros(300), 1.0, c.to(torch.uint8), s)
    with pytest.raises(RuntimeError, match="one per 256-element block: 2"):
        accumulate_keep_i8_(torch.zeros(300), torch.zeros(300), 1.0, c, torch.zeros(3))
    with pytest.raises(RuntimeError, match="zenflow::accumulate_keep_i8_: src has 299"):
        accumulate_keep_i8_(torch.zeros(300), torch.zeros(299), 1.0, c, s)
    with pytest.raises(RuntimeError, match="zenflow::add_dequantized_i8_: dst must be Float"):
        add_dequantized_i8_(torch.zeros(300, dtype=torch.float16), c, s, 1.0)
    with pytest.raises(RuntimeError, match="codes has 300 elements"):
        add_dequantized_i8_(torch.zeros(299), c, s, 1.0)
