"""The fine-tuning run: data, model, engine, run directory, metrics, eval, checkpoints, resume.

``run_finetune(spec, on_event)`` does the whole run and reports through plain event objects
(``RunStarted``, ``StepEvent``, ``EvalEvent``, ``CheckpointSaved``, ``RunFinished``,
``RunInterrupted``, ``RunDiverged``); the CLI decides how to show them. Nothing here prints.

Divergence (``zenflow.train.divergence``): ``DIVERGED_AFTER`` consecutive non-finite steps,
or non-finite parameters before a checkpoint or the final model, stop the run with
``RunDiverged``; nothing of the diverged weights is saved.

Exact resume: a checkpoint is taken at an optimizer-step boundary and holds the model, the
engine (optimizer/ZenFlow state), the data position (epoch, index into that epoch's
order), the RNG states (per device type) and the number of metrics lines written. The
epoch order is a function of (seed, epoch) only, so a resumed run sees the same batches,
the same dropout masks and the same optimizer state as an uninterrupted one.

The run directory: one process at a time (``runs.RunDirLock``); a directory that holds a
run is never reused without ``resume`` or ``overwrite``. Resuming a run that finished
emits ``RunAlreadyFinished``; one interrupted after its last step (during the final save
or summary) gets its final evaluation, model and summary done again.

Ctrl-C and SIGTERM (``zenflow.train.signals``): deferred to the next step boundary (the
step finishes, the in-flight host work is drained by the checkpoint), a checkpoint is
saved, ``RunInterrupted`` is emitted and raised; a second Ctrl-C, or SIGTERM's grace
period running out, interrupts at once. A ``KeyboardInterrupt`` raised by ``on_event`` (or
anywhere in the loop) is handled the same way. A write that fails (disk full, read-only)
raises ``StorageError`` naming the path, the free space, the last good checkpoint and the
command that continues from it.

Data parallel (``zenflow.train.parallel``; started by torchrun or ``--nproc``): every rank
runs this loop on its slice of each global micro-batch (micro_batch x world samples, in the
same epoch order as one process would use), the engine averages the gradients; rank 0
alone writes the run directory and reports events, every rank writes its checkpoint shard,
and a stop request is agreed so all ranks stop at the same step boundary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from zenflow import jsonout
from zenflow.config.rules import MAX_INT, run_length_notes
from zenflow.errors import (
    CheckpointError,
    StorageError,
    UserInputError,
    attach_log_dir,
)
from zenflow.train import runs
from zenflow.train.checkpointing import (
    CHECKPOINT_FORMAT,
    UnsafeCheckpointError,
    load_newest,
    read_checkpoint,
    rng_state,
    set_rng_state,
    shard_path,
    write_checkpoint,
    write_shard,
)
from zenflow.train.data import batches as data_batches
from zenflow.train.data import encode, get_task, load_task, truncation_line
from zenflow.train.data import steps_per_epoch as data_steps_per_epoch
from zenflow.train.divergence import DivergenceWatch
from zenflow.train.evaluate import eval_batch_size, evaluate_classifier
from zenflow.train.events import (
    CheckpointSaved,
    EvalEvent,
    RunAlreadyFinished,
    RunDiverged,
    RunFinished,
    RunInterrupted,
    RunStarted,
    StepEvent,
)
from zenflow.train.lm import evaluate_lm, lm_loss, loss_tokens
from zenflow.train.monitors import MonitorSink
from zenflow.train.parallel import (
    Parallel,
    any_rank,
    barrier,
    broadcast_object,
    device_for,
    init_parallel,
    mean_over_ranks,
    shutdown,
)
from zenflow.train.rundir import RunDirectory
from zenflow.train.sft import check_packing_support, packed_attention_mask
from zenflow.train.signals import StopRequests
from zenflow.train.spec import (
    ENGINE_MODES,
    RunSpec,
    check_paths,
    config_digest,
    data_digests,
    effective_config,
    load_spec_lm,
    load_spec_table,
    merge_resumed_spec,
    read_hw_json,
    resolve_resume,
    resume_command,
    resume_or_new,
    spec_record,
)
from zenflow.train.summary import run_header, run_summary, step_counts, zenflow_settings

__all__ = ["RunDiverged", "RunInterrupted", "RunSpec", "resume_command", "run_finetune"]


def _noop(_event) -> None:
    pass


class _Diverging(Exception):  # noqa: N818 - a stop, not an error
    """Raised in the step loop when the run has diverged (``zenflow.train.divergence``)."""

    def __init__(self, step: int, reason: str):
        super().__init__(reason)
        self.step = step
        self.reason = reason


# ---------------------------------------------------------------------------- the run


class _Run:
    """State of one fine-tuning session (one process; a resumed run is a new session)."""

    def __init__(self, spec: RunSpec, on_event: Callable[[object], None]):
        self.t_session = time.perf_counter()
        self.on_event = on_event
        self.resumed_from: Path | None = None  # the checkpoint loaded, once loaded
        self.candidates: list[Path] = []  # checkpoints to resume from, newest first
        self.explicit_checkpoint = False  # --resume named one file
        self.run_dir: Path | None = None
        self.dir: RunDirectory | None = None
        self.par = Parallel()
        self.monitor: MonitorSink | None = None
        self.notes: list[str] = []  # said in the header (RunStarted)
        self.redo_eval = False  # resumed: the evaluation due at the checkpoint's step is owed
        if spec.engine_mode not in ENGINE_MODES:
            raise UserInputError(
                f"engine mode {spec.engine_mode!r} is not allowed; use one of "
                f"{', '.join(ENGINE_MODES)} (--engine)."
            )
        check_paths(spec)
        spec, note = resume_or_new(spec)
        if note is not None:
            self.notes.append(note)
        # A resumed run keeps its hw.json unless another one is named.
        self.hw = read_hw_json(spec) if not spec.resume or spec.hw_json else None
        if spec.resume:
            run_dir, self.candidates, self.explicit_checkpoint = resolve_resume(spec)
            spec = merge_resumed_spec(spec, run_dir)
        for name in ("max_steps", "micro_batch", "eval_every", "max_eval_samples", "seq_len"):
            v = getattr(spec, name)
            if v is not None and v < 1:
                raise UserInputError(f"{name} must be at least 1, got {v}.")
        if spec.epochs is not None and not spec.epochs > 0:
            raise UserInputError(f"epochs must be positive, got {spec.epochs}.")
        self.spec = spec

    # -- data parallel: join torchrun's process group (a no-op for one process)
    def start_parallel(self) -> None:
        import torch

        from zenflow.engine.accelerator import KINDS, default_kind

        kind = self.spec.device or default_kind()
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
        self.device_kind = kind
        self.par = init_parallel(kind)
        self.spec = dataclasses.replace(self.spec, nproc=self.par.world)

    # -- the run directory (zenflow.train.rundir): locked for the whole run
    def claim_run_dir(self) -> None:
        if not self.par.main:  # rank 0 owns the run directory
            return
        self.dir = RunDirectory(self.spec)
        self.dir.claim()
        self.run_dir = self.dir.path

    def release(self) -> None:
        if self.dir is not None:
            self.dir.release()

    # -- setup
    def setup(self) -> None:
        import torch

        from zenflow.train.models import (
            check_token_ids,
            count_params,
            max_positions,
            resolve_model,
        )

        spec = self.spec
        self.torch = torch
        self.config = effective_config(spec)
        # Monitors (tensorboard/csv_monitor/wandb blocks) see every event; checked here,
        # before anything is loaded. Only rank 0 reports.
        if self.par.main:
            self.monitor = MonitorSink(self.config.monitor, self.config.source)
            self.on_event = self.monitor.tee(self.on_event)
        else:
            self.on_event = _noop
        self.micro_batch = spec.micro_batch or self.config.train_micro_batch_size_per_gpu or 8
        # Record the effective value: a resumed run compares against it.
        self.spec = spec = dataclasses.replace(spec, micro_batch=self.micro_batch)
        self.gas = int(self.config.gradient_accumulation_steps)
        self.labels = None  # the label set of a --data table (zenflow.train.tables.LabelSet)
        self.lm = spec.objective == "causal-lm"
        if self.lm:  # the records are tokenised with the model's tokenizer: model first
            if spec.data_file is None:
                raise UserInputError(
                    "--objective causal-lm trains on records: pass --data FILE.jsonl (text, "
                    "prompt/completion or chat messages records)."
                )
            resolved = resolve_model(spec.model, task_num_labels=0, init=spec.init,
                                     seed=spec.seed, head="causal-lm")  # fmt: skip
            self.task_data = load_spec_lm(spec, resolved.tokenizer)
            self.task = self.task_data.task
            self.notes += self.task_data.lines
            if spec.pack:
                check_packing_support(resolved.model, spec.seq_len)
        elif spec.data_file is not None:
            self.task_data, table = load_spec_table(spec)
            self.task, self.labels = self.task_data.task, table.labels
            self.notes += table.lines()
        else:
            self.task = get_task(spec.task)
            self.task_data = load_task(self.task, spec.data_dir)
            self.notes += self.task_data.report.lines()  # a preset of the same table reader
        if not self.lm:
            resolved = resolve_model(
                spec.model, task_num_labels=self.task.num_labels, init=spec.init, seed=spec.seed
            )
        if self.labels is not None and self.labels.kind == "classification":
            # the table's class names go with the model: config.json of the saved model
            resolved.model.config.id2label = dict(self.labels.id2label)
            resolved.model.config.label2id = dict(self.labels.label2id)
        limit = max_positions(resolved.model)
        if limit is not None and spec.seq_len > limit:
            raise UserInputError(
                f"--seq-len {spec.seq_len} is longer than the {limit} positions of model "
                f"{spec.model} (n_positions / max_position_embeddings in its config); pass "
                f"--seq-len {limit} or less."
            )
        if not self.lm:  # the LM records say it themselves (lm.LMData.lines)
            self.notes.append(truncation_line(self.task_data, resolved.tokenizer, spec.seq_len,
                                              spec.seed))  # fmt: skip
        self.sources = {**resolved.sources, "data": self.task_data.source}
        self.tokenizer = resolved.tokenizer
        # the rows the batcher takes: the LM rows as they are, a table's examples tokenised
        self.encoded = self.task_data if self.lm else encode(
            self.task_data, resolved.tokenizer, spec.seq_len
        )  # fmt: skip
        # Before the run directory is made and the model is placed: a tokenizer the model
        # cannot look up would otherwise end the first forward in an IndexError.
        check_token_ids(
            resolved.model, resolved.tokenizer, (self.encoded.train, self.encoded.dev), spec.model
        )
        self.device = device_for(self.device_kind, self.par)
        self.masters = None
        self.model = self._place_model(resolved.model)
        if self.lm:  # packed rows: segment ids cross to the device, the mask is built there
            self.mask_dtype = next(self.model.parameters()).dtype
            self.encoded.train.segments_only = True
            self.encoded.dev.mask_dtype = self.mask_dtype
        if spec.gradient_checkpointing:
            self._enable_checkpointing()
        self.params = count_params(self.model)
        # Data parallel: each step reads micro_batch x world samples of the epoch order and
        # every rank takes its micro_batch of them (the same order one process would use).
        self.global_micro = self.micro_batch * self.par.world
        self.spe = data_steps_per_epoch(len(self.task_data.train), self.global_micro, self.gas)
        self.epoch_samples = self.spe * self.gas * self.global_micro
        # --epochs 1e300 is finite, but its steps are not a number a run can count to.
        epoch_steps = min((spec.epochs or 1.0) * self.spe, MAX_INT)
        if spec.max_steps is None and epoch_steps >= MAX_INT:
            raise UserInputError(
                f"--epochs {spec.epochs:g} is {spec.epochs * self.spe:.3g} steps at {self.spe} "
                f"steps per epoch, past the most one run counts ({MAX_INT}); pass fewer "
                "epochs, or --max-steps."
            )
        if spec.max_steps is not None and spec.epochs is not None:
            self.total_steps = min(spec.max_steps, math.ceil(epoch_steps))
        elif spec.max_steps is not None:
            self.total_steps = spec.max_steps
        else:
            self.total_steps = max(1, math.ceil(epoch_steps))
        self.eval_batch = eval_batch_size(self.micro_batch)

    def _place_model(self, model):
        """The model on its device in the training dtype. bf16 (``bf16.enabled``, "auto"
        resolved for the device) is cast on the host first, after the fp32 masters were
        taken there, so the device never holds an fp32 copy of the model."""
        from zenflow.engine.schedule import resolve_bf16

        self.bf16 = resolve_bf16(self.config.bf16, self.device_kind)
        if self.bf16 and self.spec.engine_mode in ("zenflow", "offload", "device"):
            torch = self.torch
            self.masters = {n: p.detach().to(torch.float32, copy=True)
                            for n, p in model.named_parameters() if p.requires_grad}  # fmt: skip
            model = model.to(dtype=torch.bfloat16)
        return model.to(self.device)

    def _enable_checkpointing(self) -> None:
        """transformers' own activation recomputation, non-re-entrant (the streamed
        gradients' hooks then fire once per parameter per backward)."""
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise UserInputError(
                f"--gradient-checkpointing: {type(self.model).__name__} does not support "
                "activation checkpointing in transformers; run without it."
            )
        self.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        if getattr(self.model.config, "use_cache", None):
            self.model.config.use_cache = False  # a cache is never used in training

    # -- checkpoint
    def checkpoint_state(self, step, epoch, index, rng, wall_s, *, share_host=False) -> dict:
        """Everything a resumed run needs, as tensors and plain types (loadable with
        weights_only=True). ``share_host``: the engine's host state is referenced, not
        copied (write the checkpoint before the engine runs again: no second copy of the
        optimizer state in host memory). The config is in config.json; the checkpoint
        keeps its digest to prove at resume that it is still the same."""
        model_state = self.model.state_dict()
        engine_kw = {"share_host": True} if share_host else {}
        return {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "model": model_state,
            "engine": self.engine.state_dict(**engine_kw),
            "position": {"epoch": epoch, "index": index},
            "rng": rng,
            "metrics_lines": self.metrics_lines,
            "wall_s": wall_s,
            "config_sha256": config_digest(spec_record(self.spec)),
            "world_size": self.par.world,
        }

    def save_checkpoint(self, step, epoch, index, rng, wall_s, *, state=None,
                        lines_to_come: int = 0) -> Path:  # fmt: skip
        """Write a checkpoint atomically (temp file, fsync, rename); keep the newest few.
        ``lines_to_come``: metrics lines the run writes before the state moves on (the
        final evaluation's), counted as written."""
        if state is None:
            state = self.checkpoint_state(step, epoch, index, rng, wall_s)
        state["metrics_lines"] = self.metrics_lines + lines_to_come
        if self.par.enabled:  # shards first; rank 0's file after them completes the set
            if not self.par.main:
                write_shard(
                    self.torch,
                    self.run_dir,
                    step,
                    self.par.rank,
                    {"step": step, "engine": state["engine"], "rng": state["rng"]},
                )
            barrier(self.par)  # fmt: skip
            if not self.par.main:
                self.last_checkpoint = self.run_dir / runs.CHECKPOINT_DIR / f"step-{step:07d}.pt"
                return self.last_checkpoint
        path = write_checkpoint(self.torch, self.run_dir, step, state)
        self.last_checkpoint = path
        self.on_event(CheckpointSaved(step, path))
        return path

    def load_resume_state(self) -> dict:
        """Load the newest readable checkpoint of ``candidates`` (onto the CPU; the model
        and engine copy each piece to its device) and say which one, and why, when it is
        not the newest."""
        if not self.par.main:
            return self._load_shard()
        try:
            state, path, notes = load_newest(self.torch, self.candidates)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            others = [p for p in runs.checkpoints(self.run_dir)[::-1] if p != self.candidates[0]]
            if self.explicit_checkpoint and others:
                raise CheckpointError(
                    f"{exc} Resume from the run's other checkpoint with --resume {others[0]}, "
                    f"or with --resume {self.run_dir} (the newest readable one)."
                ) from None
            raise
        if self.par.enabled:  # the other ranks load the same checkpoint's shards
            broadcast_object(str(path), self.par)
        if state.get("world_size", 1) != self.par.world:
            raise CheckpointError(
                f"{path} was written by {state.get('world_size', 1)} data-parallel rank(s) "
                f"but this run has {self.par.world}: resume with --nproc "
                f"{state.get('world_size', 1)} (the engine state is partitioned by rank)."
            )
        if state.get("config_sha256") != config_digest(spec_record(self.spec)):
            raise CheckpointError(
                f"{path} was written with a different config than {self.run_dir}'s "
                f"{runs.CONFIG_FILE} holds now (it was edited, or the checkpoint comes from "
                "another run). Restore the config.json, or start a new run."
            )
        try:
            self.model.load_state_dict(state["model"])
        except (RuntimeError, KeyError) as exc:
            raise CheckpointError(
                f"{path} does not fit model {self.spec.model}: "
                f"{' '.join(str(exc).split())[:300]}. Resume it with the model it was "
                "trained from, or start a new run."
            ) from None
        self.engine.load_state_dict(state["engine"])
        self.resumed_from = path
        self.notes += notes
        return state

    def _load_shard(self) -> dict:
        """Rank > 0: the checkpoint rank 0 chose, with this rank's engine state and RNG."""
        path = Path(broadcast_object(None, self.par))
        state = read_checkpoint(self.torch, path)
        shard = read_checkpoint(self.torch, shard_path(path, self.par.rank))
        state["engine"], state["rng"] = shard["engine"], shard["rng"]
        self.model.load_state_dict(state["model"])
        self.engine.load_state_dict(state["engine"])
        self.resumed_from = path
        return state

    def save_final_model(self) -> None:
        """Save the fine-tuned model (and tokenizer) in Hugging Face format under model/."""
        from zenflow.train.models import save_model

        save_model(self.model, self.tokenizer, self.run_dir / runs.MODEL_DIR)

    # -- eval
    def evaluate(self, step: int) -> dict | None:
        """Evaluate on the dev set (rank 0; the other ranks wait for it)."""
        if not self.par.main:
            barrier(self.par)
            return None
        metrics = self._evaluate(step)
        barrier(self.par)
        return metrics

    def _evaluate(self, step: int) -> dict:
        if self.lm:
            metrics, _ = evaluate_lm(
                self.model, self.encoded.dev, self.task, batch_size=self.eval_batch,
                limit=self.spec.max_eval_samples, device=self.device, tokenizer=self.tokenizer,
                pairs=self.task_data.dev_pairs, autocast=self.engine.autocast,
            )  # fmt: skip
        else:
            metrics, _, _ = evaluate_classifier(
                self.model, self.encoded.dev, self.task, batch_size=self.eval_batch,
                limit=self.spec.max_eval_samples, device=self.device,
                autocast=self.engine.autocast,
            )  # fmt: skip
        self.write_metrics({"type": "eval", "step": step, **metrics})
        self.last_eval = {"step": step, **metrics}
        self.on_event(EvalEvent(step, metrics))
        return metrics

    def write_metrics(self, record: dict) -> None:
        if not self.par.main:  # counted on every rank: checkpoints record the count
            self.metrics_lines += 1
            return
        with runs.writing(self.run_dir / runs.METRICS_FILE):
            self.metrics_file.write(jsonout.dumps(record) + "\n")  # NaN loss: null
            self.metrics_file.flush()
        self.metrics_lines += 1

    # -- header / summary (zenflow.train.summary)
    def zenflow_settings(self) -> dict | None:
        return zenflow_settings(self.config, self.spec.engine_mode, self.engine.resolved)

    def header(self, start_step: int, start_counts: dict | None = None) -> dict:
        return run_header(self, start_step, start_counts)

    def summary(self, wall_s: float, status: str) -> dict:
        lines = runs.read_metrics(self.run_dir / runs.METRICS_FILE)
        return run_summary(self, lines, wall_s, status)

    # -- the loop
    def run(self) -> dict:
        torch = self.torch
        from zenflow.engine import ZenFlowEngine

        spec = self.spec
        done = self.dir.finished_summary(self.total_steps) if self.par.main else None
        done = broadcast_object(done, self.par)
        if done is not None:
            self.on_event(RunAlreadyFinished(done))
            return done
        if spec.engine_mode == "deepspeed":  # DeepSpeed's own engine (deepspeed_engine.py)
            from zenflow.train.deepspeed_engine import DeepSpeedAdapter

            self.engine = DeepSpeedAdapter(self.model, self.config, steps_per_epoch=self.spe)
        else:
            self.engine = ZenFlowEngine(
                self.model, self.config, mode=spec.engine_mode, steps_per_epoch=self.spe,
                accelerator=self.device_kind, ranks_per_node=self.par.local_world,
                masters=self.masters, sim_profile=spec.sim_profile,
                device_budget_bytes=spec.device_mem if self.device_kind == "sim" else None,
            )  # fmt: skip
            self.masters = None  # the engine's host state holds them now
        # The training forward goes through DeepSpeed's engine (its backward hooks need it).
        self.train_module = getattr(self.engine, "train_module", self.model)
        zf_cfg = self.config.zenflow
        if spec.engine_mode == "zenflow" and spec.init == "random" and zf_cfg is not None \
                and zf_cfg.overlap_step:  # fmt: skip
            self.notes.append(
                "random weights with overlap_step on: non-selected columns get their update "
                "a window late, which makes the loss swing where AdamW's already does (see "
                "docs/BENCHMARKS.md, loss bursts); set zero_optimization.zenflow.overlap_step="
                "false or use --engine device for training from scratch."
            )
        if spec.engine_mode == "zenflow":
            self.notes += run_length_notes(self.config.zenflow, self.total_steps)
        if spec.engine_mode == "deepspeed":
            from zenflow.train.deepspeed_engine import unsupported_notes

            self.notes += unsupported_notes(self.config)
        if spec.engine_mode == "zenflow" and self.config.zenflow is None:
            zf = self.zenflow_settings() or {}
            self.notes.append(
                f"no zenflow block in {self.config.source}: ZenFlow runs with defaults "
                f"(topk_ratio {zf.get('topk_ratio')}, update_interval "
                f"{zf.get('update_interval')}, select_interval {zf.get('select_interval')}); "
                "write one with `zfctl init` or set zero_optimization.zenflow."
            )
        self.last_checkpoint: Path | None = None
        self.last_eval: dict | None = None
        try:
            return self._run_with_engine(torch)
        except StorageError as exc:
            raise StorageError(f"{exc} {self._recovery_hint()}") from exc
        finally:
            self.engine.close()
            if self.monitor is not None:
                self.monitor.close()

    def _out_of_memory(self, exc: BaseException):
        """The device ran out of memory in forward or backward: the user error it is."""
        out_of_memory = getattr(self.engine, "out_of_memory", None)
        if out_of_memory is not None:
            return out_of_memory("forward/backward", exc)
        from zenflow.engine.accelerator import OOM_FIX, DeviceOutOfMemory

        return DeviceOutOfMemory(f"device out of memory in forward/backward ({exc}). {OOM_FIX}")

    def _recovery_hint(self) -> str:
        if self.last_checkpoint is not None:
            return (
                f"The last good checkpoint, {self.last_checkpoint}, is kept; once that is "
                f"fixed, continue with: {resume_command(self.spec, self.run_dir)}"
            )
        return "No checkpoint was written yet; start the run again once that is fixed."

    def _prepare_run_dir(self) -> tuple[int, int, int, float]:
        """Create or reopen the run dir; returns (start step, epoch, index, prior wall s)."""
        spec, torch = self.spec, self.torch
        if spec.resume:
            self.run_dir = Path(spec.run_dir)
            state = self.load_resume_state()
            step = state["step"]
            if self.par.main:
                kept = self.dir.reopen(state["metrics_lines"], step, self.total_steps)
                self.metrics_lines = len(kept)
                self.start_counts = step_counts(kept)
            else:
                self.metrics_lines = int(state["metrics_lines"])
                self.start_counts = {}
            set_rng_state(torch, self.device, state["rng"])
            self.redo_eval = broadcast_object(
                self._eval_missing(kept, step) if self.par.main else None, self.par
            )
            pos = state["position"]
            self.last_checkpoint = self.resumed_from
            start = (step, pos["epoch"], pos["index"], float(state.get("wall_s", 0.0)))
        else:
            if self.par.main:
                self.run_dir = self.dir.create(self.task.name)
            self.run_dir = Path(broadcast_object(str(self.run_dir), self.par))
            self.metrics_lines = 0
            self.start_counts = {}
            torch.manual_seed(spec.seed)
            random.seed(spec.seed)
            start = (0, 0, 0, 0.0)
        if not self.par.main:
            return start
        cfg_json = self.config.to_json_dict(self.engine.resolved)
        cfg_json[runs.RUN_MARK] = runs.RUN_FORMAT  # what makes the folder a run (runs.py)
        cfg_json["run"] = spec_record(spec)
        cfg_json["sources"] = self.sources
        if self.labels is not None:
            cfg_json["labels"] = self.labels.to_json()
            cfg_json["data_files"] = data_digests(spec)
        cfg_json["engine_resolved"] = dict(self.engine.resolved)
        cfg_json["config_ignored"] = list(self.config.ignored)
        with runs.writing(self.run_dir / runs.CONFIG_FILE):
            runs.write_json_atomic(self.run_dir / runs.CONFIG_FILE, cfg_json)
            if self.hw is not None:
                runs.write_json_atomic(self.run_dir / runs.HW_FILE, self.hw)
        if not spec.resume:  # after config.json, so a folder holding run files is a run
            runs.write_text(self.run_dir / runs.METRICS_FILE, "")
        return start

    def _eval_missing(self, kept: list[dict], step: int) -> bool:
        """Whether the periodic evaluation due at ``step`` (a resumed run's checkpoint) is
        not in the kept metrics: a stop that came during that step or its evaluation saved
        the boundary before it. The resumed run does it first, so its metrics.jsonl equals
        an uninterrupted run's."""
        every = self.spec.eval_every
        if not every or step <= 0 or step % every or step >= self.total_steps:
            return False
        return not any(r.get("type") == "eval" and r.get("step") == step for r in kept)

    def _run_with_engine(self, torch) -> dict:
        spec = self.spec
        step, epoch, index, wall_before = self._prepare_run_dir()
        if self.par.main:
            self.metrics_file = runs.open_append(self.run_dir / runs.METRICS_FILE, encoding="utf-8")
        else:  # rank > 0 writes no metrics
            self.metrics_file = open(os.devnull, "w", encoding="utf-8")
        # Phase timing on the device's timeline (CUDA events; wall clock elsewhere): never a
        # full synchronize, which would drain the engine's copy streams every micro-batch.
        accel = getattr(self.engine, "accel", None)
        mark = accel.mark if accel is not None else time.perf_counter
        to_device = accel.to_device_input if accel is not None else (
            lambda t, key="": t.to(self.device))  # fmt: skip

        def elapsed_ms(a, b) -> float:
            return accel.elapsed_ms(a, b) if accel is not None else (b - a) * 1e3

        def session_wall() -> float:
            return wall_before + time.perf_counter() - self.t_session

        # The consistent state at the last step boundary (what a checkpoint holds).
        boundary = {"step": step, "epoch": epoch, "index": index}
        boundary["rng"] = rng_state(torch, self.device)
        in_engine_step = False
        it = None
        step_times: list[float] = []
        per_step_samples = self.global_micro * self.gas
        rows = slice(self.par.rank * self.micro_batch, (self.par.rank + 1) * self.micro_batch)
        stops = StopRequests(notify=getattr(self.on_event, "signal_notice", None))
        watch = DivergenceWatch(step)

        def stop_now() -> bool:
            """A stop request, agreed: every rank stops at the same step boundary."""
            return any_rank(bool(stops.requested), self.par)

        # The handlers stay installed until the stop's checkpoint is written: a signal
        # during that save is acknowledged, never the default action (exit, no message).
        with self.metrics_file, stops:
            try:
                self.on_event(RunStarted(self.header(step, self.start_counts)))
                if stop_now():
                    raise KeyboardInterrupt
                if self.redo_eval:  # due at the checkpoint's step; the stop came before it
                    self.evaluate(step)
                while step < self.total_steps:
                    t_step = time.perf_counter()
                    marks = []
                    losses = []
                    # From the first backward on, the step changes engine state (gradient
                    # pieces stream to the host accumulator): it is finished, not interrupted.
                    with contextlib.ExitStack() as held:
                        for i in range(self.gas):
                            if index >= self.epoch_samples:
                                epoch, index, it = epoch + 1, 0, None
                            if it is None:
                                it = data_batches(
                                    self.encoded.train, self.global_micro, spec.seed, epoch, index
                                )
                            index, batch = next(it)
                            if self.lm:  # every rank's rows: the token mean's denominator
                                global_tokens = loss_tokens(batch["labels"])
                            batch = {k: to_device(v[rows], k) for k, v in batch.items()}
                            m0, w0 = mark(), time.perf_counter()
                            try:
                                if self.lm:
                                    loss = self._lm_forward(batch, global_tokens)
                                else:
                                    with self.engine.autocast():
                                        out = self.train_module(**batch)
                                    loss = out.loss.float()
                                m1 = mark()
                                if i == 0:
                                    what = f"step {step + 1}, then checkpoint {step + 1}"
                                    held.enter_context(stops.protect(what))
                                    in_engine_step = True
                                self.engine.backward(loss / self.gas)
                            except torch.OutOfMemoryError as exc:
                                raise self._out_of_memory(exc) from None
                            m2, w2 = mark(), time.perf_counter()
                            marks.append((m0, m1, m2))
                            if accel is not None:  # the device computed (the overlap figure)
                                accel.note_compute(w0, w2)
                            losses.append(loss.detach())
                        mean_loss = torch.stack(losses).mean()
                        stats = self.engine.step(mean_loss)
                    in_engine_step = False
                    # the step's one read waited for backward: the marks are complete
                    fwd_ms = sum(elapsed_ms(a, b) for a, b, _ in marks)
                    bwd_ms = sum(elapsed_ms(b, c) for _, b, c in marks)
                    self.engine.zero_grad()
                    step += 1
                    wall_ms = (time.perf_counter() - t_step) * 1e3
                    step_times.append(wall_ms / 1e3)
                    step_loss = stats.loss if stats.loss is not None else float(mean_loss)
                    stats = dataclasses.replace(
                        stats,
                        step=step,
                        forward_ms=fwd_ms,
                        backward_ms=bwd_ms,
                        loss=mean_over_ranks(step_loss, self.par),
                    )
                    sps = per_step_samples / (wall_ms / 1e3)
                    ep = epoch + index / self.epoch_samples
                    self.write_metrics(
                        {
                            "type": "step",
                            **stats.to_dict(),
                            "wall_ms": wall_ms,
                            "samples_per_s": sps,
                            "tokens_per_s": sps * spec.seq_len,
                            "epoch": ep,
                        }
                    )
                    boundary = {"step": step, "epoch": epoch, "index": index}
                    boundary["rng"] = rng_state(torch, self.device)
                    recent = step_times[-20:]
                    eta = (self.total_steps - step) * sum(recent) / len(recent)
                    self.on_event(
                        StepEvent(
                            stats=stats,
                            samples_per_s=sps,
                            tokens_per_s=sps * spec.seq_len,
                            progress=step / self.total_steps,
                            eta_s=eta,
                            epoch=ep,
                            total_steps=self.total_steps,
                        )
                    )
                    if watch.observe(stats):
                        raise _Diverging(step, watch.reason())
                    if stop_now():
                        raise KeyboardInterrupt
                    evaluated = False
                    if spec.eval_every and step % spec.eval_every == 0 and step < self.total_steps:
                        self.evaluate(step)
                        evaluated = True
                    checkpoint_due = evaluated or (
                        spec.checkpoint_every and step % spec.checkpoint_every == 0
                    )
                    # not while the loss is non-finite: the last good checkpoint stays the
                    # newest (a run that recovers is checkpointed at its next due step)
                    if checkpoint_due and not watch.streak:
                        self._check_finite_params(step)
                        with stops.protect(f"checkpoint {step}"):
                            self.save_checkpoint(
                                step, epoch, index, boundary["rng"], session_wall()
                            )
                    if stop_now():
                        raise KeyboardInterrupt
                # The final checkpoint holds the engine exactly as an uninterrupted longer run
                # would have it (host work possibly in flight), so `--resume` with more steps
                # continues bit for bit; it is written before the flush, straight from the
                # engine's host state (no copy of it: a 7B run's optimizer state is 80 GB).
                # Its metrics count includes the final evaluation's line, written next (a
                # resume of a run stopped after it drops and redoes that evaluation). The
                # flush applies what is still in a host window, so the final weights
                # (evaluated and saved) include every gradient.
                self._check_finite_params(step)
                if watch.streak:  # it ended before the loss came back: no final save
                    raise _Diverging(step, watch.reason() + ", up to the run's last step")
                with stops.protect(f"checkpoint {step}"):
                    final_state = self.checkpoint_state(
                        step, epoch, index, boundary["rng"], session_wall(), share_host=True
                    )
                    self.save_checkpoint(step, epoch, index, None, 0.0, state=final_state,
                                         lines_to_come=1)  # fmt: skip
                    del final_state
                self.engine.flush()
                self.evaluate(step)
                self._check_finite_params(step)  # the flush applied the last host work
                if self.par.main:
                    self.save_final_model()
            except KeyboardInterrupt:
                return self._interrupted(boundary, in_engine_step, session_wall(), stops)
            except _Diverging as why:
                return self._diverged(why, watch.last_good_step, session_wall())
            if not self.par.main:
                barrier(self.par)  # rank 0 writes the summary
                return {"status": "finished", "rank": self.par.rank, "run_dir": str(self.run_dir)}
            summary = self.summary(session_wall(), "finished")
            with runs.writing(self.run_dir / runs.SUMMARY_FILE):
                runs.write_json_atomic(self.run_dir / runs.SUMMARY_FILE, summary)
            barrier(self.par)
            self.on_event(RunFinished(summary))
            return summary

    def _lm_forward(self, batch: dict, global_tokens: int):
        """A causal LM's micro-batch loss (``zenflow.train.lm.lm_loss``): this rank's share
        of the global micro-batch's token mean. Packed rows bring segment ids; their 4-D
        mask is built here, on the device, in the model's dtype."""
        labels = batch.pop("labels")
        segments = batch.pop("segment_ids", None)
        if segments is not None:
            batch["attention_mask"] = packed_attention_mask(segments, self.mask_dtype)
        with self.engine.autocast():
            logits = self.train_module(**batch).logits
        return lm_loss(logits, labels, global_tokens, self.par.world)

    def _check_finite_params(self, step: int) -> None:
        """Raise ``_Diverging`` when a parameter holds NaN or inf: the weights about to be
        checkpointed or saved are those of a diverged run (one device read; every rank
        agrees). Per-tensor max-norms (NaN and inf carry through a max, and it cannot
        overflow as a sum of squares would): no parameter-sized temporary on the device."""
        torch = self.torch
        params = [p.detach() for p in self.model.parameters()]
        norms = torch._foreach_norm(params, ord=math.inf) if params else []
        bad = bool(norms) and not bool(torch.stack([n.float() for n in norms]).isfinite().all())
        if any_rank(bad, self.par):
            raise _Diverging(step, "the model's parameters hold NaN or inf values")

    def _diverged(self, why: _Diverging, last_good_step: int, wall_s: float):
        """Stop a run that diverged: nothing of its weights is saved (the newest checkpoint
        stays the last good one); summary.json says "diverged"; emit and raise RunDiverged."""
        self.engine.zero_grad()
        skipped = 0
        if self.par.main:
            summary = self.summary(wall_s, "diverged")
            summary["last_good_step"] = last_good_step
            summary["divergence"] = {"step": why.step, "reason": why.reason}
            skipped = summary["skipped_steps"]
            with runs.writing(self.run_dir / runs.SUMMARY_FILE):
                runs.write_json_atomic(self.run_dir / runs.SUMMARY_FILE, summary)
        event = RunDiverged(why.step, why.reason, last_good_step, skipped,
                            self.last_checkpoint, self.config.optimizer.lr)  # fmt: skip
        self.on_event(event)
        raise event

    def _interrupted(self, boundary: dict, in_engine_step: bool, wall_s: float, stops):
        """Save a checkpoint at the last step boundary, emit and raise RunInterrupted.

        The stop has begun: further signals are only acknowledged (``stops.begin_stop``)
        and the save is protected, so the checkpoint is whole and of one step boundary
        (its capture waits for the in-flight host step), or the previous one is kept."""
        ckpt = self.last_checkpoint
        step = boundary["step"]
        if not in_engine_step:
            # Mid-step work (a forward) is discarded: data position and RNG rewound to the
            # boundary, so the resumed run redoes this step exactly. (No backward of it has
            # run: from the first backward on a step is protected and finishes.)
            self.engine.zero_grad()
            if not self.metrics_file.closed:
                self.metrics_file.flush()
            if ckpt is None or runs.checkpoint_step(ckpt) != step:
                stops.begin_stop(step)
                with stops.protect(f"checkpoint {step}"):
                    ckpt = self.save_checkpoint(
                        step, boundary["epoch"], boundary["index"], boundary["rng"], wall_s
                    )
        # else: interrupted inside a step by something other than a signal (a
        # KeyboardInterrupt raised by a callback); the engine's state may be half-updated,
        # so the last checkpoint on disk (if any) is the one to resume from.
        cmd = resume_command(self.spec, self.run_dir) if ckpt is not None else None
        ckpt_step = runs.checkpoint_step(ckpt) or 0
        event = RunInterrupted(
            ckpt_step, ckpt, cmd, signal=stops.requested or "SIGINT", exit_code=stops.exit_code
        )
        self.on_event(event)
        raise event


def run_finetune(spec: RunSpec, on_event: Callable[[object], None] = _noop) -> dict:
    """Fine-tune ``spec.model`` on ``spec.task``; returns the summary (also summary.json).

    Emits RunStarted, then StepEvent per optimizer step, EvalEvent, CheckpointSaved, and
    finally RunFinished, or RunInterrupted (then raised) on Ctrl-C or SIGTERM, or
    RunDiverged (then raised) when the loss stays non-finite
    (``zenflow.train.divergence``); a resumed
    run that had already finished emits only RunAlreadyFinished. The run directory is
    locked for the whole call. An unexpected error (a bug) carries the run directory
    (``zenflow.errors.attach_log_dir``) so the caller can write its traceback there.
    """
    run = _Run(spec, on_event)
    finished = False
    try:
        run.start_parallel()
        run.claim_run_dir()
        run.setup()
        result = run.run()
        finished = True
        return result
    except Exception as exc:
        known = (UserInputError, RunInterrupted, RunDiverged)
        if not isinstance(exc, known) and run.run_dir is not None:
            attach_log_dir(exc, run.run_dir)
        raise
    finally:
        run.release()
        shutdown(run.par, drain=finished)
