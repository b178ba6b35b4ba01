"""AdamW on the device: dense (always-important params) and on selected columns.

The arithmetic is exactly torch.optim.AdamW's single-tensor (non-fused, non-foreach) path,
op for op, so ``topk_ratio=1.0`` reproduces torch's results. The step counter is a Python
int (never a low-precision tensor: DeepSpeed's bf16 counter froze at 256, ZENFLOW.md s.5).
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
    if hp.weight_decay != 0.0:
        if hp.adamw_mode:
            param.mul_(1 - lr * hp.weight_decay)
        else:
            grad = grad.add(param, alpha=hp.weight_decay)
    exp_avg.lerp_(grad, 1 - hp.beta1)
    exp_avg_sq.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)
    bias_correction1 = 1 - hp.beta1**step
    bias_correction2 = 1 - hp.beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(hp.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adamw_columns_(
    param: torch.Tensor,
    grad: torch.Tensor,
    cols: torch.Tensor,
    column_dim: int,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    hp: AdamHyper,
) -> None:
    """AdamW on columns ``cols`` of ``param`` only: gather -> step -> scatter back.

    ``exp_avg``/``exp_avg_sq`` have ``param``'s shape with ``len(cols)`` along
    ``column_dim`` (compact layout, position i holds column ``cols[i]``).
    """
    p_sel = param.index_select(column_dim, cols)
    g_sel = grad.index_select(column_dim, cols)
    adamw_dense_(p_sel, g_sel, exp_avg, exp_avg_sq, step, hp)
    param.index_copy_(column_dim, cols, p_sel)
