"""The 8-bit moment codes (csrc/q8_codec.h, quantize_q8_ / dequantize_q8_) against their
plain definition (zenflow/ops/q8_reference.py): bit for bit.

The native quantiser rounds with fp32 bit arithmetic; the reference searches the value
table built from the formulas. Codes, scales and decoded values must be equal on odd sizes
(partial last blocks, vector tails), for any thread count, on the cases where a bit trick
goes wrong first: exact ties between two table values (ties to the even code, also across a
binade and the e == 0 / e == 1 boundary and beyond the largest value), every code value
(which must come back as its own code), all-zero blocks, a block with one huge value, and
tiny negatives (0x00, never 0x80). The error bound of each format is checked over random
data, and shown to be nearly reached, so the check measures what it claims.

tests/ops/test_simd_paths.py reruns this file on the AVX2 and scalar builds.
"""

from __future__ import annotations

import math

import pytest
import torch

from zenflow.ops import (
    Q8_BLOCK,
    dequantize_q8_,
    dequantize_q8_reference_,
    q8_num_blocks,
    q8_values,
    quantize_q8_,
    quantize_q8_reference_,
)

SIZES = [1, 7, 255, 256, 257, 4097, 65536 + 300]
FORMATS = ["m", "u"]
THREADS = (1, 2, 3)
QMAX = {"m": 1.875, "u": 1.9375}
# Half the spacing of the fraction bits, relative to the value: 2^-(k+1), k = 3 (m), 4 (u).
REL_BOUND = {"m": 1 / 16, "u": 1 / 32}


def _quantize(fn, x: torch.Tensor, fmt: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.full((x.numel(),), 0xAA, dtype=torch.uint8)  # not a valid result anywhere
    scales = torch.full((q8_num_blocks(x.numel()),), float("nan"))
    fn(x, codes, scales, fmt=fmt, **kw)
    return codes, scales


def _dequantize(fn, codes: torch.Tensor, scales: torch.Tensor, fmt: str, **kw) -> torch.Tensor:
    out = torch.full((codes.numel(),), float("nan"))
    fn(codes, scales, out, fmt=fmt, **kw)
    return out


def _check_native_equals_reference(x: torch.Tensor, fmt: str, threads=(2,)):
    """Codes, scales and decoded values bit for bit; returns the native (codes, scales)."""
    want_codes, want_scales = _quantize(quantize_q8_reference_, x, fmt)
    want_values = _dequantize(dequantize_q8_reference_, want_codes, want_scales, fmt)
    for n in threads:
        codes, scales = _quantize(quantize_q8_, x, fmt, num_threads=n)
        assert torch.equal(codes, want_codes), f"{fmt} codes differ (num_threads={n})"
        assert torch.equal(scales, want_scales), f"{fmt} scales differ (num_threads={n})"
        values = _dequantize(dequantize_q8_, codes, scales, fmt, num_threads=n)
        assert torch.equal(values, want_values), f"{fmt} decoded values differ"
    return want_codes, want_scales


def _wide(numel: int, seed: int, fmt: str) -> torch.Tensor:
    """Values over ~20 decades with zeros sprinkled in: every code range gets used."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.exp(4 * torch.randn(numel, generator=gen))
    x[torch.rand(numel, generator=gen) < 0.05] = 0.0
    return x.abs() if fmt == "u" else x


def test_value_tables_follow_the_formulas():
    m, u = q8_values("m"), q8_values("u")
    assert m.numel() == 128 and u.numel() == 256
    assert m[[0, 1, 7, 8, 9, 127]].tolist() == [
        0,
        2**-17,
        7 * 2**-17,
        2**-14,
        1.125 * 2**-14,
        1.875,
    ]
    assert u[[1, 15, 16, 17, 255]].tolist() == [
        2**-18,
        15 * 2**-18,
        2**-14,
        1.0625 * 2**-14,
        1.9375,
    ]
    assert torch.all(m[1:] > m[:-1]) and torch.all(u[1:] > u[:-1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel", SIZES)
def test_quantize_matches_reference(native, numel, fmt):
    x = _wide(numel, seed=numel, fmt=fmt)
    codes, scales = _check_native_equals_reference(x, fmt, threads=THREADS)
    assert scales.numel() == math.ceil(numel / Q8_BLOCK)
    if numel > 7:  # the codes carry information: many distinct values, none invalid
        assert codes.unique().numel() > 20


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 2.0**-10, 0.3, 7e-21, 3e19])
def test_every_code_round_trips(native, fmt, scale):
    """quantise(value(c) * scale) == c for every code c (and its negative for m)."""
    table = q8_values(fmt)
    codes = torch.arange(table.numel())
    values, want = table, codes
    if fmt == "m":  # 128 codes, 127 negatives (0 has one code), one padding zero
        values = torch.cat([table, -table[1:], torch.zeros(1)])
        want = torch.cat([codes, codes[1:] | 0x80, torch.zeros(1, dtype=torch.int64)])
    assert values.numel() == Q8_BLOCK
    x = values * torch.tensor(scale, dtype=torch.float32)
    got, scales = _check_native_equals_reference(x, fmt)
    assert torch.equal(got.long(), want)
    if scale in (1.0, 2.0**-10):  # power of two: scale and every product are exact
        assert float(scales[0]) == scale
        assert torch.equal(_dequantize(dequantize_q8_, got, scales, fmt), x)


def _ties(fmt: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A block whose first element is QMAX*scale (so the block scale is exactly ``scale``, a
    power of two), then every midpoint between two neighbouring table values: values and
    the expected codes (the first one's, then the even code of each pair)."""
    table = q8_values(fmt).double()
    lo = torch.arange(table.numel() - 1)
    mids = (table[:-1] + table[1:]) / 2  # one bit more than a code: exact in fp32
    even = torch.where(lo % 2 == 0, lo, lo + 1)
    q = torch.cat([table[-1:], mids])
    want = torch.cat([torch.tensor([table.numel() - 1]), even])
    return (q * scale).float(), _nonzero_u(want, fmt)


def _nonzero_u(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """u: a non-zero value never gets code 0 (every value here is non-zero)."""
    return codes.clamp(min=1) if fmt == "u" else codes


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 2.0**-20, 2.0**40])
def test_exact_ties_go_to_the_even_code(native, fmt, scale):
    """Ties inside a binade, across binades and between the e == 0 and e == 1 codes."""
    x, want = _ties(fmt, scale)
    assert torch.equal((x.double() / scale).float(), x / scale)  # the ties are exact
    got, scales = _check_native_equals_reference(x, fmt)
    assert float(scales[0]) == scale
    assert torch.equal(got.long(), want)
    # One ulp either side of a tie is no tie: the nearer code wins.
    mids = x[1:]
    lo = torch.arange(mids.numel())
    for direction, want_codes in ((math.inf, lo + 1), (-math.inf, lo)):
        moved = torch.cat([x[:1], torch.nextafter(mids, torch.tensor(direction))])
        got, _ = _check_native_equals_reference(moved, fmt)
        assert torch.equal(got[1:].long(), _nonzero_u(want_codes, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_blocks_have_scale_zero(native, fmt):
    x = _wide(5 * Q8_BLOCK + 3, seed=4, fmt=fmt)
    x[Q8_BLOCK : 2 * Q8_BLOCK] = 0.0
    x[-3:] = 0.0  # the partial last block
    if fmt == "m":
        x[3 * Q8_BLOCK : 4 * Q8_BLOCK] = -0.0
    codes, scales = _check_native_equals_reference(x, fmt, threads=THREADS)
    assert scales[1] == 0 and scales[-1] == 0 and torch.all(scales[[0, 2, 4]] > 0)
    assert torch.all(codes[Q8_BLOCK : 2 * Q8_BLOCK] == 0) and torch.all(codes[-3:] == 0)
    if fmt == "m":
        assert scales[3] == 0 and torch.all(codes[3 * Q8_BLOCK : 4 * Q8_BLOCK] == 0)
    values = _dequantize(dequantize_q8_, codes, scales, fmt)
    assert torch.equal(values[x == 0], torch.zeros(int((x == 0).sum())))


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_huge_value_in_a_block(native, fmt):
    """The others fall below the smallest code: m rounds them to zero (0x00 also for the
    negatives), u keeps them at code 1 (a non-zero second moment is never zero)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3 * Q8_BLOCK, generator=gen)
    if fmt == "u":
        x = x.abs() + 1e-3
    x[Q8_BLOCK + 17] = 1e30
    codes, scales = _check_native_equals_reference(x, fmt)
    block = codes[Q8_BLOCK : 2 * Q8_BLOCK].long()
    assert block[17] == (127 if fmt == "m" else 255)
    others = torch.cat([block[:17], block[18:]])
    assert torch.all(others == (0 if fmt == "m" else 1))
    assert float(scales[1]) == pytest.approx(1e30 / QMAX[fmt], rel=1e-6)
    # The neighbouring blocks keep their own scales.
    assert float(scales[0]) < 10 and float(scales[2]) < 10


def test_small_negative_m_rounds_to_plain_zero(native):
    x = torch.tensor([1.0, -1e-9, -(2.0**-22), 3.0 * 2**-18, -(3.0 * 2**-18)] + [0.0] * 3)
    x[0] = 1.875  # scale 1: q = |x|
    codes, _ = _check_native_equals_reference(x, "m")
    # -1e-9, -2^-22 round to 0 (0x00); 3*2^-18 = 1.5*2^-17 is a tie between codes 1 and 2.
    assert codes.tolist() == [127, 0, 0, 2, 0x82, 0, 0, 0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_relative_error_bound_in_the_normal_range(native, fmt):
    """|decoded - x| <= 2^-(k+1) |x| wherever q = |x|/scale >= 2^-14, and the bound is tight."""
    gen = torch.Generator().manual_seed(6)
    numel = 64 * Q8_BLOCK
    # Two decades either side of 1 within a block: nearly all in the normal range.
    x = torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen))
    x = x.abs() if fmt == "u" else x
    codes, scales = _check_native_equals_reference(x, fmt)
    values = _dequantize(dequantize_q8_, codes, scales, fmt)
    q = x.abs() / scales.repeat_interleave(Q8_BLOCK)
    normal = q >= 2.0**-14
    assert normal.float().mean() > 0.98
    rel = ((values - x).abs() / x.abs())[normal].double()
    # Two fp32 roundings (the division into q, the product back) may add ~2^-23 each.
    assert rel.max() <= REL_BOUND[fmt] * (1 + 2**-20)
    assert rel.max() > 0.9 * REL_BOUND[fmt]
    assert torch.equal(values.sign()[normal], x.sign()[normal])


def test_u_format_encodes_the_magnitude(native):
    x = torch.tensor([1.0, -0.5, 0.25, -(2.0**-30)])
    codes, _ = _check_native_equals_reference(x, "u")
    codes_abs, _ = _check_native_equals_reference(x.abs(), "u")
    assert torch.equal(codes, codes_abs) and codes[-1] == 1


def test_results_do_not_depend_on_threads(native):
    x = _wide(3 * 65536 + 300, seed=8, fmt="m")
    _check_native_equals_reference(x, "m", threads=(1, 2, 3, 0))


def test_empty_tensor(native):
    codes, scales = _quantize(quantize_q8_, torch.zeros(0), "m")
    assert codes.numel() == 0 and scales.numel() == 0
    assert _dequantize(dequantize_q8_, codes, scales, "u").numel() == 0


def test_quantize_rejects_bad_arguments(native):
    x = torch.randn(300)
    codes, scales = torch.zeros(300, dtype=torch.uint8), torch.zeros(2)
    bad = [
        (dict(codes=torch.zeros(300, dtype=torch.int8)), "codes must be Byte"),
        (dict(codes=torch.zeros(299, dtype=torch.uint8)), "codes has 299 elements"),
        (dict(scales=torch.zeros(1)), "scales has 1 elements, expected 2"),
        (dict(scales=torch.zeros(2, dtype=torch.float64)), "scales must be Float"),
        (dict(src=torch.randn(600)[::2]), "src must be contiguous"),
        (dict(src=x.double()), "src must be Float"),
    ]
    for change, message in bad:
        args = dict(src=x, codes=codes, scales=scales) | change
        with pytest.raises(RuntimeError, match=message) as err:
            quantize_q8_(args["src"], args["codes"], args["scales"], fmt="m")
        assert str(err.value).startswith("zenflow::quantize_q8_: ")
    with pytest.raises(RuntimeError, match=r"^zenflow::dequantize_q8_: dst must be contiguous"):
        dequantize_q8_(codes, scales, torch.zeros(600)[::2], fmt="m")
    with pytest.raises(RuntimeError, match=r"^zenflow::dequantize_q8_: codes has 300 elements"):
        dequantize_q8_(codes, scales, torch.zeros(301), fmt="u")
    with pytest.raises(ValueError, match="q8 format must be 'm'"):
        quantize_q8_(x, codes, scales, fmt="v")
