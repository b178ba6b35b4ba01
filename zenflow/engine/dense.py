"""The always-important parameters (1-D, or 2-D smaller than ``min_numel``): their device
AdamW state and its update, every step, whole (zenflow mode; ``selection.classify_params``
decides which parameters these are).

Owns ``DenseState`` and the update over it. Must not touch the ZenFlow weights (their
selected columns are ``zenflow_mode``'s) nor decide the step's lr or clipping (the engine
passes them in ``hp`` and in the already-clipped gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zenflow.engine.device_adam import AdamHyper, adamw_fused_
from zenflow.engine.selection import ParamSpec


@dataclass
class DenseState:
    """Device AdamW state of an always-important parameter (1-D or small): fp32 moments,
    and an fp32 master when the weight itself is low precision."""

    spec: ParamSpec
    master: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0


def dense_state(s: ParamSpec, master: torch.Tensor, accel) -> DenseState:
    """Zero moments on the device; the fp32 master (from the host copy ``master``) only when
    the weight is not fp32 itself."""
    m = None
    if s.param.dtype != torch.float32:
        with accel.device_scope():  # device memory (sim: its pool)
            m = accel.track(master.to(accel.device).clone(), "optimizer")
    return DenseState(
        s, m, accel.zeros(s.param.shape, torch.float32, "optimizer"),
        accel.zeros(s.param.shape, torch.float32, "optimizer"),
    )  # fmt: skip


def dense_update(dense: list[DenseState], hp: AdamHyper, fused: bool) -> None:
    """Device AdamW on every always-important parameter (fp32 master when bf16): one
    fused call per step count, or the reference op by op."""
    groups: dict[int, list] = {}
    for d in dense:
        g = d.spec.param.grad
        if g is None:
            continue
        d.step += 1
        x = d.spec.param.data if d.master is None else d.master
        groups.setdefault(d.step, []).append((d, x, g.detach().float()))
    for step, items in groups.items():
        adamw_fused_([x for _, x, _ in items], [g for _, _, g in items],
                     [d.exp_avg for d, _, _ in items], [d.exp_avg_sq for d, _, _ in items],
                     step, hp, fused=fused)  # fmt: skip
        back = [(d.spec.param.data, d.master) for d, _, _ in items if d.master is not None]
        if back:  # the updated masters into the weights, rounded: one foreach call
            torch._foreach_copy_([p for p, _ in back], [m for _, m in back])
