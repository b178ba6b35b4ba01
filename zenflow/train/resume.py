"""Exact resume: what a checkpoint of a run holds, writing it from every rank, reading it back
at resume, and the run files a session starts with.

A checkpoint is taken at an optimizer-step boundary and holds the model, the engine
(optimizer/ZenFlow state), the data position (epoch, index into that epoch's order), the
RNG states (per device type) and the number of metrics lines written; the config stays in
config.json and the checkpoint keeps its digest, to prove at resume that it is the same.
Data parallel: every rank > 0 writes its shard (its engine state and RNG) first, and rank
0's file after them completes the set. The files themselves (atomic writes, retention,
weights-only loading) are ``zenflow.train.checkpointing``'s.

Decides nothing about when to checkpoint (``zenflow.train.cadence``, the trainer's loop).
"""

from __future__ import annotations

from pathlib import Path

from zenflow.errors import CheckpointError
from zenflow.train import runs
from zenflow.train.checkpointing import (
    CHECKPOINT_FORMAT,
    UnsafeCheckpointError,
    load_newest,
    read_checkpoint,
    shard_path,
    write_checkpoint,
    write_shard,
)
from zenflow.train.events import CheckpointSaved
from zenflow.train.metrics import MetricsLog
from zenflow.train.parallel import barrier, broadcast_object
from zenflow.train.spec import config_digest, data_digests, spec_record


class RunCheckpoints:
    """The checkpoints of one session: written at step boundaries, read at resume."""

    def __init__(self, torch, spec, par, model, engine, metrics: MetricsLog, on_event):
        self.torch = torch
        self.spec = spec
        self.par = par
        self.model = model
        self.engine = engine
        self.metrics = metrics  # its line count goes into every checkpoint
        self.on_event = on_event
        self.run_dir: Path | None = None  # set when the session has its run directory
        self.last: Path | None = None  # the newest checkpoint: written, or resumed from

    def state(self, step, epoch, index, rng, wall_s, *, share_host=True) -> dict:
        """Everything a resumed run needs, as tensors and plain types (loadable with
        weights_only=True). ``share_host`` (every checkpoint the trainer writes: periodic,
        interrupted, final): the engine's state is referenced, not copied, so a checkpoint
        holds no second copy of the optimizer state in host memory. The engine is at a step
        boundary and drained; the caller writes the state (``save``) before the engine
        steps, flushes or closes again, and the trainer's loop never steps before ``save``
        returns. The config is in config.json; the checkpoint keeps its digest to prove at
        resume that it is still the same."""
        model_state = self.model.state_dict()
        engine_kw = {"share_host": True} if share_host else {}
        return {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "model": model_state,
            "engine": self.engine.state_dict(**engine_kw),
            "position": {"epoch": epoch, "index": index},
            "rng": rng,
            "metrics_lines": self.metrics.lines,
            "wall_s": wall_s,
            "config_sha256": config_digest(spec_record(self.spec)),
            "world_size": self.par.world,
        }

    def save(self, step, epoch, index, rng, wall_s, *, state=None,
             lines_to_come: int = 0) -> Path:  # fmt: skip
        """Write a checkpoint atomically (temp file, fsync, rename); keep the newest few.
        ``lines_to_come``: metrics lines the run writes before the state moves on (the
        final evaluation's), counted as written."""
        if state is None:
            state = self.state(step, epoch, index, rng, wall_s)
        state["metrics_lines"] = self.metrics.lines + lines_to_come
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
                self.last = self.run_dir / runs.CHECKPOINT_DIR / f"step-{step:07d}.pt"
                return self.last
        path = write_checkpoint(self.torch, self.run_dir, step, state)
        self.last = path
        self.on_event(CheckpointSaved(step, path))
        return path

    def load(self, candidates: list[Path], explicit: bool) -> tuple[dict, Path, list[str]]:
        """Load the newest readable checkpoint of ``candidates`` (onto the CPU; the model
        and engine copy each piece to its device) -> (its state, its path, notes saying
        which one was loaded, and why, when it is not the newest). ``explicit``: --resume
        named that file."""
        if not self.par.main:
            return self._load_shard()
        try:
            state, path, notes = load_newest(self.torch, candidates)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            others = [p for p in runs.checkpoints(self.run_dir)[::-1] if p != candidates[0]]
            if explicit and others:
                raise CheckpointError(
                    f"{exc} Resume from the run's other checkpoint with --resume {others[0]}, "
                    f"or with --resume {self.run_dir} (the newest readable one)."
                ) from None
            raise
        if self.par.enabled:  # the other ranks load the same checkpoint's shards
            broadcast_object(str(path), self.par)
        self._check_fits(state, path)
        self.engine.load_state_dict(state["engine"])
        return state, path, notes

    def _check_fits(self, state: dict, path: Path) -> None:
        """The checkpoint is of this run as it is now: the same ranks, the same config, a
        model of the same shape (loaded here)."""
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

    def _load_shard(self) -> tuple[dict, Path, list[str]]:
        """Rank > 0: the checkpoint rank 0 chose, with this rank's engine state and RNG."""
        path = Path(broadcast_object(None, self.par))
        state = read_checkpoint(self.torch, path)
        shard = read_checkpoint(self.torch, shard_path(path, self.par.rank))
        state["engine"], state["rng"] = shard["engine"], shard["rng"]
        self.model.load_state_dict(state["model"])
        self.engine.load_state_dict(state["engine"])
        return state, path, []


def write_run_files(run_dir: Path, spec, config, engine, *, sources: dict, labels, hw) -> None:
    """config.json (the config as the engine resolved it, the run's spec and sources, a
    table's labels and data digests), hw.json when one was given, and for a new run an
    empty metrics.jsonl (after config.json, so a folder holding run files is a run)."""
    cfg_json = config.to_json_dict(engine.resolved)
    cfg_json[runs.RUN_MARK] = runs.RUN_FORMAT  # what makes the folder a run (runs.py)
    cfg_json["run"] = spec_record(spec)
    cfg_json["sources"] = sources
    if labels is not None:
        cfg_json["labels"] = labels.to_json()
    if labels is not None or spec.data_file is not None:  # causal-LM records too
        cfg_json["data_files"] = data_digests(spec)
    cfg_json["engine_resolved"] = dict(engine.resolved)
    cfg_json["config_ignored"] = list(config.ignored)
    with runs.writing(run_dir / runs.CONFIG_FILE):
        runs.write_json_atomic(run_dir / runs.CONFIG_FILE, cfg_json)
        if hw is not None:
            runs.write_json_atomic(run_dir / runs.HW_FILE, hw)
    if not spec.resume:
        runs.write_text(run_dir / runs.METRICS_FILE, "")
