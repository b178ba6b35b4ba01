"""The window: the steps whose non-selected gradients are summed on the host, and the host
AdamW step that ends it.

Owns the window's counters (length, the lrs' sum, first step, sum slot), when a window ends
(every S steps, or the auto interval's vote and its statistics), the host job of the window
just ended and the worker that runs it (at most one in flight), and the CPU path's
accumulation where autograd wrote the gradient. Must not touch the gradient route's pieces
(``route``) or the selected columns; a host result reaches the device through
``image_return`` only.

At the end of a window (every S steps, or the auto trigger) the host AdamW step of the
window's mean gradient runs on the worker, over the non-selected columns only (the compact
host state: one contiguous kernel call per weight); with ``overlap_step`` it runs while the
next window trains and its result reaches W at the end of that next window (non-selected
columns lag by at most 2S steps; S without overlap). At most one host step is in flight:
the previous one is waited for and applied before the next is submitted, and the next
waits for the copies that read the previous one's result (the compact master itself)
before it writes the master again.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

from zenflow.engine.host import HostJob, HostTask, HostWorker, run_host_tasks
from zenflow.engine.selection import column_scores
from zenflow.engine.zenflow.image_return import ImageReturn

AUTO_INTERVAL_MAX = 64  # bound of update_interval "auto" (window length 1..64)


class Window:
    """The current window and the host steps that end windows.

    ``mode``: the ZenFlowMode (its engine, weights, settings and copy pipeline);
    ``image_return``: where a finished host step's result goes back to the device."""

    def __init__(self, mode, image_return: ImageReturn):
        self.m = mode
        self.e = mode.e
        self.image_return = image_return
        accel = mode.e.accel
        # the worker: always on a separate device (host work runs on the host's cores), and
        # on a CPU device only with overlap (else the training thread uses every core)
        self.worker = None
        if not accel.shared_memory or mode.overlap:
            self.worker = HostWorker(accel.bind_thread)
        self.window_len = 0
        self.window_lr_sum = 0.0  # the lrs of the window's steps (zfctl.window_lr "sum")
        # zfctl.step_store "off" with clipping: the window's pieces were added unclipped, and
        # its host step scales them by the smallest clipping coefficient of its steps
        self.window_coef = 1.0
        self.window_start = mode.warmup_rounds + 1
        self.slot = 0
        self.inflight: HostJob | None = None
        self.last_applied: HostJob | None = None  # its image copies may still be running
        self.host_log: list[HostJob] = []
        self.window_lengths: list[int] = []

    def add_step(self, lr: float, coef: float = 1.0) -> None:
        """One more step in the window (its lr for zfctl.window_lr "sum"; ``coef``: its
        clipping coefficient where its pieces were added unclipped, the store-free path)."""
        self.window_len += 1
        self.window_lr_sum += lr
        self.window_coef = min(self.window_coef, coef)

    def accumulate_zero_copy(self) -> None:
        """The CPU path (no streaming): the step's gradient summed into the window sum where
        autograd wrote it, and the auto interval's statistics from it."""
        for w in self.m.zweights:
            if w.owned:
                w.acc[self.slot].add_(w.grad())
        if self.m.update_interval is None:
            self._auto_stats_zero_copy()

    def auto_update(self, values: list[float], coef: float) -> None:
        """Fold one step's masses (``auto_terms`` read, in order; ``auto_host_masses``
        already merged) into the window statistics. Mass = squared L2 norm, clipped."""
        c2 = coef * coef
        for i, w in enumerate(self.m.zweights):
            w.sel_mass_sum += c2 * values[2 * i] / w.k
            if w.n_cols > w.k:
                w.nonsel_mass_acc += c2 * values[2 * i + 1] / (w.n_cols - w.k)

    def _auto_stats_zero_copy(self) -> None:
        """Per weight: selected mass per column (summed over the window's steps, averaged at
        the vote) and accumulated non-selected mass per column, from the whole (clipped)
        gradient: the CPU path's statistics, one read for all weights."""
        if not self.m.zweights:
            return
        dp = self.e.dp
        vals = []
        for w in self.m.zweights:
            s = column_scores(w.grad(), w.cd)
            # data parallel: the selected part is the same on every rank (rank 0 counts it),
            # the non-selected part is averaged on its owner only
            vals.append(s[w.sel_dev].sum() * float(dp.rank == 0 or not dp.enabled))
            vals.append(s[w.nonsel_dev].sum() * float(w.owned))
        vals = self.e.accel.read(vals)
        if dp.enabled:
            vals = dp.allreduce_sum(vals)
        self.auto_update(vals, 1.0)

    def ends_now(self, interval: int | None) -> bool:
        """Whether the window ends with this step: ``interval`` steps (S, or the early
        schedule's ramp), or with "auto" (None) the auto interval's vote."""
        if interval is not None:
            return self.window_len >= interval
        if self.window_len >= AUTO_INTERVAL_MAX or not self.m.zweights:
            return True
        votes = sum(
            1
            for w in self.m.zweights
            if w.n_cols == w.k or w.nonsel_mass_acc >= w.sel_mass_sum / self.window_len
        )
        return votes / len(self.m.zweights) >= self.m.auto_ratio

    def pending(self) -> dict:
        """What of the host's work the weights do not show yet: host updates (the one in
        flight and the open window's) and the steps whose non-selected gradients they
        hold."""
        job = self.inflight
        in_flight = 0 if job is None else job.submit_step - job.window_start + 1
        return {"host_updates": int(job is not None) + int(self.window_len > 0),
                "steps": in_flight + self.window_len}  # fmt: skip

    def check_worker(self) -> None:
        """Surface a failed host step or accumulation now (the step after it failed)."""
        if self.m.transport is not None:
            self.m.transport.accumulator.check()
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
        """``job``'s result into the device weights; its image copies may still run."""
        self.image_return.apply(job, t)
        self.last_applied = job

    def _window_tasks(self, n: int, images: dict | None,
                      corrections: dict) -> tuple[list[HostTask], object, list, set]:  # fmt: skip
        """The host step of the window just ended (n steps), what it must wait for, the
        events it sets once it has read each weight's window sum, and the set of weights
        (positions) whose result it has written (filled as it goes). ``images``: where it
        writes a bf16 image of each weight's result too (``ImageReturn.images_for``).

        Each weight's task is one contiguous kernel call over its compact host state (the
        non-selected columns: ``host_layout``) with the compact window sum as gradient; on a
        CPU device the sum is full shape where autograd wrote it, and the task gathers its
        non-selected columns first (on the worker, one weight at a time)."""
        slot = self.slot
        tasks = []
        frees: list[threading.Event] = []
        ready: set[int] = set()  # weights whose result this host step has written
        for w in self.m.zweights:
            w.sel_mass_sum = 0.0
            w.nonsel_mass_acc = 0.0
            if not w.owned:
                continue
            if w.n_nonsel == 0:  # every column on the device: nothing for the host
                w.fresh[slot] = True
                continue
            if self.m.zero_copy:
                tasks.append(self._zero_copy_task(w, slot, n))
                continue
            fresh = w.fresh[slot]
            w.fresh[slot] = True  # the next window starts by overwriting it, once free
            if fresh:  # no gradient reached this weight in the window: its sum is zero
                w.acc[slot].zero_()
            w.free = threading.Event()  # set by the worker once its host step read the sum
            frees.append(w.free)
            acc = self.m.transport.accumulator if self.m.transport is not None else None

            def after(w=w, free=w.free, acc=acc):
                ready.add(w.position)
                free.set()
                if acc is not None:  # the adds waiting for this sum may run now
                    acc.poke()

            image = None if images is None else images.get(w.position)
            tasks.append(HostTask(w.host, w.acc[slot].view(w.compact_shape()),
                                  self.window_coef / n, w.col_inner, image, after,
                                  correction=corrections.get(w.position)))  # fmt: skip
        if not self.m.zero_copy:  # backward's order: the next window's first pieces are the
            tasks.reverse()  # last layers', whose sums the worker then frees first
        before = None
        if self.m.transport is not None:
            fence = self.m.transport.accumulator.fence()
            acc_check = self.m.transport.accumulator.check
            # the copies that read the last applied job's result must be done before this
            # job writes it again (the GPU may run behind the host)
            pending_copies = list(self.last_applied.copies) if self.last_applied else []

            def before():
                fence.wait()
                acc_check()
                for ev in pending_copies:
                    ev.synchronize()

        return tasks, before, frees, ready

    @staticmethod
    def _zero_copy_task(w, slot: int, n: int) -> HostTask:
        """A CPU device's host task: the window's full-shape sum (autograd's) gathered into
        a compact temporary of its non-selected columns when the worker gets to it, then
        zeroed for the next window."""
        acc, cd, nonsel = w.acc[slot], w.cd, w.nonsel_host

        def grad():
            return acc.index_select(cd, nonsel)

        def after():
            acc.zero_()

        return HostTask(w.host, grad, 1.0 / n, w.col_inner, None, after)

    def host_step_lr(self, hp, n: int):
        """The lr and hyper-parameters of the host AdamW step of an ``n``-step window
        (zfctl.window_lr): "last", the last step's lr (DeepSpeed's); "sum", the sum of the
        window's lrs (a steady gradient moves as far as under n AdamW steps); "sqrt", that
        sum / sqrt(n) (a gradient dominated by noise moves as far as under n AdamW steps:
        the window's mean has 1/sqrt(n) of a step's noise, so Adam's normalised step is
        sqrt(n) larger), with decoupled weight decay scaled by sqrt(n) so that the window
        decays by the sum of its lrs, as n AdamW steps do."""
        mode = self.e.window_lr
        if mode == "last":
            return hp.lr, hp
        if mode == "sum":
            return self.window_lr_sum, hp
        root = math.sqrt(n)
        if hp.adamw_mode and hp.weight_decay:
            hp = dataclasses.replace(hp, weight_decay=hp.weight_decay * root)
        return self.window_lr_sum / root, hp

    def end(self, t: int, hp, sync: bool, corrections: dict | None = None) -> None:
        """End the window at step ``t``: its host step goes to the worker (``sync``: and
        its result to the device before this returns). ``corrections``: per weight
        position, the q8 store's last correction its kernel takes in (``Q8StepStore.flush``
        with ``fold``)."""
        e = self.e
        self.wait_inflight(t)  # at most one host step in flight: the previous one first
        n = self.window_len
        images = self.image_return.images_for(t)
        tasks, before, frees, ready = self._window_tasks(n, images, corrections or {})
        job = HostJob(window_start=self.window_start, submit_step=t, buffer_slot=self.slot,
                      meta={"ready": ready, "images": images})  # fmt: skip
        self.host_log.append(job)
        kernels = self.m.kernels
        lr, hp_host = self.host_step_lr(hp, n)

        def run():
            try:
                with e.host_cores.adam() as nt:  # the accumulator yields to it where it shares
                    run_host_tasks(tasks, kernels, lr, hp_host, nt, job, before)
            finally:  # a failed step must not leave the accumulator waiting forever
                for ev in frees:
                    ev.set()

        if self.worker is not None:
            self.worker.submit(job, run)
            self.inflight = job
        else:
            t0 = time.perf_counter()
            run()
            e.rec.stall_s += time.perf_counter() - t0
        if sync:
            self.wait_inflight(t) if self.worker is not None else self._apply(job, t)
        elif self.m.slots > 1:
            self.slot = 1 - self.slot
        e.rec.window_ended = n
        self.window_lengths.append(n)
        self.window_len = 0
        self.window_lr_sum = 0.0
        self.window_coef = 1.0
        self.window_start = t + 1

    def flush(self, t: int, hp) -> None:
        """Apply everything pending: the in-flight host step, then the partial window."""
        if self.window_len > 0:
            self.end(t, hp, sync=True)
        else:
            self.wait_inflight(t)

    def drain(self) -> None:
        """Wait for background work without applying it (checkpoints, close)."""
        if self.m.transport is not None:
            self.m.transport.accumulator.drain()
        if self.inflight is not None and self.inflight.future is not None:
            self.worker.wait(self.inflight)
