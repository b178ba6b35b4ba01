"""Exceptions for problems the user can fix (bad input, missing data or model, full disk).

The CLI turns any ``UserInputError`` into one red line and exit code 2; anything else is a
bug (one line saying so, the traceback in a log file, exit 1). Messages are whole
sentences: what is wrong, where, and how to fix it.
"""

from __future__ import annotations

import errno
import os
import shutil


class UserInputError(Exception):
    """Base for errors caused by the user's input or environment, not by a bug."""


class ModelSourceError(UserInputError):
    """A model or tokenizer cannot be found or loaded from any allowed source."""


class DataError(UserInputError):
    """A task's data is missing, unreadable or malformed."""


class EngineError(UserInputError, ValueError):
    """The engine cannot run with this model/config combination (message says how to fix)."""


class StorageError(UserInputError):
    """A file or directory cannot be written (disk full, read-only, no permission)."""


class CheckpointError(UserInputError):
    """A checkpoint cannot be read (truncated, corrupt, foreign) or is refused as unsafe."""


def free_space(path: str | os.PathLike) -> str:
    """Free space on the file system holding ``path`` (its nearest existing ancestor), as
    text like "1.2 GB free on /data"; "free space unknown" when it cannot be asked."""
    p = os.path.abspath(os.fspath(path))
    while p and not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return "free space unknown"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if free >= size:
            return f"{free / size:.1f} {unit} free on {p}"
    return f"{free} bytes free on {p}"


# What to do about an OSError, by errno (the rest: "check the path and try again").
_OS_FIXES = {
    errno.ENOSPC: "free space there, or choose a location on another file system",
    errno.EDQUOT: "free space (the disk quota is used up), or choose another location",
    errno.EFBIG: "the file system or a size limit (ulimit -f) refuses files this large; "
    "choose another location or raise the limit",
    errno.EROFS: "the file system is mounted read-only; choose a writable location",
    errno.EACCES: "check the permissions, or choose a location you can write to",
    errno.EPERM: "check the permissions, or choose a location you can write to",
    errno.ENOENT: "check the path (a folder on it may be missing)",
    errno.ENOTDIR: "a part of the path is a file, not a folder; fix the path",
    errno.EISDIR: "it is a directory; give a file path",
    errno.EEXIST: "it already exists; remove it or choose another path",
}


_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def os_error_message(exc: OSError, path: str | os.PathLike | None = None, what: str = "") -> str:
    """One sentence for an OSError: the path, the system's reason, the fix and, for
    "no space" and write failures, the free space there."""
    target = path if path is not None else exc.filename
    reason = exc.strerror or str(exc) or type(exc).__name__
    fix = _OS_FIXES.get(exc.errno, "check the path and try again")
    head = f"{what} {target}" if what else str(target) if target is not None else "a file"
    msg = f"{head.strip()}: {reason}; {fix}."
    if target is not None and exc.errno in _DISK_ERRNOS:
        msg += f" ({free_space(target)}.)"
    return msg


def storage_error(
    exc: OSError, path: str | os.PathLike | None = None, what: str = ""
) -> StorageError:
    """A StorageError whose message is ``os_error_message`` (cause kept)."""
    err = StorageError(os_error_message(exc, path, what))
    err.__cause__ = exc
    return err


def undecodable_at(data: bytes, exc: UnicodeDecodeError, what: str = "") -> str:
    """Where in ``data`` a UTF-8 decode failed, in words: "line 3, byte 41 = 0xff: invalid
    start byte" (the byte offset counts from the start of the file, from 0); with ``what``:
    "line 3: WHAT (byte 41 = 0xff: invalid start byte)"."""
    line = data.count(b"\n", 0, exc.start) + 1
    bad = data[exc.start : exc.start + 1].hex() or "end of file"
    byte = f"byte {exc.start} = 0x{bad}: {exc.reason}"
    return f"line {line}: {what} ({byte})" if what else f"line {line}, {byte}"


def attach_log_dir(exc: BaseException, path: str | os.PathLike) -> None:
    """Remember on an unexpected exception (a bug) the directory its log belongs in (the
    run directory); the CLI writes the traceback there (``log_dir_of``)."""
    try:
        exc.zenflow_log_dir = os.fspath(path)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # an exception type without a __dict__
        pass


def log_dir_of(exc: BaseException) -> str | None:
    return getattr(exc, "zenflow_log_dir", None)
