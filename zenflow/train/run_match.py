"""Which saved run a resume means, and where that run's files are now.

- ``find_resumable(spec)``: ``--resume auto``'s choice. A run is matched on what it is, never
  on a name: the same model, and the same kind of data (a GLUE task, by the task's name; a
  ``--data`` run, by its file: the same path, or a file with the sha256 the run saved). The
  newest such run holding a checkpoint is taken; a newer one still in use (its lock held)
  is refused, naming the PID, rather than passed over for a second run beside it.
- ``record_paths(record)``: a spec record's local paths made absolute (model folder, data
  files and folder, config, hw.json), so a run resumes from any folder.
- ``moved_data_files(spec, cfg)``: a ``--data`` / ``--eval-data`` file given at another path
  than the run's, with the sha256 the run saved: the same rows, moved; accepted and said.
- ``changed_data_files(spec, cfg)``: the data files whose content is not what the run
  trained on (compared by role, train and eval, so a moved file is still compared).

Reads run directories (``zenflow.train.runs``) and the data files; writes nothing, and never
imports ``zenflow.train.spec`` (which imports this).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from zenflow.errors import UserInputError
from zenflow.train import runs

DATA_ROLES = ("data_file", "eval_file")  # RunSpec fields: --data, --eval-data
# The spec record's fields that may name a local file or folder (``record_paths``).
_PATH_FIELDS = ("model", "data_dir", "data_file", "eval_file", "hw_json")


def is_hub_id(value: str) -> bool:
    from zenflow.train.data import is_hub_id as hub_id

    return hub_id(value)


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_digest(path: str) -> str:
    """What identifies a ``--data`` source: a file's sha256, a hub dataset's fingerprint."""
    from zenflow.train.data import hub_fingerprint

    return hub_fingerprint(path) if is_hub_id(path) else file_sha256(path)


def data_run_name(data: str | os.PathLike) -> str:
    """The name of a ``--data`` run given no ``--task``: the file's stem, or the hub
    dataset id made path-safe."""
    if is_hub_id(data):
        return re.sub(r"[^\w.-]+", "-", str(data)).strip("-")
    return Path(data).stem


def describe(spec) -> str:
    """What a run trains on, for messages: the GLUE task, or ``--data FILE``."""
    return f"--data {spec.data_file}" if spec.data_file is not None else str(spec.task)


# ---------------------------------------------------------------------------- paths


def absolute(value):
    """``value`` as an absolute path when it names something that exists here (a model
    folder, a data file), else as given (a hub id, or a path that is not there)."""
    if not isinstance(value, str) or not value or os.path.isabs(value):
        return value
    p = os.path.expanduser(value)
    return os.path.abspath(p) if os.path.exists(p) else value


def record_paths(record: dict) -> dict:
    """``record`` (``spec.spec_record``) with its local paths absolute (``absolute``)."""
    for name in _PATH_FIELDS:
        if name in record:
            record[name] = absolute(record[name])
    if isinstance(record.get("config_source"), str) and record["config_source"] != "<dict>":
        record["config_source"] = absolute(record["config_source"])
    return record


def same_path(a: str | None, b: str | None) -> bool:
    """The same file or folder (``~`` and links resolved), or the same hub id."""
    if a is None or b is None:
        return a is b
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


# ---------------------------------------------------------------------------- data files


def saved_digest(cfg: dict, role: str) -> str | None:
    """The sha256 the run in ``cfg`` (its config.json) saved for its ``role`` file."""
    path = (cfg.get("run") or {}).get(role)
    files = cfg.get("data_files")
    return files.get(path) if isinstance(files, dict) and isinstance(path, str) else None


def moved_data_files(spec, cfg: dict) -> dict[str, tuple[str, str]]:
    """role -> (the run's path, the given path) for each data file given at another path
    with the content the run saved (its sha256): the same rows, moved."""
    saved = cfg.get("run") or {}
    out = {}
    for role in DATA_ROLES:
        mine, theirs = getattr(spec, role), saved.get(role)
        if mine is None or theirs is None or same_path(mine, theirs) or is_hub_id(mine):
            continue
        digest = saved_digest(cfg, role)
        if digest is not None and os.path.isfile(mine) and file_sha256(mine) == digest:
            out[role] = (theirs, mine)
    return out


def changed_data_files(spec, cfg: dict) -> list[str]:
    """The data files of ``spec`` whose content differs from what the run in ``cfg``
    trained on (the sha256 saved for the same role)."""
    changed = []
    for role in DATA_ROLES:
        digest, path = saved_digest(cfg, role), getattr(spec, role)
        if digest is not None and path is not None and data_digest(path) != digest:
            changed.append(str(path))
    return changed


def missing_data_file(run_dir: Path, role: str, path: str | None) -> UserInputError | None:
    """The error for a run's local data file that is no longer at its saved path."""
    if path is None or is_hub_id(path) or os.path.exists(path):
        return None
    flag = "--data" if role == "data_file" else "--eval-data"
    return UserInputError(
        f"--resume {run_dir}: the run's {flag} file {path} is not there any more. If it "
        f"moved, pass its new path: {flag} NEW_PATH (accepted when its sha256 is the one the "
        f"run saved in its {runs.CONFIG_FILE}); else restore the file, or start a new run."
    )


# ---------------------------------------------------------------------------- --resume auto


def trains_on_same(spec, cfg: dict, digest: Callable[[], str]) -> bool:
    """Whether the run of ``cfg`` trained on what ``spec`` asks for: both a GLUE task of
    the same name, or both ``--data`` of the same file (its path, or ``digest()``, the given
    file's sha256, equal to the one the run saved); any run when ``spec`` names neither."""
    info = cfg.get("run") or {}
    theirs = info.get("data_file")
    if spec.data_file is None:
        return spec.task is None or (theirs is None and info.get("task") == spec.task)
    if not isinstance(theirs, str):
        return False
    if same_path(spec.data_file, theirs):
        return True
    saved = saved_digest(cfg, "data_file")
    return saved is not None and saved == digest()


def find_resumable(spec) -> Path | None:
    """The run ``--resume auto`` continues (module doc), or None when there is none.
    UserInputError when the newest matching run is in use by another process."""
    digest = functools.cache(lambda: data_digest(spec.data_file))
    for d in reversed(runs.list_runs(spec.runs_root)):
        cfg = runs.run_config(d) or {}
        if not runs.same_model((cfg.get("run") or {}).get("model"), spec.model):
            continue
        try:
            if not trains_on_same(spec, cfg, digest):
                continue
        except OSError:  # the given file cannot be read: the loader names the problem
            continue
        holder = runs.lock_holder(d)
        if holder is not None and holder != str(os.getpid()):
            raise UserInputError(
                f"--resume auto: the latest run of {spec.model} on {describe(spec)}, {d}, is "
                f"in use by PID {holder} (it is still training). Wait for it to end and pass "
                f"--resume auto again (Ctrl-C or SIGTERM to PID {holder} stops it at a "
                "checkpoint), or omit --resume to start a second run beside it."
            )
        if runs.latest_checkpoint(d) is not None:
            return d
    return None
