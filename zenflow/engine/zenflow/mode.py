"""``ZenFlowMode``: the ZenFlow schedule (ZENFLOW.md section 2) on top of the accelerator
layer, as a sequence of rooms with one job each.

Owns what every room shares (the engine, the settings, the weights, the copy pipeline, the
step's plan) and the order of a step: plan, route (``route``), then warm-up or the first
selection (``warmup``) or the step sums, the selected columns' AdamW (``device_step``), the
window's step and, at its end, the host step (``window``) whose result goes back through
``image_return``, and a re-selection (``handover``). Must not do a room's work itself: no
buffer is written here. The names the engine, checkpoints and tests read stay on the mode
(``_InRoom``: kept by the room that owns the value).
"""

from __future__ import annotations

import time

import torch

from zenflow.engine.accelerator.base import READ_BUFFER_BYTES
from zenflow.engine.copies import bucket_count, bucket_elems_for
from zenflow.engine.engine_setup import lent_cores
from zenflow.engine.host import StepGate
from zenflow.engine.selection import column_scores, num_selected
from zenflow.engine.transport import Transport
from zenflow.engine.zenflow.device_step import DeviceStep
from zenflow.engine.zenflow.early import EarlySchedule
from zenflow.engine.zenflow.handover import Handover
from zenflow.engine.zenflow.host_layout import full_state
from zenflow.engine.zenflow.image_return import ImageReturn
from zenflow.engine.zenflow.route import GradRoute
from zenflow.engine.zenflow.state import StepPlan, ZfWeight
from zenflow.engine.zenflow.step_q8 import Q8StepStore
from zenflow.engine.zenflow.warmup import Warmup
from zenflow.engine.zenflow.window import AUTO_INTERVAL_MAX, Window

READ_BUFFER_MIN = 1 << 20


class _InRoom:
    """An attribute of ``ZenFlowMode`` kept by one of its rooms (read and written there)."""

    def __init__(self, room: str):
        self.room = room

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, mode, owner=None):
        if mode is None:
            return self
        return getattr(getattr(mode, self.room), self.name)

    def __set__(self, mode, value) -> None:
        setattr(getattr(mode, self.room), self.name, value)


class ZenFlowMode:
    """Selective device AdamW + windowed host AdamW; see the module docstring."""

    # the schedule's counters and the host jobs (checkpoints save and restore them)
    window_len = _InRoom("window")
    window_lr_sum = _InRoom("window")
    window_coef = _InRoom("window")
    window_start = _InRoom("window")
    slot = _InRoom("window")
    inflight = _InRoom("window")
    last_applied = _InRoom("window")
    host_log = _InRoom("window")
    window_lengths = _InRoom("window")
    worker = _InRoom("window")
    selected = _InRoom("handover")
    last_select_step = _InRoom("handover")
    selections = _InRoom("handover")
    selection_steps = _InRoom("handover")
    applied_in_backward = _InRoom("image_return")
    max_staleness = _InRoom("image_return")

    def __init__(self, engine, masters: dict[str, torch.Tensor]):
        self.e = engine
        accel = engine.accel
        zf = engine.zf
        self.topk_ratio = float(zf.topk_ratio)
        self.overlap = bool(zf.overlap_step)
        self.warmup_rounds = int(zf.full_warm_up_rounds)
        self.auto_ratio = float(zf.auto_ratio)
        self.update_interval = None if zf.update_interval == "auto" else int(zf.update_interval)
        self.early = EarlySchedule(engine.early, self.update_interval, self.overlap,
                                   self.warmup_rounds)  # fmt: skip
        self.select_every = engine.select_every
        self.host_state = engine.host_state  # zfctl.host_state: "exact" or "compact"
        # what crosses the device->host link (pieces) and what the window sum is kept in:
        # the training dtype and fp32, or bf16 for both with the compact host state
        compact = self.host_state == "compact"
        self.link_dtype = torch.bfloat16 if compact else engine.dtype
        self.sum_dtype = torch.bfloat16 if compact else torch.float32
        self.slots = 1  # one window sum: the next window's first write waits (ZfWeight.free)
        self.streaming = engine.stream_grads
        # A CPU device without streaming sums the gradient where autograd writes it.
        self.zero_copy = accel.shared_memory and not self.streaming
        if self.zero_copy and self.overlap:  # the CPU path keeps two full-shape sums
            self.slots = 2
        gas = engine.gas
        self.host_gas = gas > 1 and engine.grad_accumulation == "host" and not self.zero_copy
        self.adds_on_arrival, self.store_free, self.store_q8 = self._store_paths(engine)
        # One rank, pieces held for the coefficient (the step store): the step's norm is each
        # whole gradient's, taken in its hook; else each piece takes its own (the averaged
        # pieces' with data parallelism, the per-piece non-finite check of adds on arrival)
        self.whole_norms = not (self.host_gas or self.adds_on_arrival or engine.dp.enabled)
        # The first selection in each weight's gradient hook (no whole gradient on the host):
        # streamed, no micro-batches summed on the host, no warm-up, one rank (several: the
        # averaged gradient's scores need the averaged gradient, which lands on its owner)
        self.hook_select = (self.streaming and not self.host_gas and self.warmup_rounds == 0
                            and not engine.dp.enabled and not self.zero_copy)  # fmt: skip
        zspecs = [s for s in engine.specs if s.is_zenflow]
        self.bucket_elems = bucket_elems_for(
            [s.param.numel() for s in zspecs] or [1], [max(s.param.shape) for s in zspecs],
            engine.bucket_request,
        )  # fmt: skip
        # device-to-host reads (checkpoints, hand-overs) go through one fp32 bucket's bytes
        # (at least 1 MiB: a small model's hand-over is one read; at most the 16 MiB the
        # estimate counts: a larger tensor is read in chunks)
        accel.read_buffer_bytes = min(max(4 * self.bucket_elems, READ_BUFFER_MIN),
                                      READ_BUFFER_BYTES)  # fmt: skip
        self.zweights = self._make_weights(zspecs, masters)
        self.by_name = {w.spec.name: w for w in self.zweights}
        self.kernels = engine.kernels()
        self.device_step = DeviceStep(self)
        self.transport = self._make_transport()
        self.q8_store = Q8StepStore(self) if self.store_q8 and self.transport else None
        self.plan: StepPlan | None = None
        # the rooms, each after the ones it uses
        self.handover = Handover(self)
        self.image_return = ImageReturn(self)
        self.grad_route = GradRoute(self, self.image_return, self.handover)
        self.window = Window(self, self.image_return)
        self.warmup = Warmup(self, self.grad_route, self.handover, self.window)

    def _store_paths(self, engine) -> tuple[bool, bool, bool]:
        """(pieces added as they arrive, through the ring; zfctl.step_store "off": unclipped,
        the window's host step clips, ``Window.add_step``; "q8": scaled by a prediction and
        corrected from an 8-bit copy, ``step_q8``). Neither with micro-batches summed on
        the host (their fp32 sum) nor on the CPU path (no pieces)."""
        store = engine.step_store
        arrives = store in ("off", "q8") and not self.host_gas and not self.zero_copy
        return arrives, arrives and store == "off", arrives and store == "q8"

    def _make_weights(self, zspecs: list, masters: dict[str, torch.Tensor]) -> list[ZfWeight]:
        """Every ZenFlow weight's state; data parallel: the host state on its owner only."""
        dp = self.e.dp
        owners = dp.owners([s.param.numel() for s in zspecs]) if dp.enabled else [0] * len(zspecs)
        weights = []
        accel = self.e.accel
        for s, owner in zip(zspecs, owners, strict=True):
            owned = not dp.enabled or dp.owns(owner)
            init = masters.pop(s.name, None)  # the tensor itself, held until the selection
            if init is not None and owned:
                accel.adopt_host(init, "masters")
            weights.append(
                ZfWeight(s, num_selected(s.n_cols, self.topk_ratio), self, init, owner, owned)
            )  # fmt: skip
            del init
        for i, w in enumerate(weights):
            w.position = i
            if w.owned and self.warmup_rounds > 0:  # warm-up updates every column
                w.host = full_state(w, accel)
                w.host_layout = "full"
        return weights

    def _make_transport(self) -> Transport | None:
        """The copy pipeline (device buckets, host accumulator); none on the CPU path."""
        if self.zero_copy or not self.zweights:
            return None
        engine = self.e
        count = bucket_count(
            engine.copy_buckets,
            engine.dp.enabled,
            sum(w.compact_numel for w in self.zweights),
            self.bucket_elems,
        )
        return Transport(engine, self.bucket_elems, count, self.kernels, self.link_dtype)

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
            "early": self.early.describe(),
            # "never" where the return sends the master anyway (fp32, CPU, data parallel)
            "return_image": self.image_return.image_setting,
            "auto_ratio": self.auto_ratio,
            "window_lr": self.e.window_lr,
            "host_state": self.host_state,
            # "off" / "q8": each piece added as it arrives (q8: corrected from an 8-bit
            # copy); "on": a step's pieces wait in the store for the step's coefficient
            # (None: no pieces, the CPU device)
            "step_store": None if self.zero_copy else self.e.step_store,
            # how the non-selected columns are clipped (None: no clipping): "step", each
            # step's by its own coefficient; "step-q8", the same within the 8-bit copy's
            # rounding of the coefficient's change; "window", each window's sum by its
            # steps' smallest (the store-free path)
            "host_clipping": self._host_clipping(),
            "grad_path": path,
            "bucket_elems": None if self.zero_copy else self.bucket_elems,
            "zenflow_weights": len(self.zweights),
            "zenflow_params": n,
            "selected_elements": sel,
            "always_important_params": len(self.e.dense),
        }

    def _host_clipping(self) -> str | None:
        if not self.e.clip:
            return None
        return "window" if self.store_free else "step-q8" if self.store_q8 else "step"

    # ------------------------------------------------------------------ routing
    def routes(self, spec) -> bool:
        return not self.zero_copy and spec.name in self.by_name

    def take_wait(self) -> float:
        return self.transport.take_wait() if self.transport is not None else 0.0

    def plan_step(self) -> None:
        """Decide how this step's gradients travel (before the first one is routed)."""
        if self.transport is not None:
            self.transport.accumulator.check()
        window = self.window
        t = self.e.global_step + 1
        selected = self.handover.selected
        whole = t <= self.warmup_rounds or (not selected and not self.hook_select)
        # A re-selection follows a window end once select_every steps have passed; with a
        # fixed interval the window end is known now, with "auto" it may end any step.
        due = self.handover.due(t)
        interval = self.early.interval(t)
        ends = interval is None or window.window_len + 1 >= interval
        poke = self.transport.accumulator.poke if self.transport is not None else None
        self.plan = StepPlan(t, whole, selected and not whole and due and ends, StepGate(poke),
                             window.slot, first=not whole and not selected)  # fmt: skip
        # A fixed window ends with this step: its end applies the in-flight host step, whose
        # columns can go back during the backward (auto windows end on a vote after it)
        if (self.image_return.in_backward and not whole and window.inflight is not None
                and interval is not None and ends):  # fmt: skip
            self.plan.apply = window.inflight
        self.image_return.applied_early = set()
        self.grad_route.start_step()
        if self.q8_store is not None:
            self.q8_store.start_step()
        for w in self.zweights:
            w.start_step()

    def route(self, spec, g: torch.Tensor, n: int, last: bool) -> None:
        self.grad_route.route(spec, g, n, last)

    # ------------------------------------------------------------------ the step's figures
    def collect(self) -> None:
        self.grad_route.collect()

    def norm_terms(self) -> list[torch.Tensor]:
        return self.grad_route.norm_terms()

    def host_sq(self) -> float:
        return self.grad_route.host_sq()

    def auto_terms(self) -> list[torch.Tensor]:
        return self.grad_route.auto_terms()

    def auto_host_masses(self) -> list[float]:
        return self.grad_route.auto_host_masses()

    def auto_update(self, values: list[float], coef: float) -> None:
        self.window.auto_update(values, coef)

    def sync_grads(self, dp) -> list[torch.Tensor]:
        return self.grad_route.sync_grads(dp)

    # ------------------------------------------------------------------ the step
    def step(self, t: int, hp, coef: float, coef_t) -> None:
        e = self.e
        if t <= self.warmup_rounds:
            self.warmup.warmup_step(hp, coef)
            self.window.window_start = t + 1
            return
        if self.zero_copy:
            if not self.handover.selected:  # the scores are host memory: top-k there
                scores = [column_scores(w.grad(), w.cd) for w in self.zweights]
                self.handover.select(t, scores, None if e.dp.enabled else scores)
        elif self.plan.whole:  # the first selection, from the whole gradient on the host
            with lent_cores(e):
                self.warmup.first_selection(t, coef)
        elif self.plan.first:  # the first selection, made in the hooks: the host side now
            self.handover.finish_first(t)
        else:
            self.grad_route.fold_step_sums()
            if self.plan.score:  # before the clipping scales the selected gradient
                for w in self.zweights:
                    w.scores_sel = column_scores(w.grad_sel, w.cd)
        t0 = time.perf_counter()
        self.device_step.update(hp, coef_t)
        e.dense_update(hp)
        e.rec.devopt_s += time.perf_counter() - t0
        if self.zero_copy:
            self.window.accumulate_zero_copy()
        # store-free: the pieces crossed unclipped; the window's host step clips them
        self.window.add_step(hp.lr, coef if self.store_free else 1.0)
        if self.window.ends_now(self.early.interval(t)):
            # the host step reads the window sums, and takes the q8 store's last
            # corrections in as it does (the exact state: ``Q8StepStore.flush``)
            folded = self._flush_corrections(fold=True)
            reselect = self.handover.due(t)
            scores = self.handover.scores() if reselect else None
            self.window.end(t, hp, sync=reselect or not self.early.overlap(t),
                            corrections=folded)  # fmt: skip
            del folded  # it names the copies (a re-selection drops them)
            if reselect:
                if self.q8_store is not None:  # made again for the new pieces
                    self.q8_store.release()
                self.handover.select(t, scores)

    def set_gate(self, coef: float, skipped: bool) -> None:
        """The step's clipping coefficient and skip decision are known: the gate its held
        adds wait on (store-free: 1.0, nothing reached the sum clipped; the window's host
        step clips it), and the q8 store's corrections."""
        if self.plan is None:
            return
        self.plan.gate.set(1.0 if self.store_free else coef, skipped)
        if self.q8_store is not None:
            self.q8_store.gate_set(coef, skipped)

    def skip_step(self) -> None:
        """The step is skipped (non-finite): its pieces are dropped by the gate; slots this
        step would have started stay fresh; whole-gradient copies are discarded."""
        self.image_return.applied_early = set()  # applied again, same values, at the real end
        self.grad_route.skip_step()
        if self.plan is not None and self.plan.first:
            self.handover.undo_first()

    def select_gap(self) -> int:
        return self.handover.gap()

    # ------------------------------------------------------------------ host steps
    def check_worker(self) -> None:
        self.window.check_worker()

    def flush(self, t: int, hp) -> None:
        self._flush_corrections()
        self.window.flush(t, hp)

    def drain(self) -> None:
        self._flush_corrections()  # a checkpoint saves the window sums
        self.window.drain()

    def _flush_corrections(self, fold: bool = False) -> dict:
        """The q8 store's corrections still waiting for a weight's next add, queued as
        passes of their own: the window sums are about to be read (``fold``: by a window's
        host step only, which takes the ones it can in itself: returned per weight)."""
        if self.q8_store is None:
            return {}
        return self.q8_store.flush(fold=fold)

    # ------------------------------------------------------------------ lifecycle
    def release_host(self) -> None:
        """Drop every weight's host state, window sums, step store (or its 8-bit copies) and
        set-up master, and the return's images (the engine is closed: nothing reads them
        again)."""
        for w in self.zweights:
            for name in ("host", "store", "step_buf", "init_master", "q8_plan"):
                if hasattr(w, name):
                    setattr(w, name, None)
            w.acc = []
            w.drop_views()
        self.image_return.images.clear()  # in place: the host log's jobs hold it

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
