"""The plain reference against torch.optim over several steps, element by element."""

from __future__ import annotations

import pytest
import torch

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
