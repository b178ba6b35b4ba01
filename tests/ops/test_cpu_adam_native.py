"""The native op against the reference, element by element, and its input checks.

Tolerance: the kernel fuses mul+add pairs (FMA) and multiplies by 1/sqrt(1-b2^t) where
the reference divides, so each operation may round differently in the last place (an ulp is
2**-23 ~ 1.2e-7 relative). Over a few steps this stays within a few ulps of each value:
rtol 1e-6 (~8 ulps). atol covers results near zero after cancellation in
``b1*m + (1-b1)*g``, whose rounding error scales with the terms (|g| <= ~5 here), not with
the result: 1e-7 * 5 ~ one ulp of the terms.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from zenflow.hardware.probes import parse_cpuinfo
from zenflow.ops import adamw_step_, adamw_step_reference_, simd_path

SIZES = [1, 7, 4096, 4097, 2**20 + 3]
# (adamw_mode, weight_decay, grad_scale)
CONFIGS = [(True, 0.0, 1.0), (True, 0.05, 0.25), (False, 0.05, 1.0), (False, 0.0, 0.25)]
STEPS = 3
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def best_simd_path(flags: set[str]) -> str:
    """The path ``-march=native`` compiles on a CPU with these /proc/cpuinfo flags."""
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "scalar"


def test_the_checks_here_run_the_expected_simd_path(native):
    """Names the vector body every comparison in this file exercised.

    tests/ops/test_simd_paths.py reruns this file on builds for the other paths and sets
    ZENFLOW_EXPECT_SIMD to the one it asked for.
    """
    expected = os.environ.get("ZENFLOW_EXPECT_SIMD")
    if expected is None:
        cpuinfo = Path("/proc/cpuinfo")
        if not cpuinfo.is_file():
            pytest.skip("no /proc/cpuinfo to predict -march=native from")
        expected = best_simd_path(parse_cpuinfo(cpuinfo.read_text())["flags"])
    assert simd_path() == expected


def _state(numel: int, seed: int, grad_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen).to(grad_dtype) for _ in range(STEPS)]
    return param, grads


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("numel", SIZES)
def test_native_matches_reference(native, numel, grad_dtype):
    for adamw_mode, weight_decay, grad_scale in CONFIGS:
        init, grads = _state(numel, seed=numel, grad_dtype=grad_dtype)
        p_nat, m_nat, v_nat = init.clone(), torch.zeros(numel), torch.zeros(numel)
        p_ref, m_ref, v_ref = init.clone(), torch.zeros(numel), torch.zeros(numel)
        p_bf16 = torch.zeros(numel, dtype=torch.bfloat16)
        kw = dict(HYPER, weight_decay=weight_decay, grad_scale=grad_scale, adamw_mode=adamw_mode)
        for step, grad in enumerate(grads, start=1):
            adamw_step_(p_nat, grad, m_nat, v_nat, step=step, param_bf16=p_bf16, **kw)
            adamw_step_reference_(p_ref, grad, m_ref, v_ref, step=step, **kw)
        where = f"adamw_mode={adamw_mode} wd={weight_decay} grad_scale={grad_scale}"
        # Over 3 steps an element's moves can cancel exactly; nearly all must have moved.
        assert (p_nat != init).float().mean() > 0.99, f"the step did not move param ({where})"
        torch.testing.assert_close(m_nat, m_ref, rtol=1e-6, atol=1e-7, msg=where)
        torch.testing.assert_close(v_nat, v_ref, rtol=1e-6, atol=1e-9, msg=where)
        torch.testing.assert_close(p_nat, p_ref, rtol=1e-6, atol=1e-7, msg=where)
        assert torch.equal(p_bf16, p_nat.to(torch.bfloat16)), where


def test_native_bf16_copy_rounds_like_torch(native):
    """Ties, infinities and subnormals round exactly as Tensor.to(bfloat16); NaN stays NaN.

    NaN payloads differ inside torch itself (its AVX2 path writes 0xFFFF, c10::BFloat16
    0x7FC0); the kernel writes 0x7FC0, so NaN entries are compared as NaN only.
    """
    # A zero-lr step leaves param untouched, so param_bf16 is just the rounding of it.
    values = torch.tensor(
        [
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
            -(1.0 + 2**-8),
            3.0e38,
            float("inf"),
            float("-inf"),
            float("nan"),
            1e-40,
            -0.0,
            0.0,
            65504.0,
            1.00390625,
            2.0 - 2**-23,
        ]
        * 3
    )
    numel = values.numel()
    param = values.clone()
    param_bf16 = torch.zeros(numel, dtype=torch.bfloat16)
    adamw_step_(
        param,
        torch.zeros(numel),
        torch.zeros(numel),
        torch.zeros(numel),
        step=1,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        param_bf16=param_bf16,
    )
    expected = values.to(torch.bfloat16)
    is_nan = values.isnan()
    assert torch.equal(param_bf16.isnan(), is_nan)
    assert torch.equal(param_bf16[~is_nan].view(torch.int16), expected[~is_nan].view(torch.int16))


def test_native_bit_identical_across_thread_counts(native):
    numel = 2**20 + 3  # 17 blocks of 64K, the last one with a scalar tail
    init, grads = _state(numel, seed=5, grad_dtype=torch.bfloat16)
    results = {}
    for threads in (1, 2, 0):
        p, m, v = init.clone(), torch.zeros(numel), torch.zeros(numel)
        p_bf16 = torch.zeros(numel, dtype=torch.bfloat16)
        for step, grad in enumerate(grads, start=1):
            adamw_step_(
                p,
                grad,
                m,
                v,
                step=step,
                weight_decay=0.05,
                grad_scale=0.5,
                param_bf16=p_bf16,
                num_threads=threads,
                **HYPER,
            )
        results[threads] = (p, m, v, p_bf16)
    assert not torch.equal(results[1][0], init)
    for threads in (2, 0):
        for got, want in zip(results[threads], results[1], strict=True):
            assert torch.equal(got, want), f"num_threads={threads} differs from num_threads=1"


def _args(numel: int = 64):
    return dict(
        param=torch.randn(numel),
        grad=torch.randn(numel),
        exp_avg=torch.zeros(numel),
        exp_avg_sq=torch.zeros(numel),
    )


def _call(param, grad, exp_avg, exp_avg_sq, **kw):
    kw = dict(dict(HYPER, step=1, weight_decay=0.0), **kw)
    adamw_step_(param, grad, exp_avg, exp_avg_sq, **kw)


@pytest.mark.parametrize("name", ["param", "grad", "exp_avg", "exp_avg_sq"])
def test_native_rejects_non_contiguous(native, name):
    args = _args()
    args[name] = torch.zeros(128)[::2] if name != "grad" else torch.randn(128)[::2]
    before = {k: v.clone() for k, v in args.items()}
    with pytest.raises(RuntimeError, match=rf"zenflow::adamw_step_: {name} must be contiguous"):
        _call(**args)
    for key, tensor in args.items():  # rejected before any write
        assert torch.equal(tensor, before[key]), key


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("exp_avg", torch.float64),
        ("exp_avg_sq", torch.bfloat16),
        ("param", torch.float16),
        ("grad", torch.float16),
    ],
)
def test_native_rejects_wrong_dtype(native, name, dtype):
    args = _args()
    args[name] = args[name].to(dtype)
    with pytest.raises(RuntimeError, match=rf"zenflow::adamw_step_: {name} must be"):
        _call(**args)


@pytest.mark.parametrize("name", ["grad", "exp_avg", "exp_avg_sq"])
def test_native_rejects_size_mismatch(native, name):
    args = _args()
    args[name] = args[name][:-1].clone()
    with pytest.raises(RuntimeError, match=rf"zenflow::adamw_step_: {name} has 63 elements"):
        _call(**args)


def test_native_rejects_bad_param_bf16(native):
    with pytest.raises(RuntimeError, match=r"zenflow::adamw_step_: param_bf16 must be BFloat16"):
        _call(**_args(), param_bf16=torch.zeros(64))
    with pytest.raises(RuntimeError, match=r"zenflow::adamw_step_: param_bf16 has 32 elements"):
        _call(**_args(), param_bf16=torch.zeros(32, dtype=torch.bfloat16))


def test_native_rejects_bad_scalars(native):
    with pytest.raises(RuntimeError, match=r"zenflow::adamw_step_: step must be >= 1"):
        _call(**_args(), step=0)
    with pytest.raises(RuntimeError, match=r"zenflow::adamw_step_: num_threads must be >= 0"):
        _call(**_args(), num_threads=-1)


def test_native_empty_tensor_is_a_no_op(native):
    _call(**_args(0))
