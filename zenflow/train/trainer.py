"""The fine-tuning run: data, model, engine, run directory, metrics, eval, checkpoints, resume.

``run_finetune(spec, on_event)`` does the whole run and reports through plain event objects
(``RunStarted``, ``StepEvent``, ``EvalEvent``, ``CheckpointSaved``, ``RunFinished``,
``RunInterrupted``, ``RunDiverged``); the CLI decides how to show them. Nothing here prints.

This module keeps the session: its set-up, the step loop and the stop. The rest has a room
of its own in ``zenflow.train``: ``setup`` builds the data, the model on its device and the
engine; ``objective`` is what the model trains for (classification or causal LM: loading, a
micro-batch's loss, evaluation), chosen once at set-up; ``step`` is one optimizer step
(micro-batches, backward, the engine's step, the divergence checks); ``cadence`` says when
to evaluate and checkpoint; ``metrics`` writes metrics.jsonl and the step figures;
``resume`` writes and reads the checkpoints; ``summary`` makes the header and summary.json.

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
import random
import time
from collections.abc import Callable
from pathlib import Path

from zenflow.errors import StorageError, UserInputError, attach_log_dir
from zenflow.train import runs
from zenflow.train.cadence import Cadence
from zenflow.train.checkpointing import rng_state, set_rng_state
from zenflow.train.divergence import DivergenceWatch
from zenflow.train.evaluate import eval_batch_size
from zenflow.train.events import (
    EvalEvent,
    RunAlreadyFinished,
    RunDiverged,
    RunFinished,
    RunInterrupted,
    RunStarted,
)
from zenflow.train.learning import weights_seen
from zenflow.train.lora import TrainableWeights, lora_counts, merged_for_export, wrap_lora
from zenflow.train.metrics import MetricsLog, StepMeter
from zenflow.train.monitors import MonitorSink
from zenflow.train.objective import objective_for
from zenflow.train.parallel import (
    Parallel,
    agree_stop,
    barrier,
    broadcast_object,
    device_for,
    init_parallel,
    peer_lost,
    rank_lost,
    shutdown,
)
from zenflow.train.resume import RunCheckpoints, write_run_files
from zenflow.train.rundir import RunDirectory
from zenflow.train.setup import (
    build_engine,
    device_kind,
    enable_gradient_checkpointing,
    engine_notes,
    load_run_data,
    place_model,
    run_length,
)
from zenflow.train.signals import StopRequests
from zenflow.train.spec import (
    ENGINE_MODES,
    RunSpec,
    check_paths,
    effective_config,
    merge_resumed_spec,
    read_hw_json,
    resolve_resume,
    restart_hint,
    resume_command,
    resume_or_new,
)
from zenflow.train.step import (
    DataCursor,
    Diverging,
    OptimizerStep,
    StepBoundary,
    check_finite_params,
    device_scope,
)
from zenflow.train.summary import run_header, run_summary, step_counts

__all__ = ["RunDiverged", "RunInterrupted", "RunSpec", "resume_command", "run_finetune"]


def _noop(_event) -> None:
    pass


# ---------------------------------------------------------------------------- the run


def _dev_metrics(run) -> dict:
    """The objective's metrics on the dev set; its forward passes are device work (sim:
    their tensors from the simulated device's pool)."""
    with device_scope(run.engine):
        return run.objective.evaluate(
            run.model, run.encoded.dev, batch_size=run.eval_batch,
            limit=run.spec.max_eval_samples, device=run.device, autocast=run.engine.autocast,
        )  # fmt: skip


def rank_0s_fit(spec: RunSpec, par) -> RunSpec:
    """``spec`` with rank 0's fitted settings (``zfctl.return_image``, ``zfctl.step_store``:
    each rank's memory check read the host's free memory at its own moment, and ranks that
    hold their pieces differently must not train together)."""
    image, store = broadcast_object((spec.return_image, spec.step_store), par)
    return dataclasses.replace(spec, return_image=image, step_store=store)


class _Run:
    """State of one fine-tuning session (one process; a resumed run is a new session).

    ``run_finetune`` calls ``start_parallel``, ``claim_run_dir``, ``setup`` and ``run`` (the
    engine, then ``_train``: the run directory, ``_steps``, the stop). The header and
    summary.json (``zenflow.train.summary``) are read from its attributes."""

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
            spec = merge_resumed_spec(spec, run_dir, self.notes)
        for name in ("max_steps", "micro_batch", "eval_every", "max_eval_samples", "seq_len"):
            v = getattr(spec, name)
            if v is not None and v < 1:
                raise UserInputError(f"{name} must be at least 1, got {v}.")
        if spec.epochs is not None and not spec.epochs > 0:
            raise UserInputError(f"epochs must be positive, got {spec.epochs}.")
        self.spec = spec

    # -- data parallel: join torchrun's process group (a no-op for one process)
    def start_parallel(self) -> None:
        self.device_kind = device_kind(self.spec)
        self.par = init_parallel(self.device_kind)
        self.spec = dataclasses.replace(rank_0s_fit(self.spec, self.par), nproc=self.par.world)

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

    # -- set-up: the objective's data and model, on the device; the run's length
    def setup(self) -> None:
        import torch

        from zenflow.train.models import count_params

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
        # Chosen once: the step, the evaluation and the set-up below ask it, never the spec.
        self.objective = objective_for(spec, self.par.world)
        data = load_run_data(self.objective, spec)
        self.task, self.task_data, self.labels = data.task, data.task_data, data.labels
        self.tokenizer, self.sources = data.tokenizer, data.sources
        self.encoded = data.encoded  # the rows the batcher takes
        self.notes += data.notes
        self.device = device_for(self.device_kind, self.par)
        model, lora = data.model, spec.engine_mode == "lora"
        if lora:  # adapters before placement: the fp32 masters and the bf16 cast cover them
            model = wrap_lora(model, self.config.engine.lora, self.objective.name, spec.seed)
        self.model, self.masters = place_model(
            model, self.config, self.device, self.device_kind, spec.engine_mode
        )
        self.objective.placed(self.model, self.encoded)
        if spec.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        # what a checkpoint holds of the model: a LoRA run's trainable weights only
        self.weights = TrainableWeights(self.model) if lora else self.model
        self.params = lora_counts(self.model).base if lora else count_params(self.model)
        length = run_length(spec, len(self.task_data.train), self.micro_batch, self.gas,
                            self.par.world)  # fmt: skip
        self.global_micro, self.spe, self.epoch_samples, self.total_steps = length
        self.eval_batch = eval_batch_size(self.micro_batch)

    # -- the session: the engine, then the steps
    def run(self) -> dict:
        spec = self.spec
        done = self.dir.finished_summary(self.total_steps) if self.par.main else None
        done = broadcast_object(done, self.par)
        if done is not None:
            self.on_event(RunAlreadyFinished(done))
            return done
        self.engine = build_engine(
            spec, self.model, self.config, steps_per_epoch=self.spe,
            device_kind=self.device_kind, par=self.par, masters=self.masters,
        )  # fmt: skip
        self.masters = None  # the engine's host state holds them now
        self.notes += engine_notes(spec, self.config, self.engine, self.total_steps)
        self.metrics = MetricsLog(self.par)
        self.checkpoints = RunCheckpoints(self.torch, spec, self.par, self.weights, self.engine,
                                          self.metrics, self.on_event)  # fmt: skip
        self.cadence = Cadence(spec.eval_every, spec.checkpoint_every, self.total_steps)
        try:
            return self._train()
        except StorageError as exc:
            raise StorageError(f"{exc} {self._recovery_hint()}") from exc
        finally:
            self.engine.close()
            if self.monitor is not None:
                self.monitor.close()

    def _recovery_hint(self) -> str:
        if self.checkpoints.last is not None:
            return (
                f"The last good checkpoint, {self.checkpoints.last}, is kept; once that is "
                f"fixed, continue with: {resume_command(self.spec, self.run_dir)}"
            )
        return f"No checkpoint was written yet; once that is fixed: {restart_hint(self.run_dir)}"

    def _start_session(self) -> tuple[int, int, int, float]:
        """Create or reopen the run dir; returns (start step, epoch, index, prior wall s)."""
        spec = self.spec
        if spec.resume:
            start = self._resume()
        else:
            if self.par.main:
                self.run_dir = self.dir.create(self.task.name)
            self.run_dir = Path(broadcast_object(str(self.run_dir), self.par))
            self.checkpoints.run_dir = self.run_dir
            self.start_counts = {}
            self.torch.manual_seed(spec.seed)
            random.seed(spec.seed)
            start = (0, 0, 0, 0.0)
        if self.par.main:
            write_run_files(self.run_dir, spec, self.config, self.engine, sources=self.sources,
                            labels=self.labels, hw=self.hw)  # fmt: skip
        return start

    def _resume(self) -> tuple[int, int, int, float]:
        """Load the checkpoint, drop the metrics lines written after it, restore the RNG."""
        self.run_dir = self.checkpoints.run_dir = Path(self.spec.run_dir)
        state, self.resumed_from, notes = self.checkpoints.load(
            self.candidates, self.explicit_checkpoint
        )
        self.notes += notes
        step = state["step"]
        if self.par.main:
            kept = self.dir.reopen(state["metrics_lines"], step, self.total_steps)
            self.metrics.lines = len(kept)
            self.start_counts = step_counts(kept)
        else:
            self.metrics.lines = int(state["metrics_lines"])
            self.start_counts = {}
        set_rng_state(self.torch, self.device, state["rng"])
        self.redo_eval = broadcast_object(
            self.cadence.eval_owed(kept, step) if self.par.main else None, self.par
        )
        pos = state["position"]
        self.checkpoints.last = self.resumed_from
        return step, pos["epoch"], pos["index"], float(state.get("wall_s", 0.0))

    def _wall(self) -> float:
        """Wall seconds of the run: the earlier sessions' and this one's."""
        return self.wall_before + time.perf_counter() - self.t_session

    def _stop_now(self, stops: StopRequests) -> bool:
        """A stop request, agreed: every rank stops at the same step boundary, on the same
        signal (a SIGTERM to any rank is every rank's 143)."""
        agreed = agree_stop(stops.requested, self.par)
        if agreed is not None:
            stops.agree(agreed)
        return agreed is not None

    # -- the loop
    def _train(self) -> dict:
        """The run directory, the steps and the stop: finished, interrupted (a checkpoint
        of the last step boundary) or diverged (nothing of its weights saved)."""
        step, epoch, index, self.wall_before = self._start_session()
        self.metrics.open(self.run_dir)
        cursor = DataCursor(self.encoded.train, self.global_micro, self.spec.seed,
                            self.epoch_samples, epoch, index)  # fmt: skip
        # The consistent state at the last step boundary (what a checkpoint holds).
        self.boundary = StepBoundary(step, epoch, index, rng_state(self.torch, self.device))
        stops = StopRequests(notify=getattr(self.on_event, "signal_notice", None),
                             agreed=self.par.enabled)  # fmt: skip
        # The training forward goes through DeepSpeed's engine (its backward hooks need it).
        forward = getattr(self.engine, "train_module", self.model)
        steps = OptimizerStep(self.engine, forward, self.objective, cursor, stops, gas=self.gas,
                              micro_batch=self.micro_batch, par=self.par,
                              device=self.device)  # fmt: skip
        watch = DivergenceWatch(step)
        # The handlers stay installed until the stop's checkpoint is written: a signal
        # during that save is acknowledged, never the default action (exit, no message).
        with self.metrics, stops:
            try:
                self._steps(step, cursor, steps, stops, watch)
            except KeyboardInterrupt:
                return self._interrupted(self.boundary, steps.in_engine_step, self._wall(),
                                         stops)  # fmt: skip
            except Diverging as why:
                return self._diverged(why, watch.last_good_step, self._wall())
            return self._finished()

    def _steps(self, step: int, cursor: DataCursor, steps: OptimizerStep, stops: StopRequests,
               watch: DivergenceWatch) -> None:  # fmt: skip
        """From ``step`` to the run's last: each step, its metrics line and event, the
        divergence and stop checks, what is due after it (evaluation, checkpoint); then the
        final save. A stop raises KeyboardInterrupt, a divergence ``Diverging``."""
        meter = StepMeter(self.global_micro * self.gas, self.spec.seq_len, self.total_steps)
        self.on_event(RunStarted(self.header(step, self.start_counts)))
        if self._stop_now(stops):
            raise KeyboardInterrupt
        if self.redo_eval:  # due at the checkpoint's step; the stop came before it
            self.evaluate(step)
        while step < self.total_steps:
            # protected from the step's first backward until its boundary is recorded: a
            # signal in between would otherwise save the old boundary with the new state
            with contextlib.ExitStack() as held:
                stats, wall_ms = steps.run(step, held)
                step = stats.step
                record, event = meter.step(stats, wall_ms, cursor.fractional_epoch)
                self.metrics.write(record)
                rng = rng_state(self.torch, self.device)
                self.boundary = StepBoundary(step, cursor.epoch, cursor.index, rng)
                steps.in_engine_step = False
            self.on_event(event)
            if watch.observe(stats):
                raise Diverging(step, watch.reason())
            if self._stop_now(stops):
                raise KeyboardInterrupt
            evaluated = self.cadence.eval_due(step)
            if evaluated:
                self.evaluate(step)
            # not while the loss is non-finite: the last good checkpoint stays the
            # newest (a run that recovers is checkpointed at its next due step)
            if self.cadence.checkpoint_due(step, evaluated) and not watch.streak:
                self._checkpoint(step, stops)
            if self._stop_now(stops):
                raise KeyboardInterrupt
        self._final_save(step, stops, watch)

    def _checkpoint(self, step: int, stops: StopRequests) -> None:
        """The checkpoint of the boundary just reached, its weights checked first."""
        check_finite_params(self.torch, self.model, self.par, step)
        at = self.boundary
        with stops.protect(f"checkpoint {step}"):
            self.checkpoints.save(step, at.epoch, at.index, at.rng, self._wall())

    def _final_save(self, step: int, stops: StopRequests, watch: DivergenceWatch) -> None:
        """The final checkpoint, the flush, the final evaluation and the model.

        The final checkpoint holds the engine exactly as an uninterrupted longer run would
        have it (host work possibly in flight), so `--resume` with more steps continues bit
        for bit; it is written before the flush, straight from the engine's host state (no
        copy of it: a 7B run's optimizer state is 80 GB). Its metrics count includes the
        final evaluation's line, written next (a resume of a run stopped after it drops and
        redoes that evaluation). The flush applies what is still in a host window, so the
        final weights (evaluated and saved) include every gradient."""
        check_finite_params(self.torch, self.model, self.par, step)
        if watch.streak:  # it ended before the loss came back: no final save
            raise Diverging(step, watch.reason() + ", up to the run's last step")
        at = self.boundary
        with stops.protect(f"checkpoint {step}"):
            final_state = self.checkpoints.state(
                step, at.epoch, at.index, at.rng, self._wall(), share_host=True
            )
            self.checkpoints.save(step, at.epoch, at.index, None, 0.0, state=final_state,
                                  lines_to_come=1)  # fmt: skip
            del final_state
        self.engine.flush()
        self.evaluate(step)
        check_finite_params(self.torch, self.model, self.par, step)  # the last host work
        # the host optimizer state is done with (flushed, checkpointed): dropped before the
        # model is saved, whose host copies would otherwise sit beside it (issue 27)
        release = getattr(self.engine, "release_host_state", None)
        if release is not None:
            release()
        if self.par.main:
            self.save_final_model()

    def evaluate(self, step: int) -> dict | None:
        """Evaluate on the dev set through the objective (rank 0; the other ranks wait for
        it): the metrics line (ZenFlow: live or flushed weights) and ``EvalEvent``."""
        if not self.par.main:
            barrier(self.par)
            return None
        metrics = {**_dev_metrics(self), **weights_seen(self.engine)}
        self.metrics.write({"type": "eval", "step": step, **metrics})
        self.on_event(EvalEvent(step, metrics))
        barrier(self.par)
        return metrics

    def save_final_model(self) -> None:
        """Save the fine-tuned model (and tokenizer) in Hugging Face format under model/ (a
        LoRA run's adapters merged into the base: plain transformers loads it)."""
        from zenflow.train.models import save_model

        model = merged_for_export(self.model) if self.spec.engine_mode == "lora" else self.model
        save_model(model, self.tokenizer, self.run_dir / runs.MODEL_DIR)

    # -- header / summary (zenflow.train.summary)
    def header(self, start_step: int, start_counts: dict | None = None) -> dict:
        return run_header(self, start_step, start_counts)

    def summary(self, wall_s: float, status: str) -> dict:
        lines = runs.read_metrics(self.run_dir / runs.METRICS_FILE)
        return run_summary(self, lines, wall_s, status)

    # -- the stop: finished, interrupted or diverged
    def _finished(self) -> dict:
        """summary.json (rank 0, once every rank is done), then ``RunFinished``."""
        if not self.par.main:
            barrier(self.par)  # rank 0 writes the summary
            return {"status": "finished", "rank": self.par.rank, "run_dir": str(self.run_dir)}
        summary = self.summary(self._wall(), "finished")
        with runs.writing(self.run_dir / runs.SUMMARY_FILE):
            runs.write_json_atomic(self.run_dir / runs.SUMMARY_FILE, summary)
        barrier(self.par)
        self.on_event(RunFinished(summary))
        return summary

    def _diverged(self, why: Diverging, last_good_step: int, wall_s: float):
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
        lr = self.config.optimizer.lr
        lower = float(f"{lr / 10:.3g}") if lr else None  # a tenth: the usual first retry
        cmd = (  # from the last good checkpoint, at the lower lr (spec.merge_resumed_spec)
            resume_command(dataclasses.replace(self.spec, lr=lower), self.run_dir)
            if self.checkpoints.last is not None and lower is not None
            else None
        )
        event = RunDiverged(why.step, why.reason, last_good_step, skipped,
                            self.checkpoints.last, lr, resume_command=cmd,
                            restart=restart_hint(self.run_dir))  # fmt: skip
        self.on_event(event)
        raise event

    def _interrupted(self, boundary: StepBoundary, in_engine_step: bool, wall_s: float,
                     stops: StopRequests):  # fmt: skip
        """Save a checkpoint at the last step boundary, emit and raise RunInterrupted.

        The stop has begun: further signals are only acknowledged (``stops.begin_stop``)
        and the save is protected, so the checkpoint is whole and of one step boundary
        (its capture waits for the in-flight host step), or the previous one is kept."""
        ckpt = self.checkpoints.last
        step = boundary.step
        if not in_engine_step:
            # Mid-step work (a forward) is discarded: data position and RNG rewound to the
            # boundary, so the resumed run redoes this step exactly. (No backward of it has
            # run: from the first backward on a step is protected and finishes.)
            self.engine.zero_grad()
            self.metrics.flush()
            if ckpt is None or runs.checkpoint_step(ckpt) != step:
                stops.begin_stop(step)
                with stops.protect(f"checkpoint {step}"):
                    ckpt = self.checkpoints.save(
                        step, boundary.epoch, boundary.index, boundary.rng, wall_s
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
    except (RunInterrupted, RunDiverged):
        finished = True  # agreed at a step boundary: every rank leaves the group together
        raise
    except Exception as exc:
        if run.par.enabled and peer_lost(exc):  # another rank ended: not this rank's bug
            hint = run._recovery_hint() if run.par.main and hasattr(run, "checkpoints") else ""
            raise rank_lost(run.par, hint) from exc
        known = (UserInputError, RunInterrupted, RunDiverged)
        if not isinstance(exc, known) and run.run_dir is not None:
            attach_log_dir(exc, run.run_dir)
        raise
    finally:
        run.release()
        shutdown(run.par, drain=finished)
