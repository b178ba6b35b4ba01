"""The fine-tuning run: data, model, engine, run directory, metrics, eval, checkpoints, resume.

``run_finetune(spec, on_event)`` does the whole run and reports through plain event objects
(``RunStarted``, ``StepEvent``, ``EvalEvent``, ``CheckpointSaved``, ``RunFinished``,
``RunInterrupted``); the CLI decides how to show them. Nothing here prints.

Exact resume: a checkpoint is taken at an optimizer-step boundary and holds the model, the
engine (optimizer/ZenFlow state), the data position (epoch, index into that epoch's
order), the RNG states (torch, python; cuda when used) and the number of metrics lines
written. The epoch order is a function of (seed, epoch) only, so a resumed run sees the
same batches, the same dropout masks and the same optimizer state as an uninterrupted one.

Ctrl-C: the first SIGINT is deferred to the next step boundary (the step finishes, the
in-flight host work is drained by the checkpoint), a checkpoint is saved, ``RunInterrupted``
is emitted and raised; a second SIGINT interrupts at once. A ``KeyboardInterrupt`` raised
by ``on_event`` (or anywhere in the loop) is handled the same way.
"""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from zenflow.engine.stats import TIMING_FIELDS
from zenflow.errors import UserInputError
from zenflow.train import runs
from zenflow.train.checkpointing import (
    CHECKPOINT_FORMAT,
    read_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from zenflow.train.data import batches as data_batches
from zenflow.train.data import compute_metrics, encode, eval_batches, get_task, load_task
from zenflow.train.data import steps_per_epoch as data_steps_per_epoch
from zenflow.train.events import (
    CheckpointSaved,
    EvalEvent,
    RunFinished,
    RunInterrupted,
    RunStarted,
    StepEvent,
)
from zenflow.train.spec import (
    ENGINE_MODES,
    RunSpec,
    effective_config,
    merge_resumed_spec,
    resolve_resume,
    resume_command,
    spec_record,
)

__all__ = ["RunInterrupted", "RunSpec", "resume_command", "run_finetune"]


def _noop(_event) -> None:
    pass


class _SigintDeferral:
    """First SIGINT sets ``requested`` (handled at the next step boundary); the second one
    raises KeyboardInterrupt at once. Only installable in the main thread."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _finite_mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


# ---------------------------------------------------------------------------- the run


class _Run:
    """State of one fine-tuning session (one process; a resumed run is a new session)."""

    def __init__(self, spec: RunSpec, on_event: Callable[[object], None]):
        self.t_session = time.perf_counter()
        self.on_event = on_event
        self.resumed_from: Path | None = None
        if spec.engine_mode not in ENGINE_MODES:
            raise UserInputError(
                f"engine mode {spec.engine_mode!r} is not allowed; use one of "
                f"{', '.join(ENGINE_MODES)} (--engine)."
            )
        if spec.resume:
            run_dir, self.resumed_from = resolve_resume(spec)
            spec = merge_resumed_spec(spec, run_dir)
        for name in ("max_steps", "micro_batch", "eval_every", "max_eval_samples", "seq_len"):
            v = getattr(spec, name)
            if v is not None and v < 1:
                raise UserInputError(f"{name} must be at least 1, got {v}.")
        if spec.epochs is not None and not spec.epochs > 0:
            raise UserInputError(f"epochs must be positive, got {spec.epochs}.")
        self.spec = spec

    # -- setup
    def setup(self) -> None:
        import torch

        from zenflow.train.models import count_params, resolve_model

        spec = self.spec
        self.torch = torch
        self.config = effective_config(spec)
        self.micro_batch = spec.micro_batch or self.config.train_micro_batch_size_per_gpu or 8
        # Record the effective value: a resumed run compares against it.
        self.spec = spec = dataclasses.replace(spec, micro_batch=self.micro_batch)
        self.gas = int(self.config.gradient_accumulation_steps)
        self.task = get_task(spec.task)
        self.task_data = load_task(self.task, spec.data_dir)
        resolved = resolve_model(
            spec.model, task_num_labels=self.task.num_labels, init=spec.init, seed=spec.seed
        )
        self.sources = {**resolved.sources, "data": self.task_data.source}
        self.tokenizer = resolved.tokenizer
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = resolved.model.to(self.device)
        self.params = count_params(self.model)
        self.encoded = encode(self.task_data, resolved.tokenizer, spec.seq_len)
        self.spe = data_steps_per_epoch(len(self.task_data.train), self.micro_batch, self.gas)
        self.epoch_samples = self.spe * self.gas * self.micro_batch
        if spec.max_steps is not None and spec.epochs is not None:
            self.total_steps = min(spec.max_steps, math.ceil(spec.epochs * self.spe))
        elif spec.max_steps is not None:
            self.total_steps = spec.max_steps
        else:
            self.total_steps = max(1, math.ceil((spec.epochs or 1.0) * self.spe))
        self.eval_batch = 2 * self.micro_batch

    # -- checkpoint
    def checkpoint_state(self, step, epoch, index, rng, wall_s, *, snapshot=False) -> dict:
        """Everything a resumed run needs; ``snapshot`` clones the model weights so the
        state stays valid while the model keeps changing (the final flush)."""
        model_state = self.model.state_dict()
        if snapshot:
            model_state = {k: v.detach().clone() for k, v in model_state.items()}
        return {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "model": model_state,
            "engine": self.engine.state_dict(),
            "position": {"epoch": epoch, "index": index},
            "rng": rng,
            "metrics_lines": self.metrics_lines,
            "wall_s": wall_s,
            "run": spec_record(self.spec),
        }

    def save_checkpoint(self, step, epoch, index, rng, wall_s, *, state=None) -> Path:
        """Write a checkpoint atomically (temp file + rename); keep the newest few."""
        if state is None:
            state = self.checkpoint_state(step, epoch, index, rng, wall_s)
        state["metrics_lines"] = self.metrics_lines
        path = write_checkpoint(self.torch, self.run_dir, step, state)
        self.last_checkpoint = path
        self.on_event(CheckpointSaved(step, path))
        return path

    def load_checkpoint(self, path: Path) -> dict:
        state = read_checkpoint(self.torch, path, self.device)
        self.model.load_state_dict(state["model"])
        self.engine.load_state_dict(state["engine"])
        return state

    def save_final_model(self) -> None:
        """Save the fine-tuned model (and tokenizer) in Hugging Face format under model/."""
        out = self.run_dir / runs.MODEL_DIR
        self.model.save_pretrained(out)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)

    # -- eval
    def evaluate(self, step: int) -> dict:
        torch = self.torch
        model = self.model
        was_training = model.training
        model.eval()
        preds, labels, loss_sum, n = [], [], 0.0, 0
        try:
            with torch.no_grad():
                for batch in eval_batches(
                    self.encoded.dev, self.eval_batch, self.spec.max_eval_samples
                ):
                    batch = {k: v.to(self.device) for k, v in batch.items()}
                    with self.engine.autocast():
                        out = model(**batch)
                    b = batch["labels"].shape[0]
                    loss_sum += float(out.loss.float()) * b
                    n += b
                    logits = out.logits.float()
                    if self.task.is_regression:
                        preds += logits[:, 0].tolist()
                    else:
                        preds += logits.argmax(-1).tolist()
                    labels += batch["labels"].tolist()
        finally:
            model.train(was_training)
        metrics = compute_metrics(self.task, preds, labels)
        metrics["eval_loss"] = loss_sum / n
        metrics["eval_samples"] = n
        self.write_metrics({"type": "eval", "step": step, **metrics})
        self.last_eval = {"step": step, **metrics}
        self.on_event(EvalEvent(step, metrics))
        return metrics

    def write_metrics(self, record: dict) -> None:
        import json

        self.metrics_file.write(json.dumps(record, default=str) + "\n")
        self.metrics_file.flush()
        self.metrics_lines += 1

    # -- header / summary
    def header(self, start_step: int) -> dict:
        cfg = self.config
        zf = dataclasses.asdict(cfg.zenflow) if cfg.zenflow is not None else None
        if zf is not None:
            zf.update({k: v for k, v in self.engine.resolved.items() if k in zf})
        return {
            "run_dir": str(self.run_dir),
            "model": self.spec.model,
            "task": self.task.name,
            "init": self.spec.init,
            "engine_mode": self.spec.engine_mode,
            "sources": self.sources,
            "params": self.params,
            "model_bytes": self.engine.model_bytes,
            "device": str(self.device),
            "train_examples": len(self.task_data.train),
            "dev_examples": len(self.task_data.dev),
            "eval_examples": min(
                len(self.task_data.dev), self.spec.max_eval_samples or len(self.task_data.dev)
            ),
            "micro_batch": self.micro_batch,
            "gradient_accumulation_steps": self.gas,
            "seq_len": self.spec.seq_len,
            "steps_per_epoch": self.spe,
            "total_steps": self.total_steps,
            "start_step": start_step,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "lr": cfg.optimizer.lr,
            "scheduler": cfg.scheduler.type,
            "bf16": cfg.bf16,
            "gradient_clipping": cfg.gradient_clipping,
            "zenflow": zf,
            "engine_resolved": dict(self.engine.resolved),
            "config_source": cfg.source,
            "config_ignored": list(cfg.ignored),
            "metrics": list(self.task.metrics),
            "seed": self.spec.seed,
        }

    def summary(self, wall_s: float, status: str) -> dict:
        lines = runs.read_metrics(self.run_dir / runs.METRICS_FILE)
        steps = [m for m in lines if m.get("type") == "step"]
        evals = [m for m in lines if m.get("type") == "eval"]
        n = len(steps)
        model_bytes = self.engine.model_bytes
        d2h = sum(int(m.get("d2h_bytes", 0)) for m in steps)
        h2d = sum(int(m.get("h2d_bytes", 0)) for m in steps)
        samples = n * self.micro_batch * self.gas
        tokens = samples * self.spec.seq_len
        train_s = sum(float(m.get("wall_ms", 0.0)) for m in steps) / 1e3
        losses = [m.get("loss") for m in steps]
        timing = {f: _finite_mean(m.get(f) for m in steps) for f in TIMING_FIELDS}
        windows = [m["window_len"] for m in steps if m.get("window_len")]
        last_eval = {k: v for k, v in evals[-1].items() if k != "type"} if evals else None
        cfg = self.config
        return {
            "status": status,
            "run_dir": str(self.run_dir),
            "model": self.spec.model,
            "task": self.task.name,
            "engine_mode": self.spec.engine_mode,
            "steps": n,
            "total_steps": self.total_steps,
            "epochs": n / self.spe,
            "final_loss": losses[-1] if losses else None,
            "final_loss_mean_last_10": _finite_mean(losses[-10:]),
            "eval": last_eval,
            "validation": {k: last_eval[k] for k in self.task.metrics} if last_eval else None,
            "validation_accuracy": (last_eval or {}).get("accuracy"),
            "non_finite_steps": sum(
                1
                for m in steps
                if m.get("skipped") or m.get("loss") is None or not math.isfinite(m["loss"])
            ),
            "timing_ms_mean": timing,
            "stall_fraction": (
                timing["stall_ms"] / timing["wall_ms"]
                if timing["stall_ms"] is not None and timing["wall_ms"]
                else None
            ),
            "d2h_bytes_total": d2h,
            "h2d_bytes_total": h2d,
            "bytes_per_step": (d2h + h2d) / n if n else None,
            "bytes_per_step_x_model": (d2h + h2d) / n / model_bytes if n else None,
            "d2h_per_step_x_model": d2h / n / model_bytes if n else None,
            "h2d_per_step_x_model": h2d / n / model_bytes if n else None,
            "host_updates": sum(1 for m in steps if m.get("host_update")),
            "mean_window_len": sum(windows) / len(windows) if windows else None,
            "selection_changes": sum(int(m.get("selection_changed", 0)) for m in steps),
            "samples": samples,
            "tokens": tokens,
            "train_s": train_s,
            "samples_per_s": samples / train_s if train_s > 0 else None,
            "tokens_per_s": tokens / train_s if train_s > 0 else None,
            "wall_s": wall_s,
            "model_bytes": model_bytes,
            "params": self.params,
            "sources": self.sources,
            "config": {
                "source": cfg.source,
                "lr": cfg.optimizer.lr,
                "optimizer": cfg.optimizer.type,
                "weight_decay": cfg.optimizer.weight_decay,
                "scheduler": cfg.scheduler.type,
                "micro_batch": self.micro_batch,
                "gradient_accumulation_steps": self.gas,
                "seq_len": self.spec.seq_len,
                "gradient_clipping": cfg.gradient_clipping,
                "bf16": cfg.bf16,
                "zenflow": self.header(0)["zenflow"],
                "engine_resolved": dict(self.engine.resolved),
            },
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        }

    # -- the loop
    def run(self) -> dict:
        torch = self.torch
        from zenflow.engine import ZenFlowEngine

        spec = self.spec
        if spec.engine_mode == "deepspeed":  # DeepSpeed's own engine (deepspeed_engine.py)
            from zenflow.train.deepspeed_engine import DeepSpeedAdapter

            self.engine = DeepSpeedAdapter(self.model, self.config, steps_per_epoch=self.spe)
        else:
            self.engine = ZenFlowEngine(
                self.model, self.config, mode=spec.engine_mode, steps_per_epoch=self.spe
            )
        # The training forward goes through DeepSpeed's engine (its backward hooks need it).
        self.train_module = getattr(self.engine, "train_module", self.model)
        self.last_checkpoint: Path | None = None
        self.last_eval: dict | None = None
        try:
            return self._run_with_engine(torch)
        finally:
            self.engine.close()

    def _prepare_run_dir(self) -> tuple[int, int, int, float]:
        """Create or reopen the run dir; returns (start step, epoch, index, prior wall s)."""
        spec, torch = self.spec, self.torch
        if self.resumed_from is not None:
            self.run_dir = Path(spec.run_dir)
            state = self.load_checkpoint(self.resumed_from)
            # Lines written after the checkpoint belong to steps that run again.
            mpath = self.run_dir / runs.METRICS_FILE
            lines = mpath.read_text(encoding="utf-8").splitlines(True) if mpath.exists() else []
            keep = lines[: state["metrics_lines"]]
            mpath.write_text("".join(keep), encoding="utf-8")
            self.metrics_lines = len(keep)
            set_rng_state(torch, self.device, state["rng"])
            pos = state["position"]
            self.last_checkpoint = self.resumed_from
            start = (state["step"], pos["epoch"], pos["index"], float(state.get("wall_s", 0.0)))
        else:
            if spec.run_dir is not None:
                self.run_dir = Path(spec.run_dir)
                self.run_dir.mkdir(parents=True, exist_ok=True)
            else:
                self.run_dir = runs.create_run_dir(spec.runs_root, spec.model, self.task.name)
            (self.run_dir / runs.METRICS_FILE).write_text("", encoding="utf-8")
            self.metrics_lines = 0
            torch.manual_seed(spec.seed)
            random.seed(spec.seed)
            start = (0, 0, 0, 0.0)
        cfg_json = self.config.to_json_dict(self.engine.resolved)
        cfg_json["run"] = spec_record(spec)
        cfg_json["sources"] = self.sources
        cfg_json["engine_resolved"] = dict(self.engine.resolved)
        cfg_json["config_ignored"] = list(self.config.ignored)
        runs.write_json_atomic(self.run_dir / runs.CONFIG_FILE, cfg_json)
        hw = spec.hw_json if spec.hw_json is not None else Path("hw.json")
        if Path(hw).is_file():
            shutil.copyfile(hw, self.run_dir / runs.HW_FILE)
        return start

    def _run_with_engine(self, torch) -> dict:
        spec = self.spec
        step, epoch, index, wall_before = self._prepare_run_dir()
        self.metrics_file = open(self.run_dir / runs.METRICS_FILE, "a", encoding="utf-8")
        cuda = self.device.type == "cuda"

        def sync():
            if cuda:
                torch.cuda.synchronize(self.device)

        def session_wall() -> float:
            return wall_before + time.perf_counter() - self.t_session

        # The consistent state at the last step boundary (what a checkpoint holds).
        boundary = {"step": step, "epoch": epoch, "index": index}
        boundary["rng"] = rng_state(torch, self.device)
        in_engine_step = False
        it = None
        step_times: list[float] = []
        per_step_samples = self.micro_batch * self.gas
        try:
            with self.metrics_file, _SigintDeferral() as sigint:
                self.on_event(RunStarted(self.header(step)))
                while step < self.total_steps:
                    t_step = time.perf_counter()
                    fwd_ms = bwd_ms = 0.0
                    losses = []
                    for _ in range(self.gas):
                        if index >= self.epoch_samples:
                            epoch, index, it = epoch + 1, 0, None
                        if it is None:
                            it = data_batches(
                                self.encoded.train, self.micro_batch, spec.seed, epoch, index
                            )
                        index, batch = next(it)
                        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                        sync()
                        t0 = time.perf_counter()
                        with self.engine.autocast():
                            out = self.train_module(**batch)
                        loss = out.loss.float()
                        sync()
                        t1 = time.perf_counter()
                        (loss / self.gas).backward()
                        sync()
                        t2 = time.perf_counter()
                        fwd_ms += (t1 - t0) * 1e3
                        bwd_ms += (t2 - t1) * 1e3
                        losses.append(loss.detach())
                    mean_loss = torch.stack(losses).mean()
                    in_engine_step = True
                    stats = self.engine.step(mean_loss)
                    in_engine_step = False
                    self.engine.zero_grad()
                    step += 1
                    wall_ms = (time.perf_counter() - t_step) * 1e3
                    step_times.append(wall_ms / 1e3)
                    stats = dataclasses.replace(
                        stats,
                        step=step,
                        forward_ms=fwd_ms,
                        backward_ms=bwd_ms,
                        loss=float(mean_loss),
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
                    if sigint.requested:
                        raise KeyboardInterrupt
                    evaluated = False
                    if spec.eval_every and step % spec.eval_every == 0 and step < self.total_steps:
                        self.evaluate(step)
                        evaluated = True
                    if evaluated or (spec.checkpoint_every and step % spec.checkpoint_every == 0):
                        self.save_checkpoint(step, epoch, index, boundary["rng"], session_wall())
                    if sigint.requested:
                        raise KeyboardInterrupt
                # The final checkpoint holds the engine exactly as an uninterrupted longer run
                # would have it (host work possibly in flight), so `--resume` with more steps
                # continues bit for bit; it is captured before the flush. The flush applies
                # what is still in a host window, so the final weights (evaluated and saved)
                # include every gradient.
                final_state = self.checkpoint_state(
                    step, epoch, index, boundary["rng"], session_wall(), snapshot=True
                )
                self.engine.flush()
                self.evaluate(step)
                self.save_checkpoint(step, epoch, index, None, 0.0, state=final_state)
                self.save_final_model()
        except KeyboardInterrupt:
            return self._interrupted(boundary, in_engine_step, session_wall())
        summary = self.summary(session_wall(), "finished")
        runs.write_json_atomic(self.run_dir / runs.SUMMARY_FILE, summary)
        self.on_event(RunFinished(summary))
        return summary

    def _interrupted(self, boundary: dict, in_engine_step: bool, wall_s: float):
        """Save a checkpoint at the last step boundary, emit and raise RunInterrupted."""
        ckpt = self.last_checkpoint
        step = boundary["step"]
        if not in_engine_step:
            # Mid-step work (forward/backward) is discarded: gradients dropped, data position
            # and RNG rewound to the boundary, so the resumed run redoes this step exactly.
            self.engine.zero_grad()
            if not self.metrics_file.closed:
                self.metrics_file.flush()
            if ckpt is None or not ckpt.name.endswith(f"{step:07d}.pt"):
                ckpt = self.save_checkpoint(
                    step, boundary["epoch"], boundary["index"], boundary["rng"], wall_s
                )
        # else: the engine was interrupted inside its step; its state may be half-updated, so
        # the last checkpoint on disk (if any) is the one to resume from.
        cmd = resume_command(self.spec, self.run_dir) if ckpt is not None else None
        ckpt_step = int(ckpt.stem.split("-")[1]) if ckpt is not None else 0
        event = RunInterrupted(ckpt_step, ckpt, cmd)
        self.on_event(event)
        raise event


def run_finetune(spec: RunSpec, on_event: Callable[[object], None] = _noop) -> dict:
    """Fine-tune ``spec.model`` on ``spec.task``; returns the summary (also summary.json).

    Emits RunStarted, then StepEvent per optimizer step, EvalEvent, CheckpointSaved, and
    finally RunFinished, or RunInterrupted (then raised) on Ctrl-C.
    """
    run = _Run(spec, on_event)
    run.setup()
    return run.run()
