"""Checkpoint files of a run: atomic writes, retention, loading, and the RNG states they hold."""

from __future__ import annotations

import os
import random
from pathlib import Path

from zenflow.errors import UserInputError
from zenflow.train import runs

KEEP_CHECKPOINTS = 2  # the latest and one previous
CHECKPOINT_FORMAT = 1


def rng_state(torch, device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(torch, device, state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def write_checkpoint(torch, run_dir: Path, step: int, state: dict) -> Path:
    """Write ``state`` as checkpoints/step-NNNNNNN.pt atomically (temp file + rename) and
    keep the newest ``KEEP_CHECKPOINTS``."""
    d = run_dir / runs.CHECKPOINT_DIR
    d.mkdir(exist_ok=True)
    path = d / f"step-{step:07d}.pt"
    tmp = d / f".{path.name}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in runs.checkpoints(run_dir)[:-KEEP_CHECKPOINTS]:
        old.unlink(missing_ok=True)
    return path


def read_checkpoint(torch, path: Path, device) -> dict:
    """The checkpoint dict at ``path``; UserInputError when it is unreadable or foreign."""
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as exc:
        raise UserInputError(f"Cannot read checkpoint {path}: {exc}.") from exc
    if state.get("format") != CHECKPOINT_FORMAT:
        raise UserInputError(f"{path} is not a zfctl checkpoint of format {CHECKPOINT_FORMAT}.")
    return state
