"""``zfctl.step_store`` "q8", the arithmetic (``zenflow.engine.zenflow.step_q8``): each piece
is added as it arrives, scaled by the previous step's coefficient ``p``, and kept in 8 bits
by the same add; once the step's coefficient ``c`` is known the sum gets ``(c - p)`` times
the decoded copy. A window's first write goes in unscaled and is multiplied by ``c``.

Checked here against a plain statement of that arithmetic (fp32 adds and the copy's
reference decoding, ``_expected``), element for element, with the native and the reference
kernels: pieces whose 256-blocks do not line up with the pieces' edges, a piece beyond one
thread's block, a bf16 link, a bf16 window sum (the compact host state) and a skipped
step. And the bound that makes it per-step clipping: the sum differs from
``sum(c_t * g_t)`` by at most ``|c_t - p_t|`` times each copy's rounding.
The engine's own runs (bit for bit the store without clipping, resume, the layout) are in
``test_step_store`` and ``test_resume``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from zenflow.engine.accelerator import DONE
from zenflow.engine.copies import plan_pieces
from zenflow.engine.host import Accumulator, resolve_kernel
from zenflow.engine.zenflow.step_q8 import Q8StepStore
from zenflow.ops import accumulate_keep_i8_reference_, dequantized_i8_reference, i8_num_blocks


class _Accel:
    def host_empty(self, shape, dtype, pin, what):
        return torch.empty(shape, dtype=dtype)

    def host_scope(self):
        return contextlib.nullcontext()


class _Transport:
    """Pieces straight to the accumulator (the ring's slot is a copy of the bucket)."""

    def __init__(self, acc: Accumulator):
        self.accumulator = acc

    def send_piece(self, i, bucket, dst, gate, overwrite, stat=None, wait=None, keep=None):
        self.accumulator.add(DONE, bucket.clone(), dst, gate, overwrite, None, stat, wait, keep)


class _Weight:
    def __init__(self, shape, n_nonsel, bucket_elems, sum_dtype):
        self.position = 0
        self.owned = True
        self.pieces = plan_pieces(shape, 1, n_nonsel, bucket_elems)
        self.compact_numel = shape[0] * n_nonsel
        self.acc = [torch.full((self.compact_numel,), float("nan"), dtype=sum_dtype)]

    def views(self, buf):
        return [pc.of(buf) for pc in self.pieces]


class _Mode:
    def __init__(self, kernels, acc, host_state="exact", weights=()):
        self.e = type("E", (), {"accel": _Accel(), "clip": 1.0})()
        self.zweights = list(weights)
        self.host_state = host_state
        self.kernels = kernels
        self.transport = _Transport(acc)
        self.plan = type("P", (), {"slot": 0})()


def _run(kernels, w: _Weight, steps: list, fold: bool = False,
         state: str = "exact") -> tuple[torch.Tensor, Q8StepStore]:  # fmt: skip
    """Each step: (pieces, coefficient, skipped, fresh) through a Q8StepStore (``fold``:
    the last flush hands its corrections over, ``store.last_folded``, as a window's end
    does for its host step)."""
    acc = Accumulator(kernels.accumulate, threads=2, keep_i8=kernels.keep_i8)
    mode = _Mode(kernels, acc, state, [w])
    store = Q8StepStore(mode)
    try:
        for pieces, coef, skipped, fresh in steps:
            if fresh:  # a window's end: its host step reads the sum, corrected
                store.flush()
            store.start_step()
            views = w.views(w.acc[0])
            for pc, g, dst in zip(w.pieces, pieces, views, strict=True):
                store.send(w, pc, 0, g, dst, fresh, None)
            store.gate_set(coef, skipped)
        # what a window's end does before its host step reads the sum
        store.last_folded = store.flush(fold=fold)
        acc.drain()
    finally:
        acc.close()
    return w.acc[0].clone(), store


def _expected(w: _Weight, steps: list, sum_dtype: torch.dtype) -> torch.Tensor:
    """The arithmetic in plain fp32 torch: what the q8 store must compute, bit for bit."""
    out = w.acc[0].clone()
    pred = 1.0
    for pieces, coef, skipped, fresh in steps:
        for pc, g in zip(w.pieces, pieces, strict=True):
            dst = pc.of(out).view(-1)
            g32 = g.reshape(-1).float()
            if fresh:
                dst.copy_(g32)
                if not skipped and coef != 1.0:
                    dst.mul_(coef)
                continue
            dst.copy_((dst.float() + g32 * pred).to(sum_dtype))
            delta = (0.0 if skipped else coef) - pred
            if delta != 0.0:
                back = _decoded(g32)
                dst.copy_((dst.float() + back * delta).to(sum_dtype))
        if not skipped:
            pred = coef
    return out


def _steps(w: _Weight, link: torch.dtype, plan: list, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for coef, skipped, fresh in plan:
        pieces = [(torch.randn(pc.shape, generator=gen) * torch.rand(pc.shape[0], 1,
                   generator=gen) * 4).to(link) for pc in w.pieces]  # fmt: skip
        steps.append((pieces, coef, skipped, fresh))
    return steps


# a window of four steps: its first write, a coefficient that changes, one that does not,
# a skipped step, and the next window's first write over it
PLAN = [(0.5, False, True), (0.25, False, False), (0.25, False, False), (0.8, True, False),
        (0.4, False, False), (0.3, False, True), (1.0, False, False)]  # fmt: skip


@pytest.mark.parametrize("kernel", ["native", "reference"])
@pytest.mark.parametrize(
    "link,sum_dtype,shape,n_nonsel,bucket",
    [
        (torch.float32, torch.float32, (37, 64), 57, 300),  # blocks straddle the pieces
        (torch.bfloat16, torch.float32, (37, 64), 57, 300),  # the chunked quantisation
        (torch.bfloat16, torch.bfloat16, (37, 64), 57, 300),  # the compact state's sum
        (torch.float32, torch.float32, (9, 40000), 39000, 160000),  # 4 rows a piece
    ],
    ids=["fp32", "bf16-link", "bf16-sum", "big-pieces"],
)
def test_the_q8_store_computes_the_stated_arithmetic(kernel, link, sum_dtype, shape, n_nonsel,
                                                     bucket):  # fmt: skip
    kernels = resolve_kernel(kernel)
    w = _Weight(shape, n_nonsel, bucket, sum_dtype)
    assert len(w.pieces) > 1 and any(pc.numel % 256 for pc in w.pieces)
    steps = _steps(w, link, PLAN)
    got, store = _run(kernels, w, steps)
    assert torch.equal(got, _expected(_Weight(shape, n_nonsel, bucket, sum_dtype), steps,
                                      sum_dtype))  # fmt: skip
    # corrections: the first writes times their coefficient (0.5, 0.3), the steps whose
    # coefficient changed (0.25 after 0.5, 0.4 after 0.25, 1.0 after 0.3) and the skipped
    # one (minus its prediction); none for the step that kept 0.25. Each goes into the next
    # step's adds, but for the two a window's end flushes as passes (0.4's, before the
    # window of 0.3 starts, and 1.0's at the end)
    assert store.corrected == 6 and store.passes == 2
    assert store.pred == 1.0


@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.bfloat16], ids=["exact", "compact"])
@pytest.mark.parametrize("kernel", ["native", "reference"])
def test_a_window_ends_correction_folded_is_the_pass(kernel, sum_dtype):
    """At a window's end (``flush(fold=True)``) the last correction is not a pass: it is
    handed to the host step's CPU Adam (its ``corr_*`` arguments), and the sum that Adam
    reads (``corrected_sum_reference``, bit for bit the native ops': their own tests) is the
    stated arithmetic's, as with the pass, in both host states (fp32 and bf16 sums); the
    sum in memory is left uncorrected. A test's own kernel cannot take it: a pass."""
    from zenflow.ops.reference import corrected_sum_reference

    kernels = resolve_kernel(kernel)
    shape, n_nonsel, bucket = (37, 64), 57, 300
    w = _Weight(shape, n_nonsel, bucket, sum_dtype)
    steps = _steps(w, torch.float32, PLAN)
    got, store = _run(kernels, w, steps, fold=True,
                      state="compact" if sum_dtype == torch.bfloat16 else "exact")  # fmt: skip
    want = _expected(_Weight(shape, n_nonsel, bucket, sum_dtype), steps, sum_dtype)
    corr = store.last_folded[0]  # the last step's: 1.0 after 0.3
    assert corr["corr_delta"] == pytest.approx(0.7) and store.folded == 1
    assert corr["corr_starts"].tolist() == [pc.offset for pc in w.pieces] + [w.compact_numel]
    assert not torch.equal(got, want)  # not applied to the sum
    read = corrected_sum_reference(got, corr["corr_codes"], corr["corr_scales"],
                                   corr["corr_starts"], corr["corr_delta"])  # fmt: skip
    assert torch.equal(read, want)
    assert store.corrected == 6 and store.passes == 1
    # a custom kernel: the pass, as before
    custom = resolve_kernel(lambda *a, **k: None)
    custom = type(custom)(**{**custom.__dict__, "accumulate": kernels.accumulate,
                             "keep_i8": kernels.keep_i8, "add_i8": kernels.add_i8})  # fmt: skip
    w2 = _Weight(shape, n_nonsel, bucket, sum_dtype)
    got2, store2 = _run(custom, w2, steps, fold=True)
    assert store2.last_folded == {} and torch.equal(got2, want)


def test_the_sum_is_per_step_clipping_within_the_copies_rounding():
    """|sum - sum(c_t g_t)| <= sum |c_t - p_t| |g_t - copy(g_t)|, and it is not exact (the
    copies did round), and far closer than the unclipped sum scaled by any one coefficient."""
    kernels = resolve_kernel("native")
    w = _Weight((64, 96), 80, 1000, torch.float32)
    plan = [(0.5, False, True), (0.2, False, False), (0.35, False, False), (0.3, False, False)]
    steps = _steps(w, torch.float32, plan, seed=1)
    got, _ = _run(kernels, w, steps)
    exact = torch.zeros_like(got, dtype=torch.float64)
    bound = torch.zeros_like(got, dtype=torch.float64)
    mass = torch.zeros_like(got, dtype=torch.float64)  # what fp32's own rounding scales with
    pred = 1.0
    for t, (pieces, coef, _, _) in enumerate(steps):
        g = torch.cat([p.reshape(-1) for p in pieces]).double()
        exact += g * coef
        mass += g.abs() * (coef + pred)
        if t > 0:
            err = torch.cat([_rounding(p.reshape(-1)) for p in pieces])
            bound += abs(coef - pred) * err
        pred = coef
    diff = (got.double() - exact).abs()
    assert (diff <= bound + 1e-6 * mass).all()
    assert diff.max() > 0
    rel = diff.norm() / exact.norm()
    # the copies round by about 1% of a value (RMS, these heavy-tailed blocks), times
    # |c - p| <= 0.3 against coefficients of 0.2-0.5: 0.39% here
    assert rel < 0.006, rel
    unclipped = sum(torch.cat([p.reshape(-1) for p in s[0]]) for s in steps).double()
    assert ((unclipped * 0.2 - exact).norm() / exact.norm()) > 20 * rel


def _decoded(g: torch.Tensor) -> torch.Tensor:
    codes = torch.empty(g.numel(), dtype=torch.int8)
    scales = torch.empty(i8_num_blocks(g.numel()), dtype=torch.float32)
    accumulate_keep_i8_reference_(torch.zeros(g.numel()), g, 1.0, codes, scales)
    return dequantized_i8_reference(codes, scales)


def _rounding(g: torch.Tensor) -> torch.Tensor:
    return (g - _decoded(g)).abs()
