"""ZenFlowEngine: one optimizer step over the model's gradients, on any accelerator.

Usage (``step()`` is ONE optimizer step; micro-batch accumulation with
``gradient_accumulation_steps`` is the caller's loop: it runs that many backward passes
with the loss divided by it, then calls ``step()`` once; the ZenFlow window
``update_interval`` counts optimizer steps and is independent of it)::

    engine = ZenFlowEngine(model, config, mode="zenflow", steps_per_epoch=len(loader),
                           accelerator="cuda")      # or "cpu", "sim"; None = cuda if present
    with engine.autocast():
        loss = model(**batch).loss
    engine.backward(loss)
    stats = engine.step(loss)
    engine.zero_grad()

Modes: "zenflow" (``zenflow.engine.zenflow_mode``), "offload" (classic ZeRO-Offload) and
"device" (the best plain AdamW on the device), the latter two in
``zenflow.engine.baselines``. This module owns what every mode shares: the model and its
training dtype, the accelerator and the core split, the learning rate schedule, the global
gradient norm, the non-finite skip, clipping, and the per-step record. Its set-up steps
are in ``engine_setup``, the norm and clipping coefficient in ``global_norm``, the record in
``step_record``, the always-important parameters' device AdamW in ``dense``.

Memory layout (ZENFLOW.md 2b): the model's weights and gradients stay on the device in the
training dtype (bf16 when ``bf16.enabled``: an fp32 model is cast at construction, after its
fp32 values were taken as the master; a bf16 model is accepted as is); the fp32 master and
moments of offloaded weights live on the host (pinned on CUDA when
``offload_optimizer.pin_memory``).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from zenflow.config.lr_schedule import lr_at
from zenflow.config.schema import EarlyOptions
from zenflow.engine.accelerator import OOM_FIX, Accelerator, DeviceOutOfMemory
from zenflow.engine.accumulator import CoreShare
from zenflow.engine.baselines import DeviceMode, OffloadMode
from zenflow.engine.checkpoint import engine_state_dict, load_engine_state
from zenflow.engine.dense import DenseState, dense_state, dense_update
from zenflow.engine.device_adam import AdamHyper, fused_available
from zenflow.engine.distributed import DataParallel
from zenflow.engine.engine_setup import (
    MODES,
    accelerator_kind,
    adam_hyper,
    bind_numa,
    check_arguments,
    check_dtypes,
    check_model_device,
    open_accelerator,
    resolve_bf16,
    resolve_select_interval,
    resolved_settings,
    sharing_ranks,
    take_masters_and_cast,
    trainable_specs,
    zenflow_settings,
)
from zenflow.engine.global_norm import clip_coefficient, clip_in_place, global_norm, read_step
from zenflow.engine.host import resolve_kernel
from zenflow.engine.selection import DEFAULT_MIN_NUMEL
from zenflow.engine.stats import StepStats
from zenflow.engine.step_record import StepRecord, restart_counters, step_stats
from zenflow.engine.streaming import GradStream
from zenflow.engine.zenflow import ZenFlowMode
from zenflow.errors import EngineError

__all__ = ["MODES", "ZenFlowEngine"]

_HP_REST = ("beta1", "beta2", "eps", "weight_decay", "adamw_mode")


class ZenFlowEngine:
    """Fine-tuning optimizer step with the optimizer state in host memory (ZenFlow).

    ``accelerator``: "cuda", "cpu", "sim" (a simulated separate device), None (cuda if
    present, else cpu), or an ``Accelerator`` instance; ``sim_strict`` poisons copy
    destinations until their copy completes (tests). ``host_kernel``: "native" (the SIMD
    CPU Adam), "reference" or a callable with the same signature. ``device_adam``: the
    device-side AdamW (selected columns, always-important params): "fused" (torch's fused
    kernel, where torch has one for the device; else the reference, and ``resolved`` says
    so) or "reference" (torch's single-tensor op order; ``zenflow.engine.device_adam``).
    ``min_numel``: 2-D params smaller than this are always important (updated fully on the
    device). ``bucket_elems``: elements per device copy bucket (a streamed piece at most;
    default ``zenflow.engine.copies.bucket_elems_for``'s rule; benchmarks vary it).

    Data parallel: when the caller has initialised a torch.distributed process group of
    more than one rank, the engine averages gradients, partitions the host state and agrees
    every schedule decision across ranks (``zenflow.engine.distributed``);
    ``ranks_per_node`` (torchrun's LOCAL_WORLD_SIZE) shares this machine's cores among them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config,
        mode: str = "zenflow",
        *,
        steps_per_epoch: int | None = None,
        accelerator: str | Accelerator | None = None,
        host_kernel="native",
        device_adam: str = "fused",
        min_numel: int = DEFAULT_MIN_NUMEL,
        sim_strict: bool = False,
        device_budget_bytes: int | None = None,
        ranks_per_node: int = 1,
        masters: dict[str, torch.Tensor] | None = None,
        sim_lag_s: float = 0.0,
        sim_profile: str | None = None,
        bucket_elems: int | None = None,
    ):
        check_arguments(mode, device_adam)
        self.model = model
        self.config = config
        self.mode = mode
        self.specs = trainable_specs(model, min_numel)
        self.bf16 = resolve_bf16(getattr(config, "bf16", False), accelerator_kind(accelerator))
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        check_dtypes(self.specs, self.bf16)
        self.accel = open_accelerator(
            accelerator, config, mode, self.specs, self.dtype, strict=sim_strict,
            budget_bytes=device_budget_bytes, lag_s=sim_lag_s, sim_profile=sim_profile,
        )  # fmt: skip
        self.device = self.accel.device
        # the device-side AdamW (zenflow mode): torch's fused kernel where it has one
        self.fused_device_adam = device_adam == "fused" and fused_available(self.device)
        check_model_device(self.specs, self.accel)
        self._read_options(config)
        self._host_kernel_arg = host_kernel
        self.bucket_request = int(bucket_elems) if bucket_elems else None
        self._kernel = None
        self.kernel_name = "-"
        self.hp_base = adam_hyper(config.optimizer)
        self.clip = float(getattr(config, "gradient_clipping", 0.0) or 0.0)
        self._start_counters(config)
        # before the fp32 masters and the host state are first touched: their pages then
        # land on the device's NUMA node where the threads are bound to it
        self.numa = bind_numa(self.accel, self.numa_binding, ranks_per_node)
        try:
            masters = take_masters_and_cast(model, self.specs, self.bf16, masters, mode)
            self.model_bytes = sum(s.param.numel() * s.param.element_size() for s in self.specs)
            self.accel.set_held("weights", sum(p.numel() * p.element_size()
                                               for p in model.parameters()))  # fmt: skip
            self.accel.note_device_tensors([*model.parameters(), *model.buffers()])
            self.zf = None
            if mode == "zenflow":
                self.zf = zenflow_settings(config)
                self.select_every = resolve_select_interval(self.zf, steps_per_epoch)
            self._split_cores(sharing_ranks(self.accel, self.numa, ranks_per_node))
            self.dense: list[DenseState] = []
            self.impl = self._make_mode(masters)
            masters.clear()  # consumed: the modes hold what they keep (no second copy)
            del masters
            self.stream = GradStream(
                self, self.impl, streaming=self.stream_grads and mode != "device", gas=self.gas,
                on_device_accumulation=self.grad_accumulation == "device",
            )  # fmt: skip
            self.resolved: dict = resolved_settings(self, steps_per_epoch)
        except BaseException:  # the process is not left bound by an engine that never was
            self.numa.undo()
            raise

    # ------------------------------------------------------------------ setup
    def _read_options(self, config) -> None:
        """The transport options (the ``engine`` block, ``pin_memory``, micro-batches),
        "auto" resolved for this accelerator."""
        # Pinned host buffers for what crosses the link (staging, images, landing):
        # offload_optimizer.pin_memory; pinned on cuda, modelled (accounted) on sim.
        self.pin_link = bool(getattr(config, "pin_memory", True))
        self.pin = self.pin_link and self.accel.models_pinning
        options = getattr(config, "engine", None)
        stream_opt = getattr(options, "stream_grads", "auto")
        self.stream_grads = (not self.accel.shared_memory) if stream_opt == "auto" else \
            bool(stream_opt)  # fmt: skip
        self.grad_accumulation = getattr(options, "grad_accumulation", "host")
        self.copy_buckets = getattr(options, "copy_buckets", "auto")
        self.window_lr = getattr(options, "window_lr", "last")
        self.select_schedule = getattr(options, "select_schedule", "fixed")
        self.host_state = getattr(options, "host_state", "exact")
        self.early = getattr(options, "early", None) or EarlyOptions()
        self.return_image = getattr(options, "return_image", "early")
        self.numa_binding = getattr(options, "numa_binding", "auto")
        # "auto" is the store unless the memory check changed it before the run (RunSpec)
        store = getattr(options, "step_store", "auto")
        self.step_store = "on" if store == "auto" else store
        self.gas = max(1, int(getattr(config, "gradient_accumulation_steps", 1) or 1))

    def _start_counters(self, config) -> None:
        """Step counts, the lr, failure state, the step record and the data-parallel group."""
        self.global_step = 0  # optimizer steps applied (skipped steps excluded)
        self.skipped_steps = 0
        self._lr = self.hp_base.lr
        self._closed = False
        self._failed: BaseException | None = None
        self.rec = StepRecord()
        self.last_peak_held: dict[str, int] = {}  # device bytes per holder at the last peak
        self._torch_threads_orig = torch.get_num_threads()
        self.dp = DataParallel()

    def _split_cores(self, ranks_per_node: int) -> None:
        """The core split: the device's compute (a separate device: its reserved share of
        the cores, whatever the mode) and the host's work; torch runs the former."""
        overlap = bool(self.zf.overlap_step) if self.zf else False
        reserved = float(self.zf.pt_reserved_cores_perc) if self.zf else 0.5
        self.training_threads, self.host_threads = self.accel.compute_threads(
            reserved, overlap, ranks_per_node
        )
        # the accumulator's and the window Adam's share of the host threads
        self.host_cores = CoreShare(self.host_threads, self.accel.host_yields)
        torch.set_num_threads(self.training_threads)

    def _make_mode(self, masters: dict[str, torch.Tensor]):
        """The mode's state, initialised from the fp32 ``masters``; zenflow mode also fills
        ``self.dense`` (the always-important parameters' device state) before its own."""
        if self.mode == "device":
            return DeviceMode(self, masters)
        if self.mode == "offload":
            return OffloadMode(self, masters)
        self.dense = [dense_state(s, masters.pop(s.name, None), self.accel)
                      for s in self.specs if not s.is_zenflow]  # fmt: skip
        return ZenFlowMode(self, masters)

    def kernels(self):
        """The host ops (CPU Adam, its compact twin, the accumulate), resolved on first use,
        which is the engine's set-up (``resolved_settings``): the native op is built or
        loaded there, so a first build's minute is set-up time, never a step's stall."""
        if self._kernel is None:
            self._kernel = resolve_kernel(self._host_kernel_arg)
            self.kernel_name = self._kernel.name
            if self.kernel_name == "native":
                from zenflow.ops import load_native, ops_mode

                if ops_mode() == "native":
                    load_native()
        return self._kernel

    # ------------------------------------------------------------------ mode internals
    @property
    def zweights(self):
        return self.impl.zweights if self.mode == "zenflow" else []

    @property
    def window_lengths(self) -> list[int]:
        return self.impl.window_lengths if self.mode == "zenflow" else []

    @property
    def selection_steps(self) -> list[int]:
        """The steps at which columns were selected (the first selection, then every
        re-selection) since the engine was made."""
        return self.impl.selection_steps if self.mode == "zenflow" else []

    @property
    def host_log(self):
        return self.impl.host_log if self.mode == "zenflow" else []

    @property
    def max_staleness(self) -> int:
        return self.impl.max_staleness if self.mode == "zenflow" else 0

    def pending_host(self) -> dict | None:
        """ZenFlow: what the weights do not show yet, {"host_updates": n, "steps": m} (the
        in-flight host step and the open window; both 0 after ``flush``). None for the
        modes whose weights are always current (device, offload)."""
        return self.impl.window.pending() if self.mode == "zenflow" else None

    @property
    def max_in_flight(self) -> int:
        worker = getattr(self.impl, "worker", None)
        return worker.max_in_flight if worker is not None else 0

    def device_update_name(self) -> str:
        if self.fused_device_adam:
            return "fused (torch._fused_adamw_, as torch.optim.AdamW(fused=True))"
        return "reference (torch.optim.AdamW's single-tensor op order)"

    def dense_update(self, hp: AdamHyper) -> None:
        """Device AdamW on every always-important parameter (``zenflow.engine.dense``)."""
        dense_update(self.dense, hp, self.fused_device_adam)

    # ------------------------------------------------------------------ public API
    @property
    def lr(self) -> float:
        return self._lr

    def autocast(self):
        """bf16 autocast on the device when ``config.bf16``; a no-op context otherwise."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``. The gradients leave the device during it (the hooks of
        ``zenflow.engine.streaming``); calling ``loss.backward()`` directly does the same."""
        try:
            loss.backward()
        except torch.OutOfMemoryError as exc:
            raise self.out_of_memory("backward", exc) from None

    def out_of_memory(self, phase: str, exc: BaseException) -> DeviceOutOfMemory:
        """A device out-of-memory error as the user error it is (what, where, the fix)."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        held = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in
                         sorted(self.accel.held().items(), key=lambda kv: -kv[1])[:3])  # fmt: skip
        return DeviceOutOfMemory(
            f"{self.accel.kind} device out of memory during {phase} at step "
            f"{self.global_step + 1} ({first}; engine state held: {held or 'n/a'}). {OOM_FIX}"
        )

    def zero_grad(self) -> None:
        for s in self.specs:
            s.param.grad = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Join background threads (an in-flight result stays unapplied), restore torch's
        thread count. Re-raises a background failure not yet reported."""
        if self._closed:
            return
        self._closed = True
        err = None
        try:
            self.stream.close()
            err = self.impl.close()
        finally:
            self.accel.close()
            torch.set_num_threads(self._torch_threads_orig)
            self.numa.undo()
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
        hp = self._hyper(self._lr)
        self.rec = StepRecord()
        with torch.no_grad():
            self.impl.flush(self.global_step, hp)

    def release_host_state(self) -> None:
        """The run is over (flushed, its final checkpoint written): close the engine and
        drop its host optimizer state, so that the final model save's host copies never sit
        beside it (a 7B run's compact state is 47 GiB, the save's shard 12 GiB). The engine
        takes no step and writes no checkpoint afterwards. Only the zenflow mode holds a
        host state it can drop here; the others keep theirs until the engine is gone."""
        self.close()
        release = getattr(self.impl, "release_host", None)
        if release is not None:
            release()
            self._released = True

    def state_dict(self, share_host: bool = False) -> dict:
        """Everything needed to continue exactly (``zenflow.engine.checkpoint``).
        ``share_host``: reference the host state instead of copying it; write the result
        before the engine runs again."""
        if getattr(self, "_released", False):
            raise EngineError("the engine's host state was released at the end of the run: "
                              "take checkpoints before release_host_state()")  # fmt: skip
        return engine_state_dict(self, share_host)

    def load_state_dict(self, sd: dict) -> None:
        load_engine_state(self, sd)

    # ------------------------------------------------------------------ the step
    def step(self, loss=None) -> StepStats:
        """One optimizer step over the step's gradients -> :class:`StepStats`.

        One device-to-host read per step (``Accelerator.read``): the loss, the global norm
        and the auto-interval masses together; everything else stays on the device or on
        the host. With micro-batches summed on the host the norm's host share is waited for
        too (a host wait, counted as stall)."""
        self._check_usable()
        t_start = time.perf_counter()
        self.rec = StepRecord()
        self._finish_gradients()
        t = self.global_step + 1
        self._lr = lr = float(lr_at(self.config, t))
        hp = self._hyper(lr)
        norm_local, auto_vals, loss_f = read_step(self, loss)
        grad_norm, nonfinite, auto_vals = global_norm(self, norm_local, auto_vals, loss_f)
        skipped = nonfinite or not math.isfinite(grad_norm)
        coef, coef_t = 1.0, None
        if not skipped:
            coef, coef_t = clip_coefficient(self.clip, grad_norm, self.device)
        if hasattr(self.impl, "set_gate"):
            self.impl.set_gate(coef, skipped)
        if skipped:
            self.skipped_steps += 1
            if hasattr(self.impl, "skip_step"):
                self.impl.skip_step()
        else:
            self._apply(t, hp, coef, coef_t, auto_vals)
            self.global_step = t
        self.stream.reset()
        stats = step_stats(self, t, lr, loss_f, t_start, grad_norm, skipped)
        self.last_peak_held = restart_counters(self.accel)
        return stats

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("ZenFlowEngine.step() after close().")
        if self._failed is not None:
            raise RuntimeError(
                "ZenFlowEngine is unusable after a host worker failure."
            ) from self._failed

    def _hyper(self, lr: float) -> AdamHyper:
        """The configured AdamW hyper-parameters at this step's ``lr``."""
        return AdamHyper(lr, *(getattr(self.hp_base, f) for f in _HP_REST))

    def _finish_gradients(self) -> None:
        """Every gradient of the step where the mode wants it: the streamed copies
        completed (their wait counted as stall), the mode's collection done."""
        try:
            if self.mode == "zenflow":
                self.impl.check_worker()
            self.stream.finish()
            self.rec.stall_s += self.stream.wait_s
            if hasattr(self.impl, "collect"):
                self.impl.collect()
        except torch.OutOfMemoryError as exc:
            raise self.out_of_memory("the gradient routing", exc) from None
        except BaseException as e:
            if self.mode == "zenflow":
                self._failed = e
            raise

    def _apply(self, t: int, hp: AdamHyper, coef: float, coef_t, auto_vals) -> None:
        """Step ``t`` of a finite gradient: clip what is on the device, update Zen-auto's
        masses, and the mode's optimizer step."""
        try:
            if coef_t is not None:  # what is still on the device is clipped in place
                clip_in_place([s.param.grad for s in self.specs], coef_t)
            if auto_vals and hasattr(self.impl, "auto_update"):
                self.impl.auto_update(auto_vals, coef)
            with torch.no_grad():
                self.impl.step(t, hp, coef, None if self._whole_clipped() else coef_t)
        except torch.OutOfMemoryError as exc:
            raise self.out_of_memory("the optimizer step", exc) from None
        except BaseException as e:
            if self.mode == "zenflow" and self._failed is None:
                self._failed = e
            raise

    def _whole_clipped(self) -> bool:
        """Whether the mode's gradients were clipped in place with the rest (whole-gradient
        paths), so the mode must not scale them again."""
        return getattr(self.impl, "zero_copy", False) or self.mode == "device"
