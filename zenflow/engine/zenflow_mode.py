"""The ZenFlow schedule (ZENFLOW.md section 2) on top of the accelerator layer.

Per ZenFlow weight W ([out, in] for nn.Linear, columns along ``cd``), k selected columns:

| where | what |
|---|---|
| device | W in the training dtype (the model's own tensor); its gradient only while backward |
|        | computes it: each gradient is routed as soon as it is final and freed |
| device | selected columns: the step's gradient (training dtype), fp32 master slice (bf16    |
|        | only: fp32 W is its own master), exp_avg, exp_avg_sq, int64 step count per column |
| host   | fp32 master, exp_avg, exp_avg_sq of the whole weight, step count per column       |
| host   | fp32 window sum of the non-selected columns, compact (2 slots with overlap)       |
| host   | pinned: staging for one step's pieces and the image of the non-selected columns   |
|        | in the training dtype (what goes back to the device), both compact                |

One step t (after warm-up): as backward produces W's gradient (``zenflow.engine.streaming``)
its selected columns are gathered into the device buffer and its non-selected columns go to
the host in pieces (``zenflow.engine.copies``: gathered into a device bucket, copied on the
copy engine, added into the fp32 window sum by the accumulator thread, scaled there by the
step's clipping coefficient once it is known); the gradient is then freed. The step's
norm, non-finite check and auto-interval masses come from the pieces as they pass (device
scalars, read once per step with the loss). Then the selected columns take an exact AdamW
step on the device (fp32 master slice, cast into W). On a CPU device without streaming the
gradient is instead summed where autograd wrote it, with no copy at all (ZENFLOW.md
section 7).

Whole-gradient steps: warm-up steps (a full host AdamW of every ZenFlow weight) and the
first selection (its column scores need the whole gradient) send the whole gradient to the
host instead, in contiguous chunks.

At the end of a window (every S steps, or the auto trigger) the host AdamW step of the
window's mean gradient runs on the worker, over the non-selected columns only, writing the
image of the updated columns in the same pass; with ``overlap_step`` it runs while the next
window trains and its result reaches W at the end of that next window (non-selected columns
lag by at most 2S steps; S without overlap). At most one host step is in flight: the
previous one is waited for and applied before the next is submitted, and the next waits
for the copies that read the previous one's image before it writes the image again.

Step counts: the device counts steps, the host counts windows; each column keeps its own
count and carries it across a hand-over with its moments, so bias correction stays right
(the native op takes per-column counts). A host step uses lr(t) of the window's last step
t and, per column, its host count + 1.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from zenflow.engine.accelerator import DONE
from zenflow.engine.baselines import host_full_step
from zenflow.engine.copies import (
    DeviceBuckets,
    bucket_count,
    bucket_elems_for,
    plan_chunks,
    plan_pieces,
)
from zenflow.engine.device_adam import adamw_columns_, adamw_fused_
from zenflow.engine.distributed import grad_norm, norms_of
from zenflow.engine.host import (
    ColumnSteps,
    HostJob,
    HostState,
    HostTask,
    HostWorker,
    StepGate,
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
from zenflow.engine.transport import Transport

AUTO_INTERVAL_MAX = 64  # bound of update_interval "auto" (window length 1..64)
_SET = threading.Event()  # "no host step reads this sum": an event that is always set
_SET.set()


@dataclass
class StepPlan:
    """How the current step routes gradients (made before its first gradient is routed)."""

    t: int
    whole: bool  # warm-up or first selection: whole gradients to the host
    score: bool  # a re-selection may follow this step: column scores of the gradient
    gate: StepGate
    slot: int
    # the in-flight host step whose result this step applies at its end (a window end with
    # overlap): its non-selected columns go back during this step's backward instead
    apply: HostJob | None = None


class ZfWeight:
    """Engine-owned state of one ZenFlow weight (never glued onto the Parameter)."""

    def __init__(self, spec: ParamSpec, k: int, mode: ZenFlowMode, master_init,
                 owner: int = 0, owned: bool = True):  # fmt: skip
        accel = mode.e.accel
        p = spec.param
        self.spec = spec
        self.cd = spec.column_dim
        self.n_cols = spec.n_cols
        self.k = k
        self.rows = p.numel() // self.n_cols
        self.n_nonsel = self.n_cols - k
        self.compact_numel = self.rows * self.n_nonsel
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
        # the step's gradient of the selected columns (compact, training dtype)
        self.grad_sel = None
        if not mode.zero_copy:
            self.grad_sel = accel.zeros(shape_k, p.dtype, "grads")
        self.pieces = []
        if not mode.zero_copy:
            self.pieces = plan_pieces(tuple(p.shape), self.cd, self.n_nonsel, mode.bucket_elems)
        self.chunks = plan_chunks(p.numel(), mode.bucket_elems)
        self.host: HostState | None = None
        self.acc: list[torch.Tensor] = []  # window sums: compact flat (full shape zero-copy)
        self.fresh: list[bool] = []  # a slot's next add overwrites it (window start)
        self.image: torch.Tensor | None = None  # compact flat, training dtype
        self.step_buf: torch.Tensor | None = None  # a step's micro-batch sum (host gas)
        # per step: device scalars of this weight's streamed gradient
        self.sq_ns: torch.Tensor | None = None  # squared norm of the non-selected part
        self.scores_ns: torch.Tensor | None = None  # column scores of the non-selected part
        self.scores_full: torch.Tensor | None = None  # first selection: all columns (host)
        self.norm_whole: torch.Tensor | None = None  # whole-gradient step: its norm
        self.contrib = 0  # gradients routed this step
        self.stat_done = False  # host gas: the step sum's squares were totalled in-line
        self.sel_reduced = False  # data parallel: the selected gradient's all-reduce started
        self.scores_sel: torch.Tensor | None = None  # column scores of the selected part
        self.position = 0  # index among the mode's weights
        # auto update interval statistics of the current window (python floats)
        self.sel_mass_sum = 0.0  # sum over steps of (selected mass / k)
        self.nonsel_mass_acc = 0.0  # sum over steps of (non-selected mass / (n - k))
        # Set once no host step reads this weight's window sum: with overlap the next
        # window's first piece of this weight waits for it (one window sum, not two). A new
        # event per host step, taken by each add when it is queued: an add queued before
        # the host step was made never waits for that step.
        self.free = _SET
        self.sums = self.link = self.stage = None
        if not owned:
            return
        pin, dtype = mode.e.pin_link, mode.e.dtype
        master = accel.host_empty(p.shape, torch.float32, False, "host_state")
        master.copy_(master_init)  # the initial fp32 weights: not a step, not counted
        self.host = HostState(
            master,
            accel.host_zeros(p.shape, torch.float32, False, "host_state"),
            accel.host_zeros(p.shape, torch.float32, False, "host_state"),
            ColumnSteps.zeros(self.n_cols, "cpu"),
        )
        if mode.zero_copy:  # summed where autograd writes (host memory already)
            self.acc = [accel.zeros(p.shape, torch.float32, "optimizer")
                        for _ in range(mode.slots)]  # fmt: skip
        else:
            n = self.compact_numel
            # fp32 window sum (and with micro-batches summed on the host, the step's sum
            # right after it: one buffer, so a whole-gradient step can land in both)
            sums = accel.host_empty((2 * n if mode.host_gas else n,), torch.float32, False,
                                    "window_sums")  # fmt: skip
            self.acc = [sums[:n]]
            if mode.host_gas:
                self.step_buf = sums[n:]
            self.sums = sums
            # pinned, in the training dtype: the image of the updated columns (host->device)
            # and the staging of a step's pieces (device->host), one buffer
            self.link = accel.host_empty((2 * n,), dtype, pin, "link")
            self.image = self.link[:n]
            self.stage = self.link[n:]
        self.fresh = [True] * mode.slots

    def set_selection(self, sel_dev: torch.Tensor) -> None:
        self.sel_dev = sel_dev
        self.sel_host = sel_dev.cpu()
        self.nonsel_dev = complement(sel_dev, self.n_cols)
        self.nonsel_host = self.nonsel_dev.cpu()

    def compact_shape(self) -> tuple[int, ...]:
        shape = list(self.spec.param.shape)
        shape[self.cd] = self.n_nonsel
        return tuple(shape)

    def grad(self) -> torch.Tensor:
        g = self.spec.param.grad
        if g is None:  # unused this step: a zero gradient (keeps the schedule uniform)
            return torch.zeros_like(self.spec.param)
        return g.detach()

    def pack_image(self) -> None:
        """Host: the non-selected columns of the master in the training dtype, compact (an
        fp32 weight's image; a bf16 image is written by the Adam pass itself)."""
        cols = self.host.master.index_select(self.cd, self.nonsel_host)
        self.image.view(self.compact_shape()).copy_(cols)


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
        self.slots = 1  # one window sum: the next window's first write waits (ZfWeight.free)
        self.streaming = engine.stream_grads
        # A CPU device without streaming sums the gradient where autograd writes it.
        self.zero_copy = accel.shared_memory and not self.streaming
        if self.zero_copy and self.overlap:  # the CPU path keeps two full-shape sums
            self.slots = 2
        gas = engine.gas
        self.host_gas = gas > 1 and engine.grad_accumulation == "host" and not self.zero_copy
        self.zweights: list[ZfWeight] = []
        zspecs = [s for s in engine.specs if s.is_zenflow]
        self.bucket_elems = bucket_elems_for(
            [s.param.numel() for s in zspecs] or [1], [max(s.param.shape) for s in zspecs],
            engine.bucket_request,
        )  # fmt: skip
        dp = engine.dp
        owners = dp.owners([s.param.numel() for s in zspecs]) if dp.enabled else [0] * len(zspecs)
        for s, owner in zip(zspecs, owners, strict=True):
            owned = not dp.enabled or dp.owns(owner)
            self.zweights.append(
                ZfWeight(s, num_selected(s.n_cols, self.topk_ratio), self,
                         masters[s.name] if owned else None, owner, owned)
            )  # fmt: skip
        self._by_name = {w.spec.name: w for w in self.zweights}
        for i, w in enumerate(self.zweights):
            w.position = i
        self.kernels = engine.kernels()
        # fp32 scratch of the device update (bf16 models): the largest weight's selected
        # gradient, or 1/64 of all of them, whichever is more
        self._scratch = None
        if not self.zero_copy and engine.dtype != torch.float32 and self.zweights:
            shares = [w.rows * w.k for w in self.zweights]
            self._scratch = accel.empty((max(max(shares), sum(shares) // 64),), torch.float32,
                                        "grads")  # fmt: skip
        self.transport = None
        if not self.zero_copy and self.zweights:
            count = bucket_count(
                engine.copy_buckets,
                dp.enabled,
                sum(w.compact_numel for w in self.zweights),
                self.bucket_elems,
            )
            self.transport = Transport(engine, self.bucket_elems, count, self.kernels)
            self.staging = self.transport.staging(
                "pieces",
                views={(w.position, pi): pc.of(w.stage) for w in self.zweights if w.owned
                       for pi, pc in enumerate(w.pieces)},
            )  # fmt: skip
        # With overlap, the window-end step's backward brings the previous host step's
        # result back (``_apply_in_backward``): two device buckets of their own, so its
        # host->device copies run beside the backward's device->host ones
        self._h2d = None
        self._h2d_queue: deque = deque()  # (bucket index, bucket, copy event, weight, piece)
        self._applied_early: set[int] = set()  # weights the window end need not apply
        self.applied_in_backward = 0  # weights applied so, over the run (stats, tests)
        if self.transport is not None and self.overlap and not dp.enabled:
            self._h2d = DeviceBuckets(accel, self.bucket_elems, engine.dtype, 2)
        # the worker: always on a separate device (host work runs on the host's cores), and
        # on a CPU device only with overlap (else the training thread uses every core)
        self.worker = None
        if not accel.shared_memory or self.overlap:
            self.worker = HostWorker(accel.bind_thread)
        self.selected = False
        self.last_select_step = 0
        self.selections = 0  # first selection and re-selections so far (the doubling gap)
        self.selection_steps: list[int] = []  # this process's selections (not checkpointed)
        self.window_len = 0
        self.window_lr_sum = 0.0  # the lrs of the window's steps (zfctl.window_lr "sum")
        self.window_start = self.warmup_rounds + 1
        self.slot = 0
        self.inflight: HostJob | None = None
        self.last_applied: HostJob | None = None  # its image copies may still be running
        self.host_log: list[HostJob] = []
        self.window_lengths: list[int] = []
        self.max_staleness = 0
        self.plan: StepPlan | None = None
        self.first_touch: list[ZfWeight] = []  # weights whose slot this step made non-fresh
        self._landing: dict[str, torch.Tensor] = {}  # whole-gradient steps: host copies
        self._landing_events: list = []
        self._images: dict[str, torch.Tensor] = {}  # warm-up: bf16 results for the device
        self._whole_sq: dict[str, list] = {}  # data parallel: the owner's chunk squares

    # ------------------------------------------------------------------ resolved values
    def resolved(self) -> dict:
        zf = self.e.zf
        n = sum(w.spec.param.numel() for w in self.zweights)
        sel = sum(w.rows * w.k for w in self.zweights)
        if self.zero_copy:
            path = "summed where autograd writes it (CPU device: no copy)"
        else:
            path = (
                "streamed during backward: " if self.streaming else "at the optimizer step: "
            ) + (
                "selected columns kept on the device, the rest gathered in pieces, copied to "
                "pinned host staging and summed in fp32 by the host accumulator"
            )
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
            "select_schedule": self.e.select_schedule,
            "full_warm_up_rounds": self.warmup_rounds,
            "overlap_step": self.overlap,
            "auto_ratio": self.auto_ratio,
            "window_lr": self.e.window_lr,
            "grad_path": path,
            "bucket_elems": None if self.zero_copy else self.bucket_elems,
            "zenflow_weights": len(self.zweights),
            "zenflow_params": n,
            "selected_elements": sel,
            "always_important_params": len(self.e.dense),
        }

    # ------------------------------------------------------------------ routing
    def routes(self, spec) -> bool:
        return not self.zero_copy and spec.name in self._by_name

    def take_wait(self) -> float:
        return self.transport.take_wait() if self.transport is not None else 0.0

    def plan_step(self) -> None:
        """Decide how this step's gradients travel (before the first one is routed)."""
        if self.transport is not None:
            self.transport.accumulator.check()
        e = self.e
        t = e.global_step + 1
        whole = t <= self.warmup_rounds or not self.selected
        # A re-selection follows a window end once select_every steps have passed; with a
        # fixed interval the window end is known now, with "auto" it may end any step.
        due = self._reselect_due(t)
        ends = self.update_interval is None or self.window_len + 1 >= self.update_interval
        self.plan = StepPlan(t, whole, (not whole) and due and ends, StepGate(), self.slot)
        # A fixed window ends with this step: its end applies the in-flight host step, whose
        # columns can go back during the backward (auto windows end on a vote after it)
        if (self._h2d is not None and not whole and self.inflight is not None
                and self.update_interval is not None and ends):  # fmt: skip
            self.plan.apply = self.inflight
        self._applied_early = set()
        self.first_touch = []
        self._whole_sq = {}
        for w in self.zweights:
            w.contrib = 0
            w.stat_done = False
            w.sel_reduced = False
            w.sq_ns = None
            w.scores_ns = None
            w.scores_sel = None
            w.norm_whole = None

    def route(self, spec, g: torch.Tensor, n: int, last: bool) -> None:
        w = self._by_name[spec.name]
        if self.plan.whole:
            self._route_whole(w, g, n, last)
        else:
            self._route_split(w, g, n, last)
        w.contrib += 1

    def _route_split(self, w: ZfWeight, g: torch.Tensor, n: int, last: bool) -> None:
        """Selected columns into the device buffer, the rest in pieces to the host."""
        tr, plan, dp = self.transport, self.plan, self.e.dp
        if n == 0:
            torch.index_select(g, w.cd, w.sel_dev, out=w.grad_sel)
        else:
            w.grad_sel.add_(g.index_select(w.cd, w.sel_dev))
        if dp.enabled and last:
            work = dp.allreduce_async(w.grad_sel)
            tr.after_reduce(work, None, lambda w=w: w.grad_sel.mul_(1.0 / dp.world))
            w.sel_reduced = True
        stats_on_device = not self.host_gas
        # column scores: for a re-selection, and for the auto interval's masses (summed
        # per column first, as the whole gradient's scores would be)
        scoring = plan.score or self.update_interval is None
        overwrite_acc = w.owned and w.fresh[plan.slot]
        for pi, pc in enumerate(w.pieces):
            i, bucket = tr.take_bucket(pc.shape)
            src, dim, idx = pc.select(g, w.nonsel_dev)
            torch.index_select(src, dim, idx, out=bucket)

            def onward(w=w, pi=pi, pc=pc, i=i, bucket=bucket):
                if dp.enabled and w.owned:
                    bucket.mul_(1.0 / dp.world)
                if stats_on_device and w.owned:
                    sq = grad_norm(bucket).square()
                    w.sq_ns = sq if w.sq_ns is None else w.sq_ns + sq
                    if scoring:
                        self._score_piece(w, pc, bucket)
                if not w.owned:
                    tr.buckets.mark(i, self.e.accel.record_compute())
                    return
                if self.host_gas:
                    stat = None
                    if last:
                        stat = ("sq", w.spec.name)
                        w.stat_done = True
                    tr.send_piece(i, bucket, self.staging, (w.position, pi),
                                  pc.of(w.step_buf), None, n == 0, stat)  # fmt: skip
                else:
                    tr.send_piece(i, bucket, self.staging, (w.position, pi),
                                  pc.of(w.acc[plan.slot]), plan.gate, overwrite_acc,
                                  wait=w.free if overwrite_acc else None)  # fmt: skip

            if dp.enabled:
                tr.after_reduce(dp.reduce_async(bucket, w.owner), i, onward)
            else:
                onward()
        if overwrite_acc and not self.host_gas:
            w.fresh[plan.slot] = False
            self.first_touch.append(w)
        if last and plan.apply is not None:
            self._apply_in_backward(w, plan.apply)

    def _apply_in_backward(self, w: ZfWeight, job: HostJob) -> None:
        """The window-end step applies ``job`` at its end; its columns of ``w`` go back now,
        in ``w``'s backward hook (the last micro-batch's: no later forward reads ``w``
        before the step ends), when the worker has written ``w``'s image already. Each
        piece's host->device copy runs while backward goes on; its scatter into the weight
        waits one piece (``_finish_h2d``), so the device never waits for the copy it just
        queued. Values and order are the end-of-step apply's (``_apply`` skips ``w``): no
        reader of ``w``'s non-selected columns comes between, the selected columns' update
        touches other columns, and every scatter is done before the step's device update
        (``collect``). A skipped step keeps what it applied: the same values are applied
        again at the window's real end."""
        if w.position not in job.meta.get("ready", ()) or not w.owned:
            return
        t0 = time.perf_counter()
        for pc in w.pieces:
            if len(self._h2d_queue) >= 2:
                self._finish_h2d()
            i, bucket = self._h2d.take(pc.shape)
            ev = self.e.accel.copy_h2d(bucket, pc.of(w.image))
            job.copies.append(ev)
            self._h2d_queue.append((i, bucket, ev, w, pc))
        self._applied_early.add(w.position)
        self.applied_in_backward += 1
        self.transport.wait_s += time.perf_counter() - t0  # a wait here stalls backward

    def _finish_h2d(self) -> None:
        """Scatter the oldest piece copied back in the backward into its weight."""
        i, bucket, ev, w, pc = self._h2d_queue.popleft()
        accel = self.e.accel
        accel.compute_wait(ev)
        dst, dim, idx = pc.select(w.spec.param.data, w.nonsel_dev)
        dst.index_copy_(dim, idx, bucket)
        self._h2d.mark(i, accel.record_compute())

    def _score_piece(self, w: ZfWeight, pc, bucket: torch.Tensor) -> None:
        """Column scores (squared L2 per column) of a non-selected piece, on the device."""
        if w.scores_ns is None:
            w.scores_ns = torch.zeros(w.n_nonsel, dtype=torch.float32, device=bucket.device)
        sq = bucket.float().square()
        if pc.by_rows:  # rows lo:hi of every non-selected column
            w.scores_ns.add_(sq.sum(dim=0))
        else:  # non-selected columns lo:hi, whole
            w.scores_ns[pc.lo : pc.hi].add_(sq.sum(dim=1))

    def _route_whole(self, w: ZfWeight, g: torch.Tensor, n: int, last: bool) -> None:
        """The whole gradient to its owner's host (warm-up, first selection), through the
        buckets: into a landing buffer, or summed in fp32 there (micro-batches on the host)."""
        tr, dp, name = self.transport, self.e.dp, w.spec.name
        if not dp.enabled and not self.host_gas:
            w.norm_whole = grad_norm(g)
        land = self._landing_of(w) if w.owned else None
        sq_out = None
        if dp.enabled and not self.host_gas:
            sq_out = self._whole_sq.setdefault(name, [])
        if self.host_gas:
            staging = self._whole_staging(w) if w.owned else None
            if last:
                w.stat_done = True
            tr.send_whole(g, w.chunks, w.owner, sums=land, staging=staging, first=n == 0,
                          stat=("sq", name) if last else None)  # fmt: skip
        else:
            tr.send_whole(g, w.chunks, w.owner, landing=land, sq_out=sq_out,
                          events=self._landing_events)  # fmt: skip

    def _landing_of(self, w: ZfWeight) -> torch.Tensor:
        """Where a whole gradient of ``w`` lands on the host (flat, every element): on the
        weight's own buffers, which no step uses before the first selection (bf16: the
        window sum viewed as bf16; fp32: the link buffer; micro-batch sums: the fp32 sums),
        when they are large enough (at most half the columns selected); else a buffer of
        its own, freed after the first selection."""
        name = w.spec.name
        if name not in self._landing:
            numel = w.spec.param.numel()
            if self.host_gas:
                room = w.sums
            elif self.e.dtype == torch.bfloat16:
                room = w.acc[0].view(torch.bfloat16)
            else:
                room = w.link
            if room.numel() >= numel:
                self._landing[name] = room[:numel]
            else:
                dtype = torch.float32 if self.host_gas else self.e.dtype
                self._landing[name] = self.e.accel.host_empty((numel,), dtype, False, "landing")
        return self._landing[name]

    def _whole_staging(self, w: ZfWeight):
        """Micro-batches summed on the host, whole-gradient steps: pinned staging per chunk,
        on the weight's link buffer when it is large enough."""
        numel = w.spec.param.numel()
        views = None
        if w.link.numel() >= numel:
            views = {c: w.link[c[0] : c[1]] for c in w.chunks}
        return self.transport.staging(f"whole:{w.spec.name}", {c: (c[1] - c[0],)
                                      for c in w.chunks}, tag="landing",
                                      views=views)  # fmt: skip

    # ------------------------------------------------------------------ the step's figures
    def collect(self) -> None:
        """After the last gradient of the step was routed: finish the reductions in flight
        and make sure every weight has a (possibly zero) selected gradient."""
        if self.transport is not None:
            self.transport.complete()
        t0 = time.perf_counter()
        while self._h2d_queue:  # the columns applied in the backward, before any update
            self._finish_h2d()
        self.e.rec.stall_s += time.perf_counter() - t0
        if self.zero_copy or self.plan is None:
            return
        if self.plan.whole:
            return
        for w in self.zweights:
            if w.contrib == 0:
                w.grad_sel.zero_()  # unused this step: a zero gradient
        if self.e.dp.enabled:
            # weights whose hook never saw a last micro-batch (unused in one, or in all):
            # their selected gradients are averaged here, in weight order on every rank
            late = [w.grad_sel for w in self.zweights if not w.sel_reduced]
            if late:
                self.e.dp.allreduce_mean_(late)

    def norm_terms(self) -> list[torch.Tensor]:
        """fp32 device tensors whose squares sum to this rank's share of the squared global
        norm (per-tensor norms where a tensor exists, else square roots of partial sums)."""
        if self.zero_copy or self.plan is None:
            return []
        dp = self.e.dp
        lead = not dp.enabled or dp.rank == 0
        terms = []
        for w in self.zweights:
            if self.plan.whole:
                if w.norm_whole is not None:
                    terms.append(w.norm_whole)
                elif self._whole_sq.get(w.spec.name):
                    terms.append(torch.stack(self._whole_sq[w.spec.name]).sum().sqrt())
                continue
            if lead:
                terms.append(grad_norm(w.grad_sel))
            if w.sq_ns is not None:
                terms.append(w.sq_ns.sqrt())
        return terms

    def host_sq(self) -> float:
        """The squared norm summed on the host (micro-batches summed there): waits for the
        accumulator to finish the step's pieces."""
        if not self.host_gas or self.plan is None or self.transport is None:
            return 0.0
        buffers = {}  # weights whose sums were not totalled in-line
        for w in self.zweights:
            if w.owned and w.contrib and not w.stat_done:
                buf = self._landing.get(w.spec.name) if self.plan.whole else w.step_buf
                buffers[w.spec.name] = buf
        t0 = time.perf_counter()
        out = self.transport.accumulator.squares(buffers)
        self.e.rec.stall_s += time.perf_counter() - t0
        return out

    def auto_terms(self) -> list[torch.Tensor]:
        """Per weight: selected and non-selected squared masses of the step (device scalars,
        unclipped; ``auto_update`` scales them by the coefficient squared)."""
        if self.update_interval is not None or self.zero_copy or self.plan is None:
            return []
        if self.plan.whole or not self.zweights:
            return []
        dp = self.e.dp
        lead = not dp.enabled or dp.rank == 0
        zero = torch.zeros((), dtype=torch.float32, device=self.e.device)
        out = []
        for w in self.zweights:
            out.append(column_scores(w.grad_sel, w.cd).sum() if lead else zero)
            if self.host_gas or not w.owned:
                out.append(zero)  # host gas: from the host sums (see auto_host_masses)
            elif w.scores_ns is not None:
                out.append(w.scores_ns.sum())
            else:
                out.append(w.sq_ns if w.sq_ns is not None else zero)
        return out

    def auto_host_masses(self) -> list[float]:
        """Host gas: the non-selected masses per weight from the step sums (waited for)."""
        if not self.host_gas or self.update_interval is not None or self.plan is None:
            return []
        if self.plan.whole:
            return []
        acc = self.transport.accumulator
        out: list[float] = []
        for w in self.zweights:
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

    def skip_step(self) -> None:
        """The step is skipped (non-finite): its pieces are dropped by the gate; slots this
        step would have started stay fresh; whole-gradient copies are discarded."""
        for w in self.first_touch:
            w.fresh[self.plan.slot] = True
        self._applied_early = set()  # applied again, with the same values, at the real end
        self._drop_landing()

    def _wait_landing(self) -> None:
        t0 = time.perf_counter()
        for ev in self._landing_events:
            ev.synchronize()
        self._landing_events = []
        if self.host_gas and self.transport is not None:
            self.transport.accumulator.drain()
        self.e.rec.stall_s += time.perf_counter() - t0

    def _drop_landing(self) -> None:
        self._wait_landing()
        if self.host_gas and self.transport is not None:
            for w in self.zweights:
                self.transport.drop_staging(f"whole:{w.spec.name}")

    # ------------------------------------------------------------------ the step
    def step(self, t: int, hp, coef: float, coef_t) -> None:
        e = self.e
        if t <= self.warmup_rounds:
            self._warmup_step(hp, coef)
            self.window_start = t + 1
            return
        if self.zero_copy:
            if not self.selected:
                self._select(t, [column_scores(w.grad(), w.cd) for w in self.zweights])
        elif self.plan.whole:  # the first selection, from the whole gradient on the host
            self._first_selection(t, coef)
        else:
            self._fold_step_sums()
            if self.plan.score:  # before the clipping scales the selected gradient
                for w in self.zweights:
                    w.scores_sel = column_scores(w.grad_sel, w.cd)
        t0 = time.perf_counter()
        self._device_update(hp, coef_t)
        e.dense_update(hp)
        e.rec.devopt_s += time.perf_counter() - t0
        if self.zero_copy:
            for w in self.zweights:
                if w.owned:
                    w.acc[self.slot].add_(w.grad())
            if self.update_interval is None:
                self._auto_stats_zero_copy()
        self.window_len += 1
        self.window_lr_sum += hp.lr
        if self._window_ends():
            reselect = self._reselect_due(t)
            scores = self._reselect_scores() if reselect else None
            self._end_window(t, hp, sync=reselect or not self.overlap)
            if reselect:
                self._select(t, scores)

    def select_gap(self) -> int:
        """Steps from the last selection to the next re-selection (taken at the first window
        end at or after it). zfctl.select_schedule "fixed": the select interval. "doubling":
        S after the first selection, then 2S, 4S, ... (S the update_interval, 1 with
        "auto"), never more than the select interval."""
        if self.e.select_schedule != "doubling":
            return self.select_every
        base = self.update_interval or 1
        doublings = max(0, self.selections - 1)
        if doublings >= 62 or base << doublings >= self.select_every:
            return self.select_every
        return base << doublings

    def _reselect_due(self, t: int) -> bool:
        return t - self.last_select_step >= self.select_gap()

    def _device_update(self, hp, coef_t) -> None:
        """AdamW of every weight's selected columns on the device: fused calls over batches
        of weights with the same step count (one batch unless columns were handed over with
        other counts). A bf16 model's selected gradients are widened to fp32 batch by batch
        into one accounted scratch buffer (about 1/64 of the selected elements), so the
        optimizer step never holds an fp32 copy of all of them at once."""
        groups: dict[int, list[ZfWeight]] = {}
        for w in self.zweights:
            if not self.zero_copy and coef_t is not None:
                w.grad_sel.mul_(coef_t)  # fp32 coefficient, rounded once
            w.steps_dev.increment()
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
        p = w.spec.param.data
        p.index_copy_(w.cd, w.sel_dev, x if w.master_sel is None else x.to(p.dtype))

    def _sel_grad_fp32(self, w: ZfWeight, offset: int = 0) -> torch.Tensor:
        """The selected gradient in fp32: the whole gradient's columns (CPU zero-copy), the
        buffer itself (an fp32 model), or widened into the scratch at ``offset``."""
        if self.zero_copy:
            return w.grad().index_select(w.cd, w.sel_dev).float()
        if w.grad_sel.dtype == torch.float32:
            return w.grad_sel
        n = w.rows * w.k
        out = self._scratch[offset : offset + n].view(w.shape_k)
        out.copy_(w.grad_sel)
        return out

    def _fused_batch(self, batch: list[ZfWeight], step: int, hp) -> None:
        xs, gs, off = [], [], 0
        for w in batch:
            xs.append(self._sel_param(w))
            gs.append(self._sel_grad_fp32(w, off))
            off += w.rows * w.k
        adamw_fused_(xs, gs, [w.exp_avg_dev for w in batch], [w.exp_avg_sq_dev for w in batch],
                     step, hp, fused=self.e.fused_device_adam)  # fmt: skip
        for w, x in zip(batch, xs, strict=True):
            self._write_sel(w, x)

    def auto_update(self, values: list[float], coef: float) -> None:
        """Fold one step's masses (``auto_terms`` read, in order; ``auto_host_masses``
        already merged) into the window statistics. Mass = squared L2 norm, clipped."""
        c2 = coef * coef
        for i, w in enumerate(self.zweights):
            w.sel_mass_sum += c2 * values[2 * i] / w.k
            if w.n_cols > w.k:
                w.nonsel_mass_acc += c2 * values[2 * i + 1] / (w.n_cols - w.k)

    def _auto_stats_zero_copy(self) -> None:
        """Per weight: selected mass per column (summed over the window's steps, averaged at
        the vote) and accumulated non-selected mass per column, from the whole (clipped)
        gradient: the CPU path's statistics, one read for all weights."""
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
        vals = self.e.accel.read(vals)
        if dp.enabled:
            vals = dp.allreduce_sum(vals)
        self.auto_update(vals, 1.0)

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
        if not self.selected or t <= self.warmup_rounds:  # every rank needs all of it
            dp.allreduce_mean_(grads)
            return norms_of(grads) if dp.rank == 0 else []
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
        return (norms_of(shared + sel) if dp.rank == 0 else []) + norms_of(mine)

    # ------------------------------------------------------------------ host steps
    def check_worker(self) -> None:
        """Surface a failed host step or accumulation now (the step after it failed)."""
        if self.transport is not None:
            self.transport.accumulator.check()
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
        early, self._applied_early = self._applied_early, set()
        for w in self.zweights:
            p = w.spec.param.data
            if w.position in early:  # went back during this step's backward
                continue
            if not self.zero_copy:
                for pc in w.pieces:
                    i, bucket = self.transport.take_bucket(pc.shape)
                    if w.owned:
                        ev = e.accel.copy_h2d(bucket, pc.of(w.image))
                        job.copies.append(ev)
                        e.accel.compute_wait(ev)
                    if dp.enabled:  # the owner's result to every rank's device
                        dp.broadcast_(bucket, w.owner)
                    dst, dim, idx = pc.select(p, w.nonsel_dev)
                    dst.index_copy_(dim, idx, bucket)
                    self.transport.buckets.mark(i, e.accel.record_compute())
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
        self.last_applied = job
        # Staleness: the oldest gradient in this update is from job.window_start; the device
        # sees it at the end of step t. With overlap t is the end of the NEXT window, so
        # non-selected columns lag by at most 2S steps (S without overlap).
        self.max_staleness = max(self.max_staleness, t - job.window_start + 1)
        e.rec.host_update = True
        e.rec.stall_s += time.perf_counter() - t0

    def _window_tasks(self, n: int) -> tuple[list[HostTask], object, list, set]:
        """The host step of the window just ended (n steps), what it must wait for, the
        events it sets once it has read each weight's window sum, and the set of weights
        (positions) whose image it has written (filled as it goes)."""
        slot = self.slot
        tasks = []
        frees: list[threading.Event] = []
        ready: set[int] = set()  # weights whose image this host step has written
        bf16_image = self.e.dtype == torch.bfloat16
        for w in self.zweights:
            w.sel_mass_sum = 0.0
            w.nonsel_mass_acc = 0.0
            if not w.owned:
                continue
            if self.zero_copy:
                acc = w.acc[slot]

                def after(acc=acc):
                    acc.zero_()

                # Selected columns of master/moments are updated too (one flat pass is
                # faster than gather/scatter) but never observed: they reach the device only
                # by index (non-selected columns) and a column leaving the device overwrites
                # its master, moments and count at the hand-over.
                acc.index_fill_(w.cd, w.sel_dev, 0.0)
                tasks.append(HostTask(w.host, acc, 1.0 / n, w.col_inner, None, after))
                continue
            fresh = w.fresh[slot]
            w.fresh[slot] = True  # the next window starts by overwriting it, once free
            if fresh:  # no gradient reached this weight in the window: its sum is zero
                w.acc[slot].zero_()
            w.free = threading.Event()  # set by the worker once its host step read the sum
            frees.append(w.free)

            def after(w=w, pack=not bf16_image, free=w.free):
                if pack:
                    w.pack_image()
                ready.add(w.position)
                free.set()

            tasks.append(HostTask(
                w.host, w.acc[slot], 1.0 / n, w.col_inner,
                w.image if bf16_image else None, after,
                index=w.nonsel_host, column_dim=w.cd,
            ))  # fmt: skip
        if not self.zero_copy:  # backward's order: the next window's first pieces are the
            tasks.reverse()  # last layers', whose sums the worker then frees first
        before = None
        if self.transport is not None:
            fence = self.transport.accumulator.fence()
            acc_check = self.transport.accumulator.check
            # the copies that read the last applied job's images must be done before this
            # job writes the images again (the GPU may run behind the host)
            pending_copies = list(self.last_applied.copies) if self.last_applied else []

            def before():
                fence.wait()
                acc_check()
                for ev in pending_copies:
                    ev.synchronize()

        return tasks, before, frees, ready

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

    def _end_window(self, t: int, hp, sync: bool) -> None:
        e = self.e
        self.wait_inflight(t)  # at most one host step in flight: the previous one first
        n = self.window_len
        tasks, before, frees, ready = self._window_tasks(n)
        job = HostJob(window_start=self.window_start, submit_step=t, buffer_slot=self.slot,
                      meta={"ready": ready})  # fmt: skip
        self.host_log.append(job)
        kernels = self.kernels
        nt = e.host_threads
        lr, hp_host = self.host_step_lr(hp, n)

        def run():
            try:
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
        elif self.slots > 1:
            self.slot = 1 - self.slot
        e.rec.window_ended = n
        self.window_lengths.append(n)
        self.window_len = 0
        self.window_lr_sum = 0.0
        self.window_start = t + 1

    def flush(self, t: int, hp) -> None:
        """Apply everything pending: the in-flight host step, then the partial window."""
        if self.window_len > 0:
            self._end_window(t, hp, sync=True)
        else:
            self.wait_inflight(t)

    def drain(self) -> None:
        """Wait for background work without applying it (checkpoints, close)."""
        if self.transport is not None:
            self.transport.accumulator.drain()
        if self.inflight is not None and self.inflight.future is not None:
            self.worker.wait(self.inflight)

    # ------------------------------------------------------------------ warm-up
    def _warmup_step(self, hp, coef: float) -> None:
        """Full synchronous update: ZenFlow weights by the host AdamW, the rest on device."""
        e = self.e
        e.rec.warmup = True
        t0 = time.perf_counter()
        e.dense_update(hp)
        e.rec.devopt_s += time.perf_counter() - t0
        # device counts start when a column is selected: it carries the host's count
        owned = [w for w in self.zweights if w.owned]
        if self.zero_copy:
            items = [(w.spec.param, w.host, w.col_inner, w.grad(), None) for w in owned]
            host_full_step(e, items, hp, 1.0, in_place=True)
        else:
            self._wait_landing()
            items = [(w.spec.param, w.host, w.col_inner, self._landing_grad(w),
                      self._warmup_image(w)) for w in owned]  # fmt: skip
            host_full_step(e, items, hp, coef)
        if e.dp.enabled:  # each owner's updated weights to every rank
            for w in self.zweights:
                e.dp.broadcast_(w.spec.param.data, w.owner)

    def _landing_grad(self, w: ZfWeight) -> torch.Tensor:
        land = self._landing.get(w.spec.name)
        if land is None:  # no gradient this step
            return torch.zeros(w.spec.param.shape, dtype=torch.float32)
        return land.view(w.spec.param.shape)

    def _warmup_image(self, w: ZfWeight) -> torch.Tensor | None:
        """Where a bf16 weight's warm-up result is written for the device: the weight's
        link buffer when it is large enough (a bf16 whole gradient lands on the window sum,
        never on the link: ``_landing_of``), else its own buffer."""
        p = w.spec.param
        if p.dtype != torch.bfloat16:
            return None
        if w.link.numel() >= p.numel():
            return w.link[: p.numel()].view(p.shape)
        if w.spec.name not in self._images:
            self._images[w.spec.name] = self.e.accel.host_empty(p.shape, p.dtype, False,
                                                                "landing")  # fmt: skip
        return self._images[w.spec.name]

    def _release_landing(self) -> None:
        """Landing buffers live while whole-gradient steps remain (warm-up, the first
        selection), then go back to the allocator (the ones of their own)."""
        if self.selected:
            self._landing.clear()
            self._images.clear()
            if self.transport is not None:
                for w in self.zweights:
                    self.transport.drop_staging(f"whole:{w.spec.name}")

    # ------------------------------------------------------------------ selection
    def _fold_step_sums(self) -> None:
        """Host gas: each weight's step sum (its micro-batches) into the window sum, scaled
        by the step's coefficient (queued after the gate is set)."""
        if not self.host_gas:
            return
        acc, slot = self.transport.accumulator, self.plan.slot
        for w in self.zweights:
            if w.owned and w.contrib:
                acc.add(DONE, w.step_buf, w.acc[slot], self.plan.gate, w.fresh[slot], None,
                        wait=w.free if w.fresh[slot] else None)  # fmt: skip
                if w.fresh[slot]:
                    w.fresh[slot] = False
                    self.first_touch.append(w)

    def _first_selection(self, t: int, coef: float) -> None:
        """The first selection, from the whole gradient on its owner's host: score, select,
        hand over; then the selected columns' gradient goes to the device buffer and the
        rest into the window sum, as a streamed step would have left them."""
        e, dp = self.e, self.e.dp
        self._wait_landing()
        scores, host_scores = [], []
        for w in self.zweights:
            if w.owned:
                g = self._landing_grad(w)
                host_scores.append(column_scores(g, w.cd))
                scores.append(host_scores[-1].to(e.device))
            else:
                scores.append(torch.zeros(w.n_cols, dtype=torch.float32, device=e.device))
        self._select(t, scores)  # data parallel: the scores are all-reduced in place
        if self.update_interval is None:  # the step's masses, from the same scores
            if dp.enabled:  # the averaged scores are on the device: one read
                masses = []
                for w, sc in zip(self.zweights, scores, strict=True):
                    masses += [sc[w.sel_dev].sum(), sc[w.nonsel_dev].sum()]
                self.auto_update(e.accel.read(masses), coef)
            else:  # the scores were computed on the host: no read
                masses = []
                for w, sc in zip(self.zweights, host_scores, strict=True):
                    masses += [float(sc[w.sel_host].sum()), float(sc[w.nonsel_host].sum())]
                self.auto_update(masses, coef)
        acc = self.transport.accumulator
        for w in self.zweights:
            if w.owned:
                g = self._landing_grad(w)
                sel = g.index_select(w.cd, w.sel_host).to(w.grad_sel.dtype)
                e.accel.compute_wait(e.accel.copy_h2d(w.grad_sel, sel))
                ns = self._compact_out(w, g)
                torch.index_select(g, w.cd, w.nonsel_host, out=ns.view(w.compact_shape()))
                acc.add(DONE, ns, w.acc[0], self.plan.gate, True, None)
                acc.drain()  # the window sum is written before the next weight's landing
                w.fresh[0] = False
            if dp.enabled:
                dp.broadcast_(w.grad_sel, w.owner)
        self._release_landing()

    def _compact_out(self, w: ZfWeight, g: torch.Tensor) -> torch.Tensor:
        """A flat buffer of N elements in ``g``'s dtype that overlaps neither ``g`` (the
        landing) nor the window sum: the compacted non-selected columns go there before
        they are scaled into the window sum."""
        n = w.compact_numel
        acc = w.acc[0]
        on_acc = g.untyped_storage().data_ptr() == acc.untyped_storage().data_ptr()
        if g.dtype == torch.float32 and not on_acc:
            return acc  # scaled in place afterwards
        link = w.link if g.dtype == w.link.dtype else w.link.view(g.dtype)
        if link.numel() >= n:
            return link[:n]
        return torch.empty(n, dtype=g.dtype)

    def _reselect_scores(self) -> list[torch.Tensor]:
        """Column scores of this step's whole gradient, per weight, on the device: the
        selected part from the device buffer, the non-selected part from the pieces (the
        device, as they passed) or from the step's sums (the host, micro-batches summed
        there). Data parallel: the owner's scores; the other ranks add zeros."""
        out = []
        e = self.e
        for w in self.zweights:
            if self.zero_copy:
                out.append(column_scores(w.grad(), w.cd))
                continue
            scores = torch.zeros(w.n_cols, dtype=torch.float32, device=e.device)
            if w.owned:
                scores[w.sel_dev] = w.scores_sel
                if self.host_gas:
                    self.transport.accumulator.drain()
                    compact = w.step_buf.view(w.compact_shape())
                    ns_scores = column_scores(compact, w.cd)
                    scores[w.nonsel_dev] = ns_scores.to(e.device)
                elif w.scores_ns is not None:
                    scores[w.nonsel_dev] = w.scores_ns
            out.append(scores)
        return out

    def _select(self, t: int, scores: list[torch.Tensor]) -> None:
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
        for w, s in zip(self.zweights, scores, strict=True):
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
            if self.transport is not None:
                self.transport.close()
                if err is None and self.transport.accumulator.error is not None:
                    err = self.transport.accumulator.error
        return err
