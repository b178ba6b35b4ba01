"""Plain PyTorch reference of the CPU Adam step: readable, slow, the yardstick."""

from __future__ import annotations

import math

import torch


def adamw_step_reference_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    param_bf16: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    adamw_mode: bool = True,
    num_threads: int = 0,
) -> None:
    """One in-place Adam(W) step, the same arithmetic as torch.optim.AdamW's loop.

    AdamW (``adamw_mode=True``): ``p *= 1 - lr*wd`` (decoupled decay); Adam: ``g += wd*p``.
    Then ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``,
    ``p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``. ``num_threads`` is accepted
    for signature parity with the native op and ignored.
    """
    del num_threads
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0.0:
        if adamw_mode:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if param_bf16 is not None:
        param_bf16.copy_(param)
