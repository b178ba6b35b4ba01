"""The step's global gradient norm and what follows from it: the one device read, the
non-finite check, and the clipping coefficient.

One device-to-host read per step (``Accelerator.read``): the loss, the global norm and
Zen-auto's masses together. The norm is summed from fp32 per-tensor norms on the device
(the gradients still there and the mode's streamed partials) plus the host's share (micro-
batches summed on the host); data parallel, the squares, the non-finite flag and the
masses are summed across ranks in one all-reduce, so every rank takes the same decision.

Functions of the engine's state; they change no weight or optimizer state. Must not
import ``schedule``; the engine applies what they decide (skip, clip, step).
"""

from __future__ import annotations

import math

import torch

from zenflow.engine.distributed import norms_of


def norm_terms(engine) -> list[torch.Tensor]:
    """fp32 device tensors whose squares sum to this rank's share of the squared global
    norm: the per-tensor norms of the gradients still on the device (the always-important
    parameters', or every gradient without streaming) and the mode's streamed partials.
    Data parallel: the whole-gradient path averages here (``sync_grads``); the streamed
    path averaged in the backward, and only the always-important gradients remain."""
    impl, dp = engine.impl, engine.dp
    routed = [s for s in engine.specs if engine.stream.mode.routes(s)]
    whole_path = not routed or getattr(impl, "zero_copy", False)
    present = [s.param.grad for s in engine.specs if s.param.grad is not None]
    if dp.enabled:
        for s in engine.specs:  # every rank takes part in every collective, same shapes
            if s.param.grad is None and not impl.routes(s):
                s.param.grad = torch.zeros_like(s.param)
        if whole_path:
            return impl.sync_grads(dp)
        rest = [s.param.grad for s in engine.specs if not impl.routes(s)]
        dp.allreduce_mean_(rest)
        return (norms_of(rest) if dp.rank == 0 else []) + impl.norm_terms()
    terms = norms_of(present)
    if not whole_path:
        terms += impl.norm_terms()
    return terms


def read_step(engine, loss) -> tuple[float, list[float], float | None]:
    """The step's one device read -> (this rank's device norm, Zen-auto's masses as read,
    the loss as a float or None)."""
    terms = norm_terms(engine)
    total = (torch.linalg.vector_norm(torch.stack(terms), 2.0) if terms
             else torch.zeros((), dtype=torch.float32, device=engine.device))  # fmt: skip
    auto = engine.impl.auto_terms() if hasattr(engine.impl, "auto_terms") else []
    loss_t = loss.detach() if torch.is_tensor(loss) else None
    reads = [total] + auto + ([loss_t] if loss_t is not None else [])
    values = engine.accel.read(reads)
    norm_local = values[0]
    auto_vals = values[1 : 1 + len(auto)]
    if loss_t is not None:
        loss_f = values[-1]
    else:
        loss_f = None if loss is None else float(loss)
    return norm_local, auto_vals, loss_f


def global_norm(
    engine, norm_local: float, auto_vals: list[float], loss_f: float | None
) -> tuple[float, bool, list[float]]:
    """The whole gradient's norm (device and host shares, every rank) -> (grad_norm,
    whether the loss or a rank's gradient is non-finite, Zen-auto's masses summed)."""
    host_sq = engine.impl.host_sq() if hasattr(engine.impl, "host_sq") else 0.0
    if auto_vals and hasattr(engine.impl, "auto_host_masses"):
        for i, m in enumerate(engine.impl.auto_host_masses()):
            auto_vals[2 * i + 1] += m
    bad_loss = float(loss_f is not None and not math.isfinite(loss_f))
    if engine.dp.enabled:
        sq, bad, *auto_vals = engine.dp.allreduce_sum(
            [norm_local * norm_local + host_sq, bad_loss, *auto_vals]
        )
        grad_norm = math.sqrt(sq) if math.isfinite(sq) and sq >= 0 else float("nan")
        nonfinite = bad > 0
    else:
        grad_norm = norm_local
        if host_sq:
            sq = norm_local * norm_local + host_sq
            grad_norm = math.sqrt(sq) if math.isfinite(sq) else float("nan")
        nonfinite = bool(bad_loss)
    return grad_norm, nonfinite, auto_vals


def clip_coefficient(
    clip: float, grad_norm: float, device: torch.device
) -> tuple[float, torch.Tensor | None]:
    """(coef, coef_t): the factor every gradient is scaled by (1.0 without clipping), and
    the same as an fp32 scalar on the device when it is below 1 (else None: a
    multiplication by exactly 1 changes nothing)."""
    coef, coef_t = 1.0, None
    if clip > 0:
        # fp32, as torch computes it on the device: clamp(clip / (norm + 1e-6), max=1)
        c = torch.clamp(clip / (torch.tensor(grad_norm, dtype=torch.float32) + 1e-6),
                        max=1.0)  # fmt: skip
        coef = float(c)
        if coef < 1.0:  # a multiplication by exactly 1 changes nothing
            coef_t = torch.full((), coef, dtype=torch.float32, device=device)
    return coef, coef_t


def clip_in_place(grads: list[torch.Tensor | None], coef_t: torch.Tensor) -> None:
    """Scale the gradients of ``grads`` (None entries skipped) by ``coef_t``, a 0-d fp32
    tensor on their device, in place, with the values ``grad.mul_(coef_t)`` gives one
    gradient at a time, in as few launches as torch allows:

    - off CUDA a 0-d tensor is a scalar kept in fp32: each element in fp32, rounded once
      (one foreach call);
    - on CUDA ``mul_`` reads a 0-d fp32 tensor beside a bf16/fp16 gradient as that dtype
      (its dynamic cast), and torch's foreach multiplication takes its fast path (a few
      launches for the whole list) only when the scalar tensor's dtype is the list's: so
      one call per dtype, the coefficient in that dtype, the same values as ``mul_``.
      Device AdamW clips every gradient of the model here (291 at 7B), ZenFlow its
      selected columns (226 weights) and the always-important parameters."""
    live = [g for g in grads if g is not None]
    if not live:
        return
    with torch.no_grad():
        if coef_t.device.type != "cuda":
            torch._foreach_mul_(live, coef_t)
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in live:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, same in by_dtype.items():
            torch._foreach_mul_(same, coef_t if dtype == coef_t.dtype else coef_t.to(dtype))
