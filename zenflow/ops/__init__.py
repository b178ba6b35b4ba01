"""Native CPU Adam ops and their plain reference.

Public API (other modules and external checks build on these names):

- ``adamw_step_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
  weight_decay, param_bf16=None, grad_scale=1.0, adamw_mode=True, num_threads=0)``:
  one in-place AdamW step with the native SIMD kernel (built on first use; routed to the
  reference when ``ZENFLOW_OPS=reference``).
- ``adamw_step_reference_(...)``: the same step in plain PyTorch, same signature.
- ``load_native()``, ``native_status()``, ``simd_path()``, ``NativeBuildError``: see
  ``zenflow.ops.loader``.

``step`` is the 1-based step number used for bias correction. ``grad_scale`` multiplies
the gradient before use (pass 1/S to average a window's gradient *sum* without a
separate pass). ``adamw_mode=False`` gives classic Adam with L2 weight decay.
Importing this package builds nothing.
"""

from __future__ import annotations

import torch

from zenflow.ops.loader import NativeBuildError, load_native, native_status, ops_mode, simd_path
from zenflow.ops.reference import adamw_step_reference_

__all__ = [
    "NativeBuildError",
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
) -> None:
    """One in-place Adam(W) step on contiguous CPU tensors with the native kernel.

    ``param``, ``exp_avg`` and ``exp_avg_sq`` are fp32 and updated in place; ``grad`` is
    fp32 or bf16 and read only; ``param_bf16`` (optional, bf16, same numel) receives the
    updated param rounded to bf16 in the same pass. ``num_threads > 0`` sets the OpenMP
    team size for this call (0 = OpenMP default); results do not depend on it. Releases
    the GIL while it runs. Raises ``RuntimeError`` naming the bad argument for a tensor
    that is not contiguous, not on the CPU, of the wrong dtype or size.
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
    )
