"""Run directories: create, find the latest, read back (config, summary, metrics, hw).

Layout of one run (written by ``zenflow.train.trainer``)::

    runs/<YYYYmmdd-HHMMSS>-<model basename>-<task>/
        config.json     resolved DeepSpeed config + {"run": spec, "sources": ...}
        hw.json         copy of the hardware probe, when one was given or found
        metrics.jsonl   one JSON object per line: {"type": "step", ...} or {"type": "eval", ...}
        summary.json    written when the run finishes
        checkpoints/step-0000012.pt   latest (and one previous) resumable checkpoint
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

from zenflow.errors import UserInputError

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
HW_FILE = "hw.json"
CHECKPOINT_DIR = "checkpoints"
MODEL_DIR = "model"  # the fine-tuned model, Hugging Face format
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


def read_json(path: str | Path) -> dict | None:
    """The JSON object in ``path``, or None when the file does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{path} is not valid JSON: {exc}.") from exc


def read_metrics(path: str | Path) -> list[dict]:
    """Every complete line of a metrics.jsonl (a torn last line from a crash is skipped)."""
    out: list[dict] = []
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        return out
    with f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # only a crash mid-write leaves a bad line, and only as the last one
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


def _same_model(a: str | None, b: str) -> bool:
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
        if model is not None and not _same_model(info.get("model"), model):
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
    lines = read_metrics(d / METRICS_FILE)
    return {
        "run_dir": str(d),
        "config": read_json(d / CONFIG_FILE),
        "summary": read_json(d / SUMMARY_FILE),
        "metrics": [m for m in lines if m.get("type", "step") == "step"],
        "evals": [m for m in lines if m.get("type") == "eval"],
        "hw": read_json(d / HW_FILE),
        "checkpoint": str(latest_checkpoint(d) or "") or None,
    }
