"""Checkpoint files of a run: atomic writes, retention, safe loading, and the RNG states.

A checkpoint is data, never code: it holds only tensors and plain Python types (dicts,
lists, ints, floats, strings, None), and is loaded with ``torch.load(weights_only=True)``,
so a file shared by someone else cannot run anything when resumed. It loads onto the CPU
(``map_location="cpu"``); ``model.load_state_dict`` and ``engine.load_state_dict`` copy
each piece to the device that owns it, so a checkpoint resumes on any device.

Writing is atomic (temp file, fsync, rename); a failed write removes its temp file, keeps
every older checkpoint and raises ``StorageError`` naming the path and the free space.
Reading falls back from an unreadable newest checkpoint to the newest readable one
(``load_newest``) and says so; a checkpoint that would need code to load is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import random
import warnings
from pathlib import Path

from zenflow.errors import CheckpointError, StorageError, os_error_message
from zenflow.train import runs

KEEP_CHECKPOINTS = 2  # the latest and one previous
# 2: loadable with weights_only=True, RNG states per device type, no copy of the config.
CHECKPOINT_FORMAT = 2
# A failed write with less than this free beside it is reported as "no space left".
_NEARLY_FULL_BYTES = 1 << 20


class UnsafeCheckpointError(CheckpointError):
    """The file would need Python code (pickled objects) to load: refused, never loaded."""


# ---------------------------------------------------------------------------- RNG states


def rng_state(torch, device) -> dict:
    """The RNG states a resumed run restores, per device type: ``cpu`` (torch's CPU
    generator), ``python`` (``random``, as lists and ints) and ``cuda`` (one state per
    visible GPU) when the run uses CUDA."""
    version, internal, gauss_next = random.getstate()
    state = {
        "cpu": torch.get_rng_state(),
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
    }
    if device.type == "cuda":
        # torch.cuda.get_rng_state_all(): a list of CPU ByteTensors, one per device.
        # Written against torch.cuda's documented API; no GPU has run it in this project.
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(torch, device, state: dict) -> None:
    """Restore ``rng_state``'s result; states of a device type this run does not use are
    ignored (a CUDA run resumed on the CPU continues, though not bit for bit)."""
    torch.set_rng_state(state["cpu"].to("cpu"))
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
    if device.type == "cuda" and state.get("cuda"):
        # torch.cuda.set_rng_state(state, device) takes a CPU ByteTensor; a machine with
        # fewer GPUs than the saving one restores the ones it has (not run here: no GPU).
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.to("cpu"), i)


# ---------------------------------------------------------------------------- writing


def _write_failure(exc: BaseException, tmp: Path) -> OSError | None:
    """The OSError behind a failed ``torch.save`` into ``tmp``, or None when ``exc`` is not
    a write failure. torch reports I/O errors as RuntimeError without an errno ("unexpected
    pos 576 vs 534" on a full disk), so the file system is asked, while the partial file is
    still there: read-only, (nearly) no space left, or not writable."""
    if isinstance(exc, OSError):
        return exc
    if not isinstance(exc, RuntimeError):
        return None
    reason = str(exc).split("] .", 1)[-1].strip() or str(exc)
    code = errno.EIO
    with contextlib.suppress(OSError):
        st = os.statvfs(tmp.parent)
        if st.f_flag & os.ST_RDONLY:
            code = errno.EROFS
        elif st.f_bavail * st.f_frsize < _NEARLY_FULL_BYTES:
            code = errno.ENOSPC
        elif not os.access(tmp.parent, os.W_OK):
            code = errno.EACCES
    return OSError(code, f"{os.strerror(code)} (torch.save: {reason})")


def _atomic_save(torch, path: Path, state: dict) -> None:
    """``torch.save`` to a temp file beside ``path``, fsync, rename. On failure the temp file
    is removed and a write failure raises StorageError (path and free space)."""
    tmp = path.parent / f".{path.name}.tmp"
    try:
        path.parent.mkdir(exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        failure = _write_failure(exc, tmp) if isinstance(exc, Exception) else None
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if failure is not None:  # the message's free space is counted without the temp file
            raise StorageError(os_error_message(failure, path, "cannot write checkpoint")) from exc
        raise


def write_checkpoint(torch, run_dir: Path, step: int, state: dict) -> Path:
    """Write ``state`` as checkpoints/step-NNNNNNN.pt atomically and keep the newest
    ``KEEP_CHECKPOINTS`` (with their data-parallel shards). On failure older checkpoints
    stay."""
    path = run_dir / runs.CHECKPOINT_DIR / f"step-{step:07d}.pt"
    _atomic_save(torch, path, state)
    for old in runs.checkpoints(run_dir)[:-KEEP_CHECKPOINTS]:
        old.unlink(missing_ok=True)
        for shard in old.parent.glob(f"{old.stem}.rank-*.pt"):
            shard.unlink(missing_ok=True)
    return path


def shard_path(checkpoint: Path, rank: int) -> Path:
    """Where rank ``rank`` (>= 1) of a data-parallel run keeps its part of ``checkpoint``
    (``step-0000012.pt`` -> ``step-0000012.rank-1.pt``); rank 0's is in the checkpoint."""
    return checkpoint.with_name(f"{checkpoint.stem}.rank-{rank}.pt")


def write_shard(torch, run_dir: Path, step: int, rank: int, state: dict) -> Path:
    """Rank ``rank``'s engine state and RNG for step ``step``. Written before rank 0 writes
    the checkpoint itself, which is what makes a data-parallel checkpoint complete (a
    checkpoint file implies its shards)."""
    path = shard_path(run_dir / runs.CHECKPOINT_DIR / f"step-{step:07d}.pt", rank)
    _atomic_save(torch, path, {"format": CHECKPOINT_FORMAT, **state})
    return path


# ---------------------------------------------------------------------------- reading


def read_checkpoint(torch, path: Path) -> dict:
    """The checkpoint dict at ``path``, loaded onto the CPU with ``weights_only=True``.

    UnsafeCheckpointError when the file holds pickled Python objects or is a raw pickle
    (either could run code: refused, nothing of it executed); CheckpointError when it is
    unreadable or foreign. PyTorch's own advice in its refusal (load with
    ``weights_only=False``) is never passed on: that is the unsafe way."""
    if _is_raw_pickle(path):
        raise UnsafeCheckpointError(
            f"{path} is a raw Python pickle (pickle.dump, or torch.save with "
            "_use_new_zipfile_serialization=False), not the zip of tensors zfctl writes; "
            "loading a pickle could run code, so it was refused and nothing in it was "
            "executed. Use a checkpoint written by zfctl, or start a new run."
        )
    try:
        with warnings.catch_warnings():  # torch's notes on pickle protocols: not for users
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():  # an object that only code can rebuild
            raise UnsafeCheckpointError(
                f"{path} holds Python objects, not only tensors and plain data, so loading "
                "it could run code; it was refused and nothing in it was executed. zfctl "
                "never writes such checkpoints: use one written by zfctl, or start a new run."
            ) from None
        raise CheckpointError(
            f"Cannot read checkpoint {path}: its pickled data is not what zfctl writes "
            "(tensors and plain data only), so it was refused unread. Use a checkpoint "
            "written by zfctl, or start a new run."
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"Checkpoint {path} does not exist.") from None
    except OSError as exc:
        raise CheckpointError(os_error_message(exc, path, "cannot read checkpoint")) from None
    except Exception as exc:  # truncated zip, bad magic, EOF: torch raises several types
        raise CheckpointError(f"Cannot read checkpoint {path}: {_first_line(exc)}.") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{path} is not a zfctl checkpoint of format {CHECKPOINT_FORMAT} (found "
            f"{found!r}); it was written by another program or an older zfctl. Resume it "
            "with the zfctl that wrote it, or start a new run."
        )
    return state


def _is_raw_pickle(path: Path) -> bool:
    """Whether ``path`` starts like a bare pickle (the PROTO opcode 0x80 and a protocol
    number 2..5) rather than a zip archive ("PK", what torch.save writes by default). An
    unreadable file is left to ``torch.load`` to report."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        return False
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__).rstrip(".")


def load_newest(torch, candidates: list[Path]) -> tuple[dict, Path, list[str]]:
    """The newest readable checkpoint of ``candidates`` (newest first): (state, its path,
    notes about the unreadable ones skipped). An unsafe file is refused outright (no
    fallback past it); when none is readable, CheckpointError names every file."""
    notes: list[str] = []
    failures: list[str] = []
    for path in candidates:
        try:
            state = read_checkpoint(torch, path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            failures.append(str(exc))
            continue
        if failures:
            notes.append(
                f"{'; '.join(failures)} Resumed from the newest readable checkpoint, {path}, "
                "instead."
            )
        return state, path, notes
    raise CheckpointError(
        "No readable checkpoint to resume from: " + " ".join(failures) + " Start a new run "
        "(--overwrite on this run dir, or another --run-dir)."
    )
