"""The validated DeepSpeed config as frozen dataclasses, and the error type that lists problems.

Config flows one way: a JSON file (or dict) plus CLI overrides -> ``load_config`` ->
``Config`` -> engine. The engine never reads the file again.

What is honoured (everything else is listed in ``Config.ignored`` and printed once by the
caller, never silently dropped and never an error):

- ``zero_optimization.zenflow``: the ZenFlow block, validated strictly (unknown keys are
  errors, with a "did you mean" suggestion). See ``ZenFlowConfig`` and ``FIELD_DOCS``.
- ``zero_optimization.stage`` and ``zero_optimization.offload_optimizer.{device,pin_memory}``.
  With a zenflow block, stage must be 2 and the optimizer must be offloaded to ``"cpu"``.
- ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``:
  DeepSpeed's rule ``train_batch_size = micro * accumulation * world_size`` is checked when all
  three are given and the missing one is derived otherwise.
- ``optimizer`` (``AdamW`` or ``Adam``; params ``lr``, ``betas``, ``eps``, ``weight_decay``,
  ``adam_w_mode``), ``scheduler`` (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``),
  ``gradient_clipping``, ``bf16.enabled``, ``fp16.enabled``, ``steps_per_print``,
  ``wall_clock_breakdown``.
- DeepSpeed's monitor blocks ``tensorboard``, ``csv_monitor`` (``enabled``,
  ``output_path``, ``job_name``) and ``wandb`` (``enabled``, ``group``, ``team``,
  ``project``): see ``MonitorConfig``; zenflow.train.monitors writes them.

The rules are in ``zenflow.config.rules`` (with ``readers``, ``zenflow_block`` and
``training_sections``), loading in ``zenflow.config.loader``. Every
problem of one file is collected and raised together in one ``ConfigError``; each names
the JSON path, the bad value, what is allowed and how to fix it. ``null`` for an honoured
key outside the zenflow block means "not given" (as in DeepSpeed). HF-style ``"auto"``
values are accepted only where the zenflow table allows them; everywhere else a number is
required.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zenflow.errors import UserInputError

__all__ = [
    "FIELD_DOCS",
    "Config",
    "ConfigError",
    "ConfigProblem",
    "LogDirConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "WandbConfig",
    "ENGINE_FIELD_DOCS",
    "EngineOptions",
    "LoraOptions",
    "ZenFlowConfig",
]


class _Missing:
    """Sentinel for a required key that is absent; shows as ``(missing)`` in messages."""

    def __repr__(self) -> str:
        return "(missing)"


MISSING: Any = _Missing()


@dataclass(frozen=True)
class ConfigProblem:
    """One problem found in a config: where, what, what is allowed and how to fix it."""

    path: str
    """JSON path in dotted form, e.g. ``zero_optimization.zenflow.topk_ratio``."""
    value: Any
    """The offending value as read from the JSON (``MISSING`` for a required absent key)."""
    allowed: str
    """What is allowed there, as a phrase."""
    fix: str
    """What to do about it, as a sentence."""
    origin: str = ""
    """Where the value came from when not from the file: the ``--set key=value`` item."""

    def __str__(self) -> str:
        where = f"{self.path} (from {self.origin})" if self.origin else self.path
        return f"{where} = {self.value!r}: {self.allowed}. Fix: {self.fix}"


class ConfigError(UserInputError, ValueError):
    """All problems of one DeepSpeed config, reported together."""

    def __init__(self, problems: Sequence[ConfigProblem], source: str = "<dict>") -> None:
        self.problems: tuple[ConfigProblem, ...] = tuple(problems)
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        lines = [f"{self.source}: {len(self.problems)} problem(s) in the DeepSpeed config:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._message()


# --------------------------------------------------------------------------------------
# Dataclasses
# --------------------------------------------------------------------------------------

FIELD_DOCS: dict[str, str] = {
    "topk_ratio": "Share of each weight's input columns updated on the device every step "
    "(0 < x <= 1); the rest accumulate on the host.",
    "select_strategy": 'When columns are re-selected: "auto" (once per epoch), "step" '
    '(every select_interval steps) or "epoch" (every select_interval epochs).',
    "select_interval": 'Re-selection period in steps or epochs (int >= 1), or "auto"; an int '
    'needs select_strategy "step" or "epoch".',
    "update_interval": "Steps per host window: the host AdamW step for non-selected columns "
    'runs every this many steps (int >= 1), or "auto" to end a window when the accumulated '
    "non-selected gradient catches up with the selected one.",
    "full_warm_up_rounds": "Number of first steps that update every parameter synchronously "
    "(plain offloaded AdamW) before selection starts (int >= 0).",
    "overlap_step": "Run the host optimizer step on a background worker while the next "
    "window's forward/backward proceeds (true/false).",
    "auto_ratio": 'Share of weights that must vote for a host update before an "auto" '
    "update_interval ends the window (0 < x <= 1).",
    "pt_reserved_cores_perc": "Share of CPU cores kept for the training thread when "
    "overlap_step is on; the host worker gets the rest (0 < x < 1). On a CUDA device the "
    "training thread keeps at most 2 of them.",
}


@dataclass(frozen=True)
class ZenFlowConfig:
    """The ``zero_optimization.zenflow`` block (ZENFLOW.md section 3). Field docs: FIELD_DOCS."""

    topk_ratio: float = 0.1
    """Share of each weight's input columns updated on the device every step (0 < x <= 1)."""
    select_strategy: str = "auto"
    """When columns are re-selected: "auto" (once per epoch), "step" or "epoch"."""
    select_interval: int | str = "auto"
    """Re-selection period (int >= 1, in steps or epochs per select_strategy) or "auto"."""
    update_interval: int | str = "auto"
    """Steps per host window (int >= 1) or "auto" (gradient-mass trigger, see auto_ratio)."""
    full_warm_up_rounds: int = 0
    """Number of first steps with a full synchronous update of every parameter (>= 0)."""
    overlap_step: bool = False
    """Run the host step on a background worker, overlapped with the next window."""
    auto_ratio: float = 0.99
    """Share of weights voting for a host update that ends an "auto" window (0 < x <= 1)."""
    pt_reserved_cores_perc: float = 0.5
    """Share of cores kept for the training thread when overlapping (0 < x < 1); on CUDA
    the training thread keeps at most 2 of them (``accelerator.cuda.cuda_core_split``)."""


# The top-level "zfctl" block: settings of this engine that DeepSpeed has no key for. DeepSpeed
# forbids unknown keys inside zero_optimization.zenflow but ignores unknown top-level blocks,
# so a config with a "zfctl" block is still accepted by deepspeed.initialize.
ENGINE_FIELD_DOCS: dict[str, str] = {
    "stream_grads": "Move each gradient off the device during backward, as soon as it is "
    "final for the micro-batch (selected columns kept on the device, the rest copied to "
    "the host, the gradient freed), so the device never holds a whole-model gradient: "
    'true, false (whole gradients until the optimizer step) or "auto" (on for a separate '
    "device, cuda or sim; off on the CPU device, where the gradient already is host memory "
    "and is summed where autograd writes it).",
    "grad_accumulation": "Where micro-batches are summed when gradient_accumulation_steps > 1: "
    '"host" (each micro-batch streams to the host, which sums them in fp32: least device '
    'memory, one copy of the gradient per micro-batch) or "device" (autograd sums them in '
    "the device gradient and only the last micro-batch streams: one copy per step, plus a "
    "whole-model gradient on the device).",
    "window_lr": "The learning rate of a window's host AdamW step for the non-selected "
    'columns: "last" (the lr of the window\'s last step: one AdamW step per window on the '
    "window's mean gradient, as DeepSpeed's ZenFlow does) or \"sum\" (the sum of the "
    "window's per-step lrs, weight decay included: a column with a steady gradient moves as "
    "far per window as under S steps of AdamW, instead of 1/S as far; a column whose "
    "gradient is mostly noise moves sqrt(S) times as far, since the window's mean has "
    '1/sqrt(S) of a step\'s noise) or "sqrt" (that sum / sqrt(S), weight decay times '
    "sqrt(S): a noise-dominated column moves as far as under S AdamW steps, a steady one "
    'sqrt(S) times as far as with "last"; bench/window_lr.py). Opt-in: it changes the '
    "host step's arithmetic; with one-step windows all three are the same.",
    "select_schedule": 'When columns are re-selected after the first selection: "fixed" '
    '(every select interval, as DeepSpeed\'s ZenFlow does) or "doubling" (dense early, '
    "thinning out: the first re-selection one window after the first selection, then after "
    'gaps that double, S, 2S, 4S, ... steps with S the update_interval (1 with "auto"), '
    "until the gap reaches the select interval, which it then keeps). Early in fine-tuning "
    "(a new head, gradients that change fast) the important columns move; doubling follows "
    "them at about log2(interval / S) extra re-selections, each a synchronous window end. "
    "Opt-in: it changes which columns the device updates; with topk_ratio 1.0 both are AdamW.",
    "host_state": 'The host state of the non-selected columns: "exact" (fp32 master and '
    "Adam moments, an fp32 window sum: every step equals the algorithm's fp32 arithmetic; "
    'about 16 bytes per non-selected parameter plus a step\'s pieces) or "compact" (fp32 '
    "master, the two moments in 8 bits per element with a scale per 256-element block as in "
    "8-bit AdamW, the window sum and the pieces that cross the link in bf16: about 8 bytes "
    "per non-selected parameter plus a step's pieces in bf16: about half the exact state; "
    "`zfctl estimate` says whether a whole run fits). The selected columns' device state "
    "stays fp32 either way. Opt-in: it changes the host step's arithmetic; a checkpoint "
    "resumes only with the state it was written with.",
    "early": "ZenFlow's early schedule: the first steps of a run, when the model moves fastest "
    "and a stale host update costs the most, with less staleness. An object with steps (an "
    "integer >= 0, default 0: off; the early phase is the first `steps` steps after "
    'full_warm_up_rounds), windows ("ramp", default: the window length doubles from 1 to '
    "the update_interval S across the early phase, a window ending at early step t being "
    'min(S, 2^floor(log2(S t / steps))) steps long, at least 1; or "fixed": S throughout) '
    "and overlap (true, default: as overlap_step says, as after the phase; false: every "
    "early window's host step is applied at its own end, synchronously, as with "
    "overlap_step false). Non-selected columns lag by at most 2 L steps (L the window "
    "length; L without overlap) instead of 2 S, at the cost of more host steps (the ramp) or "
    "host steps on the critical path (overlap false) during the phase only; after it the "
    "schedule is the configured one. Needs an integer update_interval for the ramp. Off "
    "without a setting; the zenflow template turns it on with steps 200 (measured: "
    'docs/BENCHMARKS.md, "The early schedule"). It changes when the host updates the '
    "non-selected columns; with topk_ratio 1.0 it is AdamW either way.",
    "step_store": 'Where a step\'s non-selected gradient pieces wait on the host: "auto" '
    '(default): "on" where the whole run fits this host\'s memory with the store; where it '
    'does not, `zfctl finetune`\'s memory check runs it as "q8" if the run clips (as '
    '"off" if it does not, the same weights), says so and records it in the run\'s config '
    '(without the check, --force, "on"). "on": in a store of their own (pinned, the '
    "link's dtype: 2 bytes per non-selected "
    "parameter in bf16, 4 in fp32), where the device copies them, until the step's clipping "
    "coefficient is known at the end of backward; the host adds them into the window sum "
    'from there, while the next step\'s forward runs. "off": no store; each piece crosses '
    "into a small ring and is added into the window sum as it arrives, before any "
    "coefficient is known (with gradient_accumulation_steps > 1 only with "
    'zfctl.grad_accumulation "device"). With gradient_clipping, the window\'s host step then '
    "scales its sum by the smallest clipping coefficient of the window's steps instead of "
    "each step's pieces by their own: never more than per-step clipping gives, the same "
    "where the coefficient is 1 (or constant) through the window, and the selected columns "
    "on the device are clipped per step either way (measured: docs/BENCHMARKS.md, "
    '"Clipping without the step store"). It saves the store\'s host memory; the backward '
    "then waits for the host's adds when they are slower than the pieces, and a window's "
    "first step waits for the previous window's host step to read the sum. A non-finite "
    "step is still skipped on the device; on the host its pieces that are not finite are "
    "dropped (zeroed on the device before they cross) and its finite pieces stay in the "
    'window sum. "q8": no store either; each piece is added as it arrives, scaled by the '
    "previous step's clipping coefficient, and kept in 8 bits (1 byte per non-selected "
    "parameter and 4 per 256) until the step's own coefficient corrects the sum from that "
    "copy: per-step clipping, exact where the coefficient did not change (and in each "
    "window's first step), else within the change times the copy's rounding (at most half "
    "a code: 1/254 of the largest value of its 256). Costs the host the copy in each add, "
    "the previous step's correction read from it there, and the last copy read again at "
    "each window's end by the CPU Adam as it reads the sum: with clipping at every step "
    "1.1-1.2 times the store's host bytes per element and step in the exact state, about "
    "1.2 in the compact one (measured: "
    'docs/BENCHMARKS.md, "What the 8-bit copies cost per step"). '
    "Without clipping and with no non-finite step the three settings give the same "
    "weights, bit for bit.",
    "return_image": "How a host step's result (the non-selected columns' fp32 master) goes "
    "back to a bf16 model's device: as the fp32 master columns themselves, cast to bf16 on "
    "the device (no host copy of them), or as a bf16 image the host step writes in the same "
    "pass (round to nearest even, as the device's cast: the weights are the same bit for "
    "bit), which halves the return's link bytes at 2 bytes of pinned host memory per "
    'non-selected parameter while it exists. "early" (default): the image during '
    "zfctl.early's phase only, where short windows return a result every step or two (its "
    "buffers freed when the phase is over; nothing without zfctl.early; `zfctl finetune` "
    'runs it as "never" when the images would not fit the host\'s memory, and says so); '
    '"always": the whole run (the link is the bottleneck and the host has the memory); '
    '"never". An fp32 model, the CPU device and data parallelism send the master columns '
    "either way.",
    "numa_binding": "Whether every thread of a run goes on the cores of its device's NUMA "
    "node (a box with several; the node the kernel gives the GPU's PCI address, as "
    "`nvidia-smi topo -m` shows), so that the host's work for that device and the host "
    'state it first touches stay there: "auto" (default: when several ranks share the box, '
    "each on its own GPU's node, as `torchrun --numa-binding node`; one rank stays unbound, "
    "as binding it would halve the cores and memory channels of the host kernels that bound "
    'its step), "node" (one rank too) or "off". One node, or a device whose node is '
    "unknown: nothing is bound. The run header says what was done (numa_binding); the "
    "engine unbinds at close.",
    "copy_buckets": "Device buffers the streamed gradient pieces wait in for the copy engine, "
    "each 1/64 of the offloaded elements (at most 4M) in the training dtype: an integer >= 2 "
    'or "auto" (2; 4 with data parallelism: the least device memory). Backward produces a '
    "layer's gradients in a burst; with too few buffers it waits for the link even when the "
    "link keeps pace over the step (the stall bench/engine.py reports). More buffers let "
    "backward run ahead, at 1/64 x (1 - topk) x the training dtype's bytes per parameter "
    "each; zfctl estimate --copy-buckets shows the cost.",
    "lora": "The LoRA adapters of --engine lora (peft): an object with rank (an integer >= 1, "
    "default 8), alpha (a number > 0, default 8; the adapter's update is scaled by "
    "alpha / rank) and dropout (0 <= x < 1 on the adapters' input, default 0.0), peft's "
    "LoraConfig defaults. Adapters go on every linear projection of the attention and MLP "
    'blocks (peft\'s "all-linear"), the new classification head trains whole; the base '
    "model is frozen. --lora-rank and --lora-alpha override it; other engines ignore it.",
}


@dataclass(frozen=True)
class LoraOptions:
    """The ``zfctl.lora`` block: the adapters of ``--engine lora`` (peft's LoraConfig
    defaults: r 8, lora_alpha 8, lora_dropout 0.0)."""

    rank: int = 8
    """Rank r of each adapter pair (A: r x in, B: out x r); an integer >= 1."""
    alpha: float = 8.0
    """lora_alpha: the adapter's update B A x is scaled by alpha / rank; a number > 0."""
    dropout: float = 0.0
    """Dropout on the adapters' input (0 <= x < 1)."""


@dataclass(frozen=True)
class EarlyOptions:
    """The ``zfctl.early`` block: ZenFlow's early schedule (off with steps 0)."""

    steps: int = 0
    """Steps after full_warm_up_rounds that the early schedule covers; 0: off."""
    windows: str = "ramp"
    """"ramp" (window lengths 1, 2, 4, ... up to S across the phase) or "fixed" (S)."""
    overlap: bool = True
    """Whether an early window's host step overlaps the next window (false: synchronous)."""

    @property
    def on(self) -> bool:
        return self.steps > 0


@dataclass(frozen=True)
class EngineOptions:
    """The top-level ``zfctl`` block (engine settings DeepSpeed has no key for; DeepSpeed
    ignores the block). Field docs: ENGINE_FIELD_DOCS."""

    stream_grads: bool | str = "auto"
    """Stream gradients off the device during backward: true, false or "auto"."""
    grad_accumulation: str = "host"
    """Where micro-batches are summed: "host" or "device"."""
    copy_buckets: int | str = "auto"
    """Device buffers for pieces waiting for the copy engine: an int >= 2 or "auto"."""
    window_lr: str = "last"
    """The host step's lr: "last" (the last step's), "sum" (the window's) or "sqrt"."""
    select_schedule: str = "fixed"
    """Re-selection: "fixed" (every select interval) or "doubling" (gaps S, 2S, 4S, ...)."""
    host_state: str = "exact"
    """The non-selected columns' host state: "exact" (fp32) or "compact" (8-bit moments)."""
    lora: LoraOptions = field(default_factory=LoraOptions)
    """The adapters of ``--engine lora``: rank, alpha, dropout."""
    early: EarlyOptions = field(default_factory=EarlyOptions)
    """ZenFlow's early schedule: shorter or synchronous windows over the first steps."""
    return_image: str = "early"
    """A bf16 image of each host result for the return: "early", "always" or "never"."""
    numa_binding: str = "auto"
    """The threads on the device's NUMA node: "auto" (several ranks), "node" or "off"."""
    step_store: str = "auto"
    """Where a step's pieces wait for its clipping coefficient: "auto", "on", "off", "q8"."""


@dataclass(frozen=True)
class OptimizerConfig:
    """The ``optimizer`` block. Only AdamW and Adam are supported.

    ``adamw_mode`` says whether weight decay is decoupled (AdamW) or added to the gradient
    (classic Adam/L2). As in DeepSpeed: type ``AdamW`` always means decoupled decay (True);
    type ``Adam`` takes ``params.adam_w_mode``, whose default is True, so a plain ``"Adam"``
    block also trains with decoupled weight decay unless ``adam_w_mode: false`` is given.
    """

    type: str = "AdamW"
    """Normalised optimizer name: "AdamW" or "Adam" (the JSON is case-insensitive)."""
    lr: float = 1e-3
    """Base learning rate (> 0); a scheduler multiplies or replaces it per step."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2), each 0 <= b < 1."""
    eps: float = 1e-8
    """Adam's epsilon (> 0)."""
    weight_decay: float = 0.0
    """Weight decay (>= 0); decoupled when adamw_mode is True."""
    adamw_mode: bool = True
    """Decoupled weight decay (AdamW). AdamW -> True; Adam -> params.adam_w_mode (default True)."""


def _frozen_params(params: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(params or {}))


@dataclass(frozen=True)
class SchedulerConfig:
    """The ``scheduler`` block, with every parameter of its type filled in.

    ``params`` always holds the complete parameter set of the type (DeepSpeed's defaults
    filled in), so ``lr_schedule.lr_at`` and the JSON written back need no defaults of their
    own. One deliberate difference from DeepSpeed: when ``warmup_max_lr`` is absent it is set
    to ``optimizer.params.lr`` for both WarmupLR (DeepSpeed does the same) and WarmupDecayLR
    (DeepSpeed would use 0.001); the value is written out explicitly by
    ``Config.to_json_dict`` so DeepSpeed sees the same number.
    """

    type: str | None = None
    """None (constant lr), "WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"."""
    params: Mapping[str, Any] = field(default_factory=_frozen_params)
    """Read-only mapping of the type's parameters, defaults filled in."""


@dataclass(frozen=True)
class LogDirConfig:
    """DeepSpeed's ``tensorboard`` or ``csv_monitor`` block: where one logger writes.

    The logs go to ``<output_path>/<job_name>/``. Two deliberate differences from
    DeepSpeed 0.19.6 (whose defaults are ``output_path ""``, i.e. the launch directory,
    and ``job_name "DeepSpeedJobName"``), so runs never write into one another's files:
    an empty ``output_path`` means the run directory (``<run_dir>/tensorboard`` or
    ``<run_dir>/csv_monitor``), and an absent ``job_name`` means the run directory's name.
    """

    enabled: bool = False
    """Write this log (DeepSpeed's default: off)."""
    output_path: str = ""
    """Folder of the logs; "" = a folder inside the run directory. Relative paths are
    relative to the working directory, as in DeepSpeed."""
    job_name: str | None = None
    """Sub-folder of output_path for this run; None = the run directory's name."""


@dataclass(frozen=True)
class WandbConfig:
    """DeepSpeed's ``wandb`` block. Weights & Biases runs offline unless WANDB_MODE says
    otherwise, and only when the ``wandb`` package is installed."""

    enabled: bool = False
    """Log to W&B (needs ``pip install wandb``)."""
    group: str | None = None
    """W&B group of the run."""
    team: str | None = None
    """W&B team (entity)."""
    project: str = "deepspeed"
    """W&B project (DeepSpeed's default name)."""


@dataclass(frozen=True)
class MonitorConfig:
    """DeepSpeed's monitor blocks: per-step and eval metrics to TensorBoard, CSV, W&B."""

    tensorboard: LogDirConfig = field(default_factory=LogDirConfig)
    """``tensorboard``: event files through torch.utils.tensorboard.SummaryWriter."""
    csv_monitor: LogDirConfig = field(default_factory=LogDirConfig)
    """``csv_monitor``: one ``<tag>.csv`` per metric (rows: step, value), as DeepSpeed."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """``wandb``: Weights & Biases, offline by default."""

    @property
    def enabled(self) -> bool:
        """Whether any monitor is on."""
        return self.tensorboard.enabled or self.csv_monitor.enabled or self.wandb.enabled


@dataclass(frozen=True)
class Config:
    """A validated DeepSpeed config, as the engine honours it.

    Equality compares the honoured values and ``ignored``; ``source`` and ``raw`` are
    excluded, so ``load_config(cfg.to_json_dict()) == cfg``.
    """

    zenflow: ZenFlowConfig | None
    """The ZenFlow block; None when the config has none (plain offload or device training)."""
    optimizer: OptimizerConfig
    """The optimizer (defaults when the config has no optimizer block)."""
    scheduler: SchedulerConfig
    """The learning-rate schedule (type None when the config has none)."""
    train_batch_size: int | None
    """Samples per optimizer step over all ranks; derived when not given (None if unknown)."""
    train_micro_batch_size_per_gpu: int | None
    """Samples per forward/backward per rank; derived when not given (None if unknown)."""
    gradient_accumulation_steps: int
    """Backward passes per optimizer step (resolved, >= 1)."""
    gradient_clipping: float
    """Global gradient-norm clip; 0.0 = off. Default 1.0, as DeepSpeed 0.19.6."""
    bf16: bool | str
    """bf16 weights, gradients and autocast (``bf16.enabled``): true, false or "auto" (the
    DeepSpeed / HF convention: on for a CUDA device with bf16 and for sim, off on the CPU;
    resolved by the engine, ``zenflow.engine.engine_setup.resolve_bf16``)."""
    fp16: bool
    """Always False: fp16 is rejected as not supported by the engine."""
    steps_per_print: int
    """Print progress every this many optimizer steps (default 10)."""
    wall_clock_breakdown: bool
    """Report per-phase timings."""
    zero_stage: int
    """``zero_optimization.stage`` (0..3; 2 with ZenFlow). Default 0."""
    offload_device: str
    """``zero_optimization.offload_optimizer.device``: "cpu" or "none"."""
    pin_memory: bool
    """``zero_optimization.offload_optimizer.pin_memory``."""
    ignored: tuple[str, ...]
    """Dotted paths of keys present in the JSON that the engine does not honour."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """The ``tensorboard``, ``csv_monitor`` and ``wandb`` blocks (all off by default)."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """The top-level ``zfctl`` block: this engine's settings that DeepSpeed has no key for."""
    source: str = field(default="<dict>", compare=False)
    """Where the config came from: a file path or "<dict>"."""
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Deep copy of the input JSON after overrides (read it, do not change it)."""

    def to_json_dict(self, resolved: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Return this config as a DeepSpeed JSON dict.

        Starts from a deep copy of ``raw`` (so ignored keys survive) and writes every honoured
        value over it in its normalised form (full zenflow block, full scheduler params,
        optimizer type spelled "AdamW"/"Adam"). With ``resolved`` (e.g.
        ``{"update_interval": 4, "select_strategy": "epoch", "select_interval": 1}``), zenflow
        fields whose value is ``"auto"`` are replaced by the resolved value, and so is
        ``bf16.enabled`` ("auto") by ``resolved["bf16"]``; other keys are skipped.
        """
        out: dict[str, Any] = copy.deepcopy(dict(self.raw))
        for key in _BATCH_KEYS:
            out.pop(key, None)
        if self.train_batch_size is not None and "train_batch_size" in self.raw:
            out["train_batch_size"] = self.train_batch_size
        if self.train_micro_batch_size_per_gpu is not None:
            out["train_micro_batch_size_per_gpu"] = self.train_micro_batch_size_per_gpu
        elif self.train_batch_size is not None:
            out["train_batch_size"] = self.train_batch_size
        out["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        out["gradient_clipping"] = self.gradient_clipping
        out["steps_per_print"] = self.steps_per_print
        out["wall_clock_breakdown"] = self.wall_clock_breakdown
        out.pop("bfloat16", None)
        out["bf16"] = {**_as_dict(self.raw.get("bf16") or self.raw.get("bfloat16"))}
        bf16 = self.bf16
        if bf16 == "auto" and resolved is not None and isinstance(resolved.get("bf16"), bool):
            bf16 = resolved["bf16"]
        out["bf16"]["enabled"] = bf16
        if isinstance(self.raw.get("fp16"), Mapping):
            out["fp16"] = {**self.raw["fp16"], "enabled": False}

        opt = self.optimizer
        raw_opt = _as_dict(self.raw.get("optimizer"))
        opt_params = {**_as_dict(raw_opt.get("params"))}
        opt_params.update(
            lr=opt.lr, betas=list(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
        )
        if opt.type == "Adam":
            opt_params["adam_w_mode"] = opt.adamw_mode
        else:
            opt_params.pop("adam_w_mode", None)
        out["optimizer"] = {**raw_opt, "type": opt.type, "params": opt_params}

        if self.scheduler.type is None:
            out.pop("scheduler", None)
        else:
            raw_sch = _as_dict(self.raw.get("scheduler"))
            sch_params = {**_as_dict(raw_sch.get("params")), **dict(self.scheduler.params)}
            out["scheduler"] = {**raw_sch, "type": self.scheduler.type, "params": sch_params}

        zero = {**_as_dict(self.raw.get("zero_optimization"))}
        zero["stage"] = self.zero_stage
        offload = {**_as_dict(zero.get("offload_optimizer"))}
        offload["device"] = self.offload_device
        offload["pin_memory"] = self.pin_memory
        zero["offload_optimizer"] = offload
        if self.zenflow is None:
            zero.pop("zenflow", None)
        else:
            block = dataclasses.asdict(self.zenflow)
            for key, value in (resolved or {}).items():
                if key in block and block[key] == "auto":
                    block[key] = value
            zero["zenflow"] = block
        out["zero_optimization"] = zero
        out["zfctl"] = dataclasses.asdict(self.engine)
        return out


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _as_dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}
