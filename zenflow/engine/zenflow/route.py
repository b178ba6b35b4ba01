"""The gradient route: where each ZenFlow gradient goes as it becomes final, and the step's
figures taken from it on the way.

Owns the pieces' path (selected columns gathered into the device buffer, the rest gathered
into device buckets and sent to the host window sum, or the step sum with micro-batches
summed on the host), the whole-gradient path of warm-up and the first selection (its
landing buffers on the host), the whole gradients' or the pieces' norms and the column
scores, and the step's norm terms and auto-interval masses. Must not touch the host state,
the window's host job or the selection: it fills sums and device scalars that those rooms
read.

One step t (after warm-up): as backward produces W's gradient (``zenflow.engine.streaming``)
its selected columns are gathered into the device buffer and its non-selected columns go to
the host in pieces (``zenflow.engine.copies``: gathered into a device bucket, copied on the
copy engine, added into the fp32 window sum by the accumulator thread, scaled there by the
step's clipping coefficient once it is known; with ``zfctl.step_store`` "off", added
as it arrives, unclipped: the window's host step clips the sum; "q8", added as it arrives
scaled by a prediction and corrected from an 8-bit copy: ``step_q8``); the gradient is then
freed. The step's norm and non-finite check come from the whole gradient's norm, taken
in the hook (from the pieces' norms with data parallelism or without the step store), its
auto-interval masses from the pieces as they pass (device scalars, read once per step with
the loss). On a CPU device without streaming the gradient is instead summed where
autograd wrote it, with no copy at all (ZENFLOW.md section 7).
"""

from __future__ import annotations

import time
from functools import partial

import torch

from zenflow.engine.accelerator import DONE
from zenflow.engine.distributed import grad_norm, norms_of
from zenflow.engine.selection import column_scores
from zenflow.engine.zenflow.handover import Handover
from zenflow.engine.zenflow.image_return import ImageReturn
from zenflow.engine.zenflow.state import ZfWeight


class GradRoute:
    """The route of every ZenFlow gradient, and the figures of the step taken on it.

    ``mode``: the ZenFlowMode (its engine, weights, settings, copy pipeline and the step's
    plan); ``image_return``: the in-backward return the last micro-batch's hook starts;
    ``handover``: whether columns were selected yet (the CPU path's data parallelism)."""

    def __init__(self, mode, image_return: ImageReturn, handover: Handover):
        self.m = mode
        self.e = mode.e
        self.image_return = image_return
        self.handover = handover
        self.first_touch: list[ZfWeight] = []  # weights whose slot this step made non-fresh
        self.landing: dict[str, torch.Tensor] = {}  # whole-gradient steps: host copies
        self.landing_events: list = []
        self.whole_sq: dict[str, list] = {}  # data parallel: the owner's chunk squares

    def start_step(self) -> None:
        """A new step: no slot made non-fresh yet, no chunk squares."""
        self.first_touch = []
        self.whole_sq = {}

    def route(self, spec, g: torch.Tensor, n: int, last: bool) -> None:
        """Route ``g``, the ``n``-th micro-batch's gradient of ``spec`` (``last``: the
        step's last one), by the step's plan."""
        w = self.m.by_name[spec.name]
        if self.m.plan.whole:
            self._route_whole(w, g, n, last)
        else:
            if self.m.plan.first and w.sel_dev is None:  # the first selection, here
                w.norm_whole = grad_norm(g)  # the step's norm as a whole-gradient step has it
                self.handover.select_in_hook(w, g)
            self._route_split(w, g, n, last)
        w.contrib += 1

    def _route_split(self, w: ZfWeight, g: torch.Tensor, n: int, last: bool) -> None:
        """Selected columns into the device buffer, the rest in pieces to the host."""
        tr, plan, dp = self.m.transport, self.m.plan, self.e.dp
        host_gas, on_arrival = self.m.host_gas, self.m.adds_on_arrival
        self._gather_selected(w, g, n, last)
        stats_on_device = not host_gas
        whole_norm = self.m.whole_norms  # one launch for the weight, not one a piece
        if whole_norm and w.norm_whole is None:
            w.norm_whole = grad_norm(g)
        # column scores: for a re-selection, and for the auto interval's masses (summed
        # per column first, as the whole gradient's scores would be)
        scoring = plan.score or self.m.update_interval is None
        overwrite_acc = w.owned and w.fresh[plan.slot]
        if w.owned and not host_gas and not on_arrival:  # the previous step's adds done
            tr.store_free(w.position)  # with w's step store
        dsts, stores = self._places(w)
        # what every piece of ``w`` does with its bucket, decided once for the weight
        how = (plan, n, last, stats_on_device and w.owned and not whole_norm,
               stats_on_device and w.owned and scoring, overwrite_acc)  # fmt: skip
        for pc, dst, store, norm in zip(w.pieces, dsts, stores, w.norm_slots, strict=True):
            i, bucket = tr.take_bucket(pc.shape)
            src, dim, idx = pc.select(g, w.nonsel_dev)
            torch.index_select(src, dim, idx, out=bucket)
            if dp.enabled:
                then = partial(self._onward, w, pc, i, bucket, dst, store, norm, how)
                tr.after_reduce(dp.reduce_async(bucket, w.owner), i, then)
            else:
                self._onward(w, pc, i, bucket, dst, store, norm, how)
        if overwrite_acc and not host_gas:
            w.fresh[plan.slot] = False
            self.first_touch.append(w)
        if last and plan.apply is not None:
            self.image_return.apply_in_backward(w, plan.apply)

    def _onward(
        self, w: ZfWeight, pc, i: int, bucket: torch.Tensor, dst, store, norm, how: tuple
    ) -> None:
        """A gathered piece of ``w`` (in bucket ``i``; data parallel: reduced to its owner
        first, and averaged here) on to the host: its norm and scores taken on the way
        (``how``: the step's plan, the micro-batch, whether it is the last, whether the
        piece's norm and its column scores are taken here, whether it overwrites the
        window sum)."""
        plan, n, last, piece_norm, score, overwrite_acc = how
        tr, dp = self.m.transport, self.e.dp
        if dp.enabled and w.owned:
            bucket.mul_(1.0 / dp.world)
        if piece_norm:  # its place in the weight's piece norms
            grad_norm(bucket, out=norm)
            w.norms_routed = True
        if score:
            self._score_piece(w, pc, bucket)
        if not w.owned:
            tr.buckets.mark(i, self.e.accel.record_compute())
            return
        if self.m.host_gas:
            stat = None
            if last:
                stat = ("sq", w.spec.name)
                w.stat_done = True
            tr.send_piece(i, bucket, dst, None, n == 0, stat)
        elif self.m.adds_on_arrival:  # added as it arrives: no clipping coefficient to
            # wait for; a piece that is not finite is zeroed (its step is skipped on the device)
            bucket.masked_fill_(~torch.isfinite(norm.square()), 0)
            wait = w.free if overwrite_acc else None
            if self.m.q8_store is not None:  # scaled by a prediction, kept in 8 bits
                self.m.q8_store.send(w, pc, i, bucket, dst, overwrite_acc, wait)
            else:
                tr.send_piece(i, bucket, dst, None, overwrite_acc, wait=wait)
        else:
            tr.land_piece(i, bucket, store, dst, plan.gate, overwrite_acc, w.position,
                          wait=w.free if overwrite_acc else None)  # fmt: skip

    def _gather_selected(self, w: ZfWeight, g: torch.Tensor, n: int, last: bool) -> None:
        """The selected columns of ``g`` into (micro-batch ``n`` > 0: added to) the device
        buffer; data parallel, at the last: their average started."""
        if n == 0:
            torch.index_select(g, w.cd, w.sel_dev, out=w.grad_sel)
        else:
            w.grad_sel.add_(g.index_select(w.cd, w.sel_dev))
        dp = self.e.dp
        if dp.enabled and last:
            work = dp.allreduce_async(w.grad_sel)
            self.m.transport.after_reduce(work, None,
                                          lambda w=w: w.grad_sel.mul_(1.0 / dp.world))  # fmt: skip
            w.sel_reduced = True

    def _places(self, w: ZfWeight) -> tuple[list, list]:
        """Each piece's place in the buffer it is added into (the window sum of the plan's
        slot, or the micro-batch sum) and in the one it lands in (the step store; without
        it, the same), as views made once per buffer (``ZfWeight.views``)."""
        if not w.owned:
            return [None] * len(w.pieces), [None] * len(w.pieces)
        m = self.m
        dsts = w.views(w.step_buf if m.host_gas else w.acc[m.plan.slot])
        return dsts, (dsts if m.host_gas or m.adds_on_arrival else w.views(w.store))

    def _score_piece(self, w: ZfWeight, pc, bucket: torch.Tensor) -> None:
        """Column scores (squared L2 per column) of a non-selected piece, on the device, in
        chunks of rows (``column_scores``): the fp32 temporaries stay small whatever the
        piece's size."""
        if w.scores_ns is None:
            w.scores_ns = torch.zeros(w.n_nonsel, dtype=torch.float32, device=bucket.device)
        if pc.by_rows:  # rows lo:hi of every non-selected column
            w.scores_ns.add_(column_scores(bucket, 1))
        else:  # non-selected columns lo:hi, whole
            w.scores_ns[pc.lo : pc.hi].add_(column_scores(bucket, 0))

    def _route_whole(self, w: ZfWeight, g: torch.Tensor, n: int, last: bool) -> None:
        """The whole gradient to its owner's host (warm-up, first selection), through the
        buckets: into a landing buffer, or summed in fp32 there (micro-batches on the host)."""
        tr, dp, name = self.m.transport, self.e.dp, w.spec.name
        if not dp.enabled and not self.m.host_gas:
            w.norm_whole = grad_norm(g)
        land = self._landing_of(w) if w.owned else None
        sq_out = None
        if dp.enabled and not self.m.host_gas:
            sq_out = self.whole_sq.setdefault(name, [])
        if self.m.host_gas:  # through the staging ring into the fp32 landing
            if last:
                w.stat_done = True
            tr.send_whole(g, w.chunks, w.owner, sums=land, first=n == 0,
                          stat=("sq", name) if last else None)  # fmt: skip
        else:
            tr.send_whole(g, w.chunks, w.owner, landing=land, sq_out=sq_out,
                          events=self.landing_events)  # fmt: skip

    def _landing_of(self, w: ZfWeight) -> torch.Tensor:
        """Where a whole gradient of ``w`` lands on the host (flat, every element, pinned: the
        device writes it): a buffer of its own, allocated for the whole-gradient steps only
        (warm-up, the first selection) and freed after the first selection; fp32 when
        micro-batches are summed there."""
        name = w.spec.name
        if name not in self.landing:
            dtype = torch.float32 if self.m.host_gas else self.e.dtype
            self.landing[name] = self.e.accel.host_empty(
                (w.spec.param.numel(),), dtype, self.e.pin_link, "landing"
            )
        return self.landing[name]

    def wait_landing(self) -> None:
        """Wait until the step's whole gradients have landed on the host (counted stall)."""
        t0 = time.perf_counter()
        for ev in self.landing_events:
            ev.synchronize()
        self.landing_events = []
        if self.m.host_gas and self.m.transport is not None:
            self.m.transport.accumulator.drain()
        self.e.rec.stall_s += time.perf_counter() - t0

    def drop_landing(self) -> None:
        """A skipped step: its whole-gradient copies are waited for and discarded."""
        self.wait_landing()

    def release_landing(self) -> None:
        """After the first selection: the landing buffers go back to the allocator."""
        self.landing.clear()

    def fold_step_sums(self) -> None:
        """Host gas: each weight's step sum (its micro-batches) into the window sum, scaled
        by the step's coefficient (queued after the gate is set)."""
        if not self.m.host_gas:
            return
        acc, slot = self.m.transport.accumulator, self.m.plan.slot
        for w in self.m.zweights:
            if w.owned and w.contrib:
                acc.add(DONE, w.step_buf, w.acc[slot], self.m.plan.gate, w.fresh[slot], None,
                        wait=w.free if w.fresh[slot] else None)  # fmt: skip
                if w.fresh[slot]:
                    w.fresh[slot] = False
                    self.first_touch.append(w)

    def skip_step(self) -> None:
        """The step is skipped (non-finite): slots it would have started stay fresh, its
        whole-gradient copies are discarded (its pieces are dropped by the gate)."""
        for w in self.first_touch:
            w.fresh[self.m.plan.slot] = True
        self.drop_landing()

    def collect(self) -> None:
        """After the last gradient of the step was routed: finish the reductions in flight
        and make sure every weight has a (possibly zero) selected gradient."""
        if self.m.transport is not None:
            self.m.transport.complete()
        self.image_return.finish()  # the columns applied in the backward, before any update
        if self.m.zero_copy or self.m.plan is None:
            return
        if self.m.plan.whole:
            return
        for w in self.m.zweights:
            if w.contrib == 0:
                w.grad_sel.zero_()  # unused this step: a zero gradient
        if self.e.dp.enabled:
            # weights whose hook never saw a last micro-batch (unused in one, or in all):
            # their selected gradients are averaged here, in weight order on every rank
            late = [w.grad_sel for w in self.m.zweights if not w.sel_reduced]
            if late:
                self.e.dp.allreduce_mean_(late)

    def norm_terms(self) -> list[torch.Tensor]:
        """fp32 device tensors whose squares sum to this rank's share of the squared global
        norm (per-tensor norms where a tensor exists, else square roots of partial sums)."""
        if self.m.zero_copy or self.m.plan is None:
            return []
        dp = self.e.dp
        lead = not dp.enabled or dp.rank == 0
        terms = []
        for w in self.m.zweights:
            if w.norm_whole is not None:  # per whole gradient (whole-gradient steps, the
                terms.append(w.norm_whole)  # first selection in the hooks, one rank's pieces)
                continue
            if self.m.plan.whole or self.m.plan.first:
                if self.whole_sq.get(w.spec.name):
                    terms.append(torch.stack(self.whole_sq[w.spec.name]).sum().sqrt())
                continue
            if lead:
                terms.append(grad_norm(w.grad_sel))
            ns = w.ns_norm()
            if ns is not None:
                terms.append(ns)
        return terms

    def host_sq(self) -> float:
        """The squared norm summed on the host (micro-batches summed there): waits for the
        accumulator to finish the step's pieces."""
        if not self.m.host_gas or self.m.plan is None or self.m.transport is None:
            return 0.0
        buffers = {}  # weights whose sums were not totalled in-line
        for w in self.m.zweights:
            if w.owned and w.contrib and not w.stat_done:
                buf = self.landing.get(w.spec.name) if self.m.plan.whole else w.step_buf
                buffers[w.spec.name] = buf
        t0 = time.perf_counter()
        out = self.m.transport.accumulator.squares(buffers)
        self.e.rec.stall_s += time.perf_counter() - t0
        return out

    def auto_terms(self) -> list[torch.Tensor]:
        """Per weight: selected and non-selected squared masses of the step (device scalars,
        unclipped; ``auto_update`` scales them by the coefficient squared)."""
        if self.m.update_interval is not None or self.m.zero_copy or self.m.plan is None:
            return []
        if self.m.plan.whole or not self.m.zweights:
            return []
        dp = self.e.dp
        lead = not dp.enabled or dp.rank == 0
        zero = torch.zeros((), dtype=torch.float32, device=self.e.device)
        out = []
        for w in self.m.zweights:
            if self.m.plan.first:  # the first selection in the hooks: from its scores
                sc = w.scores_first
                out += [zero, zero] if sc is None else [sc[w.sel_dev].sum(), sc[w.nonsel_dev].sum()]
                continue
            out.append(column_scores(w.grad_sel, w.cd).sum() if lead else zero)
            if self.m.host_gas or not w.owned:
                out.append(zero)  # host gas: from the host sums (see auto_host_masses)
            elif w.scores_ns is not None:
                out.append(w.scores_ns.sum())
            else:
                ns = w.ns_norm()
                out.append(ns.square() if ns is not None else zero)
        return out

    def auto_host_masses(self) -> list[float]:
        """Host gas: the non-selected masses per weight from the step sums (waited for)."""
        if not self.m.host_gas or self.m.update_interval is not None or self.m.plan is None:
            return []
        if self.m.plan.whole:
            return []
        acc = self.m.transport.accumulator
        out: list[float] = []
        for w in self.m.zweights:
            if not (w.owned and w.contrib):
                out.append(0.0)
                continue
            key = ("mass", w.spec.name)

            def total(w=w, key=key):
                acc.sums[key] = float(w.step_buf.double().square().sum())

            acc.call(total)
            out.append(key)
        acc.drain()
        return [acc.sums.pop(k) if isinstance(k, tuple) else k for k in out]

    def sync_grads(self, dp) -> list[torch.Tensor]:
        """The zero-copy path's data parallelism (CPU device, whole gradients): average
        this step's gradients across ranks; return the norm terms this rank is the single
        holder of.

        Until the first selection, and during warm-up, every gradient is all-reduced (every
        rank needs all of it). After: the always-important params and the selected columns
        are all-reduced (every rank updates them identically), the non-selected columns are
        reduce-scattered to their weight's owner (only it accumulates them)."""
        t = self.e.global_step + 1
        grads = [s.param.grad for s in self.e.specs]
        if not self.handover.selected or t <= self.m.warmup_rounds:
            dp.allreduce_mean_(grads)  # every rank needs all of it
            return norms_of(grads) if dp.rank == 0 else []
        shared = [d.spec.param.grad for d in self.e.dense]
        sel, nonsel = [], []
        for w in self.m.zweights:
            g = w.spec.param.grad
            sel.append(g.index_select(w.cd, w.sel_dev))
            nonsel.append((g.index_select(w.cd, w.nonsel_dev), w.owner))
        dp.allreduce_mean_(shared + sel)
        dp.reduce_mean_to_owners_(nonsel)
        mine = []
        for w, gs, (gn, _) in zip(self.m.zweights, sel, nonsel, strict=True):
            g = w.spec.param.grad
            g.index_copy_(w.cd, w.sel_dev, gs)
            if w.owned:
                g.index_copy_(w.cd, w.nonsel_dev, gn)
                mine.append(gn)
        return (norms_of(shared + sel) if dp.rank == 0 else []) + norms_of(mine)
