"""ZenFlowEngine: the step schedule (ZENFLOW.md sections 2-5) wiring selection, device AdamW,
host state, the background worker, counted transfers and per-step stats.

Usage (``step()`` is ONE optimizer step; micro-batch accumulation with
``gradient_accumulation_steps`` is the caller's loop: it runs that many backward passes
with the loss divided by it, then calls ``step()`` once; the ZenFlow window
``update_interval`` counts optimizer steps and is independent of it)::

    engine = ZenFlowEngine(model, config, mode="zenflow", steps_per_epoch=len(loader))
    with engine.autocast():
        loss = model(**batch).loss
    loss.backward()
    stats = engine.step(loss)
    engine.zero_grad()

Schedule of one ZenFlow step t (after warm-up), per ZenFlow weight W with selected
columns ``sel`` and the rest ``nonsel``:

1. gradient norm over every trainable gradient; non-finite loss/gradient -> skip (no
   state changes); clip in place with the global coefficient when ``gradient_clipping``.
2. first step after warm-up: select ``sel`` from this step's column scores.
3. device AdamW on W[sel] (compact fp32 moments, integer counter) and on every
   always-important param.
4. accumulate G[nonsel] for the host: ``grad_accum="host"`` copies that slice to a host
   fp32 buffer every step (counted d2h); ``"device"`` adds the gradient into a device fp32
   buffer and gives the host the window's sum once per window (on a CPU device that buffer
   IS host memory: zero copies; on a GPU it trades one param-sized fp32 buffer of device
   memory per weight (two with overlap) for (S-1)/S of the d2h traffic).
5. window end (every S steps, or the auto trigger): with overlap, wait for the in-flight
   host step and copy its result into W[nonsel] first, then submit this window's host step
   to the worker (applied at the end of the NEXT window: non-selected columns lag by at
   most 2S steps, the bound the tests check by instrumentation); without overlap run it now
   and apply it now.
6. reselection due (only at a window end): drain everything synchronously, then hand the
   columns over by index (see :meth:`ZenFlowEngine._select`).

Step counters: ``step_dev`` per weight counts every optimizer step the weight took part in
(warm-up included) and is the bias-correction step of the device update; the host counter
``HostState.step`` counts host Adam steps absorbed (one per warm-up step, one per window).
At a hand-over the moments are carried across (host <-> device) and the receiving side's
counter is used from then on.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass

import torch

from zenflow.config.lr_schedule import lr_at
from zenflow.engine.checkpoint import engine_state_dict, load_engine_state
from zenflow.engine.device_adam import AdamHyper, adamw_columns_, adamw_dense_
from zenflow.engine.host import (
    HostJob,
    HostState,
    HostTask,
    HostWorker,
    Traffic,
    host_empty,
    host_zeros,
    resolve_kernel,
    run_host_tasks,
)
from zenflow.engine.selection import (
    DEFAULT_MIN_NUMEL,
    ParamSpec,
    allreduce_scores_,
    classify_params,
    column_scores,
    complement,
    num_selected,
    select_topk,
    split_handover,
)
from zenflow.engine.stats import StepStats
from zenflow.errors import EngineError

AUTO_INTERVAL_MAX = 64  # bound of update_interval "auto" (window length 1..64)
MODES = ("zenflow", "offload", "device")
_HP_REST = ("beta1", "beta2", "eps", "weight_decay", "adamw_mode")


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class _DenseState:
    """Device AdamW state of an always-important param (or any param in ``device`` mode)."""

    spec: ParamSpec
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0


class _ZfWeight:
    """Engine-owned state of one ZenFlow weight (never glued onto the Parameter)."""

    def __init__(self, spec: ParamSpec, k: int, pin: bool, grad_accum: str, slots: int):
        p = spec.param
        self.spec = spec
        self.cd = spec.column_dim
        self.n_cols = spec.n_cols
        self.k = k
        self.sel_dev: torch.Tensor | None = None  # sorted selected columns, device
        self.sel_host: torch.Tensor | None = None
        self.nonsel_dev: torch.Tensor | None = None
        self.nonsel_host: torch.Tensor | None = None
        shape_k = list(p.shape)
        shape_k[self.cd] = k
        self.shape_k = shape_k
        self.exp_avg_dev = torch.zeros(shape_k, dtype=torch.float32, device=p.device)
        self.exp_avg_sq_dev = torch.zeros(shape_k, dtype=torch.float32, device=p.device)
        self.step_dev = 0
        master = host_empty(p.shape, pin)
        self.host = HostState(master, host_zeros(p.shape, pin), host_zeros(p.shape, pin))
        shape_nonsel = list(p.shape)
        shape_nonsel[self.cd] = self.n_cols - k
        self.shape_nonsel = shape_nonsel
        if grad_accum == "host":
            # compact [.., n_nonsel, ..] fp32 sums on the host (nonsel count is constant)
            self.acc = [host_zeros(shape_nonsel, pin) for _ in range(slots)]
            self.staging = host_empty(shape_nonsel, pin)
        else:
            self.acc = [torch.zeros(p.shape, dtype=torch.float32, device=p.device)]
            self.acc += [torch.zeros_like(self.acc[0]) for _ in range(slots - 1)]
            self.staging = None
        # full-shape host gradient fed to the kernel (not needed when acc is host memory)
        needs_full = grad_accum == "host" or p.device.type != "cpu"
        self.grad_host = [host_zeros(p.shape, pin) for _ in range(slots)] if needs_full else None
        # auto update interval statistics of the current window (python floats)
        self.sel_mass_sum = 0.0  # sum over steps of (selected mass / k)
        self.nonsel_mass_acc = 0.0  # sum over steps of (non-selected mass / (n - k))

    def set_selection(self, sel_dev: torch.Tensor) -> None:
        self.sel_dev = sel_dev
        self.sel_host = sel_dev.cpu()
        self.nonsel_dev = complement(sel_dev, self.n_cols)
        self.nonsel_host = self.nonsel_dev.cpu()


class ZenFlowEngine:
    """Fine-tuning optimizer step with the optimizer state in host memory (ZenFlow).

    ``mode``: "zenflow" (selective device update + windowed host update), "offload"
    (classic ZeRO-Offload: full host AdamW every step) or "device" (plain AdamW on the
    device, no offload). ``host_kernel``: "native" (the SIMD CPU Adam, falls back to the
    reference while it is unavailable), "reference" or a callable with the same signature.
    ``grad_accum``: where the non-selected gradient is summed over a window (see module
    docstring); "auto" = "device" when the device is the CPU, else "host".
    ``min_numel``: 2-D params smaller than this are always important (device-updated fully).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config,
        mode: str = "zenflow",
        *,
        steps_per_epoch: int | None = None,
        device: torch.device | str | None = None,
        host_kernel="native",
        grad_accum: str = "auto",
        min_numel: int = DEFAULT_MIN_NUMEL,
    ):
        if mode not in MODES:
            raise EngineError(f"mode={mode!r} is not allowed: use one of {', '.join(MODES)}.")
        if grad_accum not in ("auto", "host", "device"):
            raise EngineError(
                f"grad_accum={grad_accum!r} is not allowed: use auto, host or device."
            )
        self.model = model
        self.config = config
        self.mode = mode
        self.specs = classify_params(model, min_numel)
        if not self.specs:
            raise EngineError("The model has no trainable parameters (requires_grad=True).")
        bad = [s.name for s in self.specs if s.param.dtype != torch.float32]
        if bad:
            raise EngineError(
                f"Trainable parameters must be fp32 (found {self.specs[0].param.dtype} in "
                f"{', '.join(bad[:3])}{'...' if len(bad) > 3 else ''}): the engine keeps fp32 "
                "weights and uses bf16 only through autocast. Fix: load the model in fp32 "
                "(model.float()) and set bf16.enabled for mixed precision."
            )
        devices = {s.param.device for s in self.specs}
        if len(devices) > 1:
            raise EngineError(f"All trainable parameters must be on one device, found {devices}.")
        self.device = torch.device(device) if device is not None else next(iter(devices))
        if next(iter(devices)) != self.device:
            raise EngineError(
                f"device={self.device} but the model's parameters are on {next(iter(devices))}: "
                "move the model first (model.to(device))."
            )
        self._pin = self.device.type == "cuda"
        self.kernel, self.kernel_name = (None, None)
        self._host_kernel_arg = host_kernel
        opt = config.optimizer
        betas = tuple(opt.betas)
        self._hp_base = AdamHyper(
            lr=float(opt.lr),
            beta1=float(betas[0]),
            beta2=float(betas[1]),
            eps=float(opt.eps),
            weight_decay=float(opt.weight_decay),
            adamw_mode=bool(getattr(opt, "adamw_mode", True)),
        )
        self.clip = float(getattr(config, "gradient_clipping", 0.0) or 0.0)
        self.bf16 = bool(getattr(config, "bf16", False))
        self.model_bytes = sum(s.param.numel() * s.param.element_size() for s in self.specs)
        self.global_step = 0  # optimizer steps applied (skipped steps excluded)
        self.skipped_steps = 0
        self._lr = self._hp_base.lr
        self.traffic = Traffic()
        self._closed = False
        self._failed: BaseException | None = None
        self._torch_threads_orig = torch.get_num_threads()
        self.cores = _cores()
        # instrumentation (tests and metrics): host jobs, window lengths, in-flight count
        self.host_log: list[HostJob] = []
        self.window_lengths: list[int] = []
        self.max_staleness = 0
        self.worker: HostWorker | None = None
        self._inflight: HostJob | None = None

        self.resolved: dict = {"mode": mode, "device": str(self.device)}
        if mode == "device":
            self._init_device_mode()
        elif mode == "offload":
            self._init_offload_mode()
        else:
            self._init_zenflow_mode(steps_per_epoch, grad_accum)
        self.resolved["host_kernel"] = (
            "-" if mode == "device" else self._kernel()[1]  # resolves native/reference now
        )
        self.resolved["model_bytes"] = self.model_bytes
        self.resolved["gradient_clipping"] = self.clip
        self.resolved["bf16"] = self.bf16

    # ------------------------------------------------------------------ setup
    def _kernel(self):
        if self.kernel is None:
            self.kernel, self.kernel_name = resolve_kernel(self._host_kernel_arg)
        return self.kernel, self.kernel_name

    def _init_device_mode(self) -> None:
        hp = self._hp_base
        cls = torch.optim.AdamW if hp.adamw_mode else torch.optim.Adam
        self.optimizer = cls(
            [s.param for s in self.specs],
            lr=hp.lr,
            betas=(hp.beta1, hp.beta2),
            eps=hp.eps,
            weight_decay=hp.weight_decay,
            foreach=True,
        )
        self.resolved.update(training_threads=torch.get_num_threads(), worker_threads=0)

    def _init_offload_mode(self) -> None:
        self.offload_states = {}
        for s in self.specs:
            st = HostState(
                host_empty(s.param.shape, self._pin),
                host_zeros(s.param.shape, self._pin),
                host_zeros(s.param.shape, self._pin),
            )
            st.master.copy_(s.param.detach())  # init copy: not a step, not counted
            self.offload_states[s.name] = st
        self.host_threads = self.cores
        self.resolved.update(
            training_threads=torch.get_num_threads(), worker_threads=0, host_threads=self.cores
        )

    def _init_zenflow_mode(self, steps_per_epoch, grad_accum) -> None:
        zf = self.config.zenflow
        if zf is None:
            from zenflow.config import ZenFlowConfig

            zf = ZenFlowConfig()
        self.zf = zf
        self.topk_ratio = float(zf.topk_ratio)
        self.overlap = bool(zf.overlap_step)
        self.warmup_rounds = int(zf.full_warm_up_rounds)
        self.auto_ratio = float(getattr(zf, "auto_ratio", 0.99))
        if zf.update_interval == "auto":
            self.update_interval = None
            ui_text = f"auto(1..{AUTO_INTERVAL_MAX})"
        else:
            self.update_interval = int(zf.update_interval)
            ui_text = self.update_interval
        self.select_every = self._resolve_select_interval(zf, steps_per_epoch)
        if grad_accum == "auto":
            grad_accum = "device" if self.device.type == "cpu" else "host"
        self.grad_accum = grad_accum
        slots = 2 if self.overlap else 1  # double-buffered accumulators with overlap
        self.zweights: list[_ZfWeight] = []
        self.dense: list[_DenseState] = []
        for s in self.specs:
            if s.is_zenflow:
                w = _ZfWeight(
                    s, num_selected(s.n_cols, self.topk_ratio), self._pin, grad_accum, slots
                )
                w.host.master.copy_(s.param.detach())  # init copy: not a step, not counted
                self.zweights.append(w)
            else:
                z = torch.zeros_like(s.param, dtype=torch.float32)
                self.dense.append(_DenseState(s, z, torch.zeros_like(z)))
        self.selected = False
        self.last_select_step = 0
        self.window_len = 0
        self.window_start = self.warmup_rounds + 1
        self.slot = 0
        if self.overlap:
            self.worker_threads = max(1, round(self.cores * (1 - float(zf.pt_reserved_cores_perc))))
            self.training_threads = max(1, self.cores - self.worker_threads)
            torch.set_num_threads(self.training_threads)
            self.worker = HostWorker()
            self.host_threads = self.worker_threads
        else:
            self.worker_threads = 0
            self.training_threads = torch.get_num_threads()
            self.host_threads = self.cores
        zbytes = sum(w.spec.param.numel() * 4 for w in self.zweights)
        self.resolved.update(
            topk_ratio=self.topk_ratio,
            update_interval=ui_text,
            select_strategy=zf.select_strategy,
            select_interval=zf.select_interval,
            select_every_steps=self.select_every,
            steps_per_epoch=steps_per_epoch,
            full_warm_up_rounds=self.warmup_rounds,
            overlap_step=self.overlap,
            auto_ratio=self.auto_ratio,
            worker_threads=self.worker_threads,
            training_threads=self.training_threads,
            host_threads=self.host_threads,
            grad_accum=grad_accum,
            grad_accum_note=(
                "non-selected gradient summed in a device fp32 buffer, handed to the host "
                "once per window"
                + (" (CPU device: zero-copy)" if self.device.type == "cpu" else "")
                if grad_accum == "device"
                else "non-selected gradient copied to a host fp32 buffer every step"
            ),
            zenflow_weights=len(self.zweights),
            zenflow_bytes=zbytes,
            always_important_params=len(self.dense),
        )

    @staticmethod
    def _resolve_select_interval(zf, steps_per_epoch) -> int:
        strategy, interval = zf.select_strategy, zf.select_interval
        fix = (
            "Pass steps_per_epoch=len(train_loader) to ZenFlowEngine, or set "
            '"select_strategy": "step" with an integer "select_interval".'
        )
        if strategy == "step":
            if interval != "auto":
                return int(interval)
            if steps_per_epoch is None:
                raise EngineError(
                    'select_strategy "step" with select_interval "auto" needs the epoch '
                    f"length. {fix}"
                )
            return int(steps_per_epoch)
        if steps_per_epoch is None or int(steps_per_epoch) < 1:
            raise EngineError(
                f"zero_optimization.zenflow.select_strategy={strategy!r} re-selects per epoch but "
                f"steps_per_epoch={steps_per_epoch!r} is unknown. {fix}"
            )
        epochs = 1 if interval == "auto" or strategy == "auto" else int(interval)
        return epochs * int(steps_per_epoch)

    # ------------------------------------------------------------------ public API
    @property
    def lr(self) -> float:
        return self._lr

    @property
    def max_in_flight(self) -> int:
        return self.worker.max_in_flight if self.worker is not None else 0

    def autocast(self):
        """bf16 autocast on the device when ``config.bf16``; a no-op context otherwise."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def zero_grad(self) -> None:
        for s in self.specs:
            s.param.grad = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Join the worker (its in-flight result stays unapplied), restore torch threads.
        Re-raises a worker failure not yet reported."""
        if self._closed:
            return
        self._closed = True
        err = None
        try:
            if self._inflight is not None and self.worker is not None:
                job, self._inflight = self._inflight, None
                try:
                    self.worker.wait(job)
                except BaseException as e:  # report after cleanup
                    err = e
        finally:
            if self.worker is not None:
                self.worker.close()
            torch.set_num_threads(self._torch_threads_orig)
        if err is not None and self._failed is None:
            self._failed = err
            raise err

    def flush(self) -> None:
        """Bring every pending host update into the device weights (end of training,
        before evaluation or saving final weights): wait for and apply the in-flight host
        step, then run the partial window's host step synchronously and apply it.

        This ends the current window early, so a run with a flush in the middle differs
        from one without; resumable checkpoints do not need it (see ``state_dict``).
        """
        if self.mode != "zenflow" or self._closed:
            return
        if self._failed is not None:
            raise RuntimeError("ZenFlowEngine is unusable after a host worker failure.")
        hp = AdamHyper(self._lr, *(getattr(self._hp_base, f) for f in _HP_REST))
        with torch.no_grad():
            if self.window_len > 0:
                self._end_window(self.global_step, hp, sync=True)
            else:
                self._wait_inflight(self.global_step)

    def state_dict(self) -> dict:
        return engine_state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        load_engine_state(self, sd)

    # ------------------------------------------------------------------ the step
    def _lr_at(self, step: int) -> float:
        return float(lr_at(self.config, step))

    def step(self, loss=None) -> StepStats:
        """One optimizer step over the gradients in ``param.grad`` -> :class:`StepStats`."""
        if self._closed:
            raise RuntimeError("ZenFlowEngine.step() after close().")
        if self._failed is not None:
            raise RuntimeError(
                "ZenFlowEngine is unusable after a host worker failure."
            ) from self._failed
        t_start = time.perf_counter()
        self._check_worker()
        self.traffic.reset()
        self._stall_s = 0.0
        self._devopt_s = 0.0
        self._host_update = False
        self._window_ended = 0
        self._moved = 0
        self._warm = False
        loss_f = None if loss is None else float(loss.detach() if torch.is_tensor(loss) else loss)
        t = self.global_step + 1
        self._lr = lr = self._lr_at(t)
        hp = AdamHyper(lr, *(getattr(self._hp_base, f) for f in _HP_REST))
        grads = [s.param.grad for s in self.specs]
        present = [g for g in grads if g is not None]
        if present:
            total = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.detach(), 2.0) for g in present]), 2.0
            )
            grad_norm = float(total)
        else:
            total, grad_norm = None, 0.0
        skipped = (loss_f is not None and not math.isfinite(loss_f)) or not math.isfinite(grad_norm)
        if skipped:
            self.skipped_steps += 1
        else:
            try:
                if self.clip > 0 and total is not None:
                    coef = torch.clamp(self.clip / (total + 1e-6), max=1.0)
                    for g in present:
                        g.detach().mul_(coef)
                with torch.no_grad():
                    if self.mode == "device":
                        self._device_mode_step(lr)
                    elif self.mode == "offload":
                        self._offload_step(t, hp)
                    elif t <= self.warmup_rounds:
                        self._warmup_step(t, hp)
                    else:
                        self._zenflow_step(t, hp)
            except BaseException as e:
                if self.worker is not None and self._failed is None:
                    self._failed = e
                raise
            self.global_step = t
        return StepStats(
            step=t,
            lr=lr,
            loss=loss_f,
            step_ms=(time.perf_counter() - t_start) * 1e3,
            device_opt_ms=self._devopt_s * 1e3,
            stall_ms=self._stall_s * 1e3,
            transfer_ms=self.traffic.transfer_s * 1e3,
            d2h_bytes=self.traffic.d2h_bytes,
            h2d_bytes=self.traffic.h2d_bytes,
            host_update=self._host_update,
            window_len=self._window_ended,
            selection_changed=self._moved,
            grad_norm=grad_norm,
            skipped=skipped,
            warmup=self._warm,
            mode=self.mode,
        )

    def _check_worker(self) -> None:
        """Surface a finished-with-error host step now (the next step after it failed)."""
        job = self._inflight
        if job is None or job.future is None or not job.future.done():
            return
        if job.future.exception() is not None:
            self._inflight = None
            try:
                self.worker.wait(job)
            except BaseException as e:
                self._failed = e
                raise

    # -- plain modes
    def _device_mode_step(self, lr: float) -> None:
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self._devopt_s += time.perf_counter() - t0

    def _offload_step(self, t: int, hp: AdamHyper) -> None:
        """ZeRO-Offload: every gradient to the host, full CPU AdamW, every weight back."""
        t0 = time.perf_counter()
        kernel = self._kernel()[0]
        tasks = []
        for s in self.specs:
            st = self.offload_states[s.name]
            g = s.param.grad
            if g is None:
                continue
            st.step += 1
            tasks.append(HostTask(st, self._grad_to_host(g), st.step, 1.0))
        self.traffic.sync(self.device)
        run_host_tasks(tasks, kernel, hp.lr, hp, self.host_threads)
        for s in self.specs:
            if s.param.grad is not None:
                self._to_param(s.param, self.offload_states[s.name].master)
        self._host_update = True
        self._stall_s += time.perf_counter() - t0

    def _grad_to_host(self, g: torch.Tensor) -> torch.Tensor:
        """A host fp32 copy of a gradient (counted). On a CPU device an fp32 gradient is
        already host memory: counted as traffic but not copied again."""
        g = g.detach()
        if self.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous():
            self.traffic.d2h_bytes += g.numel() * g.element_size()
            return g
        return self.traffic.to_host(g.float().contiguous(), self._pin)

    def _to_param(self, p: torch.Tensor, master: torch.Tensor) -> None:
        self.traffic.copy_(p.data, master, "h2d")

    # -- ZenFlow
    def _dense_update(self, hp: AdamHyper) -> None:
        for d in self.dense:
            g = d.spec.param.grad
            if g is None:
                continue
            d.step += 1
            adamw_dense_(d.spec.param.data, g.detach(), d.exp_avg, d.exp_avg_sq, d.step, hp)

    def _warmup_step(self, t: int, hp: AdamHyper) -> None:
        """Full synchronous update: ZenFlow weights by the host AdamW, the rest on device."""
        self._warm = True
        t0 = time.perf_counter()
        self._dense_update(hp)
        self._devopt_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        kernel = self._kernel()[0]
        tasks = []
        for w in self.zweights:
            g = w.spec.param.grad
            w.step_dev += 1
            w.host.step += 1
            gh = self._grad_to_host(g) if g is not None else host_zeros(w.spec.param.shape, False)
            tasks.append(HostTask(w.host, gh, w.host.step, 1.0))
        self.traffic.sync(self.device)
        run_host_tasks(tasks, kernel, hp.lr, hp, self.cores)
        for w in self.zweights:
            self._to_param(w.spec.param, w.host.master)
        self._host_update = bool(tasks)
        self._stall_s += time.perf_counter() - t0
        self.window_start = t + 1

    def _grad_of(self, w: _ZfWeight) -> torch.Tensor:
        g = w.spec.param.grad
        if g is None:  # unused this step: a zero gradient (keeps the schedule uniform)
            return torch.zeros_like(w.spec.param)
        return g.detach()

    def _zenflow_step(self, t: int, hp: AdamHyper) -> None:
        if not self.selected:
            self._select(t)
        t0 = time.perf_counter()
        for w in self.zweights:
            w.step_dev += 1
            adamw_columns_(
                w.spec.param.data, self._grad_of(w), w.sel_dev, w.cd,
                w.exp_avg_dev, w.exp_avg_sq_dev, w.step_dev, hp,
            )  # fmt: skip
        self._dense_update(hp)
        self._devopt_s += time.perf_counter() - t0
        self._accumulate()
        self.window_len += 1
        if self._window_ends():
            reselect = t - self.last_select_step >= self.select_every
            self._end_window(t, hp, sync=reselect or not self.overlap)
            if reselect:
                self._select(t)

    def _accumulate(self) -> None:
        first = self.window_len == 0
        for w in self.zweights:
            g = self._grad_of(w)
            acc = w.acc[self.slot]
            if self.grad_accum == "host":
                part = g.index_select(w.cd, w.nonsel_dev)  # the d2h slice: non-selected only
                if self.device.type == "cpu":
                    # the gather above already produced a host copy: count it, don't copy again
                    self.traffic.d2h_bytes += part.numel() * part.element_size()
                    acc.copy_(part) if first else acc.add_(part)
                elif first:
                    self.traffic.copy_(acc, part, "d2h")
                else:
                    self.traffic.copy_(w.staging, part, "d2h")
            else:
                acc.copy_(g) if first else acc.add_(g)
        if self.grad_accum == "host" and self.device.type != "cpu":
            self.traffic.sync(self.device)
            if not first:
                for w in self.zweights:
                    w.acc[self.slot].add_(w.staging)
        if self.update_interval is None:
            self._auto_stats()

    def _auto_stats(self) -> None:
        """Per weight: selected mass per column (summed over the window's steps, averaged at
        the vote) and accumulated non-selected mass per column. Mass = squared L2 norm."""
        if not self.zweights:
            return
        vals = []
        for w in self.zweights:
            s = column_scores(self._grad_of(w), w.cd)
            vals.append(s[w.sel_dev].sum())
            vals.append(s[w.nonsel_dev].sum())
        vals = torch.stack(vals).tolist()
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

    def _wait_inflight(self, t: int) -> None:
        """Wait for the in-flight host step (if any) and copy its result to the device."""
        job, self._inflight = self._inflight, None
        if job is None:
            return
        t0 = time.perf_counter()
        if job.future is not None:
            self.worker.wait(job)
        self._stall_s += time.perf_counter() - t0
        self._apply(job, t)

    def _apply(self, job: HostJob, t: int) -> None:
        """Copy the host result into the device weights: ONLY the non-selected columns."""
        t0 = time.perf_counter()
        for w in self.zweights:
            vals = w.host.master.index_select(w.cd, w.nonsel_host)
            if self.device.type == "cpu":  # the gather is the copy: count it
                self.traffic.h2d_bytes += vals.numel() * vals.element_size()
            else:
                vals = self.traffic.to_device(vals, self.device)
            w.spec.param.data.index_copy_(w.cd, w.nonsel_dev, vals)
        job.applied_step = t
        # Staleness: the oldest gradient in this update is from job.window_start; the device
        # sees it at the end of step t. With overlap t is the end of the NEXT window, so
        # non-selected columns lag by at most 2S steps (S without overlap).
        self.max_staleness = max(self.max_staleness, t - job.window_start + 1)
        self._host_update = True
        self._stall_s += time.perf_counter() - t0

    def _end_window(self, t: int, hp: AdamHyper, sync: bool) -> None:
        # at most one host step in flight: wait for (and apply) the previous one first
        self._wait_inflight(t)
        t0 = time.perf_counter()
        n = self.window_len
        tasks = []
        for w in self.zweights:
            acc = w.acc[self.slot]
            if w.grad_host is None:  # CPU device, grad_accum="device": the sum is host memory
                grad_full = acc
            else:
                grad_full = w.grad_host[self.slot]
                if self.grad_accum == "host":
                    grad_full.index_copy_(w.cd, w.nonsel_host, acc)
                else:  # GPU device buffer: move the non-selected slice once per window
                    part = acc.index_select(w.cd, w.nonsel_dev)
                    staged = self.traffic.to_host(part, self._pin)
                    self.traffic.sync(self.device)
                    grad_full.index_copy_(w.cd, w.nonsel_host, staged)
                grad_full.index_fill_(w.cd, w.sel_host, 0.0)
            # Selected columns of master/moments are updated too (one flat kernel pass is
            # faster than gather/scatter) but never observed: they reach the device only by
            # index (non-selected columns), and a column leaving the device overwrites its
            # master and host moments at the hand-over.
            w.host.step += 1
            tasks.append(HostTask(w.host, grad_full, w.host.step, 1.0 / n))
            w.sel_mass_sum = 0.0
            w.nonsel_mass_acc = 0.0
        job = HostJob(window_start=self.window_start, submit_step=t, buffer_slot=self.slot)
        self.host_log.append(job)
        kernel = self._kernel()[0]
        self._stall_s += time.perf_counter() - t0
        if sync:
            t0 = time.perf_counter()
            run_host_tasks(tasks, kernel, hp.lr, hp, self.cores, job)
            self._stall_s += time.perf_counter() - t0
            self._apply(job, t)
        else:
            nt = self.worker_threads
            self.worker.submit(job, lambda: run_host_tasks(tasks, kernel, hp.lr, hp, nt, job))
            self._inflight = job
            if self.zweights and len(self.zweights[0].acc) > 1:
                self.slot = 1 - self.slot
        self._window_ended = n
        self.window_lengths.append(n)
        self.window_len = 0
        self.window_start = t + 1

    def _select(self, t: int) -> None:
        """(Re)select columns and hand ownership over by index.

        Preconditions: no host step in flight and master == device on non-selected columns
        (first selection: master was just copied from the device; reselection: runs right
        after a synchronous window end). Columns device->host write their device values into
        the master BY INDEX and carry their device moments into the host moments; columns
        host->device take the master values and carry the host moments (we carry rather than
        restart moments: a restarted column would take a full-size first Adam step).
        """
        t0 = time.perf_counter()
        for w in self.zweights:
            p = w.spec.param.data
            scores = allreduce_scores_(column_scores(self._grad_of(w), w.cd))
            new = select_topk(scores, w.k)
            if w.sel_dev is None:
                old = torch.empty(0, dtype=torch.long, device=new.device)
            else:
                old = w.sel_dev
            stay_o, stay_n, in_pos, in_cols, out_pos, out_cols = split_handover(old, new)
            if out_cols.numel():
                out_h = out_cols.cpu()
                for dst, src in (
                    (w.host.master, p.index_select(w.cd, out_cols)),
                    (w.host.exp_avg, w.exp_avg_dev.index_select(w.cd, out_pos)),
                    (w.host.exp_avg_sq, w.exp_avg_sq_dev.index_select(w.cd, out_pos)),
                ):
                    dst.index_copy_(w.cd, out_h, self._dev_to_host(src))
            m_new = torch.empty_like(w.exp_avg_dev)
            v_new = torch.empty_like(w.exp_avg_sq_dev)
            m_new.index_copy_(w.cd, stay_n, w.exp_avg_dev.index_select(w.cd, stay_o))
            v_new.index_copy_(w.cd, stay_n, w.exp_avg_sq_dev.index_select(w.cd, stay_o))
            if in_cols.numel():
                in_h = in_cols.cpu()
                p.index_copy_(
                    w.cd, in_cols, self._host_to_dev(w.host.master.index_select(w.cd, in_h))
                )
                m_new.index_copy_(
                    w.cd, in_pos, self._host_to_dev(w.host.exp_avg.index_select(w.cd, in_h))
                )
                v_new.index_copy_(
                    w.cd, in_pos, self._host_to_dev(w.host.exp_avg_sq.index_select(w.cd, in_h))
                )
            w.exp_avg_dev, w.exp_avg_sq_dev = m_new, v_new
            w.set_selection(new)
            self._moved += int(in_cols.numel() + out_cols.numel())
        self.selected = True
        self.last_select_step = t
        self._stall_s += time.perf_counter() - t0

    def _dev_to_host(self, src: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":  # src is a fresh gather: that was the copy
            self.traffic.d2h_bytes += src.numel() * src.element_size()
            return src
        out = self.traffic.to_host(src, self._pin)
        self.traffic.sync(self.device)
        return out

    def _host_to_dev(self, src: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            self.traffic.h2d_bytes += src.numel() * src.element_size()
            return src
        return self.traffic.to_device(src, self.device)
