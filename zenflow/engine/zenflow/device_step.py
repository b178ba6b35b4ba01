"""The device step: AdamW of every weight's selected columns on the device.

Owns the update of the selected columns (fused calls over batches of weights with the same
step count, per-column counts otherwise) and the fp32 scratch a bf16 model's selected
gradients are widened into. Must not touch the non-selected columns (the host's, returned
by ``image_return``), the window or the selection: it reads ``grad_sel`` as the route left
it and writes the selected columns of W, their fp32 master slice and moments.
"""

from __future__ import annotations

import torch

from zenflow.engine.device_adam import adamw_columns_, adamw_fused_
from zenflow.engine.host import ColumnSteps
from zenflow.engine.zenflow.state import ZfWeight


class DeviceStep:
    """AdamW over the selected columns, on the device.

    ``mode``: the ZenFlowMode (its engine, weights and settings)."""

    def __init__(self, mode):
        self.m = mode
        self.e = mode.e
        # fp32 scratch of the device update (bf16 models): the largest weight's selected
        # gradient, or 1/64 of all of them, whichever is more
        self._scratch = None
        if not mode.zero_copy and mode.e.dtype != torch.float32 and mode.zweights:
            shares = [w.rows * w.k for w in mode.zweights]
            self._scratch = mode.e.accel.empty((max(max(shares), sum(shares) // 64),),
                                               torch.float32, "grads")  # fmt: skip

    def update(self, hp, coef_t) -> None:
        """AdamW of every weight's selected columns on the device: fused calls over batches
        of weights with the same step count (one batch unless columns were handed over with
        other counts). A bf16 model's selected gradients are widened to fp32 batch by batch
        into one accounted scratch buffer (about 1/64 of the selected elements), so the
        optimizer step never holds an fp32 copy of all of them at once."""
        groups: dict[int, list[ZfWeight]] = {}
        weights = self.m.zweights
        if not self.m.zero_copy and coef_t is not None and weights:
            # fp32 coefficient, rounded once (one foreach call: one launch, not one a weight)
            torch._foreach_mul_([w.grad_sel for w in weights], coef_t)
        ColumnSteps.increment_all([w.steps_dev for w in weights])
        for w in weights:
            if w.steps_dev.uniform is not None:
                groups.setdefault(w.steps_dev.uniform, []).append(w)
            else:
                g = self._sel_grad_fp32(w)
                x = self._sel_param(w)
                adamw_columns_(x, g, w.exp_avg_dev, w.exp_avg_sq_dev, w.steps_dev.counts, w.cd,
                               hp)  # fmt: skip
                self._write_sel(w, x)
        for step, ws in groups.items():
            batch: list[ZfWeight] = []
            used = 0
            for w in ws + [None]:
                n = 0 if w is None else w.rows * w.k
                if w is None or (batch and self._scratch is not None
                                 and used + n > self._scratch.numel()):  # fmt: skip
                    if batch:
                        self._fused_batch(batch, step, hp)
                    batch, used = [], 0
                if w is not None:
                    batch.append(w)
                    used += n

    def _sel_param(self, w: ZfWeight) -> torch.Tensor:
        """The fp32 values the selected columns' AdamW updates (compact)."""
        p = w.spec.param.data
        return p.index_select(w.cd, w.sel_dev) if w.master_sel is None else w.master_sel

    def _write_sel(self, w: ZfWeight, x: torch.Tensor) -> None:
        """The updated selected columns into W (a bf16 model's cast from its master)."""
        p = w.spec.param.data
        p.index_copy_(w.cd, w.sel_dev, x if w.master_sel is None else x.to(p.dtype))

    def _sel_grad_fp32(self, w: ZfWeight, offset: int = 0, widen: list | None = None):
        """The selected gradient in fp32: the whole gradient's columns (CPU zero-copy), the
        buffer itself (an fp32 model), or widened into the scratch at ``offset`` (with
        ``widen``: the (scratch view, bf16 gradient) pair is appended there for the caller's
        one foreach copy, and the view returned unfilled)."""
        if self.m.zero_copy:
            return w.grad().index_select(w.cd, w.sel_dev).float()
        if w.grad_sel.dtype == torch.float32:
            return w.grad_sel
        n = w.rows * w.k
        out = self._scratch[offset : offset + n].view(w.shape_k)
        if widen is None:
            out.copy_(w.grad_sel)
        else:
            widen.append((out, w.grad_sel))
        return out

    def _fused_batch(self, batch: list[ZfWeight], step: int, hp) -> None:
        """One fused AdamW call over ``batch`` (every weight at step count ``step``); a bf16
        model's gradients widened in one foreach copy."""
        xs, gs, off = [], [], 0
        widen: list[tuple[torch.Tensor, torch.Tensor]] = []
        for w in batch:
            xs.append(self._sel_param(w))
            gs.append(self._sel_grad_fp32(w, off, widen))
            off += w.rows * w.k
        if widen:
            torch._foreach_copy_([d for d, _ in widen], [g for _, g in widen])
        adamw_fused_(xs, gs, [w.exp_avg_dev for w in batch], [w.exp_avg_sq_dev for w in batch],
                     step, hp, fused=self.e.fused_device_adam)  # fmt: skip
        for w, x in zip(batch, xs, strict=True):
            self._write_sel(w, x)
