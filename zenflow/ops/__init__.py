"""Native CPU Adam ops and their plain reference.

Public API (other modules and external checks build on these names):

- ``adamw_step_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
  weight_decay, param_bf16=None, grad_scale=1.0, adamw_mode=True, num_threads=0)``:
  one in-place AdamW step with the native SIMD kernel (built on first use).
- ``adamw_step_reference_(...)``: the same step in plain PyTorch, same signature.

``step`` is the 1-based step number used for bias correction. ``grad_scale`` multiplies
the gradient before use (pass 1/S to average a window's gradient *sum* without a
separate pass). ``adamw_mode=False`` gives classic Adam with L2 weight decay.
"""

from zenflow.ops.reference import adamw_step_reference_

__all__ = ["adamw_step_reference_"]
