"""What ``zfctl eval`` checks of its inputs and its output before it scores anything.

- ``unfinished_run_error``: a run without a saved model said for what it is: diverged (at
  which step, its last good checkpoint and the command that goes on from it at a lower
  learning rate), or not finished yet (the command that resumes it).
- ``check_run_data``: a run's own evaluation rows are those of the files it trained with;
  each file's sha256 (config.json ``data_files``, as ``--resume`` checks) must still match,
  else the "own" rows would be other rows, or rows the model trained on.
- ``check_predictions``: ``--predictions FILE`` never writes over a file this command
  reads (its ``--data``, the run's data files, the GLUE files, the model folder's files) or
  a run's own files (config.json, metrics.jsonl, summary.json, checkpoints/, model/, ...),
  even with ``--force``; any other existing file needs ``--force``, as ``zfctl init
  --output``. A FIFO or a device (``/dev/stdout``) is written into, as before.

Owns: these checks. Must not: load a model or read rows (``evaluate``), or write anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from zenflow.errors import DataError, UserInputError
from zenflow.train import runs

_ROLES = {"data_file": "--data (training) file", "eval_file": "--eval-data file"}


def unfinished_run_error(run_dir: Path, rec: dict) -> UserInputError:
    """Why the run in ``run_dir`` (its spec record ``rec``) has no saved model, and what
    to do about it."""
    summary = runs.read_json(run_dir / runs.SUMMARY_FILE)
    model = rec.get("model")
    if isinstance(summary, dict) and summary.get("status") == "diverged":
        where = summary.get("divergence") or {}
        ckpt = runs.latest_checkpoint(run_dir)
        lower = _lower_lr(rec)
        lr_flag = f" --lr {lower:g}" if lower is not None else " --lr LOWER_LR"
        if ckpt is not None:
            then = (
                f"Its last good checkpoint is {ckpt}: go on from it at a lower learning rate "
                f"(zfctl finetune {model} --resume {run_dir}{lr_flag}) and evaluate the run "
                "once it has finished."
            )
        else:
            then = (
                "No checkpoint was written before it diverged: start a new run with a lower "
                "learning rate (--lr)."
            )
        reason = where.get("reason") or "a non-finite loss"
        return UserInputError(
            f"{run_dir} diverged at step {where.get('step', '?')} ({reason}; last good step "
            f"{summary.get('last_good_step', '?')}) and stopped without saving a model: there "
            "is nothing to evaluate. " + then
        )
    return UserInputError(
        f"{run_dir} holds no saved model yet ({run_dir / runs.MODEL_DIR} is missing: the run "
        f"has not finished). Resume it to the end (zfctl finetune {model} --resume "
        f"{run_dir}), or pass a model folder."
    )


def _lower_lr(rec: dict) -> float | None:
    """A tenth of the run's learning rate (the trainer's advice after a divergence)."""
    lr = rec.get("lr")
    if lr is None:
        params = ((rec.get("config_input") or {}).get("optimizer") or {}).get("params") or {}
        lr = params.get("lr")
    return float(f"{lr / 10:.3g}") if isinstance(lr, int | float) and lr > 0 else None


def check_run_data(run_dir: Path) -> None:
    """DataError when a data file of the run in ``run_dir`` is missing or differs from the
    one it trained with (the sha256 its config.json saved for it)."""
    from zenflow.train import run_match

    cfg = runs.run_config(run_dir) or {}
    rec = cfg.get("run") or {}
    for role, what in _ROLES.items():
        path, digest = rec.get(role), run_match.saved_digest(cfg, role)
        if path is None or digest is None:
            continue
        hub = run_match.is_hub_id(path)
        if not hub and not os.path.isfile(path):
            raise DataError(
                f"{path}, the run's {what}, is not there any more, so the run's own "
                f"evaluation rows cannot be read. Restore it, or evaluate on a file of your "
                f"own: zfctl eval {run_dir} --data FILE."
            )
        if run_match.data_digest(path) != digest:
            raise DataError(
                f"{path}, the run's {what}, changed since the run in {run_dir} started (its "
                f"{runs.CONFIG_FILE} 'data_files' holds the sha256 it trained on): the run's "
                "own evaluation rows (its --eval-data, or its seeded split of --data) would "
                "now be other rows, or rows the model trained on. Restore the file, or "
                f"evaluate on a file of your choice: zfctl eval {run_dir} --data FILE."
            )


# Names in a run directory that are the run's own (written and read by zfctl).
_RUN_ENTRIES = (*runs.OUR_ENTRIES, runs.LOCK_FILE)


def check_predictions(path: Path, inputs: Iterable[str | Path], model_dir: Path,
                      force: bool) -> None:  # fmt: skip
    """UserInputError when ``--predictions path`` would write over an input of this
    command, a run's own file, or (without ``force``) any existing file (module doc)."""
    from zenflow.outputs import check_writable

    target = check_writable(path, "--predictions: cannot write")
    if target.direct:  # a FIFO or a device: written into, nothing is replaced
        return
    real = Path(os.path.realpath(path))
    fix = "Pass another path with --predictions."
    for name in inputs:
        if target.exists and _same(real, name):
            raise UserInputError(
                f"--predictions {path} is {name}, which this command reads; writing the "
                f"predictions there would destroy it (--force does not change that). {fix}"
            )
    owner = _run_owning(real)
    if owner is not None:
        run_dir, entry = owner
        raise UserInputError(
            f"--predictions {path} is inside the run {run_dir} ({entry}, which zfctl keeps "
            f"for the run); writing there would damage the run (--force does not change "
            f"that). {fix}"
        )
    folder = Path(os.path.realpath(model_dir))
    if target.exists and folder in real.parents:
        raise UserInputError(
            f"--predictions {path} is a file of the model folder {model_dir} being evaluated; "
            f"writing there could destroy the model (--force does not change that). {fix}"
        )
    if target.exists and not force:
        raise UserInputError(
            f"--predictions {path} already exists; pass --force to overwrite it, or "
            "--predictions PATH to write elsewhere."
        )


def _same(real: Path, name: str | Path) -> bool:
    try:
        return os.path.samefile(real, name)
    except (OSError, ValueError):  # not there (a hub id): not the same file
        return False


def _run_owning(real: Path) -> tuple[Path, str] | None:
    """(run directory, entry) when ``real`` is one of a run's own entries or inside one."""
    for parent in real.parents:
        rel = real.relative_to(parent)
        if rel.parts[0] in _RUN_ENTRIES and runs.holds_run(parent):
            return parent, rel.parts[0]
    return None
