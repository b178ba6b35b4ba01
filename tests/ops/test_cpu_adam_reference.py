"""The plain reference against torch.optim over several steps, element by element."""

from __future__ import annotations

import pytest
import torch
from torch.optim.adam import adam as torch_adam

from zenflow.ops import adamw_step_reference_

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
STEPS = 12


def _run_both(torch_cls, weight_decay: float, adamw_mode: bool):
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(1031, generator=gen)
    grads = [torch.randn(1031, generator=gen) for _ in range(STEPS)]

    param_torch = torch.nn.Parameter(init.clone())
    opt = torch_cls(
        [param_torch], lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False
    )
    param_ref = init.clone()
    exp_avg = torch.zeros_like(init)
    exp_avg_sq = torch.zeros_like(init)
    for step, grad in enumerate(grads, start=1):
        param_torch.grad = grad.clone()
        opt.step()
        adamw_step_reference_(
            param_ref,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            eps=EPS,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
        )
    state = opt.state[param_torch]
    return init, param_ref, exp_avg, exp_avg_sq, param_torch.detach(), state


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_reference_matches_torch_adamw(weight_decay):
    init, param, exp_avg, exp_avg_sq, param_torch, state = _run_both(
        torch.optim.AdamW, weight_decay, adamw_mode=True
    )
    # 12 steps of lr 1e-2 move elements by about 0.05 on average: a no-op step fails.
    assert (param != init).all() and (param - init).abs().mean() > 1e-2
    # torch updates exp_avg with lerp (m + (1-b1)*(g-m)) where the reference computes
    # b1*m + (1-b1)*g: a last-ulp difference per step, so a few ulps of tolerance.
    torch.testing.assert_close(exp_avg, state["exp_avg"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(param, param_torch, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_reference_classic_adam_matches_torch_adam(weight_decay):
    init, param, exp_avg, exp_avg_sq, param_torch, state = _run_both(
        torch.optim.Adam, weight_decay, adamw_mode=False
    )
    assert (param != init).all() and (param - init).abs().mean() > 1e-2
    torch.testing.assert_close(exp_avg, state["exp_avg"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(param, param_torch, rtol=1e-6, atol=1e-7)


def test_reference_modes_differ_with_weight_decay():
    """AdamW's decoupled decay and Adam's L2 term must not collapse into one formula."""
    _, param_w, *_ = _run_both(torch.optim.AdamW, 0.1, adamw_mode=True)
    _, param_l2, *_ = _run_both(torch.optim.Adam, 0.1, adamw_mode=False)
    assert (param_w - param_l2).abs().max() > 1e-4


def test_reference_grad_scale_and_bf16_copy():
    gen = torch.Generator().manual_seed(1)
    param = torch.randn(257, generator=gen)
    grad = torch.randn(257, generator=gen)
    twin = param.clone()
    m, v = torch.zeros(257), torch.zeros(257)
    m2, v2 = torch.zeros(257), torch.zeros(257)
    param_bf16 = torch.zeros(257, dtype=torch.bfloat16)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    # The sum of 4 equal gradients scaled by 1/4 is the same step as one gradient.
    adamw_step_reference_(param, grad * 4, m, v, grad_scale=0.25, param_bf16=param_bf16, **kw)
    adamw_step_reference_(twin, grad, m2, v2, **kw)
    torch.testing.assert_close(param, twin, rtol=0, atol=0)
    torch.testing.assert_close(m, m2, rtol=0, atol=0)
    assert torch.equal(param_bf16, param.to(torch.bfloat16))


# (param shape, the dim that indexes columns, col_inner): nn.Linear [out, in] has its
# columns along dim 1, transformers Conv1D [in, out] along dim 0; a 3-D weight flattens
# its leading dims into rows.
COLUMN_LAYOUTS = [((5, 7), 1, 1), ((7, 5), 0, 5), ((2, 3, 7), 2, 1)]
COLUMN_STEPS = [1, 2, 100, 401, 10**6, 3, 7]


COLUMN_WEIGHT_DECAY = 0.1


def _torch_column(state, grads, col_dim: int, j: int, first_step: int, adamw_mode: bool):
    """Column j of (param, exp_avg, exp_avg_sq) stepped alone by torch's single-tensor
    Adam(W) over ``grads``, its first step ``first_step``."""
    p_col, m_col, v_col = (t.select(col_dim, j).clone() for t in state)
    # torch increments the step tensor before using it.
    step_col = torch.tensor(float(first_step - 1))
    for grad in grads:
        torch_adam(
            [p_col],
            [grad.select(col_dim, j).clone()],
            [m_col],
            [v_col],
            [],
            [step_col],
            foreach=False,
            decoupled_weight_decay=adamw_mode,
            amsgrad=False,
            beta1=BETAS[0],
            beta2=BETAS[1],
            lr=LR,
            weight_decay=COLUMN_WEIGHT_DECAY,
            eps=EPS,
            maximize=False,
        )
    return p_col, m_col, v_col


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize(("shape", "col_dim", "col_inner"), COLUMN_LAYOUTS)
def test_reference_per_column_matches_torch_column_by_column(shape, col_dim, col_inner, adamw_mode):
    """col_steps against torch's single-tensor Adam(W) run on each column alone.

    Column j of the weight, its moments and its gradient are taken out as tensors of their
    own and stepped by torch.optim.adam.adam (foreach=False: the single-tensor loop) with
    that column's step count; the reference steps the whole weight with col_steps. Moments
    start non-zero (a column handed over with its state), so a wrong step count changes
    the result.
    """
    gen = torch.Generator().manual_seed(11)
    init = torch.randn(shape, generator=gen)
    init_m = 0.1 * torch.randn(shape, generator=gen)
    init_v = 0.01 * torch.rand(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    col_steps = torch.tensor(COLUMN_STEPS)
    weight_decay = COLUMN_WEIGHT_DECAY

    param, exp_avg, exp_avg_sq = init.clone(), init_m.clone(), init_v.clone()
    single_step = init.clone()  # the same with one scalar step for all: must differ
    m_single, v_single = init_m.clone(), init_v.clone()
    for k, grad in enumerate(grads):
        kw = dict(
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            eps=EPS,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
        )
        steps = col_steps + k
        adamw_step_reference_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=int(steps.max()),
            col_steps=steps,
            col_inner=col_inner,
            **kw,
        )
        adamw_step_reference_(single_step, grad, m_single, v_single, step=int(steps.max()), **kw)

    for j, first_step in enumerate(COLUMN_STEPS):
        state = (init, init_m, init_v)
        p_col, m_col, v_col = _torch_column(state, grads, col_dim, j, first_step, adamw_mode)
        where = f"column {j} (first step {first_step})"
        torch.testing.assert_close(
            exp_avg.select(col_dim, j), m_col, rtol=1e-6, atol=1e-7, msg=where
        )
        torch.testing.assert_close(
            exp_avg_sq.select(col_dim, j), v_col, rtol=1e-6, atol=1e-9, msg=where
        )
        torch.testing.assert_close(param.select(col_dim, j), p_col, rtol=1e-6, atol=1e-7, msg=where)
    # The comparison can tell step counts apart: one scalar step for all columns is far off.
    assert (param - single_step).abs().max() > 1e-3


@pytest.mark.parametrize("bad", [0, -2])
def test_reference_rejects_col_inner_below_one_even_without_col_steps(bad):
    param = torch.randn(8)
    with pytest.raises(ValueError, match=r"adamw_step_reference_: col_inner must be >= 1"):
        adamw_step_reference_(
            param,
            torch.randn(8),
            torch.zeros(8),
            torch.zeros(8),
            step=1,
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            eps=EPS,
            weight_decay=0.0,
            col_inner=bad,
        )
