"""The compact host state's moments through fp32 (``Q8HostState.moments_fp32`` /
``set_moments``, a hand-over's re-layout and the first selection) hold two fp32 arrays at
their peak, nothing more: the second moment is squared and square-rooted in place
(``zenflow.ops.q8_reference.sqrt_rounded_``, a float64 chunk at a time) with the same bits
as the whole-tensor definition. The allocations are read from torch's profiler
(``profile_memory``: every CPU allocation an op makes, by size)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from zenflow import ops
from zenflow.engine.host import ColumnSteps, resolve_kernel
from zenflow.engine.zenflow.q8_state import Q8HostState
from zenflow.ops import q8_reference
from zenflow.ops.q8_reference import sqrt_rounded, sqrt_rounded_


def _allocations(fn) -> list[int]:
    """The sizes of the CPU allocations ``fn()`` makes, in bytes."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [ev.cpu_memory_usage for ev in prof.events() if ev.cpu_memory_usage > 0]


@pytest.mark.parametrize("n", [1, 255, 4097, 70_001])
@pytest.mark.parametrize("chunk", [1, 1000, 1 << 20])
def test_the_chunked_square_root_is_the_whole_ones_bit_for_bit(n, chunk):
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)) ** 7 * 1e-3
    x[::5] = 0.0
    want = sqrt_rounded(x)
    y = x.clone()
    out = sqrt_rounded_(y, chunk=chunk)
    assert out.data_ptr() == y.data_ptr()  # in place
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


def test_the_chunked_square_root_in_a_lent_buffer_is_the_same_and_checks_it():
    x = torch.rand(5000, generator=torch.Generator().manual_seed(2)) ** 5
    want = sqrt_rounded(x)
    buf = torch.empty(777, dtype=torch.float64)
    assert _allocations(lambda: sqrt_rounded_(x, buf=buf)) == []
    assert torch.equal(x.view(torch.int32), want.view(torch.int32))
    for bad in (torch.empty(8), torch.empty(0, dtype=torch.float64),
                torch.empty(2, 2, dtype=torch.float64)):  # fmt: skip
        with pytest.raises(ValueError, match="float64"):
            sqrt_rounded_(x, buf=bad)


def test_the_chunked_square_root_refuses_a_strided_view():
    with pytest.raises(ValueError, match="contiguous"):
        sqrt_rounded_(torch.rand(8, 8).t())


def test_its_float64_temporary_is_one_chunk():
    x = torch.rand(1_000_000)
    assert max(_allocations(lambda: sqrt_rounded(x))) >= 8 * x.numel()  # what it replaces
    assert max(_allocations(lambda: sqrt_rounded_(x, chunk=4096))) <= 8 * 4096


def _state(shape, kernels) -> Q8HostState:
    numel = shape[0] * shape[1]
    blocks = ops.q8_num_blocks(numel)
    moments = {
        "m_codes": torch.zeros(numel, dtype=torch.uint8),
        "m_scales": torch.zeros(blocks),
        "u_codes": torch.zeros(numel, dtype=torch.uint8),
        "u_scales": torch.zeros(blocks),
    }
    steps = ColumnSteps(torch.zeros(shape[1], dtype=torch.int64), None)
    return Q8HostState(torch.zeros(shape), moments, steps, kernels)


@pytest.mark.parametrize("kernel", ["native", "reference"])
def test_moments_through_fp32_hold_two_arrays_and_keep_the_codes(kernel, monkeypatch):
    """Quantise, dequantise, quantise again: the codes are the reference's (the plain
    definition: m as is, u = sqrt(v) correctly rounded), with either kernel. With the
    native one (the engine's), no allocation on the way is larger than one fp32 array, and
    all of them together are two arrays plus chunk-sized temporaries (the plain reference
    kernels allocate as they please: they are the definition, not the engine's path)."""
    ops.load_native()
    kernels = resolve_kernel(kernel)
    if kernels.name != kernel:
        pytest.skip(f"the native op is not available here: {kernels.name}")
    shape = (300, 1001)
    numel = shape[0] * shape[1]
    g = torch.Generator().manual_seed(3)
    m = torch.randn(shape, generator=g) * 1e-3
    v = torch.rand(shape, generator=g) ** 4 * 1e-6
    st = _state(shape, kernels)
    st.set_moments(m.clone(), v.clone())

    want = {k: torch.empty_like(t) for k, t in st.moment_tensors().items()}
    ops.quantize_q8_reference_(m.reshape(-1), want["m_codes"], want["m_scales"], fmt="m")
    ops.quantize_q8_reference_(sqrt_rounded(v).reshape(-1), want["u_codes"],
                               want["u_scales"], fmt="u")  # fmt: skip
    for k, t in st.moment_tensors().items():
        assert torch.equal(t, want[k]), k

    codes = {k: t.clone() for k, t in st.moment_tensors().items()}
    got = {}
    sizes = _allocations(lambda: got.setdefault("mv", st.moments_fp32()))
    m2, v2 = got.pop("mv")
    if kernel == "native":
        assert sorted(sizes) == [4 * numel, 4 * numel]  # m and v, v squared in place
    monkeypatch.setattr(q8_reference, "SQRT_CHUNK", 4096)  # well below the array
    sizes = _allocations(lambda: st.set_moments(m2, v2))
    if kernel == "native":
        assert max(sizes, default=0) <= 8 * 4096
    for k, t in st.moment_tensors().items():  # a round trip gives the same codes
        assert torch.equal(t, codes[k]), k


def test_the_fp32_moments_are_counted_in_the_host_peak_while_they_live():
    """With an accelerator, the moments' fp32 arrays (a re-layout's, the first selection's)
    are accounted as ``moments_fp32`` while they live: the run's host peak has them (the
    estimate's 8 N of a weight), and they leave the held bytes when freed."""
    from zenflow.engine.accelerator import CpuAccelerator

    accel = CpuAccelerator()
    kernels = resolve_kernel("reference")
    shape = (64, 300)
    st = Q8HostState.empty(accel, shape, shape[1], False, kernels)
    steady = accel.host_peak_bytes()
    assert "moments_fp32" not in accel.host_held()
    m, v = st.moments_fp32()
    assert accel.host_held()["moments_fp32"] == 2 * 4 * m.numel()
    assert accel.host_peak_bytes() == steady + 8 * m.numel()
    st.set_moments(m, v)  # consumes them
    del m, v
    assert "moments_fp32" not in accel.host_held()
    t = st.fp32_array((5, 7))  # the first selection's targets take the same way
    assert accel.host_held()["moments_fp32"] == 4 * 35
    del t
    assert "moments_fp32" not in accel.host_held()


def test_a_selections_scratch_lends_views_of_one_pair_while_held():
    """``MomentScratch``: while held, two fp32 arrays of the asked size (accounted as
    ``moments_fp32``), lent as contiguous views of their front for any shape that fits,
    one pair for every weight; none too large, none outside ``held``, none for 0; gone
    after. ``moments_fp32`` dequantises into the lent pair and ``set_moments`` quantises
    from it (the square root in the held float64 chunk) without allocating (the native
    kernels), with the values and codes of arrays of its own."""
    from zenflow.engine.accelerator import CpuAccelerator
    from zenflow.engine.zenflow.q8_state import MomentScratch

    ops.load_native()
    kernels = resolve_kernel("native")
    if kernels.name != "native":
        pytest.skip(f"the native op is not available here: {kernels.name}")
    accel = CpuAccelerator()
    scratch = MomentScratch(accel)
    assert scratch.pair((2, 3)) is None
    with scratch.held(0):
        assert scratch.pair((1,)) is None
        assert "moments_fp32" not in accel.host_held()
    shape = (64, 300)
    st = Q8HostState.empty(accel, shape, shape[1], False, kernels)
    g = torch.Generator().manual_seed(5)
    st.set_moments(torch.randn(shape, generator=g) * 1e-3,
                   torch.rand(shape, generator=g) ** 4 * 1e-6)  # fmt: skip
    own_m, own_v = st.moments_fp32()
    own = 2 * 4 * own_m.numel()
    with scratch.held(64 * 300 + 7):
        wide = 8 * (64 * 300 + 7)  # the square root's float64 chunk: below SQRT_CHUNK here
        assert accel.host_held()["moments_fp32"] == own + 2 * 4 * (64 * 300 + 7) + wide
        assert scratch.wide().dtype == torch.float64
        a, b = scratch.pair((3, 5))
        assert a.shape == b.shape == (3, 5) and a.is_contiguous() and b.is_contiguous()
        assert a.data_ptr() != b.data_ptr()
        assert scratch.pair((64 * 300 + 8,)) is None  # too large: the caller's own
        with scratch.held(10):  # held already: the outer pair stays
            assert scratch.pair((64, 300)) is not None
        got = {}
        sizes = _allocations(lambda: got.setdefault("mv", st.moments_fp32(scratch)))
        m, v = got["mv"]
        assert sizes == []
        assert m.data_ptr() == scratch.pair(shape)[0].data_ptr()
        assert torch.equal(m, own_m) and torch.equal(v, own_v)
        codes = {k: t.clone() for k, t in st.moment_tensors().items()}
        assert _allocations(functools.partial(st.set_moments, m, v, scratch)) == []
        for k, t in st.moment_tensors().items():  # the codes of the arrays of its own
            assert torch.equal(t, codes[k]), k
        del a, b, m, v
        got.clear()  # the views keep the arrays alive
    assert scratch.pair((3, 5)) is None and scratch.wide() is None
    assert accel.host_held()["moments_fp32"] == own  # own_m and own_v only
