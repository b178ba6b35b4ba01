"""Engine set-up: what ``ZenFlowEngine.__init__`` resolves before the first step.

The arguments checked, the trainable parameters found, the training dtype (``bf16``
"auto" resolved), the accelerator opened and the model's device checked against it, the
AdamW hyper-parameters read, the fp32 masters taken before the model is cast, the
selection interval in steps, and the resolved-settings record (``engine.resolved``).

Plain functions of the model, the config and the accelerator: they hold no state and
never step. Must not import ``schedule`` (the engine imports this) nor any mode.
"""

from __future__ import annotations

import contextlib
import os

import torch

from zenflow.engine.accelerator import Accelerator, make_accelerator, numa
from zenflow.engine.device_adam import DEVICE_ADAM_IMPLS, AdamHyper
from zenflow.engine.selection import ParamSpec, classify_params
from zenflow.errors import EngineError

MODES = ("zenflow", "offload", "device")


def check_arguments(mode: str, device_adam: str) -> None:
    if mode not in MODES:
        raise EngineError(f"mode={mode!r} is not allowed: use one of {', '.join(MODES)}.")
    if device_adam not in DEVICE_ADAM_IMPLS:
        raise EngineError(
            f"device_adam={device_adam!r} is not allowed: use one of "
            f"{', '.join(DEVICE_ADAM_IMPLS)}."
        )


def trainable_specs(model: torch.nn.Module, min_numel: int) -> list[ParamSpec]:
    specs = classify_params(model, min_numel)
    if not specs:
        raise EngineError("The model has no trainable parameters (requires_grad=True).")
    return specs


# ---------------------------------------------------------------------- training dtype
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


def accelerator_kind(accelerator: str | Accelerator | None) -> str | None:
    """The kind asked for (None: not decided yet, cuda if present)."""
    if isinstance(accelerator, str) or accelerator is None:
        return accelerator
    return accelerator.kind


def check_dtypes(specs: list[ParamSpec], bf16: bool) -> None:
    dtypes = {s.param.dtype for s in specs}
    allowed = {torch.float32, torch.bfloat16} if bf16 else {torch.float32}
    if not dtypes <= allowed:
        names = [s.name for s in specs if s.param.dtype not in allowed][:3]
        fix = (
            "set bf16.enabled to true to train a bf16 model (fp32 master on the host), "
            "or load it in fp32 (model.float())"
            if torch.bfloat16 in dtypes
            else "load the model in fp32 or bf16"
        )
        raise EngineError(
            f"Trainable parameters of dtype {sorted(map(str, dtypes))} (e.g. "
            f"{', '.join(names)}) are not supported with bf16.enabled={bf16}: {fix}."
        )


def take_masters_and_cast(
    model: torch.nn.Module, specs: list[ParamSpec], bf16: bool, given, mode: str = "zenflow"
) -> dict[str, torch.Tensor]:
    """The fp32 initial values of the trainable weights the mode needs on the host (the
    masters), then the model in the training dtype on the device. No second copy: a weight
    that is fp32 in host memory already (cpu, sim) gives its own tensor, and the cast gives
    the parameter a new bf16 one; an fp32 model that stays fp32 needs no masters in the
    zenflow mode (the device weight holds them: its non-selected columns are read at the
    first selection). ``given``: masters taken before the model was cast and moved
    (``zenflow.train.setup.place_model``, so the device never holds fp32); the caller drops
    its references, the modes pop them as they consume them."""
    if given is not None:
        missing = [s.name for s in specs if s.name not in given]
        if missing:
            raise EngineError(f"masters= lacks {', '.join(missing[:3])}.")
        # taken out of the caller's dict: it holds no reference once the modes consumed them
        masters = {s.name: given.pop(s.name) for s in specs}
    else:
        cast = bf16 and any(s.param.dtype != torch.bfloat16 for s in specs)
        masters = {}
        for s in specs:
            p = s.param.detach()
            if p.dtype == torch.float32 and not cast and mode != "offload":
                continue  # the weight is its own fp32 master
            masters[s.name] = p if p.dtype == torch.float32 and p.device.type == "cpu" \
                else p.float().cpu()  # fmt: skip
    if bf16 and any(s.param.dtype != torch.bfloat16 for s in specs):
        model.to(dtype=torch.bfloat16)  # the same Parameter objects, new bf16 data
    return masters


# ---------------------------------------------------------------------- the accelerator
def _cores() -> int:
    # looked up at each call, so a test's monkeypatched ``accelerator.base.cores`` is seen
    from zenflow.engine.accelerator.base import cores

    return cores()


def open_accelerator(
    accelerator: str | Accelerator | None,
    config,
    mode: str,
    specs: list[ParamSpec],
    dtype: torch.dtype,
    *,
    strict: bool,
    budget_bytes: int | None,
    lag_s: float,
    sim_profile: str | None,
) -> Accelerator:
    """The accelerator the engine runs on, given the model's device and the training
    dtype; a sim core is calibrated on the device's share of the cores."""
    reserved = 0.5
    if mode == "zenflow" and config.zenflow is not None:
        reserved = float(config.zenflow.pt_reserved_cores_perc)
    return make_accelerator(
        accelerator,
        device=specs[0].param.device,
        pin_memory=bool(getattr(config, "pin_memory", True)),
        strict=strict,
        budget_bytes=budget_bytes,
        lag_s=lag_s,
        sim_profile=sim_profile,
        compute_threads=max(1, round(_cores() * reserved)),
        compute_dtype=dtype,
    )


def bind_numa(accel: Accelerator, mode: str, ranks_per_node: int) -> numa.Binding:
    """``zfctl.numa_binding``: every thread of the process on the cores of the device's
    NUMA node where the rules say so (``accelerator.numa``), before the host state is
    allocated (its pages then land on that node); the decision and its reason otherwise."""
    try:
        allowed = set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: nothing to bind
        return numa.Binding("not bound: no CPU affinity on this system")
    node = accel.numa_node() if mode != "off" else None
    return numa.bind(numa.plan(mode, node, numa.node_cpus(), allowed, ranks_per_node))


def sharing_ranks(accel: Accelerator, binding: numa.Binding, ranks_per_node: int) -> int:
    """The ranks whose threads share this process's cores: all the box's, or, bound to a
    node, those whose device is on the same node (local rank r drives device r)."""
    if not binding.bound or ranks_per_node <= 1:
        return ranks_per_node
    same = sum(1 for r in range(ranks_per_node) if accel.numa_node(r) == binding.node)
    return max(1, same)


@contextlib.contextmanager
def lent_cores(engine):
    """Host work on the training thread that the step waits for while the host's own
    kernels are idle (the first selection: scores, concatenations, casts): torch takes the
    host's threads too where the training thread keeps only a few of them
    (``accel.lends_host_cores``: CUDA, whose training thread keeps 2 of 16 cores; an H200
    box's first selection spent 1.9 s more in those ops on 2 threads than on 8)."""
    if not engine.accel.lends_host_cores:
        yield
        return
    torch.set_num_threads(engine.training_threads + engine.host_threads)
    try:
        yield
    finally:
        torch.set_num_threads(engine.training_threads)


def _device_matches(param_device: torch.device, device: torch.device) -> bool:
    if param_device.type != device.type:
        return False
    if device.type != "cuda":
        return True
    pi = param_device.index if param_device.index is not None else torch.cuda.current_device()
    di = device.index if device.index is not None else torch.cuda.current_device()
    return pi == di


def check_model_device(specs: list[ParamSpec], accel: Accelerator) -> None:
    """Every trainable parameter on the accelerator's one device."""
    devices = {s.param.device for s in specs}
    if len(devices) > 1:
        raise EngineError(f"All trainable parameters must be on one device, found {devices}.")
    if not _device_matches(next(iter(devices)), accel.device):
        raise EngineError(
            f"The accelerator is {accel.kind} ({accel.device}) but the model's "
            f"parameters are on {next(iter(devices))}: move the model first "
            f"(model.to('{accel.device}'))."
        )


# ---------------------------------------------------------------------- optimizer settings
def adam_hyper(opt) -> AdamHyper:
    """The configured AdamW hyper-parameters (``config.optimizer``); the lr is the base the
    schedule scales."""
    betas = tuple(opt.betas)
    return AdamHyper(
        lr=float(opt.lr),
        beta1=float(betas[0]),
        beta2=float(betas[1]),
        eps=float(opt.eps),
        weight_decay=float(opt.weight_decay),
        adamw_mode=bool(getattr(opt, "adamw_mode", True)),
    )


def zenflow_settings(config):
    """The zenflow block, or its defaults when the config has none."""
    from zenflow.config.schema import ZenFlowConfig

    return config.zenflow if config.zenflow is not None else ZenFlowConfig()


def resolve_select_interval(zf, steps_per_epoch) -> int:
    """``select_strategy`` and ``select_interval`` as a number of optimizer steps."""
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
                f'select_strategy "step" with select_interval "auto" needs the epoch length. {fix}'
            )
        return int(steps_per_epoch)
    if steps_per_epoch is None or int(steps_per_epoch) < 1:
        raise EngineError(
            f"zero_optimization.zenflow.select_strategy={strategy!r} re-selects per epoch but "
            f"steps_per_epoch={steps_per_epoch!r} is unknown. {fix}"
        )
    epochs = 1 if interval == "auto" or strategy == "auto" else int(interval)
    return epochs * int(steps_per_epoch)


# ---------------------------------------------------------------------- the record
def resolved_settings(engine, steps_per_epoch: int | None) -> dict:
    """``engine.resolved``: every setting as the engine resolved it ("auto" values, the
    accelerator, threads, the mode's own choices), for the run header and the bench."""
    mode = engine.mode
    return {
        "mode": mode,
        "accelerator": engine.accel.kind,
        "device": str(engine.device),
        "device_description": engine.accel.describe(),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "pinned_host_buffers": engine.pin,
        "stream_grads": engine.stream_grads and mode != "device",
        "grad_accumulation": engine.grad_accumulation if engine.gas > 1 else None,
        "copy_buckets": engine.copy_buckets,
        "training_threads": engine.training_threads,
        "host_threads": engine.host_threads,
        "host_thread_share": engine.host_cores.describe(),
        "numa_binding": engine.numa.reason,
        "world_size": engine.dp.world,
        "steps_per_epoch": steps_per_epoch,
        **engine.impl.resolved(),
        "host_kernel": "-" if mode == "device" else engine.kernels().name,
        **({"device_update": engine.device_update_name()} if mode == "zenflow" else {}),
        "model_bytes": engine.model_bytes,
        "gradient_clipping": engine.clip,
        "bf16": engine.bf16,
    }
