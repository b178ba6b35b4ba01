"""AdamW on the device: dense (always-important params) and on a weight's selected columns.

The scalar-step arithmetic is exactly torch.optim.AdamW's single-tensor (non-fused,
non-foreach) path, op for op, so ``topk_ratio=1.0`` reproduces torch's results. Step
counters are integers (never a low-precision tensor: DeepSpeed's bf16 counter froze at 256,
ZENFLOW.md s.5). Selected columns may carry different counts (each column keeps its own
across hand-overs); then bias correction is per column (``adamw_columns_``), computed in
float64 and applied in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool = True  # False: classic Adam, L2 decay added to the gradient


def _decay_and_moments(param, grad, exp_avg, exp_avg_sq, hp: AdamHyper) -> None:
    """Weight decay (decoupled, or L2 into the gradient) and the moment updates, in place."""
    if hp.weight_decay != 0.0:
        if hp.adamw_mode:
            param.mul_(1 - hp.lr * hp.weight_decay)
        else:
            grad = grad.add(param, alpha=hp.weight_decay)
    exp_avg.lerp_(grad, 1 - hp.beta1)
    exp_avg_sq.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)


def adamw_dense_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    hp: AdamHyper,
) -> None:
    """One in-place AdamW step; ``step`` is the 1-based count after this update."""
    lr = hp.lr
    _decay_and_moments(param, grad, exp_avg, exp_avg_sq, hp)
    bias_correction1 = 1 - hp.beta1**step
    bias_correction2 = 1 - hp.beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(hp.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def column_factors(steps: torch.Tensor, hp: AdamHyper, column_dim: int, ndim: int):
    """Per-column ``(-lr / (1 - beta1^t), sqrt(1 - beta2^t))`` as fp32, shaped to broadcast
    along ``column_dim`` of an ``ndim``-D tensor. Computed in float64 like the scalar path."""
    t = steps.to(torch.float64)
    neg_step_size = -hp.lr / (1 - torch.full_like(t, hp.beta1).pow(t))
    bc2_sqrt = torch.sqrt(1 - torch.full_like(t, hp.beta2).pow(t))
    shape = [1] * ndim
    shape[column_dim] = -1
    return neg_step_size.float().view(shape), bc2_sqrt.float().view(shape)


def adamw_columns_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    steps: torch.Tensor,
    column_dim: int,
    hp: AdamHyper,
) -> None:
    """One in-place AdamW step on a compact column block whose columns (along
    ``column_dim``) have their own 1-based counts ``steps`` (int64, one per column)."""
    _decay_and_moments(param, grad, exp_avg, exp_avg_sq, hp)
    neg_step_size, bc2_sqrt = column_factors(steps, hp, column_dim, param.dim())
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(hp.eps)
    param.add_(exp_avg / denom * neg_step_size)
