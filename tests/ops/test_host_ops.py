"""The compact host ops (csrc/host_ops.cpp) against their plain references and the full op.

``adamw_compact_step_`` updates the non-selected columns of a weight's host state from a
gradient in the compact layout ``W.index_select(column_dim, index)``. Three checks per
case: element-wise against the PyTorch reference (gather, reference step, scatter), bit
for bit against the full-shape native ``adamw_step_`` on the same elements (the compact op
computes each element with the same instructions), and the other columns untouched. Odd
shapes put run and row boundaries inside vectors and across the 64K-element blocks;
thread counts 1..3 must give the same bits.

``accumulate_`` is ``dst = scale*src`` or ``dst += fp32(scale*src)``; it is checked bit
for bit against the reference (the product must not be fused into an FMA), bit-identical
across thread counts, and its sum of squares against float64. A bf16 ``dst`` (the compact
host state's window sum) is summed in fp32 and rounded to nearest even: bit for bit the
reference, ties checked on constructed values, the sum of squares over the stored values.
"""

from __future__ import annotations

import pytest
import torch

from zenflow.ops import (
    accumulate_,
    accumulate_reference_,
    adamw_compact_step_,
    adamw_compact_step_reference_,
    adamw_step_,
)

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
# (rows, cols): a 1x1, odd shapes, one with 64K-element blocks crossing rows
SHAPES = [(1, 1), (3, 7), (17, 33), (65, 257), (5, 20011)]
THREADS = (1, 2, 3)


def _index(cols: int, share: float, seed: int) -> torch.Tensor:
    """Sorted non-selected column ids: random, with runs of consecutive ids and gaps."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, round(cols * share))
    return torch.randperm(cols, generator=gen)[:n].sort().values


def _state(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(shape, generator=gen)
    exp_avg = 0.1 * torch.randn(shape, generator=gen)
    exp_avg_sq = 0.01 * torch.rand(shape, generator=gen)
    return param, exp_avg, exp_avg_sq


def _compact_shape(shape, column_dim, n):
    out = list(shape)
    out[column_dim] = n
    return tuple(out)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("column_dim", [0, 1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_column", [False, True])
def test_compact_step_matches_reference_and_full_op(
    native, shape, column_dim, grad_dtype, per_column
):
    if column_dim == 0:
        shape = (shape[1], shape[0])  # columns are rows: [C, out]
    cols = shape[column_dim]
    index = _index(cols, 0.8, seed=cols)
    n = index.numel()
    gen = torch.Generator().manual_seed(7)
    grad = torch.randn(_compact_shape(shape, column_dim, n), generator=gen).to(grad_dtype)
    col_steps = None
    if per_column:  # far-apart counts, as after hand-overs
        col_steps = torch.tensor([(1, 2, 100, 10**6)[j % 4] for j in range(cols)])
    kw = dict(HYPER, step=3, grad_scale=0.25, col_steps=col_steps)

    init = _state(shape, seed=1)
    native_state = [t.clone() for t in init]
    image = torch.zeros(grad.shape, dtype=torch.bfloat16)
    p, m, v = native_state
    adamw_compact_step_(p, grad, m, v, index, column_dim, image=image, num_threads=2, **kw)

    ref_state = [t.clone() for t in init]
    ref_image = torch.zeros(grad.shape, dtype=torch.bfloat16)
    p, m, v = ref_state
    adamw_compact_step_reference_(p, grad, m, v, index, column_dim, image=ref_image, **kw)
    for got, want in zip(native_state, ref_state, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(image.float(), ref_image.float(), atol=1e-2, rtol=1e-2)

    # bit for bit what the full-shape op computes for those elements
    full_state = [t.index_select(column_dim, index).contiguous() for t in init]
    full_kw = {}
    if col_steps is not None:
        inner = 1 if column_dim == 1 else shape[1]
        full_kw = {"col_steps": col_steps[index].contiguous(), "col_inner": inner}
    bf16 = torch.zeros(grad.shape, dtype=torch.bfloat16)
    adamw_step_(*full_state[:1], grad, *full_state[1:], param_bf16=bf16,
                **dict(HYPER, step=3, grad_scale=0.25), **full_kw)  # fmt: skip
    for got, want in zip(native_state, full_state, strict=True):
        assert torch.equal(got.index_select(column_dim, index), want)
    assert torch.equal(image, bf16)

    # the selected (other) columns are untouched, and the step did something
    mask = torch.ones(cols, dtype=torch.bool)
    mask[index] = False
    others = mask.nonzero().flatten()
    for got, before in zip(native_state, init, strict=True):
        assert torch.equal(
            got.index_select(column_dim, others), before.index_select(column_dim, others)
        )
    assert not torch.equal(native_state[0], init[0])


@pytest.mark.parametrize("column_dim", [0, 1])
def test_compact_step_threads_bit_identical(native, column_dim):
    shape = (129, 1031) if column_dim == 1 else (1031, 129)
    index = _index(shape[column_dim], 0.9, seed=3)
    grad = torch.randn(_compact_shape(shape, column_dim, index.numel())).bfloat16()
    results = []
    for threads in THREADS:
        state = [t.clone() for t in _state(shape, seed=2)]
        image = torch.empty(grad.shape, dtype=torch.bfloat16)
        p, m, v = state
        adamw_compact_step_(p, grad, m, v, index, column_dim, image=image, num_threads=threads,
                            step=5, **HYPER)  # fmt: skip
        results.append((state, image))
    for state, image in results[1:]:
        assert torch.equal(image, results[0][1])
        for a, b in zip(state, results[0][0], strict=True):
            assert torch.equal(a, b)


def test_compact_step_rejects_bad_arguments(native):
    p, m, v = _state((4, 6), seed=0)
    index = torch.tensor([1, 3, 4])
    grad = torch.zeros(4, 3)
    bad = [
        (dict(index=torch.tensor([3, 1, 4])), "strictly increasing"),
        (dict(index=torch.tensor([1, 3, 6])), "strictly increasing"),
        (dict(grad=torch.zeros(4, 4)), "grad has 16 elements"),
        (dict(column_dim=2), "column_dim must be 0 or 1"),
        (dict(col_steps=torch.ones(5, dtype=torch.int64)), "col_steps must be"),
        (dict(col_steps=torch.zeros(6, dtype=torch.int64)), "col_steps must be >= 1"),
    ]
    for change, message in bad:
        args = dict(index=index, grad=grad, column_dim=1, col_steps=None)
        args.update(change)
        with pytest.raises(RuntimeError, match=message) as err:
            adamw_compact_step_(p, args["grad"], m, v, args["index"], args["column_dim"],
                                step=1, col_steps=args["col_steps"], **HYPER)  # fmt: skip
        assert "zenflow::adamw_compact_step_" in str(err.value)


@pytest.mark.parametrize("numel", [1, 7, 15, 16, 17, 65537, 200003])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overwrite", [False, True])
def test_accumulate_matches_reference(native, numel, src_dtype, overwrite):
    gen = torch.Generator().manual_seed(numel)
    start = torch.randn(numel, generator=gen)
    src = torch.randn(numel, generator=gen).to(src_dtype)
    got, want = start.clone(), start.clone()
    sq = accumulate_(got, src, 0.37, overwrite, sumsq=True, num_threads=2)
    sq_ref = accumulate_reference_(want, src, 0.37, overwrite, sumsq=True)
    assert torch.equal(got, want)  # the product rounded first: no FMA contraction
    assert sq == pytest.approx(sq_ref, rel=1e-6)
    assert sq == pytest.approx(float(got.double().square().sum()), rel=1e-6)


@pytest.mark.parametrize("offset", [0, 1, 5, 15])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_streamed_overwrite_matches_reference(native, offset, src_dtype):
    """A window's first sum of 2^18 elements or more is written with non-temporal stores
    (scalar stores up to the vector alignment): bit for bit the reference, aligned and at
    starts 1, 5 and 15 elements off (a piece's place in a window sum starts anywhere), on
    1-3 threads, and not one element outside it written."""
    numel = (1 << 18) + 4099  # blocks of 64K, a partial last one, a tail off the vector
    gen = torch.Generator().manual_seed(offset)
    src = torch.randn(numel, generator=gen)
    src[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40, 3e38])
    src = src.to(src_dtype)
    want = torch.full((numel,), 7.0)
    accumulate_reference_(want, src, 0.37, True)
    for threads in THREADS:
        buf = torch.full((numel + 32,), -3.0)
        got = buf[offset : offset + numel]
        assert accumulate_(got, src, 0.37, True, num_threads=threads) == 0.0
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaN's bits too
        outside = torch.cat([buf[:offset], buf[offset + numel :]])
        assert torch.equal(outside, torch.full_like(outside, -3.0))


def test_accumulate_unit_scale_is_the_exact_sum(native):
    """scale 1: the window sum equals torch's fp32 add exactly."""
    gen = torch.Generator().manual_seed(0)
    acc = torch.randn(100003, generator=gen)
    src = torch.randn(100003, generator=gen).bfloat16()
    want = acc + src.float()
    assert accumulate_(acc, src, 1.0, False) == 0.0
    assert torch.equal(acc, want)


def test_accumulate_threads_bit_identical(native):
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(300007, generator=gen)
    src = torch.randn(300007, generator=gen).bfloat16()
    outs = []
    for threads in THREADS:
        dst = start.clone()
        outs.append((dst, accumulate_(dst, src, 0.5, False, sumsq=True, num_threads=threads)))
    for dst, sq in outs[1:]:
        assert torch.equal(dst, outs[0][0])
        assert sq == outs[0][1]


@pytest.mark.parametrize("numel", [1, 7, 15, 16, 17, 65537, 200003])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overwrite", [False, True])
def test_accumulate_bf16_dst_matches_reference(native, numel, src_dtype, overwrite):
    gen = torch.Generator().manual_seed(numel + 1)
    start = torch.randn(numel, generator=gen).bfloat16()
    src = torch.randn(numel, generator=gen).to(src_dtype)
    got, want = start.clone(), start.clone()
    sq = accumulate_(got, src, 0.37, overwrite, sumsq=True, num_threads=2)
    sq_ref = accumulate_reference_(want, src, 0.37, overwrite, sumsq=True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    prod = src.float() * torch.tensor(0.37, dtype=torch.float32)
    fp32_sum = prod if overwrite else start.float() + prod
    assert torch.equal(got, fp32_sum.bfloat16())  # torch's own rounding of the fp32 sum
    assert (got.float() != fp32_sum).any() or numel < 16  # which did round
    assert sq == pytest.approx(sq_ref, rel=1e-6)
    assert sq == pytest.approx(float(got.double().square().sum()), rel=1e-6)


def test_accumulate_bf16_dst_rounds_to_nearest_even(native):
    """1 + 2^-8 lies halfway between the bf16 values 1 and 1 + 2^-7: even, 1. 1 + 3*2^-8
    lies halfway between 1 + 2^-7 and 1 + 2^-6: even, 1 + 2^-6. Just above a tie: up."""
    dst = torch.ones(5, dtype=torch.bfloat16)
    src = torch.tensor([2**-8, 3 * 2**-8, 2**-8 + 2**-20, 2**-9, -(2**-8)])
    sq = accumulate_(dst, src, 1.0, False, sumsq=True)
    want = [1.0, 1 + 2**-6, 1 + 2**-7, 1.0, 1.0 - 2**-8]
    assert dst.float().tolist() == want
    assert sq == sum(x * x for x in want)  # over the stored values
    accumulate_(dst, torch.full((5,), 3.0), 0.5, True)
    assert dst.float().tolist() == [1.5] * 5


def test_accumulate_bf16_dst_threads_bit_identical(native):
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(300007, generator=gen).bfloat16()
    src = torch.randn(300007, generator=gen)
    outs = []
    for threads in THREADS:
        dst = start.clone()
        outs.append((dst, accumulate_(dst, src, 0.5, False, sumsq=True, num_threads=threads)))
    for dst, sq in outs[1:]:
        assert torch.equal(dst.view(torch.int16), outs[0][0].view(torch.int16))
        assert sq == outs[0][1]


def test_accumulate_rejects_bad_arguments(native):
    with pytest.raises(RuntimeError, match="zenflow::accumulate_: src has 3 elements"):
        accumulate_(torch.zeros(4), torch.zeros(3), 1.0, False)
    with pytest.raises(RuntimeError, match="dst must be Float or BFloat16"):
        accumulate_(torch.zeros(4, dtype=torch.float16), torch.zeros(4), 1.0, False)
    with pytest.raises(RuntimeError, match="contiguous"):
        accumulate_(torch.zeros(4, 2).t(), torch.zeros(8), 1.0, False)
    with pytest.raises(RuntimeError, match="dst must be contiguous"):
        accumulate_(torch.zeros(4, 2, dtype=torch.bfloat16).t(), torch.zeros(8), 1.0, False)


# ------------------------------------------------------------------ compact_merge_ (hand-over)
def _merge_case(n, other, m, column_dim, dtype, seed):
    """A compact array, m old positions leaving it, m new positions joining, their values."""
    gen = torch.Generator().manual_seed(seed)
    shape = (other, n) if column_dim == 1 else (n, other)
    data = (100 * torch.randn(shape, generator=gen)).to(dtype)
    drop = torch.randperm(n, generator=gen)[:m].sort().values
    ins = torch.randperm(n, generator=gen)[:m].sort().values
    values = (100 * torch.randn(_compact_shape(shape, column_dim, m), generator=gen)).to(dtype)
    return data, drop, ins, values


@pytest.mark.parametrize("column_dim", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
@pytest.mark.parametrize(("n", "other", "m"), [(1, 1, 0), (1, 3, 1), (9, 4, 3), (40, 7, 40),
                                               (257, 65, 31), (20011, 5, 2000)])  # fmt: skip
def test_compact_merge_matches_reference(native, column_dim, dtype, n, other, m):
    """Element-wise (it only moves values: bit for bit) against the gather/scatter
    reference, including every column leaving (m = n) and none (m = 0)."""
    from zenflow.ops import compact_merge_, compact_merge_reference_

    data, drop, ins, values = _merge_case(n, other, m, column_dim, dtype, seed=n + m)
    want = data.clone()
    compact_merge_reference_(want, drop, ins, values, column_dim)
    compact_merge_(data, drop, ins, values, column_dim, num_threads=2)
    assert torch.equal(data, want)


def test_compact_merge_is_the_hand_over_of_sorted_columns(native):
    """What the engine relies on: with the non-selected column ids of a weight sorted
    before and after a re-selection, the merge gives exactly the new compact layout."""
    from zenflow.ops import compact_merge_

    gen = torch.Generator().manual_seed(3)
    rows, cols, k = 6, 50, 9
    full = torch.randn(rows, cols, generator=gen)
    old_sel = torch.randperm(cols, generator=gen)[:k].sort().values
    others = torch.tensor([c for c in range(cols) if c not in old_sel][:5])
    new_sel = torch.cat([old_sel[:4], others]).sort().values

    def nonsel(sel):
        keep = torch.ones(cols, dtype=torch.bool)
        keep[sel] = False
        return keep.nonzero().flatten()

    old_ns, new_ns = nonsel(old_sel), nonsel(new_sel)
    entering = new_sel[torch.isin(new_sel, old_ns)]  # leave the host array
    leaving = old_sel[~torch.isin(old_sel, new_sel)]  # join it
    host = full.index_select(1, old_ns).contiguous()
    drop, ins = torch.searchsorted(old_ns, entering), torch.searchsorted(new_ns, leaving)
    compact_merge_(host, drop, ins, full.index_select(1, leaving), 1)
    assert torch.equal(host, full.index_select(1, new_ns))


def test_compact_merge_threads_bit_identical(native):
    from zenflow.ops import compact_merge_

    data, drop, ins, values = _merge_case(1001, 37, 150, 1, torch.float32, seed=1)
    outs = []
    for threads in THREADS:
        d = data.clone()
        compact_merge_(d, drop, ins, values, 1, num_threads=threads)
        outs.append(d)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_compact_merge_rejects_bad_arguments(native):
    from zenflow.ops import compact_merge_

    data = torch.zeros(4, 6)
    good = dict(drop=torch.tensor([1, 3]), ins=torch.tensor([0, 5]), values=torch.ones(4, 2),
                column_dim=1)  # fmt: skip
    bad = [
        (dict(drop=torch.tensor([3, 1])), "sorted and distinct"),
        (dict(ins=torch.tensor([0, 6])), "not a position in"),
        (dict(ins=torch.tensor([0])), "as many columns join"),
        (dict(values=torch.ones(4, 3)), "values must hold the 2 joining columns"),
        (dict(values=torch.ones(4, 2, dtype=torch.float64)), "of data's dtype"),
        (dict(column_dim=2), "column_dim must be 0 or 1"),
    ]
    for change, message in bad:
        args = dict(good, **change)
        with pytest.raises(RuntimeError, match=message) as err:
            compact_merge_(data, args["drop"], args["ins"], args["values"], args["column_dim"])
        assert "zenflow::compact_merge_" in str(err.value)
    assert torch.equal(data, torch.zeros(4, 6))  # a refused call changed nothing


# ------------------------------------------------------------- gather_columns_ (column gathers)
def _gather_index(n: int, m: int, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "sorted":  # the engine's: sorted distinct ids, runs and gaps
        return torch.randperm(n, generator=gen)[:m].sort().values
    if kind == "all":  # one run
        return torch.arange(n)
    return torch.randint(0, n, (m,), generator=gen)  # any order, repeats


GATHER_CASES = [((1, 1, 1), 1), ((3, 9, 2), 4), ((5, 2003, 3), 1800), ((700, 300, 1), 270),
                ((1, 40000, 1), 35000)]  # fmt: skip


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("kind", ["sorted", "all", "any"])
@pytest.mark.parametrize(("shape", "m"), GATHER_CASES)
def test_gather_columns_matches_index_select(native, dim, dtype, kind, shape, m):
    """Element-wise against torch.index_select (it only moves values: bit for bit), for
    columns along any dim of a contiguous tensor, sorted ids with runs, one run, and ids
    in any order with repeats."""
    from zenflow.ops import gather_columns_, gather_columns_reference_

    gen = torch.Generator().manual_seed(sum(shape) + m)
    src = (100 * torch.randn(shape, generator=gen)).to(dtype)
    n = shape[dim]
    index = _gather_index(n, n if kind == "all" else min(m, n), kind, seed=m)
    want_shape = list(shape)
    want_shape[dim] = index.numel()
    want = torch.full(want_shape, 7).to(dtype)
    got = want.clone()
    gather_columns_reference_(want, src, index, dim)
    gather_columns_(got, src, index, dim, num_threads=2)
    assert torch.equal(got, want)
    assert torch.equal(got, src.index_select(dim, index))


def test_gather_columns_threads_bit_identical_and_large_runs(native):
    """Any thread count, and a single slice whose runs are cut for the threads."""
    from zenflow.ops import gather_columns_

    gen = torch.Generator().manual_seed(5)
    for shape, dim in (((257, 3001), 1), ((3001, 513), 0)):
        src = torch.randn(shape, generator=gen)
        index = _gather_index(shape[dim], shape[dim] * 9 // 10, "sorted", seed=1)
        outs = []
        for threads in THREADS:
            out = torch.empty(src.index_select(dim, index).shape)
            gather_columns_(out, src, index, dim, num_threads=threads)
            outs.append(out)
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        assert torch.equal(outs[0], src.index_select(dim, index))


def test_gather_columns_rejects_bad_arguments(native):
    from zenflow.ops import gather_columns_

    src = torch.arange(24.0).reshape(4, 6)
    good = dict(out=torch.zeros(4, 2), index=torch.tensor([1, 3]), dim=1)
    bad = [
        (dict(index=torch.tensor([0, 6])), "is not an item in"),
        (dict(index=torch.tensor([-1, 2])), "is not an item in"),
        (dict(index=torch.tensor([1.0, 3.0])), "index must be a contiguous 1-D Long"),
        (dict(out=torch.zeros(4, 3)), "needs that shape with 2 at dim 1"),
        (dict(out=torch.zeros(4, 2, dtype=torch.float64)), "of src's dtype"),
        (dict(out=torch.zeros(2, 4).t()), "out must be a contiguous"),
        (dict(dim=2), "is not a dim of src"),
        (dict(out=src[:, :2].contiguous().view(4, 2), dim=1), None),  # a copy: fine
    ]
    for change, message in bad:
        args = dict(good, **change)
        if message is None:
            gather_columns_(args["out"], src, args["index"], args["dim"])
            continue
        out_before = args["out"].clone()
        with pytest.raises(RuntimeError, match=message) as err:
            gather_columns_(args["out"], src, args["index"], args["dim"])
        assert "zenflow::gather_columns_" in str(err.value)
        assert torch.equal(args["out"], out_before)  # a refused call wrote nothing
    with pytest.raises(RuntimeError, match="out overlaps src"):
        gather_columns_(src.view(-1)[:8].view(4, 2), src, torch.tensor([1, 3]), 1)
    assert torch.equal(src, torch.arange(24.0).reshape(4, 6))
