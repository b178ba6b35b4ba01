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
gradient norm, the non-finite skip, clipping, and the per-step record.

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
from dataclasses import dataclass

import torch

from zenflow.config.lr_schedule import lr_at
from zenflow.engine.accelerator import OOM_FIX, Accelerator, DeviceOutOfMemory, make_accelerator
from zenflow.engine.baselines import DeviceMode, OffloadMode
from zenflow.engine.checkpoint import engine_state_dict, load_engine_state
from zenflow.engine.device_adam import (
    DEVICE_ADAM_IMPLS,
    AdamHyper,
    adamw_fused_,
    fused_available,
)
from zenflow.engine.distributed import DataParallel, norms_of
from zenflow.engine.host import resolve_kernel
from zenflow.engine.selection import DEFAULT_MIN_NUMEL, ParamSpec, classify_params
from zenflow.engine.stats import StepStats
from zenflow.engine.streaming import GradStream
from zenflow.engine.zenflow_mode import ZenFlowMode
from zenflow.errors import EngineError

MODES = ("zenflow", "offload", "device")
_HP_REST = ("beta1", "beta2", "eps", "weight_decay", "adamw_mode")


@dataclass
class StepRecord:
    """What the current step did, filled by the modes (reset every step)."""

    stall_s: float = 0.0
    devopt_s: float = 0.0
    transfer_s: float = 0.0
    host_update: bool = False
    window_ended: int = 0
    moved: int = 0
    warmup: bool = False


@dataclass
class DenseState:
    """Device AdamW state of an always-important parameter (1-D or small): fp32 moments,
    and an fp32 master when the weight itself is low precision."""

    spec: ParamSpec
    master: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0


def resolve_bf16(value, kind: str | None) -> bool:
    """``bf16.enabled`` resolved for an accelerator kind: ``"auto"`` (the DeepSpeed / HF
    convention) is on for sim and for a CUDA device with bf16 support, off on the CPU."""
    if value != "auto":
        return bool(value)
    if kind == "sim":
        return True
    if kind in (None, "cuda") and torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    return False


def _cores() -> int:
    from zenflow.engine.accelerator import cores

    return cores()


def _device_matches(param_device: torch.device, device: torch.device) -> bool:
    if param_device.type != device.type:
        return False
    if device.type != "cuda":
        return True
    pi = param_device.index if param_device.index is not None else torch.cuda.current_device()
    di = device.index if device.index is not None else torch.cuda.current_device()
    return pi == di


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
    device).

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
    ):
        if mode not in MODES:
            raise EngineError(f"mode={mode!r} is not allowed: use one of {', '.join(MODES)}.")
        if device_adam not in DEVICE_ADAM_IMPLS:
            raise EngineError(
                f"device_adam={device_adam!r} is not allowed: use one of "
                f"{', '.join(DEVICE_ADAM_IMPLS)}."
            )
        self.model = model
        self.config = config
        self.mode = mode
        self.specs = classify_params(model, min_numel)
        if not self.specs:
            raise EngineError("The model has no trainable parameters (requires_grad=True).")
        kind = accelerator if isinstance(accelerator, str) or accelerator is None else \
            accelerator.kind  # fmt: skip
        self.bf16 = resolve_bf16(getattr(config, "bf16", False), kind)
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        self._check_dtypes()
        reserved = 0.5
        if mode == "zenflow" and config.zenflow is not None:
            reserved = float(config.zenflow.pt_reserved_cores_perc)
        self.accel = make_accelerator(
            accelerator,
            device=self.specs[0].param.device,
            pin_memory=bool(getattr(config, "pin_memory", True)),
            strict=sim_strict,
            budget_bytes=device_budget_bytes,
            lag_s=sim_lag_s,
            sim_profile=sim_profile,
            compute_threads=max(1, round(_cores() * reserved)),
            compute_dtype=self.dtype,
        )
        self.device = self.accel.device
        # the device-side AdamW (zenflow mode): torch's fused kernel where it has one
        self.fused_device_adam = device_adam == "fused" and fused_available(self.device)
        devices = {s.param.device for s in self.specs}
        if len(devices) > 1:
            raise EngineError(f"All trainable parameters must be on one device, found {devices}.")
        if not _device_matches(next(iter(devices)), self.device):
            raise EngineError(
                f"The accelerator is {self.accel.kind} ({self.device}) but the model's "
                f"parameters are on {next(iter(devices))}: move the model first "
                f"(model.to('{self.device}'))."
            )
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
        self.gas = max(1, int(getattr(config, "gradient_accumulation_steps", 1) or 1))
        self._host_kernel_arg = host_kernel
        self._kernel = None
        self.kernel_name = "-"
        opt = config.optimizer
        betas = tuple(opt.betas)
        self.hp_base = AdamHyper(
            lr=float(opt.lr),
            beta1=float(betas[0]),
            beta2=float(betas[1]),
            eps=float(opt.eps),
            weight_decay=float(opt.weight_decay),
            adamw_mode=bool(getattr(opt, "adamw_mode", True)),
        )
        self.clip = float(getattr(config, "gradient_clipping", 0.0) or 0.0)
        self.global_step = 0  # optimizer steps applied (skipped steps excluded)
        self.skipped_steps = 0
        self._lr = self.hp_base.lr
        self._closed = False
        self._failed: BaseException | None = None
        self.rec = StepRecord()
        self.last_peak_held: dict[str, int] = {}  # device bytes per holder at the last peak
        self._torch_threads_orig = torch.get_num_threads()
        self.bucket_request = int(getattr(config, "reduce_bucket_size", 0) or 0) or None
        self.dp = DataParallel()

        masters = self._take_masters_and_cast(masters)
        self.model_bytes = sum(s.param.numel() * s.param.element_size() for s in self.specs)
        self.accel.set_held("weights", sum(p.numel() * p.element_size()
                                           for p in model.parameters()))  # fmt: skip
        self.zf = None
        self.dense: list[DenseState] = []
        overlap = False
        if mode == "zenflow":
            from zenflow.config.schema import ZenFlowConfig

            self.zf = config.zenflow if config.zenflow is not None else ZenFlowConfig()
            overlap = bool(self.zf.overlap_step)
            self.select_every = self._resolve_select_interval(self.zf, steps_per_epoch)
        # The core split: the device's compute (a separate device: its reserved share of the
        # cores, whatever the mode) and the host's work.
        reserved = float(self.zf.pt_reserved_cores_perc) if self.zf else 0.5
        self.training_threads, self.host_threads = self.accel.compute_threads(
            reserved, overlap, ranks_per_node
        )
        torch.set_num_threads(self.training_threads)
        if mode == "device":
            self.impl = DeviceMode(self, masters)
        elif mode == "offload":
            self.impl = OffloadMode(self, masters)
        else:
            self.dense = [self._dense_state(s, masters[s.name]) for s in self.specs
                          if not s.is_zenflow]  # fmt: skip
            self.impl = ZenFlowMode(self, masters)
        del masters  # the host state holds its own copies now
        self.stream = GradStream(
            self, self.impl, streaming=self.stream_grads and mode != "device", gas=self.gas,
            on_device_accumulation=self.grad_accumulation == "device",
        )  # fmt: skip
        self.resolved: dict = {
            "mode": mode,
            "accelerator": self.accel.kind,
            "device": str(self.device),
            "device_description": self.accel.describe(),
            "dtype": str(self.dtype).replace("torch.", ""),
            "pinned_host_buffers": self.pin,
            "stream_grads": self.stream_grads and mode != "device",
            "grad_accumulation": self.grad_accumulation if self.gas > 1 else None,
            "copy_buckets": self.copy_buckets,
            "training_threads": self.training_threads,
            "host_threads": self.host_threads,
            "world_size": self.dp.world,
            "steps_per_epoch": steps_per_epoch,
            **self.impl.resolved(),
            "host_kernel": "-" if mode == "device" else self.kernels().name,
            **({"device_update": self.device_update_name()} if mode == "zenflow" else {}),
            "model_bytes": self.model_bytes,
            "gradient_clipping": self.clip,
            "bf16": self.bf16,
        }

    # ------------------------------------------------------------------ setup
    def _check_dtypes(self) -> None:
        dtypes = {s.param.dtype for s in self.specs}
        allowed = {torch.float32, torch.bfloat16} if self.bf16 else {torch.float32}
        if not dtypes <= allowed:
            names = [s.name for s in self.specs if s.param.dtype not in allowed][:3]
            fix = (
                "set bf16.enabled to true to train a bf16 model (fp32 master on the host), "
                "or load it in fp32 (model.float())"
                if torch.bfloat16 in dtypes
                else "load the model in fp32 or bf16"
            )
            raise EngineError(
                f"Trainable parameters of dtype {sorted(map(str, dtypes))} (e.g. "
                f"{', '.join(names)}) are not supported with bf16.enabled={self.bf16}: {fix}."
            )

    def _take_masters_and_cast(self, given) -> dict[str, torch.Tensor]:
        """fp32 host copies of the trainable weights (the masters' initial values), then
        the model in the training dtype on the device. ``given``: masters taken before the
        model was cast and moved (``prepare_model``), so the device never holds fp32."""
        if given is not None:
            missing = [s.name for s in self.specs if s.name not in given]
            if missing:
                raise EngineError(f"masters= lacks {', '.join(missing[:3])}.")
            masters = {s.name: given[s.name] for s in self.specs}
        else:
            masters = {s.name: s.param.detach().float().cpu().clone() for s in self.specs}
        if self.bf16 and any(s.param.dtype != torch.bfloat16 for s in self.specs):
            self.model.to(dtype=torch.bfloat16)  # the same Parameter objects, bf16 data
        return masters

    def _dense_state(self, s: ParamSpec, master: torch.Tensor) -> DenseState:
        acc = self.accel
        m = None
        if s.param.dtype != torch.float32:
            m = acc.track(master.to(self.device).clone(), "optimizer")
        return DenseState(
            s, m, acc.zeros(s.param.shape, torch.float32, "optimizer"),
            acc.zeros(s.param.shape, torch.float32, "optimizer"),
        )  # fmt: skip

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

    def kernels(self):
        """The host ops (CPU Adam, its compact twin, the accumulate), resolved on first use:
        the native ops build lazily."""
        if self._kernel is None:
            self._kernel = resolve_kernel(self._host_kernel_arg)
            self.kernel_name = self._kernel.name
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

    @property
    def max_in_flight(self) -> int:
        worker = getattr(self.impl, "worker", None)
        return worker.max_in_flight if worker is not None else 0

    def device_update_name(self) -> str:
        if self.fused_device_adam:
            return "fused (torch._fused_adamw_, as torch.optim.AdamW(fused=True))"
        return "reference (torch.optim.AdamW's single-tensor op order)"

    def dense_update(self, hp: AdamHyper) -> None:
        """Device AdamW on every always-important parameter (fp32 master when bf16): one
        fused call per step count, or the reference op by op."""
        groups: dict[int, list] = {}
        for d in self.dense:
            g = d.spec.param.grad
            if g is None:
                continue
            d.step += 1
            x = d.spec.param.data if d.master is None else d.master
            groups.setdefault(d.step, []).append((d, x, g.detach().float()))
        for step, items in groups.items():
            adamw_fused_([x for _, x, _ in items], [g for _, _, g in items],
                         [d.exp_avg for d, _, _ in items], [d.exp_avg_sq for d, _, _ in items],
                         step, hp, fused=self.fused_device_adam)  # fmt: skip
            for d, _, _ in items:
                if d.master is not None:
                    d.spec.param.data.copy_(d.master)

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
        hp = AdamHyper(self._lr, *(getattr(self.hp_base, f) for f in _HP_REST))
        self.rec = StepRecord()
        with torch.no_grad():
            self.impl.flush(self.global_step, hp)

    def state_dict(self, share_host: bool = False) -> dict:
        """Everything needed to continue exactly (``zenflow.engine.checkpoint``).
        ``share_host``: reference the host state instead of copying it; write the result
        before the engine runs again."""
        return engine_state_dict(self, share_host)

    def load_state_dict(self, sd: dict) -> None:
        load_engine_state(self, sd)

    # ------------------------------------------------------------------ the step
    def _norm_terms(self) -> list[torch.Tensor]:
        """fp32 device tensors whose squares sum to this rank's share of the squared global
        norm: the per-tensor norms of the gradients still on the device (the always-important
        parameters', or every gradient without streaming) and the mode's streamed partials.
        Data parallel: the whole-gradient path averages here (``sync_grads``); the streamed
        path averaged in the backward, and only the always-important gradients remain."""
        impl, dp = self.impl, self.dp
        routed = [s for s in self.specs if self.stream.mode.routes(s)]
        whole_path = not routed or getattr(impl, "zero_copy", False)
        present = [s.param.grad for s in self.specs if s.param.grad is not None]
        if dp.enabled:
            for s in self.specs:  # every rank takes part in every collective, same shapes
                if s.param.grad is None and not impl.routes(s):
                    s.param.grad = torch.zeros_like(s.param)
            if whole_path:
                return impl.sync_grads(dp)
            rest = [s.param.grad for s in self.specs if not impl.routes(s)]
            dp.allreduce_mean_(rest)
            return (norms_of(rest) if dp.rank == 0 else []) + impl.norm_terms()
        terms = norms_of(present)
        if not whole_path:
            terms += impl.norm_terms()
        return terms

    def step(self, loss=None) -> StepStats:
        """One optimizer step over the step's gradients -> :class:`StepStats`.

        One device-to-host read per step (``Accelerator.read``): the loss, the global norm
        and the auto-interval masses together; everything else stays on the device or on
        the host. With micro-batches summed on the host the norm's host share is waited for
        too (a host wait, counted as stall)."""
        if self._closed:
            raise RuntimeError("ZenFlowEngine.step() after close().")
        if self._failed is not None:
            raise RuntimeError(
                "ZenFlowEngine is unusable after a host worker failure."
            ) from self._failed
        t_start = time.perf_counter()
        self.rec = StepRecord()
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
        t = self.global_step + 1
        self._lr = lr = float(lr_at(self.config, t))
        hp = AdamHyper(lr, *(getattr(self.hp_base, f) for f in _HP_REST))
        terms = self._norm_terms()
        total = (torch.linalg.vector_norm(torch.stack(terms), 2.0) if terms
                 else torch.zeros((), dtype=torch.float32, device=self.device))  # fmt: skip
        auto = self.impl.auto_terms() if hasattr(self.impl, "auto_terms") else []
        loss_t = loss.detach() if torch.is_tensor(loss) else None
        reads = [total] + auto + ([loss_t] if loss_t is not None else [])
        values = self.accel.read(reads)
        norm_local = values[0]
        auto_vals = values[1 : 1 + len(auto)]
        if loss_t is not None:
            loss_f = values[-1]
        else:
            loss_f = None if loss is None else float(loss)
        host_sq = self.impl.host_sq() if hasattr(self.impl, "host_sq") else 0.0
        if auto_vals and hasattr(self.impl, "auto_host_masses"):
            for i, m in enumerate(self.impl.auto_host_masses()):
                auto_vals[2 * i + 1] += m
        bad_loss = float(loss_f is not None and not math.isfinite(loss_f))
        if self.dp.enabled:
            sq, bad, *auto_vals = self.dp.allreduce_sum(
                [norm_local * norm_local + host_sq, bad_loss, *auto_vals]
            )
            grad_norm = math.sqrt(sq) if math.isfinite(sq) and sq >= 0 else float("nan")
            nonfinite = bad > 0
        else:
            grad_norm = norm_local
            if host_sq:
                sq = norm_local * norm_local + host_sq
                grad_norm = math.sqrt(sq) if math.isfinite(sq) else float("nan")
            nonfinite = bool(bad_loss)
        skipped = nonfinite or not math.isfinite(grad_norm)
        coef, coef_t = 1.0, None
        if not skipped and self.clip > 0:
            # fp32, as torch computes it on the device: clamp(clip / (norm + 1e-6), max=1)
            c = torch.clamp(self.clip / (torch.tensor(grad_norm, dtype=torch.float32) + 1e-6),
                            max=1.0)  # fmt: skip
            coef = float(c)
            if coef < 1.0:  # a multiplication by exactly 1 changes nothing
                coef_t = torch.full((), coef, dtype=torch.float32, device=self.device)
        if hasattr(self.impl, "plan") and self.impl.plan is not None:
            self.impl.plan.gate.set(coef, skipped)
        if skipped:
            self.skipped_steps += 1
            if hasattr(self.impl, "skip_step"):
                self.impl.skip_step()
        else:
            try:
                if coef_t is not None:  # what is still on the device is clipped in place
                    for s in self.specs:
                        if s.param.grad is not None:
                            s.param.grad.detach().mul_(coef_t)  # in fp32, rounded once
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
            self.global_step = t
        self.stream.reset()
        rec = self.rec
        syncs = self.accel.syncs
        stats = StepStats(
            step=t,
            lr=lr,
            loss=loss_f,
            step_ms=(time.perf_counter() - t_start) * 1e3,
            device_opt_ms=rec.devopt_s * 1e3,
            stall_ms=rec.stall_s * 1e3,
            transfer_ms=rec.transfer_s * 1e3,
            d2h_bytes=self.accel.traffic.d2h_bytes,
            h2d_bytes=self.accel.traffic.h2d_bytes,
            device_bytes=self.accel.device_bytes(),
            device_peak_bytes=self.accel.peak_bytes(),
            pinned_host_bytes=self.accel.pinned_bytes(),
            host_bytes=sum(self.accel.host_held().values()),
            full_syncs=syncs.full,
            d2h_reads=syncs.reads,
            overlap_share=self.accel.overlap_share(),
            host_update=rec.host_update,
            window_len=rec.window_ended,
            selection_changed=rec.moved,
            grad_norm=grad_norm,
            skipped=skipped,
            warmup=rec.warmup,
            mode=self.mode,
        )
        # the next step's figures start here (the trainer's forward/backward included)
        self.last_peak_held = self.accel.peak_held()
        self.accel.traffic.reset()
        syncs.reset()
        self.accel.reset_peak()
        return stats

    def _whole_clipped(self) -> bool:
        """Whether the mode's gradients were clipped in place with the rest (whole-gradient
        paths), so the mode must not scale them again."""
        return getattr(self.impl, "zero_copy", False) or self.mode == "device"
