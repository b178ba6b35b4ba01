"""Selection and hand-over: which columns of each weight the device updates, when they are
chosen again, and how their optimizer state changes sides.

Owns the selection counters (selected yet, last selection step, count, the steps) and the
hand-over BY INDEX: leaving columns write their fp32 values, moments and per-column counts
into the host state, entering columns take the host's; moments and counts are carried, not
restarted. Column scores and top-k themselves are ``zenflow.engine.selection``'s. Must not
touch the window sums, the host job or the gradient route: a hand-over runs only when no
host step is in flight and the device holds every host result.
"""

from __future__ import annotations

import time

import torch

from zenflow.engine.host import ColumnSteps
from zenflow.engine.selection import column_scores, select_topk, split_handover
from zenflow.engine.zenflow.state import ZfWeight


class Handover:
    """(Re)selection of every weight's columns and the hand-over of their state.

    ``mode``: the ZenFlowMode (its engine, weights, settings and copy pipeline)."""

    def __init__(self, mode):
        self.m = mode
        self.e = mode.e
        self.selected = False
        self.last_select_step = 0
        self.selections = 0  # first selection and re-selections so far (the doubling gap)
        self.selection_steps: list[int] = []  # this process's selections (not checkpointed)

    def gap(self) -> int:
        """Steps from the last selection to the next re-selection (taken at the first window
        end at or after it). zfctl.select_schedule "fixed": the select interval. "doubling":
        S after the first selection, then 2S, 4S, ... (S the update_interval, 1 with
        "auto"), never more than the select interval."""
        if self.e.select_schedule != "doubling":
            return self.m.select_every
        base = self.m.update_interval or 1
        doublings = max(0, self.selections - 1)
        if doublings >= 62 or base << doublings >= self.m.select_every:
            return self.m.select_every
        return base << doublings

    def due(self, t: int) -> bool:
        """Whether a re-selection is due at step ``t`` (taken at a window end)."""
        return t - self.last_select_step >= self.gap()

    def scores(self) -> list[torch.Tensor]:
        """Column scores of this step's whole gradient, per weight, on the device: the
        selected part from the device buffer, the non-selected part from the pieces (the
        device, as they passed) or from the step's sums (the host, micro-batches summed
        there). Data parallel: the owner's scores; the other ranks add zeros."""
        out = []
        e = self.e
        for w in self.m.zweights:
            if self.m.zero_copy:
                out.append(column_scores(w.grad(), w.cd))
                continue
            scores = torch.zeros(w.n_cols, dtype=torch.float32, device=e.device)
            if w.owned:
                scores[w.sel_dev] = w.scores_sel
                if self.m.host_gas:
                    self.m.transport.accumulator.drain()
                    compact = w.step_buf.view(w.compact_shape())
                    ns_scores = column_scores(compact, w.cd)
                    scores[w.nonsel_dev] = ns_scores.to(e.device)
                elif w.scores_ns is not None:
                    scores[w.nonsel_dev] = w.scores_ns
            out.append(scores)
        return out

    def select(self, t: int, scores: list[torch.Tensor]) -> None:
        """(Re)select columns and hand ownership over by index.

        Preconditions: no host step in flight and the device holds every host result
        (first selection: the master was just copied from the weights; reselection: runs
        right after a synchronous window end). Columns leaving the device write their fp32
        values, moments and counts into the host state BY INDEX; columns entering take the
        host's. Moments are carried, not restarted (a restarted column would take a
        full-size first Adam step), and so are the counts (bias correction).
        """
        e = self.e
        dp = e.dp
        t0 = time.perf_counter()
        leaving: list = []
        for w, s in zip(self.m.zweights, scores, strict=True):
            if dp.enabled:  # the owner scores the averaged gradient; the others add zeros
                if not w.owned:
                    s.zero_()
                dp.allreduce_scores_(s, w.spec.param.numel())
            e.rec.moved += self._hand_over(w, select_topk(s, w.k), leaving)
        self._write_leaving(leaving)
        self.selected = True
        self.last_select_step = t
        self.selections += 1
        self.selection_steps.append(t)
        e.rec.stall_s += time.perf_counter() - t0

    def _write_leaving(self, leaving: list) -> None:
        """The leaving columns' device values, moments, counts and indices (gathered by
        ``_hand_over``) into their host state by index, fetched in ONE device-to-host read
        for all weights (counted): float64 holds fp32 values and integer counts exactly."""
        if not leaving:
            return
        flat = torch.cat([t.reshape(-1).to(torch.float64) for _, tensors in leaving
                          for t in tensors])  # fmt: skip
        flat = self.e.accel.read_tensor(flat)
        off = 0
        for w, tensors in leaving:
            vals = []
            for t in tensors:
                vals.append(flat[off : off + t.numel()].view(t.shape))
                off += t.numel()
            cols_h = vals[4].to(torch.int64)
            host, cd = w.host, w.cd
            for dst, v in zip((host.master, host.exp_avg, host.exp_avg_sq), vals[:3],
                              strict=True):  # fmt: skip
                dst.index_copy_(cd, cols_h, v.to(torch.float32))
            host.steps.counts[cols_h] = vals[3].to(torch.int64)
            host.steps.recheck()  # the counts changed after _hand_over's recheck

    def _hand_over(self, w: ZfWeight, new: torch.Tensor, leaving: list) -> int:
        """Make ``new`` (sorted) the selected columns of ``w``; returns the columns moved.
        The leaving columns' device state is gathered into ``leaving`` (written to the host
        by ``_write_leaving``, one read for all weights)."""
        accel, dp = self.e.accel, self.e.dp
        p = w.spec.param.data
        cd, host = w.cd, w.host
        old = w.sel_dev if w.sel_dev is not None else new[:0]
        stay_o, stay_n, in_pos, in_cols, out_pos, out_cols = split_handover(old, new)
        if out_cols.numel() and w.owned:  # device -> host, by index (gathered now)
            src = p.index_select(cd, out_cols) if w.master_sel is None else \
                w.master_sel.index_select(cd, out_pos)  # fmt: skip
            leaving.append((w, (src, w.exp_avg_dev.index_select(cd, out_pos),
                                w.exp_avg_sq_dev.index_select(cd, out_pos),
                                w.steps_dev.counts[out_pos], out_cols)))  # fmt: skip
        in_h = in_cols.cpu()
        n_in = int(in_cols.numel())
        shape_in = list(w.shape_k)
        shape_in[cd] = n_in

        def incoming(read_host, shape, dtype):
            """The entering columns' host values, on this rank's device (from the owner)."""
            if w.owned:
                t = accel.to_device(read_host(), "handover")
            else:
                t = accel.empty(shape, dtype, "handover")
            if dp.enabled:
                dp.broadcast_(t, w.owner)
            return t

        fields = [("exp_avg_dev", "exp_avg"), ("exp_avg_sq_dev", "exp_avg_sq")]
        if w.master_sel is not None:
            fields.append(("master_sel", "master"))
        for name, host_name in fields:
            old_t = getattr(w, name)
            new_t = accel.empty(w.shape_k, torch.float32, "optimizer")
            new_t.index_copy_(cd, stay_n, old_t.index_select(cd, stay_o))
            if n_in:
                vals = incoming(lambda h=host_name: getattr(host, h).index_select(cd, in_h),
                                shape_in, torch.float32)  # fmt: skip
                new_t.index_copy_(cd, in_pos, vals)
            setattr(w, name, new_t)
        steps = accel.empty((w.k,), torch.int64, "optimizer")
        steps[stay_n] = w.steps_dev.counts[stay_o]
        if n_in:
            steps[in_pos] = incoming(lambda: host.steps.counts[in_h], (n_in,), torch.int64)
            master_in = incoming(lambda: host.master.index_select(cd, in_h), shape_in,
                                 torch.float32)  # fmt: skip
            p.index_copy_(cd, in_cols, master_in.to(p.dtype))  # equal already; explicit
        w.steps_dev = ColumnSteps(steps, None)
        w.steps_dev.recheck()
        if w.owned:
            host.steps.recheck()
        w.set_selection(new)
        return int(in_cols.numel() + out_cols.numel())
