"""Per-column step counts (``col_steps``, ``col_inner``): native against reference.

Layouts: "linear" is an nn.Linear weight [rows, C] whose columns are dim 1 (col_inner=1, a
new column every element); "conv1d" is a transformers Conv1D weight [C, rows] whose
columns are dim 0 (col_inner=rows, runs of rows elements share a column). Odd C and rows
put row and run boundaries everywhere inside the vectors, and the large cases put them
across the 64K-element block boundaries too.

Tolerances are those of test_cpu_adam_native.py (same arithmetic, same reasoning). The
moments start non-zero, as for a column handed over with its state, so the bias
correction of every step count (1 .. 10**6) changes the result.

tests/ops/test_simd_paths.py reruns this file on the AVX2 and scalar builds.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from zenflow.ops import adamw_step_, adamw_step_reference_

COLS = [1, 7, 16, 17, 257]
ROWS = [1, 3, 65]
LAYOUTS = ["linear", "conv1d"]
STEP_SPREAD = [1, 2, 100, 401, 10**6]
# (adamw_mode, weight_decay, grad_scale)
CONFIGS = [(True, 0.05, 0.25), (False, 0.05, 1.0)]
GRAD_DTYPES = [torch.float32, torch.bfloat16]
THREADS = (1, 2, 3)
STEPS = 3
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def _col_inner(layout: str, rows: int) -> int:
    return 1 if layout == "linear" else rows


def _col_steps(cols: int, offset: int = 0) -> torch.Tensor:
    """Neighbouring columns get steps far apart: 1, 2, 100, 401, 10**6, 1, ..."""
    return torch.tensor([STEP_SPREAD[(j + offset) % len(STEP_SPREAD)] for j in range(cols)])


def _state(numel: int, seed: int, grad_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=gen)
    exp_avg = 0.1 * torch.randn(numel, generator=gen)
    exp_avg_sq = 0.01 * torch.rand(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen).to(grad_dtype) for _ in range(STEPS)]
    return param, exp_avg, exp_avg_sq, grads


def _run(step_fn, init, grads, col_steps, col_inner, with_bf16, **kw):
    """STEPS calls of step_fn on copies of init; each call advances every column by one."""
    param, exp_avg, exp_avg_sq = (t.clone() for t in init)
    param_bf16 = torch.zeros(param.numel(), dtype=torch.bfloat16) if with_bf16 else None
    for k, grad in enumerate(grads):
        steps = col_steps + k
        step_fn(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=int(steps.max()),
            col_steps=steps,
            col_inner=col_inner,
            param_bf16=param_bf16,
            **kw,
        )
    return param, exp_avg, exp_avg_sq, param_bf16


def _check_against_reference(init, grads, col_steps, col_inner, threads, **kw):
    """Native with each thread count (bit-identical) against the reference (tolerances)."""
    where = f"{kw} col_inner={col_inner} C={col_steps.numel()}"
    ref = _run(adamw_step_reference_, init, grads, col_steps, col_inner, False, **kw)
    first = None
    for n in threads:
        got = _run(adamw_step_, init, grads, col_steps, col_inner, True, num_threads=n, **kw)
        if first is None:
            first = got
            continue
        for a, b in zip(got, first, strict=True):
            assert torch.equal(a, b), f"num_threads={n} differs from num_threads={threads[0]}"
    p_nat, m_nat, v_nat, p_bf16 = first
    p_ref, m_ref, v_ref, _ = ref
    # Over 3 steps an element's moves can cancel exactly; nearly all must have moved.
    assert (p_nat != init[0]).float().mean() > 0.99, f"the step did not move param ({where})"
    torch.testing.assert_close(m_nat, m_ref, rtol=1e-6, atol=1e-7, msg=where)
    torch.testing.assert_close(v_nat, v_ref, rtol=1e-6, atol=1e-9, msg=where)
    torch.testing.assert_close(p_nat, p_ref, rtol=1e-6, atol=1e-7, msg=where)
    assert torch.equal(p_bf16, p_nat.to(torch.bfloat16)), where
    # The same run without param_bf16 writes the same fp32 state.
    plain = _run(adamw_step_, init, grads, col_steps, col_inner, False, num_threads=1, **kw)
    for a, b in zip(plain[:3], first[:3], strict=True):
        assert torch.equal(a, b), f"param_bf16 changed the fp32 results ({where})"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_per_column_matches_reference(native, layout, cols, rows):
    numel = cols * rows
    for grad_dtype, (adamw_mode, weight_decay, grad_scale) in itertools.product(
        GRAD_DTYPES, CONFIGS
    ):
        init_p, init_m, init_v, grads = _state(numel, seed=numel, grad_dtype=grad_dtype)
        kw = dict(HYPER, weight_decay=weight_decay, grad_scale=grad_scale, adamw_mode=adamw_mode)
        _check_against_reference(
            (init_p, init_m, init_v),
            grads,
            _col_steps(cols),
            _col_inner(layout, rows),
            THREADS,
            **kw,
        )


# Several 64K-element blocks: rows and runs straddle block boundaries, and with 70001
# columns a table row is longer than a block.
@pytest.mark.parametrize(("cols", "rows"), [(257, 1021), (70001, 3), (3, 70001)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_per_column_multi_block(native, layout, cols, rows):
    numel = cols * rows
    init_p, init_m, init_v, grads = _state(numel, seed=7, grad_dtype=torch.bfloat16)
    kw = dict(HYPER, weight_decay=0.05, grad_scale=0.5, adamw_mode=True)
    _check_against_reference(
        (init_p, init_m, init_v),
        grads,
        _col_steps(cols, offset=3),
        _col_inner(layout, rows),
        THREADS + (0,),
        **kw,
    )


@pytest.mark.parametrize("step", [1, 401, 10**6])
@pytest.mark.parametrize(("layout", "cols", "rows"), [("linear", 17, 4099), ("conv1d", 17, 4099)])
def test_equal_col_steps_are_bit_identical_to_the_scalar_step(native, layout, cols, rows, step):
    """col_steps all equal to t gives exactly the scalar-step bits; ``step`` itself is unused.

    4099-element runs (conv1d) and 17-element rows (linear) send elements at every offset
    through the per-column vector and scalar sequences, over several blocks.
    """
    numel = cols * rows
    for grad_dtype, (adamw_mode, weight_decay, grad_scale) in itertools.product(
        GRAD_DTYPES, CONFIGS
    ):
        init_p, init_m, init_v, grads = _state(numel, seed=step, grad_dtype=grad_dtype)
        kw = dict(HYPER, weight_decay=weight_decay, grad_scale=grad_scale, adamw_mode=adamw_mode)
        results = []
        for use_cols, threads in [(False, 1), (True, 1), (True, 2)]:
            p, m, v = init_p.clone(), init_m.clone(), init_v.clone()
            p_bf16 = torch.zeros(numel, dtype=torch.bfloat16)
            extra = {}
            if use_cols:
                # A scalar step far from the columns' own: it must not be used.
                extra = dict(
                    col_steps=torch.full((cols,), step), col_inner=_col_inner(layout, rows)
                )
            adamw_step_(
                p,
                grads[0],
                m,
                v,
                step=step + 1000 if use_cols else step,
                param_bf16=p_bf16,
                num_threads=threads,
                **extra,
                **kw,
            )
            results.append((p, m, v, p_bf16))
        assert not torch.equal(results[0][0], init_p)
        for got in results[1:]:
            for a, b in zip(got, results[0], strict=True):
                assert torch.equal(a, b), f"per-column differs from scalar step ({kw})"


# (argument overrides, what the message must say after the op name)
BAD_ARGS = {
    "int32": (dict(col_steps=torch.ones(8, dtype=torch.int32)), r"col_steps must be (Long|int64)"),
    "float": (dict(col_steps=torch.ones(8)), r"col_steps must be (Long|int64)"),
    "2-D": (dict(col_steps=torch.ones(2, 4, dtype=torch.int64)), r"col_steps must be 1-D"),
    "non-contiguous": (
        dict(col_steps=torch.ones(16, dtype=torch.int64)[::2]),
        r"col_steps must be contiguous",
    ),
    "empty": (dict(col_steps=torch.ones(0, dtype=torch.int64)), r"col_steps must have at least"),
    "cols not dividing": (
        dict(col_steps=torch.ones(7, dtype=torch.int64)),
        r"param has 64 elements, not a multiple of col_steps.numel\(\) \* col_inner = 7 \* 1",
    ),
    "runs not dividing": (
        dict(col_steps=torch.ones(4, dtype=torch.int64), col_inner=3),
        r"param has 64 elements, not a multiple of col_steps.numel\(\) \* col_inner = 4 \* 3",
    ),
    "col_inner 0": (
        dict(col_steps=torch.ones(8, dtype=torch.int64), col_inner=0),
        r"col_inner must be >= 1",
    ),
    "col_inner -1": (
        dict(col_steps=torch.ones(8, dtype=torch.int64), col_inner=-1),
        r"col_inner must be >= 1",
    ),
    "step 0": (
        dict(col_steps=torch.tensor([1, 2, 0, 4, 5, 6, 7, 8])),
        r"col_steps must be >= 1 \(1-based, for bias correction\), got 0 at column 2",
    ),
}


@pytest.mark.parametrize(
    ("op", "prefix"),
    [(adamw_step_, "zenflow::adamw_step_"), (adamw_step_reference_, "adamw_step_reference_")],
    ids=["native", "reference"],
)
@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_col_steps_are_rejected_before_any_write(native, op, prefix, case):
    overrides, message = BAD_ARGS[case]
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(64, generator=gen) for _ in range(4)]  # param, grad, m, v
    before = [t.clone() for t in args]
    kw = dict(HYPER, step=1, weight_decay=0.1, **overrides)
    error = RuntimeError if op is adamw_step_ else ValueError
    with pytest.raises(error, match=rf"{prefix}: {message}"):
        op(*args, **kw)
    for got, want in zip(args, before, strict=True):
        assert torch.equal(got, want)


def test_col_steps_off_the_cpu_are_rejected(native):
    """The reference names the argument; the dispatcher refuses the native op by name first.

    A tensor off the CPU in any argument makes torch's dispatcher look for a kernel of that
    device, and the op registers only a CPU kernel, so the op's own device check is a guard
    for direct C++ callers.
    """
    args = [torch.randn(64) for _ in range(4)]
    kw = dict(HYPER, step=1, weight_decay=0.0)
    meta_steps = torch.ones(8, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"adamw_step_reference_: col_steps must be on the CPU"):
        adamw_step_reference_(*args, col_steps=meta_steps, **kw)
    with pytest.raises(RuntimeError, match=r"zenflow::adamw_step_: .*Meta"):
        adamw_step_(*args, col_steps=meta_steps, **kw)
