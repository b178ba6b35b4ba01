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

import math
import time

import torch

from zenflow.engine.host import ColumnSteps
from zenflow.engine.selection import column_scores, select_topk, split_handover
from zenflow.engine.zenflow.host_layout import (
    SelectionPlan,
    compact_shape,
    entering,
    first_compact,
    relayout,
)
from zenflow.engine.zenflow.q8_state import MomentScratch
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
        # the first selection made in the hooks this step, per weight (until the step)
        self.first_plans: dict[int, SelectionPlan] = {}
        # the fp32 arrays 8-bit moments pass through, one pair for a whole selection
        self.scratch = MomentScratch(mode.e.accel)

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

    def select(self, t: int, scores: list[torch.Tensor],
               host_scores: list[torch.Tensor] | None = None) -> None:  # fmt: skip
        """(Re)select columns and hand ownership over by index.

        Preconditions: no host step in flight and the device holds every host result
        (first selection: the host holds the initial values; reselection: runs right after
        a synchronous window end). Columns leaving the device bring their fp32 values,
        moments and counts into the host's compact arrays; columns entering take the host's.
        Moments are carried, not restarted (a restarted column would take a full-size first
        Adam step), and so are the counts (bias correction). Weight by weight: the leaving
        columns are read through the accelerator's one read buffer (several weights per
        fill while they fit), and each weight's host arrays are re-laid as soon as its
        columns are in (``host_layout.relayout``). ``host_scores``: the same scores on the
        host (one rank; the first selection from whole gradients): top-k is taken there and
        the columns sent, instead of read back.
        """
        e = self.e
        dp = e.dp
        t0 = time.perf_counter()
        self._wait_return_copies()
        if host_scores is not None and not dp.enabled:
            with e.accel.host_scope():  # top-k of the host's scores, on the host
                news_host = [select_topk(s, w.k) for w, s in zip(self.m.zweights, host_scores,
                                                                 strict=True)]  # fmt: skip
            # each its own tensor, as top-k's are (not views that keep the copy alive)
            news = [t.clone() for t in self._to_device(news_host)]
        else:
            news = []
            for w, s in zip(self.m.zweights, scores, strict=True):
                if dp.enabled:  # the owner scores the averaged gradient; the others add 0
                    if not w.owned:
                        s.zero_()
                    dp.allreduce_scores_(s, w.spec.param.numel())
                news.append(select_topk(s, w.k))
            # every weight's new columns to the host in one read: the hand-over is planned
            # there (``_hand_over``), with no wait for the device per weight
            news_host = e.accel.reader(counted=True).read(news)
        with self.scratch.held(self._scratch_numel()):
            self._hand_over_all(news, news_host)
        self.selected = True
        self.last_select_step = t
        self.selections += 1
        self.selection_steps.append(t)
        e.rec.stall_s += time.perf_counter() - t0

    def _hand_over_all(self, news: list, news_host: list) -> None:
        """Every weight's hand-over to its new columns (``news``, on the device; their host
        copies ``news_host``), each weight's host arrays re-laid as soon as its leaving
        columns are read (several weights per fill of the one read buffer)."""
        reader = self.e.accel.reader(counted=True)
        plans: dict[int, tuple] = {}
        for w, new, new_host in zip(self.m.zweights, news, news_host, strict=True):
            plan, leaving = self._hand_over(w, new, new_host)
            self.e.rec.moved += int(plan.in_cols.numel() + plan.out_cols.numel())
            if leaving is None:
                self._relayout(w, plan, None)
                continue
            plans[w.position] = (w, plan)
            reader.add(w.position, leaving)
            for pos, host in reader.ready():
                self._relayout(*plans.pop(pos), host)
        for pos, host in reader.finish():
            self._relayout(*plans.pop(pos), host)

    def _scratch_numel(self) -> int:
        """Elements of the selection's fp32 moment arrays: the largest compact array this
        rank re-lays (0: no 8-bit moments here)."""
        if self.m.host_state != "compact":
            return 0
        return max((math.prod(compact_shape(w)) for w in self.m.zweights if w.owned),
                   default=0)  # fmt: skip

    # ------------------------------------------------------------------ in the hooks
    def select_in_hook(self, w: ZfWeight, g: torch.Tensor | None) -> None:
        """The first selection of ``w`` in its gradient hook (streamed, no host-summed
        micro-batches, no warm-up, one rank): top-k of the column scores of ``g`` as it
        becomes final (fp32, on the device; None: unused this step, zero scores), the
        device state of the selected columns taken from the host's initial values; the
        step then routes ``g`` like any split step. No whole gradient lands on the host.
        The host's compact state is made at the step (``finish_first``), unless the step
        is skipped (``undo_first``: the next step selects from its own gradient)."""
        if g is None:
            scores = torch.zeros(w.n_cols, dtype=torch.float32, device=self.e.device)
        else:
            scores = column_scores(g, w.cd)
            w.scores_first = scores  # the auto interval's masses of the step come from them
        plan, _ = self._hand_over(w, select_topk(scores, w.k))
        self.e.rec.moved += int(plan.in_cols.numel())
        self.first_plans[w.position] = plan
        if w.owned:
            w.window_buffers(self.m)

    def finish_first(self, t: int) -> None:
        """The step of a first selection made in the hooks was not skipped: every weight
        (one whose hook did not fire: from zero scores) gets its compact host state, from
        the masters taken at set-up or its device weight, weight by weight."""
        with self.scratch.held(self._scratch_numel()):
            for w in self.m.zweights:
                if w.position not in self.first_plans:
                    self.select_in_hook(w, None)
                self._relayout(w, self.first_plans.pop(w.position), None)
        self.selected = True
        self.last_select_step = t
        self.selections += 1
        self.selection_steps.append(t)

    def undo_first(self) -> None:
        """A skipped step selected nothing: the weights selected in its hooks go back to no
        selection (their host side was never made; the device state is made again)."""
        for w in self.m.zweights:
            if self.first_plans.pop(w.position, None) is not None:
                w.clear_selection()
        self.e.rec.moved = 0

    def _wait_return_copies(self) -> None:
        """The host->device copies that read the host state (the last applied host step's
        result) are done before a hand-over re-lays and frees it."""
        job = self.m.window.last_applied
        if job is not None:
            for ev in job.copies:
                ev.synchronize()

    def _relayout(self, w: ZfWeight, plan: SelectionPlan, host: list | None) -> None:
        """``w``'s host arrays in the new layout (the owner's): the compact state made at the
        first selection, re-laid at a re-selection with the leaving columns' ``host``
        values (fp32 master, moments, counts: ``_hand_over``'s order)."""
        if not w.owned:
            return
        mode = self.m
        if plan.old_nonsel is None:
            first_compact(w, mode, plan)
        else:
            leaving = None
            if host is not None:
                leaving = dict(zip(("master", "exp_avg", "exp_avg_sq", "counts"), host,
                                   strict=True))  # fmt: skip
            relayout(w, mode, plan, leaving)
        w.window_buffers(mode)

    def read_columns(self, w: ZfWeight, out: torch.Tensor) -> None:
        """The device weight's non-selected columns into ``out`` (host, fp32, compact): an
        fp32 weight's initial values at its first selection, piece by piece through the
        copy buckets (the device never holds more than a bucket of them)."""
        accel, tr = self.e.accel, self.m.transport
        p = w.spec.param.detach()
        if tr is None:  # shared memory: the weight is host memory
            torch.index_select(p, w.cd, w.nonsel_dev, out=out.view(w.compact_shape()))
            return
        flat, events = out.view(-1), []
        for pc in w.pieces:
            i, bucket = tr.take_bucket(pc.shape)
            src, dim, idx = pc.select(p, w.nonsel_dev)
            torch.index_select(src, dim, idx, out=bucket)
            ev = accel.copy_d2h(pc.of(flat), bucket)
            tr.buckets.mark(i, ev)
            events.append(ev)
        for ev in events:
            ev.synchronize()

    def _hand_over(self, w: ZfWeight, new: torch.Tensor, new_host: torch.Tensor | None = None):
        """Make ``new`` (sorted, on the device; ``new_host``: the same on the host, read
        here when not given) the selected columns of ``w`` on the device -> (the host plan,
        the leaving columns' device state to read: fp32 master, moments, counts, or None).
        The plan is made on the host; its index sets go to the device in one copy and the
        entering columns' host values (``host_layout.entering``, the owner's: broadcast to
        the other ranks) in one more, so the training thread never waits for the device
        here (the counts' host mirror says whether they are uniform)."""
        p = w.spec.param.data
        cd = w.cd
        with self.e.accel.host_scope():  # the plan: host memory
            if new_host is None:
                new_host = new.cpu()
            plan = SelectionPlan.make(w.sel_host, new_host, w.n_cols)
            old_host = w.sel_host if w.sel_host is not None else new_host[:0]
            split = split_handover(old_host, new_host)  # on the host
        stay_o, stay_n, in_pos, in_cols, out_pos, out_cols, nonsel = self._to_device(
            [*split, plan.new_nonsel]
        )  # fmt: skip
        leaving = None
        if out_cols.numel() and w.owned:  # device -> host, by index (gathered now)
            src = p.index_select(cd, out_cols) if w.master_sel is None else \
                w.master_sel.index_select(cd, out_pos)  # fmt: skip
            leaving = [
                src.float(),
                w.exp_avg_dev.index_select(cd, out_pos),
                w.exp_avg_sq_dev.index_select(cd, out_pos),
                w.steps_dev.counts[out_pos],
            ]
        n_in = int(in_cols.numel())
        # the same on every rank (all take part in the same broadcast): the host holds a
        # master unless this is an fp32 weight's first selection without masters (its
        # device weight is the master); a bf16 weight always has one
        has_master = plan.old_nonsel is not None or w.host_master_at_start
        fields = [("exp_avg_dev", "exp_avg"), ("exp_avg_sq_dev", "exp_avg_sq")]
        if w.master_sel is not None:
            fields.append(("master_sel", "master"))
        names = [h for _, h in fields]
        if has_master and "master" not in names:
            names.append("master")
        host_in = entering(w, self.m, plan.in_cols) if w.owned and n_in else {}
        incoming = self._incoming(w, host_in, n_in, names) if n_in else {}
        for name, host_name in fields:
            old_t = getattr(w, name)
            new_t = self.e.accel.empty(w.shape_k, torch.float32, "optimizer")
            new_t.index_copy_(cd, stay_n, old_t.index_select(cd, stay_o))
            if n_in:
                new_t.index_copy_(cd, in_pos, incoming[host_name])
            setattr(w, name, new_t)
        steps = self.e.accel.empty((w.k,), torch.int64, "optimizer")
        steps[stay_n] = w.steps_dev.counts[stay_o]
        if n_in:
            steps[in_pos] = incoming["counts"]
            if has_master:  # equal already (the apply put the master into W); explicit
                p.index_copy_(cd, in_cols, incoming["master"].to(p.dtype))
        with self.e.accel.host_scope():
            mirror = self._mirror(w, split, host_in.get("counts"))
        w.steps_dev = ColumnSteps(steps, None, mirror)
        w.steps_dev.recheck()
        w.set_selection(new, new_host, nonsel.clone(), plan.new_nonsel)
        return plan, leaving

    def _to_device(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host int64 index sets on the device, in one host->device copy (views of it)."""
        sizes = [int(x.numel()) for x in parts]
        with self.e.accel.host_scope():
            packed = torch.cat(parts)
        packed = self.e.accel.to_device(packed, "handover")
        return list(packed.split(sizes))

    def _incoming(self, w: ZfWeight, host_in: dict, n_in: int, names: list[str]) -> dict:
        """The ``n_in`` entering columns' counts (int64) and fp32 ``names`` values on this
        rank's device, from the owner's ``host_in``: one host->device copy of their bytes
        (counts first, so every part starts aligned), one broadcast with data parallelism."""
        shape_in = list(w.shape_k)
        shape_in[w.cd] = n_in
        numel = math.prod(shape_in)
        sizes = [8 * n_in] + [4 * numel] * len(names)
        accel, dp = self.e.accel, self.e.dp
        if w.owned:
            parts = [host_in["counts"]] + [host_in[n] for n in names]
            with accel.host_scope():
                packed = torch.cat([x.contiguous().view(-1).view(torch.uint8) for x in parts])
            dev = accel.to_device(packed, "handover")
        else:
            dev = accel.empty((sum(sizes),), torch.uint8, "handover")
        if dp.enabled:
            dp.broadcast_(dev, w.owner)
        counts, *values = dev.split(sizes)
        out = {"counts": counts.view(torch.int64)}
        for name, v in zip(names, values, strict=True):
            out[name] = v.view(torch.float32).view(shape_in)
        return out

    @staticmethod
    def _mirror(w: ZfWeight, split, entering_counts) -> torch.Tensor | None:
        """The new selected columns' counts on the host (``ColumnSteps.mirror``): the
        staying columns' from the old mirror, the entering ones' from the host; None when
        either is not on this host (another rank's columns, no mirror kept)."""
        stay_o, stay_n, in_pos = split[0], split[1], split[2]
        old = w.steps_dev.mirror if w.steps_dev is not None else None
        if (stay_o.numel() and old is None) or (in_pos.numel() and entering_counts is None):
            return None
        mirror = torch.empty(w.k, dtype=torch.int64)
        if stay_o.numel():
            mirror[stay_n] = old[stay_o]
        if in_pos.numel():
            mirror[in_pos] = entering_counts
        return mirror
