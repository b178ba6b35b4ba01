"""Building what a run trains with: its data and model (through the objective), the device
the model lives on and its dtype, how many steps the run takes, and the engine.

The trainer's session (``zenflow.train.trainer._Run``: ``start_parallel``, ``setup``,
``run``) calls these once, before the run's files (config.json, metrics.jsonl) are written,
so a mistake ends the run with a sentence before its first step. Nothing here writes the
run directory, reports events or steps the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from zenflow.config.readers import MAX_INT
from zenflow.config.zenflow_block import run_length_notes
from zenflow.errors import UserInputError
from zenflow.train.data import steps_per_epoch as data_steps_per_epoch
from zenflow.train.objective import Objective
from zenflow.train.summary import zenflow_settings


@dataclass
class RunData:
    """The objective's data and model, checked against each other."""

    model: Any  # on the host, not yet placed
    tokenizer: Any
    task: Any  # data.GlueTask or data.LMTask
    task_data: Any  # data.TaskData or data.LMData: the rows as read
    labels: Any  # data.LabelSet of a --data table, else None
    encoded: Any  # the rows the batcher takes (.train, .dev)
    sources: dict  # where the model, tokenizer and data came from
    notes: list[str]  # what the run's header says of them


def load_run_data(objective: Objective, spec) -> RunData:
    """Read the rows and resolve the model (``objective.load``), check the sequence length
    against the model's positions, encode the rows and check the tokens against the model's
    vocabulary."""
    from zenflow.train.models import check_token_ids, max_positions

    loaded = objective.load(spec)
    resolved = loaded.resolved
    limit = max_positions(resolved.model)
    if limit is not None and spec.seq_len > limit:
        raise UserInputError(
            f"--seq-len {spec.seq_len} is longer than the {limit} positions of model "
            f"{spec.model} (n_positions / max_position_embeddings in its config); pass "
            f"--seq-len {limit} or less."
        )
    encoded = objective.encode(loaded, spec)
    # Before the run directory is made and the model is placed: a tokenizer the model
    # cannot look up would otherwise end the first forward in an IndexError.
    check_token_ids(resolved.model, resolved.tokenizer, (encoded.train, encoded.dev), spec.model)
    return RunData(
        model=resolved.model,
        tokenizer=resolved.tokenizer,
        task=loaded.task,
        task_data=loaded.task_data,
        labels=loaded.labels,
        encoded=encoded,
        sources={**resolved.sources, "data": loaded.task_data.source},
        notes=loaded.notes,
    )


def device_kind(spec) -> str:
    """The accelerator kind of the run (``--device``, else the machine's default), checked."""
    import torch

    from zenflow.engine.accelerator import KINDS, default_kind

    kind = spec.device or default_kind()
    if kind not in KINDS:
        raise UserInputError(
            f"--device {kind!r} is not allowed; use one of {', '.join(KINDS)} (sim: a "
            "simulated separate accelerator, to rehearse a GPU box)."
        )
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserInputError(
            "--device cuda: torch sees no CUDA device. Use --device cpu, or --device sim "
            "to rehearse a GPU box on this machine."
        )
    return kind


def place_model(model, config, device, device_kind: str, engine_mode: str):
    """The model on its device in the training dtype -> (model, fp32 masters or None).

    bf16 (``bf16.enabled``, "auto" resolved for the device) is cast on the host first,
    after the fp32 masters were taken there, so the device never holds an fp32 copy of the
    model. The masters are the fp32 tensors themselves (the cast gives the parameters new
    bf16 ones); they go to the engine, which takes them out of the dict as it consumes them
    (the caller drops the dict)."""
    import torch

    from zenflow.engine.engine_setup import resolve_bf16

    masters = None
    if resolve_bf16(config.bf16, device_kind) and engine_mode in ("zenflow", "offload", "device",
                                                                   "lora"):  # fmt: skip
        # the fp32 tensors themselves (no copy): the cast gives each parameter a new bf16
        # tensor, so the host never holds two fp32 copies of the model
        masters = {n: p.detach() if p.dtype == torch.float32 else p.detach().float()
                   for n, p in model.named_parameters() if p.requires_grad}  # fmt: skip
        model = model.to(dtype=torch.bfloat16)
    return model.to(device), masters


def enable_gradient_checkpointing(model) -> None:
    """transformers' own activation recomputation, non-re-entrant (the streamed gradients'
    hooks then fire once per parameter per backward)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserInputError(
            f"--gradient-checkpointing: {type(model).__name__} does not support "
            "activation checkpointing in transformers; run without it."
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False  # a cache is never used in training


class RunLength(NamedTuple):
    """How a run walks its data: samples per micro-batch over all ranks, optimizer steps."""

    global_micro: int  # micro_batch x world: one micro-batch of every rank
    steps_per_epoch: int
    epoch_samples: int  # the samples an epoch's steps read (the rest of the order is dropped)
    total_steps: int


def run_length(spec, train_rows: int, micro_batch: int, gas: int, world: int) -> RunLength:
    """The run's length from ``--max-steps`` and ``--epochs`` (the fewer steps when both)."""
    # Data parallel: each step reads micro_batch x world samples of the epoch order and
    # every rank takes its micro_batch of them (the same order one process would use).
    global_micro = micro_batch * world
    spe = data_steps_per_epoch(train_rows, global_micro, gas)
    # --epochs 1e300 is finite, but its steps are not a number a run can count to.
    epoch_steps = min((spec.epochs or 1.0) * spe, MAX_INT)
    if spec.max_steps is None and epoch_steps >= MAX_INT:
        raise UserInputError(
            f"--epochs {spec.epochs:g} is {spec.epochs * spe:.3g} steps at {spe} "
            f"steps per epoch, past the most one run counts ({MAX_INT}); pass fewer "
            "epochs, or --max-steps."
        )
    if spec.max_steps is not None and spec.epochs is not None:
        total_steps = min(spec.max_steps, math.ceil(epoch_steps))
    elif spec.max_steps is not None:
        total_steps = spec.max_steps
    else:
        total_steps = max(1, math.ceil(epoch_steps))
    return RunLength(global_micro, spe, spe * gas * global_micro, total_steps)


def build_engine(spec, model, config, *, steps_per_epoch: int, device_kind: str, par,
                 masters: dict | None):  # fmt: skip
    """The run's engine: ``ZenFlowEngine`` in ``spec.engine_mode``, or DeepSpeed's own
    (``zenflow.train.deepspeed_engine``) for ``--engine deepspeed``; ``--engine lora`` is
    the device mode's AdamW over the adapters and head (``zenflow.train.lora``)."""
    if spec.engine_mode == "deepspeed":
        from zenflow.train.deepspeed_engine import DeepSpeedAdapter

        return DeepSpeedAdapter(model, config, steps_per_epoch=steps_per_epoch)
    from zenflow.engine import ZenFlowEngine

    lora = spec.engine_mode == "lora"
    engine = ZenFlowEngine(
        model, config, mode="device" if lora else spec.engine_mode,
        steps_per_epoch=steps_per_epoch, accelerator=device_kind,
        ranks_per_node=par.local_world, masters=masters, sim_profile=spec.sim_profile,
        device_budget_bytes=spec.device_mem if device_kind == "sim" else None,
    )  # fmt: skip
    if lora:
        from zenflow.train.lora import lora_resolved

        engine.resolved.update(lora_resolved(model))
    return engine


def engine_notes(spec, config, engine, total_steps: int) -> list[str]:
    """What the run's header says about the engine's settings for this run."""
    notes = []
    zf_cfg = config.zenflow
    if spec.engine_mode == "zenflow" and spec.init == "random" and zf_cfg is not None \
            and zf_cfg.overlap_step:  # fmt: skip
        notes.append(
            "random weights with overlap_step on: non-selected columns get their update "
            "a window late, which makes the loss swing where AdamW's already does (see "
            "docs/BENCHMARKS.md, loss bursts); set zero_optimization.zenflow.overlap_step="
            "false or use --engine device for training from scratch."
        )
    if spec.engine_mode == "zenflow":
        notes += run_length_notes(config.zenflow, total_steps)
    if spec.engine_mode == "lora":
        from zenflow.train.lora import lora_note

        notes.append(lora_note(engine.resolved["lora"]))
    if spec.engine_mode == "deepspeed":
        from zenflow.train.deepspeed_engine import unsupported_notes

        notes += unsupported_notes(config)
    if spec.engine_mode == "zenflow" and config.zenflow is None:
        zf = zenflow_settings(config, spec.engine_mode, engine.resolved) or {}
        notes.append(
            f"no zenflow block in {config.source}: ZenFlow runs with defaults "
            f"(topk_ratio {zf.get('topk_ratio')}, update_interval "
            f"{zf.get('update_interval')}, select_interval {zf.get('select_interval')}); "
            "write one with `zfctl init` or set zero_optimization.zenflow."
        )
    return notes
