"""``adamw_q8_step_`` (csrc/q8_ops.cpp): the Adam step with 8-bit block-wise moments.

Three comparisons per case, over several steps:

1. bit for bit against its definition run with the native fp32 step
   (``adamw_q8_step_reference_(..., adam_step=adamw_step_)``: dequantise with the table,
   ``adamw_step_`` on the fp32 moments, requantise by table search). The native kernel runs
   ``adamw_step_``'s instructions on the decoded moments, so codes, scales, param and image
   must all be equal: this is what checks the bit arithmetic and the block bookkeeping;
2. against the plain definition (``adamw_step_reference_`` inside), whose fp32 arithmetic
   may differ by an ulp: codes may then differ by one step of the code grid in a few
   places, the param by a small share of one update;
3. against fp32 Adam (``adamw_step_`` with fp32 moments from the same start): the 8-bit
   moments change each update by at most ~1/16 of it, so the param stays within a fraction
   of lr of the exact run.

And: the step moved the param and changed the codes; 1, 2 and 3 threads give the same bits;
per-column step counts in both layouts; all-zero and one-huge-value blocks.

tests/ops/test_simd_paths.py reruns this file on the AVX2 and scalar builds.
"""

from __future__ import annotations

import pytest
import torch

import zenflow.ops
from zenflow.ops import (
    Q8_BLOCK,
    adamw_q8_step_,
    adamw_q8_step_reference_,
    adamw_step_,
    dequantize_q8_,
    q8_num_blocks,
    quantize_q8_,
)

SIZES = [1, 7, 255, 256, 257, 4097, 65536 + 300]
# (adamw_mode, weight_decay, grad_scale)
CONFIGS = [(True, 0.05, 0.25), (False, 0.05, 1.0)]
GRAD_DTYPES = [torch.float32, torch.bfloat16]
THREADS = (1, 2, 3)
STEPS = 3
LR = 1e-2
HYPER = dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8)


def _quantized(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    scales = torch.empty(q8_num_blocks(x.numel()))
    quantize_q8_(x, codes, scales, fmt=fmt)
    return codes, scales


def _decoded(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    out = torch.empty(codes.numel())
    dequantize_q8_(codes, scales, out, fmt=fmt)
    return out


def _start(numel: int, seed: int, grad_dtype: torch.dtype):
    """param, the four q8 tensors of non-zero moments (as after some steps), and grads."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=gen)
    exp_avg = 0.1 * torch.randn(numel, generator=gen)
    exp_avg_sq = 0.01 * torch.rand(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen).to(grad_dtype) for _ in range(STEPS)]
    state = (param, *_quantized(exp_avg, "m"), *_quantized(exp_avg_sq.sqrt(), "u"))
    return state, grads


def _run(step_fn, state, grads, col_steps=None, col_inner=1, **kw):
    """STEPS calls on copies of state (param, m_codes, m_scales, u_codes, u_scales);
    returns the final copies and the image of the last step."""
    state = [t.clone() for t in state]
    image = torch.zeros(state[0].numel(), dtype=torch.bfloat16)
    for k, grad in enumerate(grads):
        steps = {} if col_steps is None else dict(col_steps=col_steps + k, col_inner=col_inner)
        step = k + 1 if col_steps is None else int((col_steps + k).max())
        step_fn(*state[:1], grad, *state[1:], step=step, image=image, **steps, **kw)
    return [*state, image]


def _exact_definition(*args, **kw):
    return adamw_q8_step_reference_(*args, adam_step=adamw_step_, **kw)


def _check(state, grads, threads=(2,), col_steps=None, col_inner=1, vs_fp32=True, **kw):
    """Comparisons 1-3 of the module docstring (3 unless not vs_fp32); returns the native
    result."""
    where = f"{kw} col_inner={col_inner}"
    want = _run(_exact_definition, state, grads, col_steps, col_inner, **kw)
    got = None
    for n in threads:
        got = _run(adamw_q8_step_, state, grads, col_steps, col_inner, num_threads=n, **kw)
        names = ("param", "m_codes", "m_scales", "u_codes", "u_scales", "image")
        for name, a, b in zip(names, got, want, strict=True):
            assert torch.equal(a, b), f"{name} differs from the definition (threads={n}, {where})"
    param, m_codes, m_scales, u_codes, u_scales, image = got
    # The step did something: the param moved, the moments changed, the image is the param.
    assert (param != state[0]).float().mean() > 0.99, where
    m_before, m_after = _decoded(*state[1:3], "m"), _decoded(m_codes, m_scales, "m")
    assert (m_after != m_before).float().mean() > 0.3, where
    assert (_decoded(u_codes, u_scales, "u") != _decoded(*state[3:5], "u")).any(), where
    assert torch.equal(image, param.bfloat16())

    # An ulp of difference in the fp32 step flips a code only next to a rounding boundary
    # (~2^-19 of the elements per step), and a flip changes that element's update by at
    # most ~1/8: nearly all codes and params agree, all params within a few updates.
    plain = _run(adamw_q8_step_reference_, state, grads, col_steps, col_inner, **kw)
    for name, a, b in (("m_codes", m_codes, plain[1]), ("u_codes", u_codes, plain[3])):
        assert (a != b).float().mean() <= 1e-3, f"{name} differ from the plain definition"
    close = (param - plain[0]).abs() <= 1e-6 * param.abs() + 1e-7
    assert close.float().mean() >= 0.999, where
    torch.testing.assert_close(param, plain[0], rtol=0, atol=STEPS * LR, msg=where)
    if vs_fp32:
        _check_against_fp32_adam(state, grads, param, col_steps, col_inner, **kw)
    return got


def _check_against_fp32_adam(state, grads, param, col_steps, col_inner, **kw):
    """The first update is fp32 Adam's exactly (same moments); each later one starts from
    moments within 1/16 (m) and 1/16 (v = u^2) of fp32 Adam's, so it differs by about a
    tenth at most: on average far less than the updates themselves."""
    p, m_codes, m_scales, u_codes, u_scales = (t.clone() for t in state)
    m, v = _decoded(m_codes, m_scales, "m"), _decoded(u_codes, u_scales, "u").square()
    for k, grad in enumerate(grads):
        steps = {} if col_steps is None else dict(col_steps=col_steps + k, col_inner=col_inner)
        step = k + 1 if col_steps is None else int((col_steps + k).max())
        adamw_step_(p, grad, m, v, step=step, **steps, **kw)
    moved = (p - state[0]).abs().mean()
    assert (param - p).abs().mean() <= 0.05 * moved


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("numel", SIZES)
def test_q8_step_matches_its_definition(native, numel, grad_dtype):
    for adamw_mode, weight_decay, grad_scale in CONFIGS:
        state, grads = _start(numel, seed=numel, grad_dtype=grad_dtype)
        kw = dict(HYPER, weight_decay=weight_decay, grad_scale=grad_scale, adamw_mode=adamw_mode)
        _check(state, grads, **kw)


def test_q8_step_bit_identical_across_thread_counts(native):
    state, grads = _start(3 * 65536 + 300, seed=3, grad_dtype=torch.bfloat16)
    _check(state, grads, threads=THREADS + (0,), **HYPER, weight_decay=0.05, grad_scale=0.5)


# (layout, C, rows): Linear [rows, C] has col_inner 1; Conv1D [C, rows] has col_inner rows.
# Odd shapes put rows, runs and 256-element blocks out of step; the last ones cross the
# 64K-element thread blocks.
COLUMN_CASES = [
    ("linear", 7, 3),
    ("linear", 257, 65),
    ("linear", 70001, 3),
    ("conv1d", 7, 3),
    ("conv1d", 17, 1031),
    ("conv1d", 3, 70001),
]


@pytest.mark.parametrize(("layout", "cols", "rows"), COLUMN_CASES)
def test_q8_step_per_column(native, layout, cols, rows):
    numel = cols * rows
    state, grads = _start(numel, seed=cols, grad_dtype=torch.bfloat16)
    col_steps = torch.tensor([(1, 2, 100, 401, 10**6)[j % 5] for j in range(cols)])
    col_inner = 1 if layout == "linear" else rows
    kw = dict(HYPER, weight_decay=0.05, grad_scale=0.5)
    got = _check(state, grads, THREADS, col_steps=col_steps, col_inner=col_inner, **kw)
    # Every column at the same count is the scalar-step call, bit for bit.
    same = _run(adamw_q8_step_, state, grads, torch.full((cols,), 1), col_inner, **kw)
    plain = _run(adamw_q8_step_, state, grads, **kw)
    for a, b in zip(same, plain, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], plain[0])  # the counts mattered


def test_q8_step_from_zero_state_is_fp32_adam(native):
    """Fresh moments are all-zero blocks (scale 0, codes 0): the first step is exactly
    adamw_step_'s from zero moments. A block of zero gradients keeps scale 0."""
    numel = 4 * Q8_BLOCK + 5
    gen = torch.Generator().manual_seed(9)
    param, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    grad[Q8_BLOCK : 2 * Q8_BLOCK] = 0.0
    m_codes, u_codes = (torch.zeros(numel, dtype=torch.uint8) for _ in range(2))
    m_scales, u_scales = (torch.zeros(q8_num_blocks(numel)) for _ in range(2))
    image = torch.zeros(numel, dtype=torch.bfloat16)
    p_exact, m, v = param.clone(), torch.zeros(numel), torch.zeros(numel)
    adamw_q8_step_(param, grad, m_codes, m_scales, u_codes, u_scales, image=image, step=1,
                   **HYPER, weight_decay=0.0)  # fmt: skip
    adamw_step_(p_exact, grad, m, v, step=1, **HYPER, weight_decay=0.0)
    assert torch.equal(param, p_exact) and torch.equal(image, p_exact.bfloat16())
    assert m_scales[1] == 0 and u_scales[1] == 0 and torch.all(m_scales[[0, 2, 3, 4]] > 0)
    assert torch.equal(m_codes, _quantized(m, "m")[0])
    assert torch.equal(u_codes, _quantized(v.sqrt(), "u")[0])


def test_q8_step_block_with_one_huge_gradient(native):
    """The huge value takes its block's scale: the other m there fall below the smallest
    code (0), their u stay non-zero (code >= 1). The other blocks do not notice."""
    state, grads = _start(3 * Q8_BLOCK + 11, seed=10, grad_dtype=torch.float32)
    calm = _run(adamw_q8_step_, state, grads, **HYPER, weight_decay=0.0)
    for grad in grads:
        grad[Q8_BLOCK + 5] = 1e20
    got = _check(state, grads, threads=(1, 3), vs_fp32=False, **HYPER, weight_decay=0.0)
    m_codes, u_codes = got[1], got[3]
    block = slice(Q8_BLOCK, 2 * Q8_BLOCK)
    assert m_codes[Q8_BLOCK + 5] == 127 and u_codes[Q8_BLOCK + 5] == 255
    assert (m_codes[block] == 0).sum() == Q8_BLOCK - 1
    assert torch.all(u_codes[block] >= 1)
    outside = torch.ones(3 * Q8_BLOCK + 11, dtype=torch.bool)
    outside[block] = False
    for name, k in (("param", 0), ("m_codes", 1), ("u_codes", 3)):
        assert torch.equal(got[k][outside], calm[k][outside]), name
    for name, k in (("m_scales", 2), ("u_scales", 4)):
        assert torch.equal(got[k][[0, 2, 3]], calm[k][[0, 2, 3]]), name


def test_q8_step_empty_is_a_no_op(native):
    empty_u8, empty = torch.zeros(0, dtype=torch.uint8), torch.zeros(0)
    adamw_q8_step_(empty, empty, empty_u8, empty, empty_u8.clone(), empty.clone(), step=1,
                   **HYPER, weight_decay=0.0)  # fmt: skip


def _args(numel: int = 300) -> dict:
    nb = q8_num_blocks(numel)
    return dict(
        param=torch.randn(numel),
        grad=torch.randn(numel),
        m_codes=torch.zeros(numel, dtype=torch.uint8),
        m_scales=torch.zeros(nb),
        u_codes=torch.zeros(numel, dtype=torch.uint8),
        u_scales=torch.zeros(nb),
    )


BAD = [
    (dict(param=torch.randn(600)[::2]), "param must be contiguous"),
    (dict(grad=torch.randn(300).half()), "grad must be Float or BFloat16"),
    (dict(m_codes=torch.zeros(300)), "m_codes must be Byte"),
    (dict(u_codes=torch.zeros(299, dtype=torch.uint8)), "u_codes has 299 elements"),
    (dict(m_scales=torch.zeros(1)), "m_scales has 1 elements, expected 2"),
    (dict(u_scales=torch.zeros(3)), "u_scales has 3 elements, expected 2"),
    (dict(image=torch.zeros(300)), "image must be BFloat16"),
    (dict(step=0), "step must be >= 1"),
    (dict(num_threads=-1), "num_threads must be >= 0"),
    (dict(col_steps=torch.ones(7, dtype=torch.int64)), "not a multiple of col_steps"),
    (dict(col_steps=torch.zeros(3, dtype=torch.int64)), "col_steps must be >= 1"),
    (dict(col_steps=torch.ones(3, dtype=torch.int64), col_inner=0), "col_inner must be >= 1"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_q8_step_rejects_bad_arguments(native, change, message):
    args = _args()
    tensors = {k: change.get(k, v) for k, v in args.items()}
    options = {k: v for k, v in change.items() if k not in args}
    before = {k: v.clone() for k, v in tensors.items()}
    with pytest.raises(RuntimeError, match=message) as err:
        adamw_q8_step_(*tensors.values(), **dict(dict(HYPER, step=1, weight_decay=0.0), **options))
    assert str(err.value).startswith("zenflow::adamw_q8_step_: ")
    for name, tensor in tensors.items():  # rejected before any write
        assert torch.equal(tensor, before[name]), name


def test_reference_mode_routes_q8_ops_to_the_reference(monkeypatch):
    def no_native():
        raise AssertionError("ZENFLOW_OPS=reference must not touch the native op")

    monkeypatch.setenv("ZENFLOW_OPS", "reference")
    monkeypatch.setattr(zenflow.ops, "load_native", no_native)
    state, grads = _start(300, seed=11, grad_dtype=torch.float32)
    kw = dict(HYPER, weight_decay=0.05)
    got = _run(adamw_q8_step_, state, grads, **kw)
    want = _run(adamw_q8_step_reference_, state, grads, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not torch.equal(got[0], state[0])
