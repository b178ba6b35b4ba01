"""Run directories: create, find the latest, read back (config, summary, metrics, hw).

Layout of one run (written by ``zenflow.train.trainer``)::

    runs/<YYYYmmdd-HHMMSS>-<model basename>-<task>/
        config.json     resolved DeepSpeed config + {"run": spec, "sources": ...}
        hw.json         copy of the hardware probe, when one was given or found
        metrics.jsonl   one JSON object per line: {"type": "step", ...} or {"type": "eval", ...}
        summary.json    written when the run finishes
        checkpoints/step-0000012.pt   latest (and one previous) resumable checkpoint
        model/          the fine-tuned model (Hugging Face format), written at the end
        .zfctl.lock     flock held by the process running it (see ``RunDirLock``)
        zfctl-error.log the traceback of an internal error (a bug), when one happened

``OUR_ENTRIES`` are the names zfctl writes; ``clear_run`` (``--overwrite``) removes those
and nothing else.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from zenflow.errors import StorageError, UserInputError, storage_error, undecodable_at

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
HW_FILE = "hw.json"
CHECKPOINT_DIR = "checkpoints"
MODEL_DIR = "model"  # the fine-tuned model, Hugging Face format
LOCK_FILE = ".zfctl.lock"
ERROR_LOG = "zfctl-error.log"
# A directory holding any of these holds a run (hw.json or a log alone do not make one).
RUN_MARKERS = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINT_DIR, MODEL_DIR)
OUR_ENTRIES = (*RUN_MARKERS, HW_FILE, ERROR_LOG)
_CKPT_RE = re.compile(r"^step-(\d+)\.pt$")


def model_basename(model: str) -> str:
    """``/x/y/tiny-gpt2/`` -> ``tiny-gpt2``; ``openai-community/gpt2`` -> ``gpt2``."""
    name = Path(str(model).rstrip("/\\")).name or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def create_run_dir(runs_root: str | Path, model: str, task: str, now: float | None = None) -> Path:
    """Make a new, empty ``<runs_root>/<YYYYmmdd-HHMMSS>-<model>-<task>`` (suffix -2, -3... on
    a name clash within the same second)."""
    root = Path(runs_root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = f"{stamp}-{model_basename(model)}-{task}"
    for i in range(1, 1000):
        d = root / (base if i == 1 else f"{base}-{i}")
        try:
            d.mkdir()
        except FileExistsError:
            continue
        return d
    raise UserInputError(f"Could not create a new run directory under {root} for {base}.")


def write_json_atomic(path: str | Path, obj) -> None:
    """Write JSON to a temporary file beside ``path`` (parents created), fsync, then
    os.replace: never a half-written file, and an existing file keeps its permissions."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=_json_default)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "items"):
        return dict(obj.items())
    return repr(obj)


@contextlib.contextmanager
def writing(path: str | Path, what: str = "cannot write"):
    """Turn an OSError raised inside into a StorageError naming ``path``, the reason and
    the free space there (full disk, read-only file system, no permission)."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise storage_error(exc, path, what) from exc


def trim_metrics(path: str | Path, keep_lines: int, *, drop_eval_at: int | None = None) -> list:
    """Cut metrics.jsonl back to its first ``keep_lines`` lines (those a checkpoint
    counted; later lines belong to steps that run again), and also drop a last eval line
    of step ``drop_eval_at`` (an evaluation that runs again). Returns the kept records."""
    path = Path(path)
    lines = path.read_bytes().splitlines(True) if path.exists() else []
    keep = lines[:keep_lines]
    if keep and drop_eval_at is not None:
        try:
            last = json.loads(keep[-1].decode("utf-8"))
        except ValueError:
            last = None
        if (
            isinstance(last, dict)
            and last.get("type") == "eval"
            and last.get("step") == drop_eval_at
        ):
            keep.pop()
    with writing(path):
        path.write_bytes(b"".join(keep))
    records = []
    for line in keep:
        with contextlib.suppress(ValueError):
            rec = json.loads(line.decode("utf-8"))
            if isinstance(rec, dict):
                records.append(rec)
    return records


def read_json(path: str | Path) -> dict | None:
    """The JSON object in ``path``, or None when the file does not exist. UserInputError
    naming the file (and the line and byte) when it is not UTF-8 JSON; a byte-order mark
    is skipped."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        return json.loads(data.decode("utf-8-sig"))
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as exc:
        raise UserInputError(
            f"{path} is not UTF-8 text ({undecodable_at(data, exc)}); restore it from a "
            "copy, or delete it if zfctl can write it again."
        ) from exc
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{path} is not valid JSON: {exc}.") from exc


def read_metrics(path: str | Path, problems: list[str] | None = None) -> list[dict]:
    """Every JSON-object line of a metrics.jsonl. A line that is not UTF-8, not JSON or not
    an object is skipped and reading goes on; each such line is described in ``problems``
    (when given). A torn last line (a crash mid-write) is described as such."""
    out: list[dict] = []
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except FileNotFoundError:
        return out
    last = max((i for i, b in enumerate(raw_lines) if b.strip()), default=-1)
    for i, raw in enumerate(raw_lines):
        if not raw.strip():
            continue
        where = f"{path} line {i + 1}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            problem = f"{where} is not UTF-8 text; skipped it"
        except ValueError:
            if i == last and i == len(raw_lines) - 1:  # no newline after it: cut mid-write
                problem = f"{where} (the last) is incomplete, as a crash mid-write leaves it"
                problem += "; skipped it"
            else:
                problem = f"{where} is not valid JSON; skipped it"
        else:
            if isinstance(record, dict):
                out.append(record)
                continue
            problem = f"{where} is not a JSON object; skipped it"
        if problems is not None:
            problems.append(problem)
    return out


def checkpoint_step(path: str | Path | None) -> int | None:
    """The step of a checkpoint file named ``step-0000012.pt`` (12), else None."""
    m = _CKPT_RE.match(Path(path).name) if path else None
    return int(m.group(1)) if m else None


def checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoint files, oldest step first."""
    d = Path(run_dir) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _CKPT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def _run_info(run_dir: Path) -> dict:
    cfg = read_json(run_dir / CONFIG_FILE) or {}
    return cfg.get("run") or {}


def same_model(a: str | None, b: str) -> bool:
    if a is None:
        return False
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


def list_runs(runs_root: str | Path) -> list[Path]:
    """Run directories under ``runs_root`` (those with a config.json), oldest first."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    runs = [d for d in root.iterdir() if d.is_dir() and (d / CONFIG_FILE).is_file()]
    # Names start with a timestamp; mtime breaks ties and orders renamed directories.
    return sorted(runs, key=lambda d: (d.name[:15], (d / CONFIG_FILE).stat().st_mtime, d.name))


def latest_run(
    runs_root: str | Path,
    model: str | None = None,
    task: str | None = None,
    *,
    with_checkpoint: bool = False,
) -> Path | None:
    """The newest run under ``runs_root``, optionally for this model and task and only runs
    that hold a checkpoint; None when there is none."""
    for d in reversed(list_runs(runs_root)):
        info = _run_info(d)
        if model is not None and not same_model(info.get("model"), model):
            continue
        if task is not None and info.get("task") != task:
            continue
        if with_checkpoint and latest_checkpoint(d) is None:
            continue
        return d
    return None


def read_run(run_dir: str | Path) -> dict:
    """Everything a report needs: {"run_dir", "config", "summary", "metrics", "evals", "hw"}.

    ``metrics`` holds the step lines, ``evals`` the evaluation lines; ``summary`` is None
    for a run that has not finished (interrupted or still running).
    """
    d = Path(run_dir)
    if not (d / CONFIG_FILE).is_file():
        raise UserInputError(
            f"{d} is not a zfctl run directory (no {CONFIG_FILE}). Pass a directory under "
            "runs/ written by `zfctl finetune`."
        )
    problems: list[str] = []
    lines = read_metrics(d / METRICS_FILE, problems)
    return {
        "run_dir": str(d),
        "warnings": problems,
        "config": read_json(d / CONFIG_FILE),
        "summary": read_json(d / SUMMARY_FILE),
        "metrics": [m for m in lines if m.get("type", "step") == "step"],
        "evals": [m for m in lines if m.get("type") == "eval"],
        "hw": read_json(d / HW_FILE),
        "checkpoint": str(latest_checkpoint(d) or "") or None,
    }


# ---------------------------------------------------------------------------- ownership


def holds_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds (part of) a run: any of ``RUN_MARKERS``."""
    d = Path(run_dir)
    return any(os.path.lexists(d / name) for name in RUN_MARKERS)


def clear_run(run_dir: str | Path) -> list[str]:
    """Remove the run files zfctl writes (``OUR_ENTRIES``) from ``run_dir`` and nothing
    else (a link is removed, never followed); returns the names removed."""
    d = Path(run_dir)
    removed = []
    for name in OUR_ENTRIES:
        p = d / name
        try:
            if p.is_symlink() or p.is_file():
                p.unlink()
            elif p.is_dir():
                shutil.rmtree(p)
            else:
                continue
        except OSError as exc:
            raise storage_error(exc, p, "cannot remove the old run's") from exc
        removed.append(name)
    return removed


class RunDirLock:
    """An exclusive ``flock`` on ``<run_dir>/.zfctl.lock``, held while a run uses the
    directory. The kernel drops it when the holder exits, however it dies (kill -9
    included), so a lock file left behind never blocks anyone; the file holds the
    holder's PID for the message. The file itself stays (unlinking a lock file races with
    a process that has just opened it)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise storage_error(exc, self.path, "cannot create the run lock") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise UserInputError(
                f"run dir {self.path.parent} in use by PID {holder} (another `zfctl finetune` "
                "holds its lock); wait for it to finish or stop it, or choose another "
                "--run-dir."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
