"""``--engine deepspeed``: DeepSpeed 0.19.6's own ZeRO-Offload or ZenFlow behind our engine API.

``DeepSpeedAdapter(model, config)`` runs ``deepspeed.initialize`` on the model with the same
DeepSpeed JSON config our engine reads, and exposes what the trainer and ``zfctl bench`` use
of ``ZenFlowEngine``: ``backward``, ``step -> StepStats``, ``zero_grad``, ``autocast``,
``flush``, ``state_dict``/``load_state_dict``, ``close``, ``model_bytes``, ``resolved``.
DeepSpeed's ZenFlow runs when the config has a ``zero_optimization.zenflow`` block, its
ZeRO-Offload (stage 2, optimizer on the CPU) when it has none.

What DeepSpeed needs, and how it gets it here:

- **Forward through DeepSpeed's engine.** 0.19.6 registers its backward hooks (ZeRO's
  gradient reduction into the offloaded partition) on the *outputs of its own forward*; a
  forward through the bare module skips them. ``train_module`` is the DeepSpeed engine: the
  trainer calls it for the training forward. Evaluation may call the module directly.
- **Backward.** ``backward(loss)`` is ``model_engine.backward(loss)``; a plain
  ``loss.backward()`` on a loss from ``train_module`` takes the same path (0.19.6 supports
  torch-style backward with ZeRO). Both divide by DeepSpeed's own accumulation count, which
  is 1 here for offload, and ``update_interval`` for ZenFlow (DeepSpeed's ZenFlow reuses
  ``gradient_accumulation_steps`` as its window: that is how it averages a window's
  gradient).
- **Gradient accumulation.** The caller's loop accumulates (loss divided by
  ``gradient_accumulation_steps``, then one ``step()``), as with our engine. DeepSpeed is
  told ``gradient_accumulation_steps: 1`` and, for offload with accumulation,
  ``managed_gradient_accumulation: false`` (every ``step()`` is the boundary; tested equal
  to one step over the whole batch). DeepSpeed's ZenFlow cannot accumulate micro-batches
  (its window takes the accumulation count), so it refuses ``gradient_accumulation_steps``
  above 1.
- **Selection interval.** Without a data loader DeepSpeed's ``select_strategy`` ``auto`` and
  ``epoch`` never re-select (ZENFLOW.md section 5). Given ``steps_per_epoch``, the adapter
  passes the resolved interval in steps (``"step"``), as our engine resolves it.
- **A process group.** DeepSpeed needs ``torch.distributed``. When none exists, the adapter
  creates a single-process group (gloo on cpu, nccl on cuda) on an in-memory ``HashStore``:
  no TCP port, nothing to hang on, destroyed by ``close()``. ``MASTER_ADDR``/``MASTER_PORT``
  only name DeepSpeed's CPU shared-memory segment (about 70 MB, which DeepSpeed never
  removes); the adapter unlinks it right after ``initialize`` (one rank maps it and needs
  no name).
- **Quiet stdout.** DeepSpeed logs and prints to stdout (its config at ``initialize``, its
  timers every step with ``wall_clock_breakdown``), which would break ``--json`` output and
  the live dashboard. Its logger goes to stderr at WARNING, and its per-step prints are
  dropped while the adapter lives.

What is not observable: DeepSpeed reports no stall, no copy traffic and no device optimizer
time, so ``stall_ms``, ``transfer_ms``, ``d2h_bytes``, ``h2d_bytes``, ``device_opt_ms`` and
``selection_changed`` stay 0 and are listed in ``resolved["unavailable_fields"]`` (the
dashboard says so); ``device_bytes`` (no per-holder accounting) is None. ``step_ms`` is the
wall time of ``model_engine.step()`` measured here; ``forward_ms``/``backward_ms`` come from
DeepSpeed's ``wall_clock_breakdown`` timers when the config enables them (the trainer
measures its own either way); ``host_update`` and ``window_len`` follow DeepSpeed's update
boundary.

Checkpoints: runs on this engine cannot be resumed. DeepSpeed 0.19.6 keeps no checkpoint of
ZenFlow's state (selected columns, device and host moments, accumulated gradients), and the
adapter does not restore DeepSpeed's ZeRO optimizer state either, so ``state_dict()`` holds
a marker only and ``load_state_dict`` refuses with a message. ``flush()`` does nothing:
DeepSpeed has no call that applies a partial ZenFlow window, so the non-selected columns'
last (partial) window is not in the final weights (said in ``resolved``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from zenflow.engine.stats import StepStats
from zenflow.errors import EngineError, UserInputError

DEEPSPEED_VERSION = "0.19.6"  # pinned in pyproject.toml; see tests/test_deepspeed_pin.py
# StepStats fields DeepSpeed does not report: left at 0, named in resolved.
UNAVAILABLE_FIELDS = (
    "stall_ms", "transfer_ms", "d2h_bytes", "h2d_bytes", "device_opt_ms", "selection_changed",
)  # fmt: skip
_SHM_PREFIX = "deepspeed_allreduce_buffer"  # DeepSpeed's CPU comm segment (csrc/cpu/comm)


def _quiet(*_args, **_kwargs) -> None:
    """Stand-in for DeepSpeed's per-step stdout prints."""


def _silence_deepspeed() -> None:
    """DeepSpeed's logger to stderr at WARNING; its per-step prints (timers, ZenFlow's auto
    window) dropped. Process-wide: DeepSpeed is only ever used through this adapter."""
    from deepspeed.ops.adam import zenflow_torch_adam
    from deepspeed.runtime.zenflow import engine as zf_engine
    from deepspeed.utils import logger
    from deepspeed.utils import timer as ds_timer

    logger.setLevel(logging.WARNING)
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    ds_timer.print_dist = _quiet  # wall_clock_breakdown's "time (ms) | ..." every step
    zf_engine.print = _quiet  # "Zenflow: This is an update iter" with update_interval auto
    zenflow_torch_adam.print = _quiet  # "Zenflow: clearing selective optimizer states..."
    # Its ZenFlow Adam calls a deprecated torch function every step: one warning, not news.
    warnings.filterwarnings("ignore", message=r"`torch\._utils\.is_compiling` is deprecated")


def _set_default_env(port: str) -> None:
    """The environment DeepSpeed reads for a single local process (user values win)."""
    for key, value in (
        ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port),
    ):  # fmt: skip
        os.environ.setdefault(key, value)


def shm_segment_paths() -> list[Path]:
    """This process's DeepSpeed CPU comm segments in /dev/shm (named by uid, MASTER_ADDR,
    MASTER_PORT and rank)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not addr or not port:
        return []
    name = f"{_SHM_PREFIX}_{os.getuid()}_{addr}_{port}_{os.environ.get('RANK', '0')}"
    path = Path("/dev/shm") / name
    return [path] if path.exists() else []


def deepspeed_config(config, *, steps_per_epoch: int | None = None) -> tuple[dict, dict]:
    """The JSON dict handed to ``deepspeed.initialize``, and notes on what was adapted.

    Starts from ``config.to_json_dict()`` (the user's keys, ours normalised); sets the batch
    keys for one rank with the caller's accumulation (see the module docstring) and resolves
    an epoch-based ZenFlow selection interval to steps when ``steps_per_epoch`` is known.
    """
    gas = int(config.gradient_accumulation_steps)
    zf = config.zenflow
    if zf is not None and gas > 1:
        raise UserInputError(
            f"gradient_accumulation_steps is {gas}, but DeepSpeed's ZenFlow cannot accumulate "
            "micro-batches (it uses gradient_accumulation_steps as its update window). Set "
            '"gradient_accumulation_steps": 1 with --engine deepspeed, or use --engine zenflow.'
        )
    micro = config.train_micro_batch_size_per_gpu
    if micro is None:
        raise UserInputError(
            "--engine deepspeed needs train_micro_batch_size_per_gpu in the config (or "
            "--micro-batch)."
        )
    out = config.to_json_dict()
    if config.bf16 == "auto":  # DeepSpeed takes a bool: resolved for where it runs
        from zenflow.engine.engine_setup import resolve_bf16

        out["bf16"]["enabled"] = resolve_bf16("auto", None)
    out.pop("train_batch_size", None)
    out["train_micro_batch_size_per_gpu"] = int(micro)
    out["gradient_accumulation_steps"] = 1
    notes: dict[str, Any] = {}
    if gas > 1:
        # The caller accumulates; every step() is DeepSpeed's boundary.
        out["managed_gradient_accumulation"] = False
        notes["accumulation"] = f"{gas} micro-batches per step, accumulated by the caller"
    if zf is not None:
        block = out["zero_optimization"]["zenflow"]
        strategy, interval = zf.select_strategy, zf.select_interval
        steps = None
        if strategy == "step" and interval != "auto":
            steps = int(interval)
        elif steps_per_epoch:
            epochs = 1 if strategy in ("auto", "step") or interval == "auto" else int(interval)
            steps = epochs * int(steps_per_epoch)
        if steps is not None:
            block["select_strategy"], block["select_interval"] = "step", steps
            notes["select_interval_steps"] = steps
        else:
            notes["select_interval_steps"] = None
            notes["selection_note"] = (
                "epoch length unknown: DeepSpeed selects once and never re-selects"
            )
    return out, notes


def unsupported_notes(config) -> list[str]:
    """What of ``config`` DeepSpeed's engine does not do (zfctl's own options), said once in
    the run's header: the run goes on as DeepSpeed does it."""
    notes = []
    if config.zenflow is not None and config.engine.window_lr != "last":
        notes.append(
            f'zfctl.window_lr "{config.engine.window_lr}" is an option of zfctl\'s engine: '
            "DeepSpeed's ZenFlow takes each window's host step at the lr of the window's last "
            "step, and so does this run."
        )
    if config.zenflow is not None and config.engine.select_schedule != "fixed":
        notes.append(
            f'zfctl.select_schedule "{config.engine.select_schedule}" is an option of zfctl\'s '
            "engine: DeepSpeed's ZenFlow re-selects every select interval, and so does this run."
        )
    if config.zenflow is not None and config.engine.early.on:
        notes.append(
            f"zfctl.early (steps {config.engine.early.steps}) is an option of zfctl's engine: "
            "DeepSpeed's ZenFlow runs its configured windows from the first step, and so does "
            "this run."
        )
    if config.zenflow is not None and config.engine.return_image == "always":
        notes.append(
            'zfctl.return_image "always" is an option of zfctl\'s engine: DeepSpeed copies '
            "its host results back to the device its own way, and so does this run."
        )
    if config.zenflow is not None and config.engine.host_state != "exact":
        notes.append(
            f'zfctl.host_state "{config.engine.host_state}" is an option of zfctl\'s engine: '
            "DeepSpeed's ZenFlow keeps fp32 Adam moments on the host, and so does this run."
        )
    return notes


def _trainable_params(model) -> tuple[list, Any]:
    """The model's trainable parameters and their device (cpu or cuda)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise EngineError("The model has no trainable parameters (requires_grad=True).")
    device = params[0].device
    if device.type not in ("cpu", "cuda"):
        raise EngineError(
            f"--engine deepspeed runs on cpu or cuda; the model is on {device}. Use "
            "--engine zenflow for other accelerators."
        )
    return params, device


def _check_offload_config(config) -> None:
    """DeepSpeed's ZeRO-Offload needs stage 2 with the optimizer on the CPU (ZenFlow: a
    zenflow block)."""
    if config.zenflow is None and (config.zero_stage != 2 or config.offload_device != "cpu"):
        raise UserInputError(
            "--engine deepspeed runs DeepSpeed's ZeRO-Offload or ZenFlow: the config needs "
            '"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}} '
            f"(found stage {config.zero_stage}, offload device {config.offload_device}), "
            "and a zenflow block for ZenFlow (templates/offload.json, templates/zenflow.json)."
        )


class DeepSpeedAdapter:
    """DeepSpeed's engine (``deepspeed.initialize``) with the interface of ``ZenFlowEngine``.

    ``model`` is on its device (cpu or cuda), fp32; ``config`` a ``zenflow.config.Config``.
    ``steps_per_epoch`` resolves epoch-based ZenFlow selection (see ``deepspeed_config``).
    """

    def __init__(self, model, config, *, steps_per_epoch: int | None = None):
        self.model = model
        self.config = config
        self._closed = False
        self._flushed = False
        params, device = _trainable_params(model)
        self.model_bytes = sum(p.numel() * p.element_size() for p in params)
        _check_offload_config(config)
        self.mode = "zenflow" if config.zenflow is not None else "offload"
        self.device = device
        ds_config, notes = deepspeed_config(config, steps_per_epoch=steps_per_epoch)
        self.ds_config = ds_config
        self._bf16 = bool(ds_config["bf16"]["enabled"])
        accel = "cuda" if device.type == "cuda" else "cpu"
        deepspeed = self._import_deepspeed(accel, device)
        self._initialize(deepspeed, params, accel)
        self.global_step = 0
        self._since_boundary = 0
        self._timers = bool(config.wall_clock_breakdown)
        self.resolved: dict[str, Any] = self._resolved(deepspeed.__version__, accel, notes)

    def _import_deepspeed(self, accel: str, device):
        """DeepSpeed imported for ``accel`` (its accelerator is chosen at import), pinned
        version checked, quietened, its CPU ops built; the environment of a single local
        process set when no process group exists (``_own_group``)."""
        if os.environ.get("DS_ACCELERATOR", accel) != accel:
            raise EngineError(
                f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} but the model is on {device}; "
                f"unset DS_ACCELERATOR or set it to {accel}."
            )
        os.environ["DS_ACCELERATOR"] = accel
        import torch.distributed as dist

        self._own_group = not dist.is_initialized()
        if self._own_group:
            # Only names DeepSpeed's shared-memory segment: one name per process.
            _set_default_env(str(20000 + os.getpid() % 20000))
        try:
            import deepspeed
        except ImportError as exc:  # pragma: no cover - a dependency of the project
            raise UserInputError(
                f"--engine deepspeed needs deepspeed=={DEEPSPEED_VERSION} (pip install "
                f"deepspeed=={DEEPSPEED_VERSION}); importing it failed: {exc}"
            ) from exc
        if deepspeed.__version__ != DEEPSPEED_VERSION:
            raise UserInputError(
                f"--engine deepspeed is pinned to DeepSpeed {DEEPSPEED_VERSION}, found "
                f"{deepspeed.__version__} (0.19.7 and 0.19.8 corrupt every 2-D weight at "
                "initialize with ZenFlow on). Reinstall with scripts/setup.sh."
            )
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != accel:
            raise EngineError(
                f"DeepSpeed chose its {get_accelerator().device_name()} accelerator but the "
                f"model is on {device}. Set DS_ACCELERATOR={accel} before anything imports "
                "deepspeed."
            )
        _silence_deepspeed()
        from zenflow.ops.loader import load_deepspeed_op

        # Built under zenflow's build guard (a killed build's lock is cleared, not waited on);
        # deepspeed.initialize then reuses the loaded modules.
        load_deepspeed_op("CPUAdamBuilder")
        if accel == "cpu":
            load_deepspeed_op("ShareMemCommBuilder")
        return deepspeed

    def _initialize(self, deepspeed, params: list, accel: str) -> None:
        """``deepspeed.initialize`` in this process's group (created here when there is
        none); the shared-memory segment's name is unlinked right after."""
        import torch
        import torch.distributed as dist

        if self._own_group:
            backend = "nccl" if accel == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self._affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self._threads = torch.get_num_threads()
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # config dump, "built successfully"
                self.model_engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
                    model=self.model, model_parameters=params,
                    config=copy.deepcopy(self.ds_config),
                )  # fmt: skip
        except BaseException:
            self._destroy_group()
            raise
        finally:
            for path in shm_segment_paths():
                path.unlink(missing_ok=True)

    def _resolved(self, version: str, accel: str, notes: dict) -> dict[str, Any]:
        """What the engine runs with (``ZenFlowEngine.resolved``'s keys where they apply)."""
        import torch.distributed as dist

        config = self.config
        zenflow = None
        if self.mode == "zenflow":
            engine = self.model_engine
            block = self.ds_config["zero_optimization"]["zenflow"]
            zenflow = {
                "topk_ratio": config.zenflow.topk_ratio,
                "update_interval": "auto" if engine.auto_update else engine.update_interval,
                "select_strategy": block["select_strategy"],
                "select_interval": engine.select_interval,
                "overlap_step": bool(engine.overlap_step),
                "full_warm_up_rounds": engine.full_warm_up_rounds,
            }
        resolved: dict[str, Any] = {
            "engine": "deepspeed",
            "deepspeed_version": version,
            "mode": f"deepspeed-{self.mode}",
            "device": str(self.device),
            "accelerator": accel,
            "zero_stage": int(self.model_engine.zero_optimization_stage()),
            "offload_device": str(config.offload_device),
            "optimizer_class": type(self.optimizer).__name__,
            "host_kernel": "DeepSpeed ZenFlowCPUAdam"
            if self.mode == "zenflow"
            else "DeepSpeedCPUAdam",
            "zenflow": zenflow,
            "process_group": (
                f"{dist.get_backend()}, world size {dist.get_world_size()}"
                + (" (created by zfctl)" if self._own_group else "")
            ),
            "unavailable_fields": list(UNAVAILABLE_FIELDS),
            "resumable": False,
            "flush": "DeepSpeed cannot apply a partial ZenFlow window: the last window's "
            "non-selected gradients are not in the final weights"
            if self.mode == "zenflow"
            else "nothing to do: every offload step is complete",
            "model_bytes": self.model_bytes,
            "gradient_clipping": config.gradient_clipping,
            "bf16": self._bf16,
            **notes,
        }
        if zenflow is not None:  # the trainer's header reads these top-level keys
            resolved.update(zenflow)
        return resolved

    # ------------------------------------------------------------------ the engine API
    @property
    def train_module(self):
        """What the training forward must call: DeepSpeed's engine (it wraps ``model``)."""
        return self.model_engine

    def autocast(self):
        """A no-op context: DeepSpeed applies bf16 itself (its module holds bf16 weights)."""
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        """``model_engine.backward(loss)`` (DeepSpeed scales by its own accumulation count)."""
        self.model_engine.backward(loss)

    def step(self, loss=None) -> StepStats:
        """``model_engine.step()`` -> StepStats (see the module docstring for the fields)."""
        import torch

        if self._closed or self._flushed:
            raise RuntimeError(
                f"DeepSpeedAdapter.step() after {'close' if self._closed else 'flush'}()."
            )
        engine = self.model_engine
        boundary = bool(engine.is_gradient_accumulation_boundary())
        lr = float(engine.optimizer.param_groups[0]["lr"])  # this step's (scheduler runs after)
        skipped_before = int(getattr(engine, "skipped_steps", 0))
        t0 = time.perf_counter()
        engine.step()
        # host wall time of the step, as ZenFlowEngine's step_ms: no full synchronize here,
        # which on CUDA would drain DeepSpeed's own copy streams every step (the step's
        # one device read below, the loss, waits for the compute stream only)
        step_ms = (time.perf_counter() - t0) * 1e3
        self.global_step += 1
        self._since_boundary += 1
        window_len = 0
        if boundary:
            window_len, self._since_boundary = self._since_boundary, 0
        timers = engine.get_wall_clock_timers() if self._timers else {}
        norm = engine.get_global_grad_norm()
        loss_f = None if loss is None else float(loss.detach() if torch.is_tensor(loss) else loss)
        return StepStats(
            step=self.global_step,
            lr=lr,
            loss=loss_f,
            step_ms=step_ms,
            forward_ms=float(timers.get("fwd_microstep", 0.0)),
            backward_ms=float(timers.get("bwd_microstep", 0.0)),
            host_update=boundary,
            window_len=window_len if self.mode == "zenflow" else 0,
            grad_norm=None if norm is None else float(norm),
            skipped=int(getattr(engine, "skipped_steps", 0)) > skipped_before,
            mode=f"deepspeed-{self.mode}",
            device_bytes=None,  # DeepSpeed does not account its device memory by holder
        )

    def zero_grad(self) -> None:
        """Drop ``param.grad`` (DeepSpeed already reduced them into its own buffers)."""
        self.model_engine.zero_grad()

    def flush(self) -> None:
        """The end of training: hand the module weights Hugging Face can save.

        DeepSpeed has no call that applies a partial ZenFlow window (``resolved["flush"]``).
        Its ZenFlow keeps each 2-D weight column-major, a transposed view into its flat
        buffer, which ``save_pretrained`` cannot write; the module gets contiguous copies
        (same values) and this adapter refuses further steps, since DeepSpeed would update
        its buffer, no longer the module.
        """
        if self.mode != "zenflow" or self._flushed:
            return
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                if not p.is_contiguous():
                    p.data = p.data.contiguous()
        self._flushed = True

    def state_dict(self, share_host: bool = False) -> dict:
        """A marker, not a resumable state (see the module docstring)."""
        return {"engine": "deepspeed", "resumable": False, "global_step": self.global_step}

    def load_state_dict(self, state: dict) -> None:
        raise UserInputError(
            "Runs with --engine deepspeed cannot be resumed: DeepSpeed 0.19.6 keeps no "
            "checkpoint of its ZenFlow state (selected columns, moments, accumulated "
            "gradients) and zfctl does not restore DeepSpeed's ZeRO optimizer state. Start a "
            "new run, or use --engine zenflow or offload, whose runs resume exactly."
        )

    def close(self) -> None:
        """Destroy the process group this adapter created; give back the cores DeepSpeed's
        ZenFlow overlap took (it pins this process to its training share)."""
        if self._closed:
            return
        self._closed = True
        import torch

        if self._affinity is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._affinity)
        torch.set_num_threads(self._threads)
        self._destroy_group()

    def _destroy_group(self) -> None:
        from zenflow.engine.distributed import leave_process_group

        if self._own_group:  # one rank: the barrier cannot wait for anyone
            leave_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
