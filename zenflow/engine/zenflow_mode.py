"""The ZenFlow schedule (ZENFLOW.md section 2) on top of the accelerator layer.

Per ZenFlow weight W ([out, in] for nn.Linear, columns along ``cd``), k selected columns:

| where | what |
|---|---|
| device | W and its gradient in the training dtype (the model's own tensors) |
| device | selected columns: fp32 master slice (bf16 only: fp32 W is its own master), |
|        | exp_avg, exp_avg_sq, int64 step count per column |
| host   | fp32 master, exp_avg, exp_avg_sq of the whole weight, step count per column |
| host   | fp32 sum of the window's non-selected gradient (2 slots with overlap) |
| host   | training-dtype image of the non-selected columns, packed for the copy back |

One step t (after warm-up): the selected columns take an exact AdamW step on the device
(fp32 master slice, cast into W); the non-selected gradient columns go to the host in
pieces (``zenflow.engine.copies``: gathered into a device bucket, copied on the copy
engine, added into the fp32 sum by the accumulator thread), never through the training
thread's arithmetic. On a CPU device (shared memory) the gradient is instead summed where
autograd wrote it, with no copy at all (ZENFLOW.md section 7).

At the end of a window (every S steps, or the auto trigger) the host AdamW step of the
window's mean gradient runs on the worker; with ``overlap_step`` it runs while the next
window trains and its result reaches W at the end of that next window (non-selected columns
lag by at most 2S steps; S without overlap). At most one host step is in flight: the
previous one is waited for and applied before the next is submitted.

Step counts: the device counts steps, the host counts windows; each column keeps its own
count and carries it across a hand-over with its moments, so bias correction stays right
(the native op takes per-column counts). A host step uses lr(t) of the window's last step
t and, per column, its host count + 1.
"""

from __future__ import annotations

import functools
import time

import torch

from zenflow.engine.baselines import full_host_step
from zenflow.engine.copies import (
    DeviceBuckets,
    HostStaging,
    bucket_elems_for,
    plan_pieces,
)
from zenflow.engine.device_adam import adamw_columns_, adamw_fused_
from zenflow.engine.distributed import sum_of_squares
from zenflow.engine.host import (
    Accumulator,
    ColumnSteps,
    HostJob,
    HostState,
    HostTask,
    HostWorker,
    run_host_tasks,
)
from zenflow.engine.selection import (
    ParamSpec,
    column_scores,
    complement,
    num_selected,
    select_topk,
    split_handover,
)

AUTO_INTERVAL_MAX = 64  # bound of update_interval "auto" (window length 1..64)


class ZfWeight:
    """Engine-owned state of one ZenFlow weight (never glued onto the Parameter)."""

    def __init__(self, spec: ParamSpec, k: int, accel, master_init: torch.Tensor | None,
                 slots: int, pin: bool, dtype: torch.dtype, bucket_elems: int,
                 owner: int = 0, owned: bool = True):  # fmt: skip
        p = spec.param
        self.spec = spec
        self.cd = spec.column_dim
        self.n_cols = spec.n_cols
        self.k = k
        self.rows = p.numel() // self.n_cols
        # data parallel: the rank holding this weight's host state (every rank: one rank)
        self.owner = owner
        self.owned = owned
        # per-column layout for the native op: element i is in column (i // inner) % n_cols
        self.col_inner = 1 if self.cd == p.dim() - 1 else p.shape[-1]
        self.sel_dev: torch.Tensor | None = None
        self.sel_host: torch.Tensor | None = None
        self.nonsel_dev: torch.Tensor | None = None
        self.nonsel_host: torch.Tensor | None = None
        shape_k = list(p.shape)
        shape_k[self.cd] = k
        self.shape_k = tuple(shape_k)
        self.fp32_weight = p.dtype == torch.float32
        # selected columns, compact along cd (position i holds column sel[i])
        self.master_sel = None if self.fp32_weight else accel.zeros(shape_k, torch.float32,
                                                                    "optimizer")  # fmt: skip
        self.exp_avg_dev = accel.zeros(shape_k, torch.float32, "optimizer")
        self.exp_avg_sq_dev = accel.zeros(shape_k, torch.float32, "optimizer")
        self.steps_dev = ColumnSteps(accel.zeros((k,), torch.int64, "optimizer"), 0)
        self.pieces = []
        if not accel.shared_memory:
            self.pieces = plan_pieces(tuple(p.shape), self.cd, self.n_cols - k, bucket_elems)
        self.host: HostState | None = None
        self.acc: list[torch.Tensor] = []
        self.image: list[torch.Tensor] = []
        if not owned:
            return
        master = accel.host_empty(p.shape, torch.float32, pin)
        master.copy_(master_init)  # the initial fp32 weights: not a step, not counted
        self.host = HostState(
            master,
            accel.host_zeros(p.shape, torch.float32, pin),
            accel.host_zeros(p.shape, torch.float32, pin),
            ColumnSteps.zeros(self.n_cols, "cpu"),
        )
        if accel.shared_memory:  # summed where autograd writes (host memory already)
            self.acc = [accel.zeros(p.shape, torch.float32, "optimizer") for _ in range(slots)]
        else:
            self.acc = [accel.host_zeros(p.shape, torch.float32, pin) for _ in range(slots)]
            flat = accel.host_empty((self.rows * (self.n_cols - k),), dtype, pin)
            off = 0  # per piece: a contiguous view of flat, in the piece's shape
            for pc in self.pieces:
                self.image.append(flat[off : off + pc.numel].view(pc.shape))
                off += pc.numel
        # auto update interval statistics of the current window (python floats)
        self.sel_mass_sum = 0.0  # sum over steps of (selected mass / k)
        self.nonsel_mass_acc = 0.0  # sum over steps of (non-selected mass / (n - k))

    def set_selection(self, sel_dev: torch.Tensor) -> None:
        self.sel_dev = sel_dev
        self.sel_host = sel_dev.cpu()
        self.nonsel_dev = complement(sel_dev, self.n_cols)
        self.nonsel_host = self.nonsel_dev.cpu()

    def grad(self) -> torch.Tensor:
        g = self.spec.param.grad
        if g is None:  # unused this step: a zero gradient (keeps the schedule uniform)
            return torch.zeros_like(self.spec.param)
        return g.detach()

    def pack_image(self) -> None:
        """Host: the non-selected columns of the master, cast to the training dtype, piece by
        piece (what the next apply copies to the device)."""
        for pc, img in zip(self.pieces, self.image, strict=True):
            src, dim, idx = pc.select(self.host.master, self.nonsel_host)
            img.copy_(src.index_select(dim, idx))


class ZenFlowMode:
    """Selective device AdamW + windowed host AdamW; see the module docstring."""

    def __init__(self, engine, masters: dict[str, torch.Tensor]):
        self.e = engine
        accel = engine.accel
        zf = engine.zf
        self.topk_ratio = float(zf.topk_ratio)
        self.overlap = bool(zf.overlap_step)
        self.warmup_rounds = int(zf.full_warm_up_rounds)
        self.auto_ratio = float(zf.auto_ratio)
        self.update_interval = None if zf.update_interval == "auto" else int(zf.update_interval)
        self.select_every = engine.select_every
        self.slots = 2 if self.overlap else 1  # double-buffered sums with overlap
        self.zweights: list[ZfWeight] = []
        zspecs = [s for s in engine.specs if s.is_zenflow]
        self.bucket_elems = bucket_elems_for(
            [s.param.numel() for s in zspecs], [max(s.param.shape) for s in zspecs],
            engine.bucket_request,
        )  # fmt: skip
        dp = engine.dp
        owners = dp.owners([s.param.numel() for s in zspecs]) if dp.enabled else [0] * len(zspecs)
        for s, owner in zip(zspecs, owners, strict=True):
            owned = not dp.enabled or dp.owns(owner)
            self.zweights.append(
                ZfWeight(s, num_selected(s.n_cols, self.topk_ratio), accel,
                         masters[s.name] if owned else None, self.slots, engine.pin,
                         engine.dtype, self.bucket_elems, owner, owned)
            )  # fmt: skip
        self.stream = not accel.shared_memory and bool(self.zweights)
        if self.stream:
            max_piece = max(pc.numel for w in self.zweights for pc in w.pieces) if any(
                w.pieces for w in self.zweights) else 1  # fmt: skip
            self.buckets = DeviceBuckets(accel, max_piece, engine.dtype)
            self.staging = HostStaging(accel, engine.dtype, engine.pin, {
                (wi, pi): pc.shape
                for wi, w in enumerate(self.zweights) if w.owned
                for pi, pc in enumerate(w.pieces)
            })  # fmt: skip
            self.accumulator = Accumulator(1)
        else:
            self.buckets = self.staging = self.accumulator = None
        # the worker: always on a separate device (host work runs on the host's cores), and
        # on a CPU device only with overlap (else the training thread uses every core)
        self.worker = HostWorker() if (self.stream or self.overlap) else None
        self.selected = False
        self.last_select_step = 0
        self.window_len = 0
        self.window_start = self.warmup_rounds + 1
        self.slot = 0
        self.inflight: HostJob | None = None
        self.host_log: list[HostJob] = []
        self.window_lengths: list[int] = []
        self.max_staleness = 0

    # ------------------------------------------------------------------ resolved values
    def resolved(self) -> dict:
        zf = self.e.zf
        n = sum(w.spec.param.numel() for w in self.zweights)
        sel = sum(w.rows * w.k for w in self.zweights)
        return {
            "topk_ratio": self.topk_ratio,
            "update_interval": (
                f"auto(1..{AUTO_INTERVAL_MAX})"
                if self.update_interval is None
                else self.update_interval
            ),  # fmt: skip
            "select_strategy": zf.select_strategy,
            "select_interval": zf.select_interval,
            "select_every_steps": self.select_every,
            "full_warm_up_rounds": self.warmup_rounds,
            "overlap_step": self.overlap,
            "auto_ratio": self.auto_ratio,
            "grad_path": (
                "pieces gathered on the device, copied to pinned host staging, summed in fp32 "
                "by the host accumulator"
                if self.stream
                else "summed where autograd writes it (CPU device: no copy)"
            ),  # fmt: skip
            "bucket_elems": self.bucket_elems if self.stream else None,
            "zenflow_weights": len(self.zweights),
            "zenflow_params": n,
            "selected_elements": sel,
            "always_important_params": len(self.e.dense),
        }

    # ------------------------------------------------------------------ the step
    def step(self, t: int, hp) -> None:
        e = self.e
        if t <= self.warmup_rounds:
            self._warmup_step(hp)
            self.window_start = t + 1
            return
        if not self.selected:
            self._select(t)
        t0 = time.perf_counter()
        for w in self.zweights:
            self._device_update(w, hp)
        e.dense_update(hp)
        e.rec.devopt_s += time.perf_counter() - t0
        self._accumulate()
        self.window_len += 1
        if self._window_ends():
            reselect = t - self.last_select_step >= self.select_every
            self._end_window(t, hp, sync=reselect or not self.overlap)
            if reselect:
                self._select(t)

    def _device_update(self, w: ZfWeight, hp) -> None:
        p = w.spec.param.data
        g_sel = w.grad().index_select(w.cd, w.sel_dev).float()
        w.steps_dev.increment()
        x = p.index_select(w.cd, w.sel_dev) if w.master_sel is None else w.master_sel
        if w.steps_dev.uniform is not None:
            adamw_fused_([x], [g_sel], [w.exp_avg_dev], [w.exp_avg_sq_dev], w.steps_dev.uniform,
                         hp, fused=self.e.fused_device_adam)  # fmt: skip
        else:
            adamw_columns_(x, g_sel, w.exp_avg_dev, w.exp_avg_sq_dev, w.steps_dev.counts, w.cd,
                           hp)  # fmt: skip
        p.index_copy_(w.cd, w.sel_dev, x if w.master_sel is None else x.to(p.dtype))

    def _accumulate(self) -> None:
        e = self.e
        if self.stream:
            t0 = time.perf_counter()
            for wi, w in enumerate(self.zweights):
                if not w.owned:
                    continue
                g = w.grad()
                acc = w.acc[self.slot]
                for pi, pc in enumerate(w.pieces):
                    i, bucket = self.buckets.take(pc.shape)
                    src, dim, idx = pc.select(g, w.nonsel_dev)
                    torch.index_select(src, dim, idx, out=bucket)
                    staged = self.staging.take((wi, pi))
                    ev = e.accel.copy_d2h(staged, bucket)
                    self.buckets.mark(i, ev)
                    dst, dim, idx = pc.select(acc, w.nonsel_host)
                    release = functools.partial(self.staging.give, (wi, pi))
                    self.accumulator.add(ev, staged, dst, dim, idx, release)
            e.rec.transfer_s += time.perf_counter() - t0
        else:
            for w in self.zweights:
                if w.owned:
                    w.acc[self.slot].add_(w.grad())
        if self.update_interval is None:
            self._auto_stats()

    def _auto_stats(self) -> None:
        """Per weight: selected mass per column (summed over the window's steps, averaged at
        the vote) and accumulated non-selected mass per column. Mass = squared L2 norm."""
        if not self.zweights:
            return
        dp = self.e.dp
        vals = []
        for w in self.zweights:
            s = column_scores(w.grad(), w.cd)
            # data parallel: the selected part is the same on every rank (rank 0 counts it),
            # the non-selected part is averaged on its owner only
            vals.append(s[w.sel_dev].sum() * float(dp.rank == 0 or not dp.enabled))
            vals.append(s[w.nonsel_dev].sum() * float(w.owned))
        vals = torch.stack(vals).tolist()
        if dp.enabled:
            vals = dp.allreduce_sum(vals)
        for i, w in enumerate(self.zweights):
            w.sel_mass_sum += vals[2 * i] / w.k
            if w.n_cols > w.k:
                w.nonsel_mass_acc += vals[2 * i + 1] / (w.n_cols - w.k)

    def _window_ends(self) -> bool:
        if self.update_interval is not None:
            return self.window_len >= self.update_interval
        if self.window_len >= AUTO_INTERVAL_MAX or not self.zweights:
            return True
        votes = sum(
            1
            for w in self.zweights
            if w.n_cols == w.k or w.nonsel_mass_acc >= w.sel_mass_sum / self.window_len
        )
        return votes / len(self.zweights) >= self.auto_ratio

    # ------------------------------------------------------------------ data parallel
    def sync_grads(self, dp) -> float:
        """Average this step's gradients across ranks; return the squares this rank is the
        single holder of (their all-reduced sum is the squared global norm).

        Until the first selection, and during warm-up, every gradient is all-reduced (every
        rank needs all of it). After: the always-important params and the selected columns
        are all-reduced (every rank updates them identically), the non-selected columns are
        reduce-scattered to their weight's owner (only it accumulates them)."""
        t = self.e.global_step + 1
        grads = [s.param.grad for s in self.e.specs]
        if not self.selected or t <= self.warmup_rounds:  # every rank needs all of it
            dp.allreduce_mean_(grads)
            return sum_of_squares(grads) if dp.rank == 0 else 0.0
        shared = [d.spec.param.grad for d in self.e.dense]
        sel, nonsel = [], []
        for w in self.zweights:
            g = w.spec.param.grad
            sel.append(g.index_select(w.cd, w.sel_dev))
            nonsel.append((g.index_select(w.cd, w.nonsel_dev), w.owner))
        dp.allreduce_mean_(shared + sel)
        dp.reduce_mean_to_owners_(nonsel)
        mine = []
        for w, gs, (gn, _) in zip(self.zweights, sel, nonsel, strict=True):
            g = w.spec.param.grad
            g.index_copy_(w.cd, w.sel_dev, gs)
            if w.owned:
                g.index_copy_(w.cd, w.nonsel_dev, gn)
                mine.append(gn)
        return (sum_of_squares(shared + sel) if dp.rank == 0 else 0.0) + sum_of_squares(mine)

    # ------------------------------------------------------------------ host steps
    def check_worker(self) -> None:
        """Surface a failed host step or accumulation now (the step after it failed)."""
        if self.accumulator is not None:
            self.accumulator.check()
        job = self.inflight
        if job is None or job.future is None or not job.future.done():
            return
        if job.future.exception() is not None:
            self.inflight = None
            self.worker.wait(job)

    def wait_inflight(self, t: int) -> None:
        """Wait for the in-flight host step (if any) and copy its result to the device."""
        job, self.inflight = self.inflight, None
        if job is None:
            return
        t0 = time.perf_counter()
        if job.future is not None:
            self.worker.wait(job)
        self.e.rec.stall_s += time.perf_counter() - t0
        self._apply(job, t)

    def _apply(self, job: HostJob, t: int) -> None:
        """Copy the host result into the device weights: ONLY the non-selected columns, by
        index, cast to the training dtype (the fp32 master is never overwritten)."""
        e = self.e
        t0 = time.perf_counter()
        dp = e.dp
        for w in self.zweights:
            p = w.spec.param.data
            if self.stream:
                for i_pc, pc in enumerate(w.pieces):
                    i, bucket = self.buckets.take(pc.shape)
                    if w.owned:
                        e.accel.compute_wait(e.accel.copy_h2d(bucket, w.image[i_pc]))
                    if dp.enabled:  # the owner's result to every rank's device
                        dp.broadcast_(bucket, w.owner)
                    dst, dim, idx = pc.select(p, w.nonsel_dev)
                    dst.index_copy_(dim, idx, bucket)
                    self.buckets.mark(i, e.accel.record_compute())
            else:  # shared memory: the gather is the copy (counted at the weight's dtype)
                if w.owned:
                    vals = w.host.master.index_select(w.cd, w.nonsel_host).to(p.dtype)
                    e.accel.traffic.h2d_bytes += vals.numel() * p.element_size()
                else:
                    shape = list(p.shape)
                    shape[w.cd] = w.n_cols - w.k
                    vals = torch.empty(shape, dtype=p.dtype, device=p.device)
                if dp.enabled:
                    dp.broadcast_(vals, w.owner)
                p.index_copy_(w.cd, w.nonsel_dev, vals)
        job.applied_step = t
        # Staleness: the oldest gradient in this update is from job.window_start; the device
        # sees it at the end of step t. With overlap t is the end of the NEXT window, so
        # non-selected columns lag by at most 2S steps (S without overlap).
        self.max_staleness = max(self.max_staleness, t - job.window_start + 1)
        e.rec.host_update = True
        e.rec.stall_s += time.perf_counter() - t0

    def _window_tasks(self, n: int) -> tuple[list[HostTask], object]:
        """The host step of the window just ended (n steps) and what it must wait for."""
        slot = self.slot
        tasks = []
        for w in self.zweights:
            w.sel_mass_sum = 0.0
            w.nonsel_mass_acc = 0.0
            if not w.owned:
                continue
            acc = w.acc[slot]

            def after(w=w, acc=acc):
                if self.stream:
                    w.pack_image()
                acc.zero_()

            # Selected columns of master/moments are updated too (one flat pass is faster
            # than gather/scatter) but never observed: they reach the device only by index
            # (non-selected columns) and a column leaving the device overwrites its master,
            # moments and count at the hand-over. Their sum is zeroed so the result does not
            # depend on the transport (the CPU path sums whole gradients).
            if not self.stream:
                acc.index_fill_(w.cd, w.sel_dev, 0.0)
            tasks.append(HostTask(w.host, acc, 1.0 / n, w.col_inner, None, after))
        before = None
        if self.stream:
            fence = self.accumulator.fence()
            acc_check = self.accumulator.check

            def before():
                fence.wait()
                acc_check()

        return tasks, before

    def _end_window(self, t: int, hp, sync: bool) -> None:
        e = self.e
        self.wait_inflight(t)  # at most one host step in flight: the previous one first
        n = self.window_len
        tasks, before = self._window_tasks(n)
        job = HostJob(window_start=self.window_start, submit_step=t, buffer_slot=self.slot)
        self.host_log.append(job)
        kernel = e.kernel()
        nt = e.host_threads
        run = lambda: run_host_tasks(tasks, kernel, hp.lr, hp, nt, job, before)  # noqa: E731
        if self.worker is not None:
            self.worker.submit(job, run)
            self.inflight = job
        else:
            t0 = time.perf_counter()
            run()
            e.rec.stall_s += time.perf_counter() - t0
        if sync:
            self.wait_inflight(t) if self.worker is not None else self._apply(job, t)
        elif self.slots > 1:
            self.slot = 1 - self.slot
        e.rec.window_ended = n
        self.window_lengths.append(n)
        self.window_len = 0
        self.window_start = t + 1

    def flush(self, t: int, hp) -> None:
        """Apply everything pending: the in-flight host step, then the partial window."""
        if self.window_len > 0:
            self._end_window(t, hp, sync=True)
        else:
            self.wait_inflight(t)

    def drain(self) -> None:
        """Wait for background work without applying it (checkpoints, close)."""
        if self.accumulator is not None:
            self.accumulator.drain()
        if self.inflight is not None and self.inflight.future is not None:
            self.worker.wait(self.inflight)

    # ------------------------------------------------------------------ warm-up
    def _warmup_step(self, hp) -> None:
        """Full synchronous update: ZenFlow weights by the host AdamW, the rest on device."""
        e = self.e
        e.rec.warmup = True
        t0 = time.perf_counter()
        e.dense_update(hp)
        e.rec.devopt_s += time.perf_counter() - t0
        # device counts start when a column is selected: it carries the host's count
        owned = [w for w in self.zweights if w.owned]
        full_host_step(e, [(w.spec.param, w.host, w.col_inner) for w in owned], hp)
        if e.dp.enabled:  # each owner's updated weights to every rank
            for w in self.zweights:
                e.dp.broadcast_(w.spec.param.data, w.owner)

    # ------------------------------------------------------------------ selection
    def _select(self, t: int) -> None:
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
        for w in self.zweights:
            scores = column_scores(w.grad(), w.cd)
            if dp.enabled:  # the owner scores the averaged gradient; the others add zeros
                if not w.owned:
                    scores.zero_()
                dp.allreduce_scores_(scores, w.spec.param.numel())
            e.rec.moved += self._hand_over(w, select_topk(scores, w.k))
        self.selected = True
        self.last_select_step = t
        e.rec.stall_s += time.perf_counter() - t0

    def _hand_over(self, w: ZfWeight, new: torch.Tensor) -> int:
        """Make ``new`` (sorted) the selected columns of ``w``; returns the columns moved."""
        accel, dp = self.e.accel, self.e.dp
        p = w.spec.param.data
        cd, host = w.cd, w.host
        old = w.sel_dev if w.sel_dev is not None else new[:0]
        stay_o, stay_n, in_pos, in_cols, out_pos, out_cols = split_handover(old, new)
        if out_cols.numel() and w.owned:  # device -> host, by index
            out_h = out_cols.cpu()
            src = p.index_select(cd, out_cols) if w.master_sel is None else \
                w.master_sel.index_select(cd, out_pos)  # fmt: skip
            for dst, val in (
                (host.master, src),
                (host.exp_avg, w.exp_avg_dev.index_select(cd, out_pos)),
                (host.exp_avg_sq, w.exp_avg_sq_dev.index_select(cd, out_pos)),
            ):
                dst.index_copy_(cd, out_h, accel.to_host(val))
            host.steps.counts[out_h] = accel.to_host(w.steps_dev.counts[out_pos])
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

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> BaseException | None:
        """Join the threads (an in-flight result stays unapplied); return a failure not yet
        reported."""
        err = None
        try:
            if self.inflight is not None and self.worker is not None:
                job, self.inflight = self.inflight, None
                try:
                    self.worker.wait(job)
                except BaseException as exc:  # report after cleanup
                    err = exc
        finally:
            if self.worker is not None:
                self.worker.close()
            if self.accumulator is not None:
                self.accumulator.close()
                if err is None and self.accumulator.error is not None:
                    err = self.accumulator.error
        return err
