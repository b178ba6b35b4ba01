"""The device step: AdamW of every weight's selected columns on the device.

Owns the update of the selected columns (fused calls over batches of weights with the same
step count, per-column counts otherwise) and its fp32 scratch: a bf16 model's selected
gradients are widened there, and the per-column update's denominators are made there.
Must not touch the non-selected columns (the host's, returned by ``image_return``), the
window or the selection: it reads ``grad_sel`` as the route left it and writes the
selected columns of W, their fp32 master slice and moments.
"""

from __future__ import annotations

import torch

from zenflow.engine.device_adam import (
    adamw_columns_,
    adamw_columns_multi_,
    adamw_fused_,
    column_factor_views,
)
from zenflow.engine.global_norm import clip_in_place
from zenflow.engine.host import ColumnSteps
from zenflow.engine.zenflow.state import ZfWeight


class DeviceStep:
    """AdamW over the selected columns, on the device.

    ``mode``: the ZenFlowMode (its engine, weights and settings)."""

    def __init__(self, mode):
        self.m = mode
        self.e = mode.e
        # fp32 scratch of the device update: the largest weight's selected gradient, or 1/64
        # of all of them, whichever is more. A bf16 model's selected gradients are widened
        # there (made now); an fp32 model's per-column update makes its denominators there
        # (made at the first re-selection's update: accounted, and on CUDA the block the
        # caching allocator would keep after that update anyway)
        self._scratch = None
        self._views: dict[tuple, torch.Tensor] = {}  # (weight, offset, dtype) -> scratch view
        # per-column counts in batches (adamw_columns_multi_), or weight by weight with the
        # reference device update (adamw_columns_); settable alone, for a test to compare
        self.batched_columns = mode.e.fused_device_adam
        shares = [w.rows * w.k for w in mode.zweights]
        # most selected elements one batch widens or makes denominators for
        self._cap = max(max(shares), sum(shares) // 64) if shares else 0
        self._widens = not mode.zero_copy and mode.e.dtype != torch.float32 and bool(shares)
        if self._widens:
            self._scratch = mode.e.accel.empty((self._cap,), torch.float32, "grads")

    def update(self, hp, coef_t) -> None:
        """AdamW of every weight's selected columns on the device: fused calls over batches
        of weights with the same step count, and batched foreach calls over the weights
        whose columns carry their own counts (after a hand-over). A bf16 model's selected
        gradients are widened to fp32 batch by batch into one accounted scratch buffer
        (about 1/64 of the selected elements), so the optimizer step never holds an fp32
        copy of all of them at once."""
        groups: dict[int | None, list[ZfWeight]] = {}
        weights = self.m.zweights
        if not self.m.zero_copy and coef_t is not None and weights:
            # mul_'s values, in a few launches for all the weights (``clip_in_place``)
            clip_in_place([w.grad_sel for w in weights], coef_t)
        ColumnSteps.increment_all([w.steps_dev for w in weights])
        for w in weights:  # None: per-column counts
            groups.setdefault(w.steps_dev.uniform, []).append(w)
        factors = {}  # per-column counts: every such weight's factors in one computation
        if None in groups:
            ws = groups[None]
            counts = [w.steps_dev.counts for w in ws]
            dims = [w.spec.param.dim() for w in ws]
            negs, bc2s = column_factor_views(counts, [w.cd for w in ws], dims, hp)
            factors = {id(w): (n, b) for w, n, b in zip(ws, negs, bc2s, strict=True)}
        for step, ws in groups.items():
            cap = self._batch_cap(step)
            batch: list[ZfWeight] = []
            used = 0
            for w in ws + [None]:
                n = 0 if w is None else w.rows * w.k
                if w is None or (batch and cap is not None and used + n > cap):
                    if batch:
                        self._batch(batch, step, hp, factors)
                    batch, used = [], 0
                if w is not None:
                    batch.append(w)
                    used += n

    def _batch_cap(self, step: int | None) -> int | None:
        """Most selected elements one batch updates: the scratch's (bf16, where the batch is
        widened; with per-column counts, ``step`` None, any dtype: the denominators are
        made there); else no cap (the fused kernel makes no temporaries)."""
        if self._widens or step is None:
            return self._cap
        return None

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
        out = self._scratch_view(w, offset, torch.float32)
        if widen is None:
            out.copy_(w.grad_sel)
        else:
            widen.append((out, w.grad_sel))
        return out

    def _batch(self, batch: list[ZfWeight], step: int | None, hp, factors: dict) -> None:
        """One update of ``batch``: a fused AdamW call (every weight at step count ``step``)
        or, with ``step`` None, the per-column counts' foreach calls (``factors``: each
        weight's column factors, by id; with the reference device update, ``adamw_columns_``
        weight by weight); a bf16 model's gradients widened in one foreach copy."""
        xs, gs, off = [], [], 0
        widen: list[tuple[torch.Tensor, torch.Tensor]] = []
        for w in batch:
            xs.append(self._sel_param(w))
            gs.append(self._sel_grad_fp32(w, off, widen))
            off += w.rows * w.k
        if widen:
            torch._foreach_copy_([d for d, _ in widen], [g for _, g in widen])
        ms = [w.exp_avg_dev for w in batch]
        vs = [w.exp_avg_sq_dev for w in batch]
        if step is not None:
            adamw_fused_(xs, gs, ms, vs, step, hp, fused=self.e.fused_device_adam)
        elif not self.batched_columns:  # the plain reference, weight by weight
            for w, x, g in zip(batch, xs, gs, strict=True):
                adamw_columns_(x, g, w.exp_avg_dev, w.exp_avg_sq_dev, w.steps_dev.counts, w.cd,
                               hp)  # fmt: skip
                self._write_sel(w, x)
            return
        else:  # the denominators in the scratch (the widened gradients there are spent
            # once the moments are); a CPU device's in new memory
            room = None if self.m.zero_copy else self._room(batch)
            counts = [w.steps_dev.counts for w in batch]
            mine = [factors[id(w)] for w in batch]
            adamw_columns_multi_(xs, gs, ms, vs, counts, [w.cd for w in batch], hp, room,
                                 ([n for n, _ in mine], [b for _, b in mine]))  # fmt: skip
        self._write_batch(batch, xs, spent=len(widen) == len(batch))

    def _room(self, batch: list[ZfWeight], dtype: torch.dtype = torch.float32) -> list:
        """Each weight's block of the scratch as ``dtype``, at the offsets ``_sel_grad_fp32``
        widens the batch's gradients to (so a widened gradient's room is itself); the
        scratch is made here first for an fp32 model's per-column denominators."""
        if self._scratch is None:
            self._scratch = self.e.accel.empty((self._cap,), torch.float32, "grads")
        out, off = [], 0
        for w in batch:
            out.append(self._scratch_view(w, off, dtype))
            off += w.rows * w.k
        return out

    def _scratch_view(self, w: ZfWeight, offset: int, dtype: torch.dtype) -> torch.Tensor:
        """``w``'s selected block in the scratch at ``offset`` (in elements of ``dtype``:
        fp32, or the 16-bit cast of a bf16 model), made once: the batches are the same
        every step, so a step slices nothing."""
        key = (w.position, offset, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 8 * len(self.m.zweights):  # batches changed many times
                self._views.clear()
            flat = self._scratch if dtype == torch.float32 else self._scratch.view(dtype)
            n = w.rows * w.k
            view = self._views[key] = flat[offset : offset + n].view(w.shape_k)
        return view

    def _write_batch(self, batch: list[ZfWeight], xs: list[torch.Tensor], spent: bool) -> None:
        """The updated selected columns of ``batch`` into their weights. A bf16 model whose
        batch was widened in the scratch (``spent``: nothing there is read any more) casts
        every master in one foreach copy into the scratch's bytes, then one index_copy_ a
        weight; otherwise ``_write_sel`` each."""
        dtype = batch[0].spec.param.dtype
        if not spent or any(w.master_sel is None or w.spec.param.dtype != dtype for w in batch):
            for w, x in zip(batch, xs, strict=True):
                self._write_sel(w, x)
            return
        casts = self._room(batch, dtype)  # the scratch's first half, as 16-bit elements
        torch._foreach_copy_(casts, xs)
        for w, c in zip(batch, casts, strict=True):
            w.spec.param.data.index_copy_(w.cd, w.sel_dev, c)
