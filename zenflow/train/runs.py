"""Run directories: create, find the latest, read back (config, summary, metrics, hw).

Layout of one run (written by ``zenflow.train.trainer``)::

    runs/<YYYYmmdd-HHMMSS>-<model basename>-<task>/
        config.json     resolved DeepSpeed config + {"zfctl_run": 1, "run": spec,
                        "sources": ...}: what makes the folder a zfctl run (``run_config``)
        hw.json         copy of the hardware probe, when one was given or found
        metrics.jsonl   one JSON object per line: {"type": "step", ...} or {"type": "eval", ...}
        summary.json    written when the run finishes
        checkpoints/step-0000012.pt   latest (and one previous) resumable checkpoint
        model/          the fine-tuned model (Hugging Face format), written at the end
        .zfctl.lock     flock held by the process running it (see ``RunDirLock``)
        zfctl-error.log the traceback of an internal error (a bug), when one happened
        tensorboard/, csv_monitor/, wandb/   the monitors' logs, when enabled with no path

A folder is a run only when its config.json says so (``run_config``). ``OUR_ENTRIES`` are
the names zfctl writes; ``clear_run`` (``--overwrite``) removes those from a run and
nothing else, and nothing at all from a folder that is not a run. Inside checkpoints/ and
model/ it removes only the files zfctl names (``is_our_checkpoint_file``,
``is_our_model_file``): a user's ``my-best.pt`` or ``my_adapter.bin`` there stays, and is
reported as kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

from zenflow.errors import UserInputError, storage_error, undecodable_at
from zenflow.outputs import open_append, write_file, write_json_atomic, write_text, writing

# The writers live in zenflow.outputs; the trainer calls them from here.
__all__ = ["open_append", "write_json_atomic", "write_text", "writing"]

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
HW_FILE = "hw.json"
CHECKPOINT_DIR = "checkpoints"
MODEL_DIR = "model"  # the fine-tuned model, Hugging Face format
LOCK_FILE = ".zfctl.lock"
ERROR_LOG = "zfctl-error.log"
# The monitors' folders when their output_path is "" (zenflow.train.monitors.log_dir).
MONITOR_DIRS = ("tensorboard", "csv_monitor", "wandb")
# config.json's key saying zfctl wrote it, with the layout's version. A folder is a zfctl
# run only by its config.json (``run_config``): never by the mere names of its files (a
# Hugging Face model folder holds a config.json too).
RUN_MARK = "zfctl_run"
RUN_FORMAT = 1
# What ``clear_run`` (--overwrite) removes from a run, config.json last: a run cleared
# halfway is still recognised as a run and can be cleared again.
OUR_ENTRIES = (METRICS_FILE, SUMMARY_FILE, CHECKPOINT_DIR, MODEL_DIR, HW_FILE, ERROR_LOG,
               *MONITOR_DIRS, CONFIG_FILE)  # fmt: skip
# What zfctl may leave in a folder before the run's config.json exists (the lock, a bug's
# log): such a folder still counts as empty.
HOUSEKEEPING = (LOCK_FILE, ERROR_LOG)
_CKPT_RE = re.compile(r"^step-(\d+)\.pt$")
# What zfctl writes in checkpoints/: step-NNNNNNN.pt, a data-parallel rank's shard
# step-NNNNNNN.rank-R.pt, and the temp file of either (checkpointing._atomic_save) that a
# kill -9 mid-write leaves. Never a look-alike: step-0000099.pt.bak or my-best.pt stay.
_OUR_CHECKPOINT_RE = re.compile(r"^(step-\d+(\.rank-\d+)?\.pt|\.step-\d+(\.rank-\d+)?\.pt\.tmp)$")
# What models.save_model (Hugging Face save_pretrained of the model and its tokenizer)
# writes in model/: the model's config and weights (one file or shards and their index),
# and the tokenizer's files of every tokenizer class transformers saves. A name outside
# these is someone else's file and stays.
_OUR_MODEL_FILES = frozenset(
    ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
     "pytorch_model.bin", "pytorch_model.bin.index.json", "tokenizer.json",
     "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
     "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
     "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "spm.model")
)  # fmt: skip
_OUR_MODEL_SHARD_RE = re.compile(r"^(model-\d+-of-\d+\.safetensors|pytorch_model-\d+-of-\d+\.bin)$")


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
    write_file(path, lambda f: f.write(b"".join(keep)), binary=True)
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


# The numbers a metrics line may hold: (lowest, highest) allowed. A value outside, or NaN or
# inf (bare tokens in files written before zfctl wrote strict JSON), reads back as missing
# (None); so does a step's null loss (a skipped step). ``read_metrics`` describes each kind.
_NON_NEGATIVE = (0.0, math.inf)
_SHARE = (0.0, 1.0)
_CORRELATION = (-1.0, 1.0)
VALUE_RANGES = {
    **dict.fromkeys(
        ("loss", "eval_loss", "lr", "grad_norm", "epoch", "samples_per_s", "tokens_per_s",
         "d2h_bytes", "h2d_bytes", "device_bytes", "device_peak_bytes", "host_bytes",
         "host_peak_bytes", "pinned_host_bytes", "wall_ms", "step_ms", "forward_ms", "backward_ms",
         "device_opt_ms", "stall_ms", "transfer_ms"),
        _NON_NEGATIVE,
    ),
    **dict.fromkeys(("accuracy", "f1", "overlap_share"), _SHARE),
    **dict.fromkeys(("matthews", "pearson", "spearman"), _CORRELATION),
}  # fmt: skip


def _value_problem(record: dict, key: str) -> str | None:
    """What is wrong with ``record[key]`` (then set to None), or None when it is fine."""
    value = record.get(key)
    if value is None:  # not reported; only a step's loss is always reported
        return "loss missing (null: a skipped, non-finite step)" if (
            key == "loss" and key in record and record.get("type", "step") == "step"
        ) else None  # fmt: skip
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        problem = f"{key} not a number"
    elif not math.isfinite(value):
        problem = f"{key} not finite ({value})"
    else:
        lo, hi = VALUE_RANGES[key]
        if lo <= value <= hi:
            return None
        problem = f"{key} out of range ({value:g}; allowed {lo:g} to {hi:g})"
    record[key] = None
    return problem


def _check_values(record: dict, line: int, seen: dict) -> None:
    """Set each bad number of ``record`` to None; count it in ``seen`` by kind:
    (line type, problem) -> [count, first line, first problem]."""
    for key in [k for k in record if k in VALUE_RANGES]:
        problem = _value_problem(record, key)
        if problem is not None:  # the kind: the problem without the value
            kind = (str(record.get("type", "step")), problem.split(" (")[0])
            seen.setdefault(kind, [0, line, problem])[0] += 1


def read_metrics(path: str | Path, problems: list[str] | None = None) -> list[dict]:
    """Every JSON-object line of a metrics.jsonl. A line that is not UTF-8, not JSON or not
    an object is skipped and reading goes on; each such line is described in ``problems``
    (when given). A torn last line (a crash mid-write) is described as such. A number out
    of ``VALUE_RANGES`` or not finite, and a step's null loss, read back as None; each kind
    is described once in ``problems``, with its count and first line."""
    out: list[dict] = []
    seen: dict[tuple[str, str], list] = {}
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
                _check_values(record, i + 1, seen)
                out.append(record)
                continue
            problem = f"{where} is not a JSON object; skipped it"
        if problems is not None:
            problems.append(problem)
    if problems is not None:
        for (kind, _), (count, first, problem) in seen.items():
            lines = f"{count} {kind} line{'s' if count > 1 else ''}"
            problems.append(f"{path}: {lines} with {problem}, first at line {first}; read "
                            "as a missing value")  # fmt: skip
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


def is_run_config(cfg) -> bool:
    """Whether a config.json's content is one zfctl wrote for a run: it carries
    ``RUN_MARK``, or (written before the mark existed) a "run" object naming the model
    (the spec zfctl has always saved there; no model's own config.json has one)."""
    if not isinstance(cfg, dict):
        return False
    mark = cfg.get(RUN_MARK)
    if isinstance(mark, int) and not isinstance(mark, bool) and mark >= 1:
        return True
    run = cfg.get("run")
    return isinstance(run, dict) and isinstance(run.get("model"), str)


def run_config(run_dir: str | Path) -> dict | None:
    """The config.json of the zfctl run in ``run_dir``, or None when ``run_dir`` holds
    none (no config.json, or one zfctl did not write: unreadable, not JSON, no mark)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        cfg = read_json(path)
    except (UserInputError, OSError):
        return None
    return cfg if is_run_config(cfg) else None


def _run_info(run_dir: Path) -> dict:
    return (run_config(run_dir) or {}).get("run") or {}


def same_model(a: str | None, b: str) -> bool:
    if a is None:
        return False
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


def list_runs(runs_root: str | Path) -> list[Path]:
    """The zfctl runs under ``runs_root`` (``holds_run``), oldest first."""
    root = Path(runs_root)
    if not root.is_dir():
        return []
    runs = [d for d in root.iterdir() if d.is_dir() and holds_run(d)]
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
    config = read_json(d / CONFIG_FILE) if (d / CONFIG_FILE).is_file() else None
    if not is_run_config(config):
        raise UserInputError(
            f"{d} is not a zfctl run directory ({not_a_run_reason(d)}). Pass a directory "
            "under runs/ written by `zfctl finetune`."
        )
    problems: list[str] = []
    lines = read_metrics(d / METRICS_FILE, problems)
    return {
        "run_dir": str(d),
        "warnings": problems,
        "config": config,
        "summary": read_json(d / SUMMARY_FILE),
        "metrics": [m for m in lines if m.get("type", "step") == "step"],
        "evals": [m for m in lines if m.get("type") == "eval"],
        "hw": read_json(d / HW_FILE),
        "checkpoint": str(latest_checkpoint(d) or "") or None,
    }


# ---------------------------------------------------------------------------- ownership


def holds_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a zfctl run: its config.json is one zfctl wrote
    (``run_config``). File names alone never make a run."""
    return run_config(run_dir) is not None


def not_a_run_reason(run_dir: str | Path) -> str:
    """Why ``run_dir`` is not a zfctl run, for messages: "no config.json" or "its
    config.json was not written by zfctl"."""
    if not (Path(run_dir) / CONFIG_FILE).is_file():
        return f"no {CONFIG_FILE}"
    return f"its {CONFIG_FILE} was not written by zfctl"


def foreign_entries(run_dir: str | Path) -> list[str]:
    """The names in ``run_dir`` that are not zfctl's housekeeping (``HOUSEKEEPING``),
    sorted: what makes a folder that is not a run "not empty"."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n not in HOUSEKEEPING)


def is_our_checkpoint_file(name: str) -> bool:
    """Whether a name in checkpoints/ is one zfctl writes (a checkpoint, a rank's shard, or
    the temp file of either)."""
    return _OUR_CHECKPOINT_RE.match(name) is not None


def is_our_model_file(name: str) -> bool:
    """Whether a name in model/ is one ``models.save_model`` writes."""
    return name in _OUR_MODEL_FILES or _OUR_MODEL_SHARD_RE.match(name) is not None


# The folders of a run that may also hold the user's files, and which of their names are ours.
_SHARED_FOLDERS = {CHECKPOINT_DIR: is_our_checkpoint_file, MODEL_DIR: is_our_model_file}


def _remove(p: Path) -> bool:
    """Remove ``p`` (a link is removed, never followed); False when nothing is there."""
    try:
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            return False
    except OSError as exc:
        raise storage_error(exc, p, "cannot remove the old run's") from exc
    return True


def _clear_shared_folder(d: Path, name: str, kept: list[str]) -> bool:
    """Remove zfctl's files from the run's ``name`` folder (checkpoints/ or model/), and the
    folder when nothing else is left in it; the other entries stay and are added to
    ``kept`` (as ``name/entry``). True when the folder itself was removed."""
    folder = d / name
    if folder.is_symlink() or not folder.is_dir():
        return _remove(folder)  # a link, or a file where the folder would be: ours by name
    ours = _SHARED_FOLDERS[name]
    for entry in sorted(os.listdir(folder)):
        p = folder / entry
        if ours(entry) and (p.is_symlink() or not p.is_dir()):
            _remove(p)
        else:
            kept.append(f"{name}/{entry}")
    try:
        folder.rmdir()
    except OSError:  # the user's files are still in it
        return False
    return True


def clear_run(run_dir: str | Path, kept: list[str] | None = None) -> list[str]:
    """Remove the run files zfctl writes (``OUR_ENTRIES``) from the run in ``run_dir`` and
    nothing else (a link is removed, never followed); returns the names removed. In
    checkpoints/ and model/ only zfctl's own files go (``is_our_checkpoint_file``,
    ``is_our_model_file``); the others stay, with their folder, and are listed in ``kept``
    (when given) as ``folder/name``. A folder that is not a zfctl run (``holds_run``) is
    refused with UserInputError, untouched."""
    d = Path(run_dir)
    if not holds_run(d):
        raise UserInputError(
            f"{d} is not a zfctl run ({not_a_run_reason(d)}); nothing in it was removed. "
            "--overwrite replaces only a run zfctl wrote; choose an empty or new folder."
        )
    kept = [] if kept is None else kept
    removed = []
    for name in OUR_ENTRIES:
        if name in _SHARED_FOLDERS:
            gone = _clear_shared_folder(d, name, kept)
        else:
            gone = _remove(d / name)
        if gone:
            removed.append(name)
    return removed


def lock_holder(run_dir: str | Path) -> str | None:
    """The PID (as text) of the process that holds ``run_dir``'s lock (``RunDirLock``) now,
    or None when no process does. Asks with a shared lock, which never blocks another
    asker; the file is only opened for reading (never created)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except OSError:  # no lock file (no run started here), or it cannot be read
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops the shared lock
    return None


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
