"""AdamW on the device: dense (always-important params) and on a weight's selected columns.

Two implementations of the same step:

- ``adamw_dense_``: the plain reference, exactly torch.optim.AdamW's single-tensor
  (non-fused, non-foreach) path, op for op, so ``topk_ratio=1.0`` reproduces torch's
  single-tensor results bit for bit. About eight passes over memory (and as many kernel
  launches on a GPU) per tensor.
- ``adamw_fused_``: torch's fused AdamW kernel (``torch._fused_adamw_``, the kernel behind
  ``torch.optim.AdamW(fused=True)``) over a list of tensors at once: one pass, one launch.
  It differs from the reference by float rounding only (``tests/engine/test_device_adam.py``
  compares them element-wise); with ``topk_ratio=1.0`` the engine then reproduces
  ``torch.optim.AdamW(fused=True)`` bit for bit. The engine uses it wherever torch has it
  (fp32 state on cpu or cuda; ``fused_available``) unless asked for the reference.

Step counters are integers (never a low-precision tensor: DeepSpeed's bf16 counter froze at
256, ZENFLOW.md s.5); the fused kernel gets the count as a fresh fp32 scalar on the device
each call (filled there, never copied from the host), exact up to 2**24 steps. Selected
columns may carry different counts (each column keeps its own across hand-overs); then bias
correction is per column (``adamw_columns_``, reference arithmetic only), computed in
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


DEVICE_ADAM_IMPLS = ("fused", "reference")


def fused_available(device: torch.device) -> bool:
    """Whether torch's fused AdamW kernel runs on ``device`` (fp32 state: the engine's)."""
    return device.type in ("cpu", "cuda") and hasattr(torch, "_fused_adamw_")


def adamw_fused_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    hp: AdamHyper,
    fused: bool = True,
) -> None:
    """One in-place AdamW step (``hp.adamw_mode`` False: Adam with L2 decay) on every tensor
    of the lists, all at the 1-based count ``step``: in one fused kernel call, or with
    ``fused=False`` the reference (``adamw_dense_``) on each. fp32, same device, same
    shapes pairwise.

    The fused kernel walks the four tensors' memory in lockstep, so it is only given
    tensors that are all contiguous (the engine's own buffers are): a strided parameter
    beside contiguous moments would be updated with another element's moments. Any other
    tensor takes the reference step."""
    batch, rest = [], []
    for four in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        (batch if fused and all(t.is_contiguous() for t in four) else rest).append(four)
    for p, g, m, v in rest:
        adamw_dense_(p, g, m, v, step, hp)
    if not batch:
        return
    p, g, m, v = (list(ts) for ts in zip(*batch, strict=True))
    # torch.full launches a fill on the device: no host-to-device copy, so no stream sync
    steps = [torch.full((), float(step), device=p[0].device)] * len(p)
    kernel = torch._fused_adamw_ if hp.adamw_mode else torch._fused_adam_
    kernel(
        p, g, m, v, [], steps,
        lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
        amsgrad=False, maximize=False,
    )  # fmt: skip


def adamw_columns_multi_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    column_dims: list[int],
    hp: AdamHyper,
    scratch: list[torch.Tensor] | None = None,
    factors: tuple[list, list] | None = None,
) -> None:
    """``adamw_columns_`` on every tensor of the lists at once, with the same arithmetic op
    for op (element-wise equal): the moments in foreach calls, the per-column factors of
    all the tensors in one computation over their counts laid end to end, then one
    launch per tensor (``exp_avg / denom``, written over the denominator) where the
    reference makes about twenty. ``scratch``: fp32 tensors shaped like ``params`` that
    are free once the moments are updated (the widened gradients themselves may be); the
    denominators are made there instead of in new memory. ``factors``: the tensors'
    ``column_factor_views`` where the caller made them (for more tensors than one call
    updates, at once)."""
    if hp.weight_decay != 0.0:
        if hp.adamw_mode:
            torch._foreach_mul_(params, 1 - hp.lr * hp.weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=hp.weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - hp.beta1)
    torch._foreach_mul_(exp_avg_sqs, hp.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - hp.beta2)
    negs, bc2s = factors or column_factor_views(steps, column_dims, [p.dim() for p in params], hp)
    if scratch is None:
        denoms = torch._foreach_sqrt(exp_avg_sqs)
    else:
        denoms = scratch
        torch._foreach_copy_(denoms, exp_avg_sqs)
        torch._foreach_sqrt_(denoms)
    torch._foreach_div_(denoms, bc2s)
    torch._foreach_add_(denoms, hp.eps)
    for m, d in zip(exp_avgs, denoms, strict=True):
        torch.div(m, d, out=d)
    torch._foreach_mul_(denoms, negs)
    torch._foreach_add_(params, denoms)


def column_factor_views(steps: list[torch.Tensor], column_dims: list[int], ndims: list[int],
                        hp: AdamHyper) -> tuple[list, list]:  # fmt: skip
    """``column_factors`` of several tensors' counts in one computation (their counts laid
    end to end): per tensor, views shaped to broadcast along its column dim."""
    neg_flat, bc2_flat = column_factors(torch.cat(steps), hp, 0, 1)
    sizes = [s.numel() for s in steps]
    shapes = []
    for nd, cd in zip(ndims, column_dims, strict=True):
        shape = [1] * nd
        shape[cd] = -1
        shapes.append(shape)
    negs = [f.view(sh) for f, sh in zip(neg_flat.split(sizes), shapes, strict=True)]
    bc2s = [f.view(sh) for f, sh in zip(bc2_flat.split(sizes), shapes, strict=True)]
    return negs, bc2s


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
