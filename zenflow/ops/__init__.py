"""Native CPU Adam ops and their plain reference.

Public API (other modules and external checks build on these names):

- ``adamw_step_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
  weight_decay, param_bf16=None, grad_scale=1.0, adamw_mode=True, num_threads=0,
  col_steps=None, col_inner=1)``:
  one in-place AdamW step with the native SIMD kernel (built on first use; routed to the
  reference when ``ZENFLOW_OPS=reference``).
- ``adamw_step_reference_(...)``: the same step in plain PyTorch, same signature.
- ``load_native()``, ``native_status()``, ``simd_path()``, ``NativeBuildError``: see
  ``zenflow.ops.loader``.

``step`` is the 1-based step number used for bias correction. ``grad_scale`` multiplies
the gradient before use (pass 1/S to average a window's gradient *sum* without a
separate pass). ``adamw_mode=False`` gives classic Adam with L2 weight decay.

Per-column step counts: ZenFlow hands columns of a 2-D weight between the device and the
host with their moments, so each column keeps its own step count. ``col_steps`` (int64,
1-D, contiguous, CPU, C >= 1 entries, each >= 1) gives it: element ``i`` of the flattened
param takes its bias correction from ``col_steps[(i // col_inner) % C]``, and ``step`` is
then only checked, not used (pass e.g. the largest count). ``numel`` must be a multiple of
``C * col_inner``. An ``nn.Linear`` weight ``[out, in]`` (columns along dim 1) is
``col_inner=1, C=in``; a transformers ``Conv1D`` weight ``[in, out]`` (columns along dim 0)
is ``col_inner=out, C=in``. ``col_inner`` is ignored without ``col_steps``.
Importing this package builds nothing.
"""

from __future__ import annotations

import torch

from zenflow.ops.loader import NativeBuildError, load_native, native_status, ops_mode, simd_path
from zenflow.ops.reference import (
    accumulate_reference_,
    adamw_compact_step_reference_,
    adamw_step_reference_,
)

__all__ = [
    "NativeBuildError",
    "accumulate_",
    "accumulate_reference_",
    "adamw_compact_step_",
    "adamw_compact_step_reference_",
    "adamw_step_",
    "adamw_step_reference_",
    "load_native",
    "native_status",
    "simd_path",
]


def adamw_step_(
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
    col_steps: torch.Tensor | None = None,
    col_inner: int = 1,
) -> None:
    """One in-place Adam(W) step on contiguous CPU tensors with the native kernel.

    ``param``, ``exp_avg`` and ``exp_avg_sq`` are fp32 and updated in place; ``grad`` is
    fp32 or bf16 and read only; ``param_bf16`` (optional, bf16, same numel) receives the
    updated param rounded to bf16 in the same pass. ``num_threads > 0`` sets the OpenMP
    team size for this call (0 = OpenMP default); results do not depend on it.

    ``col_steps`` (optional, int64, 1-D, contiguous, CPU, C >= 1 entries, each >= 1) gives
    every column its own 1-based bias-correction step: element ``i`` of the flattened param
    belongs to column ``(i // col_inner) % C``, and ``step`` is not used for bias
    correction (it must still be >= 1; pass e.g. the largest count). ``numel`` must be a
    multiple of ``C * col_inner``. ``nn.Linear`` weight ``[out, in]``: ``col_inner=1``,
    ``C=in``; ``Conv1D`` weight ``[in, out]``: ``col_inner=out``, ``C=in``. With every entry
    equal to ``step`` the result is bit-identical to the call without ``col_steps``.

    Releases the GIL while it runs. Raises ``RuntimeError`` starting with
    ``zenflow::adamw_step_`` and naming the bad argument for a tensor that is not
    contiguous, not on the CPU, of the wrong dtype or size, and for a bad ``col_steps`` or
    ``col_inner``.
    """
    if ops_mode() == "reference":
        adamw_step_reference_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            param_bf16=param_bf16,
            grad_scale=grad_scale,
            adamw_mode=adamw_mode,
            num_threads=num_threads,
            col_steps=col_steps,
            col_inner=col_inner,
        )
        return
    load_native()
    torch.ops.zenflow.adamw_step_.default(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param_bf16,
        int(step),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        float(grad_scale),
        bool(adamw_mode),
        int(num_threads),
        col_steps,
        int(col_inner),
    )


def adamw_compact_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    index: torch.Tensor,
    column_dim: int,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    image: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    adamw_mode: bool = True,
    num_threads: int = 0,
    col_steps: torch.Tensor | None = None,
) -> None:
    """One in-place Adam(W) step of the columns ``index`` of a 2-D fp32 weight's host state
    (``param``, ``exp_avg``, ``exp_avg_sq``: full shape, contiguous) from a gradient in the
    compact layout ``W.index_select(column_dim, index)`` (fp32 or bf16, contiguous).

    ``index``: int64, sorted, distinct column ids along ``column_dim``; the other columns
    are not read or written. ``image`` (optional, bf16, compact layout) receives the updated
    columns rounded to bf16 in the same pass (what goes back to the device). ``col_steps``
    (optional, int64, one entry per column id) gives each column its 1-based count;
    otherwise ``step`` is every column's. Same arithmetic as ``adamw_step_`` (bit-identical
    on those elements, for any ``num_threads``); raises ``RuntimeError`` starting with
    ``zenflow::adamw_compact_step_`` for a bad argument.
    """
    if ops_mode() == "reference":
        adamw_compact_step_reference_(
            param, grad, exp_avg, exp_avg_sq, index, column_dim, step=step, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, image=image,
            grad_scale=grad_scale, adamw_mode=adamw_mode, col_steps=col_steps,
        )  # fmt: skip
        return
    load_native()
    torch.ops.zenflow.adamw_compact_step_.default(
        param, grad, exp_avg, exp_avg_sq, index, int(column_dim), image, int(step), float(lr),
        float(beta1), float(beta2), float(eps), float(weight_decay), float(grad_scale),
        bool(adamw_mode), int(num_threads), col_steps,
    )  # fmt: skip


def accumulate_(
    dst: torch.Tensor,
    src: torch.Tensor,
    scale: float = 1.0,
    overwrite: bool = False,
    sumsq: bool = False,
    num_threads: int = 0,
) -> float:
    """``dst = scale * src`` (``overwrite``) or ``dst += scale * src`` (the product rounded
    to fp32 first, as clipping a gradient and then summing it), in place on
    contiguous CPU tensors (``dst`` fp32, ``src`` fp32 or bf16, same numel), on
    ``num_threads`` threads (0 = OpenMP default; the result does not depend on it). Returns
    the sum of squares of ``dst`` afterwards (float64) when ``sumsq``, else 0.0. Releases the
    GIL while it runs."""
    if ops_mode() == "reference":
        return accumulate_reference_(dst, src, scale, overwrite, sumsq)
    load_native()
    return float(
        torch.ops.zenflow.accumulate_.default(
            dst, src, float(scale), bool(overwrite), bool(sumsq), int(num_threads)
        )
    )
