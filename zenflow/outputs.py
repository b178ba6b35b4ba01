"""Writing a file at a path the user named, without replacing or deleting what zfctl did not
write.

Every file zfctl writes goes through here: ``zfctl init --output``, ``zfctl tune-hw
--output`` and ``--config ... --write``, ``zfctl report --plot``, ``zfctl bench --json`` and
the files of a run directory (config.json, summary.json, hw.json, metrics.jsonl, the CSV
logs). ``output_target`` says what the path is and so how it is written:

- nothing there yet, or a regular file: atomically (a temporary ``.<name>.<random>.tmp``
  beside it, fsync, ``os.replace``), so a reader never sees half a file and an existing
  file keeps its permissions; a new file gets the permissions of any new file (0666 less
  the umask: a teammate can read it where the umask allows), never a temp file's private
  0600; missing parent folders are created;
- a symbolic link to a regular file (or a dangling one): the link stays, and the file it
  points to is replaced atomically as above;
- a FIFO or a character device (/dev/null, /dev/stdout on a terminal or a pipe), or a
  /dev/... or /proc/... link to a regular file (/dev/stdout redirected to a file,
  /dev/fd/3): written into, as the shell's ``>`` would, never renamed over (renaming would
  put a regular file where the device node or link was);
- a directory, a block device, a socket or anything else: refused, before anything is
  written.

Every failure is a ``StorageError`` naming the user's path (never the temporary file), the
reason, the fix and, for a full disk, the free space (``zenflow.errors.storage_error``).
``check_writable`` asks the same questions before slow work (``zfctl tune-hw`` probes for
minutes), so a path that cannot be written is refused first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from zenflow import jsonout
from zenflow.errors import StorageError, storage_error

# Links here are the kernel's file-descriptor links (/dev/stdout, /dev/fd/N,
# /proc/self/fd/N): the file behind them is written in place, not replaced.
_SPECIAL_ROOTS = ("/dev/", "/proc/")
_DIRECT_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device"}
_REFUSED = {
    stat.S_IFDIR: "a directory",
    stat.S_IFBLK: "a block device (a disk or partition)",
    stat.S_IFSOCK: "a socket",
}


@dataclass(frozen=True)
class OutputTarget:
    """What an output path is. ``path`` as named (for messages); ``real`` where the bytes
    land (links followed); ``direct``: written into, no temporary file and no rename;
    ``exists``: something is there now."""

    path: Path
    real: Path
    direct: bool
    exists: bool


def _head(what: str, path: Path) -> str:
    return f"{what} {path}" if what else str(path)


def _kind(path: Path) -> int | None:
    try:
        return stat.S_IFMT(os.stat(path).st_mode)
    except OSError:
        return None


def output_target(path: str | os.PathLike, what: str = "cannot write") -> OutputTarget:
    """Classify ``path`` for writing (module doc); StorageError naming it when it is a
    directory, a block device, a socket or otherwise not a file, or cannot be looked at
    (a part of it is a file, no permission)."""
    path = Path(path)
    try:
        st = os.stat(path)  # follows links: the kind of what would be written
    except FileNotFoundError:
        if os.path.islink(path):  # a dangling link: create the file it points to
            return OutputTarget(path, Path(os.path.realpath(path)), False, False)
        return OutputTarget(path, path, False, False)
    except OSError as exc:  # ENOTDIR, EACCES, ELOOP
        raise storage_error(exc, path, what) from exc
    kind = stat.S_IFMT(st.st_mode)
    if kind == stat.S_IFREG:
        link = os.path.islink(path)
        special = link and os.path.abspath(path).startswith(_SPECIAL_ROOTS)
        real = path if special or not link else Path(os.path.realpath(path))
        return OutputTarget(path, real, special, True)
    if kind in (stat.S_IFIFO, stat.S_IFCHR):
        return OutputTarget(path, path, True, True)
    what_it_is = _REFUSED.get(kind, "not a regular file")
    fix = "give a file path"
    if kind == stat.S_IFDIR:
        fix += f", e.g. {path / 'NAME'}"
    raise StorageError(
        f"{_head(what, path)}: it is {what_it_is}, which zfctl never writes over; {fix}."
    )


def check_writable(path: str | os.PathLike, what: str = "cannot write") -> OutputTarget:
    """``output_target`` plus, for a file to be (re)placed, the folder that will hold it:
    its nearest existing ancestor must be a directory this process can write into (on a
    writable file system). For checks before slow work; writing asks again."""
    target = output_target(path, what)
    if target.direct:  # a FIFO would block until a reader comes; the device is there
        return target
    folder = target.real.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():  # a file where a folder must be: created parents cannot go there
        raise storage_error(OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)), path, what)
    if not os.access(folder, os.W_OK | os.X_OK):
        code = errno.EACCES
        with contextlib.suppress(OSError):
            if os.statvfs(folder).f_flag & os.ST_RDONLY:
                code = errno.EROFS
        exc = OSError(code, f"{os.strerror(code)} (folder {folder})")
        raise storage_error(exc, path, what)
    return target


def write_file(
    path: str | os.PathLike,
    fill: Callable[[IO[Any]], Any],
    *,
    what: str = "cannot write",
    binary: bool = False,
    newline: str | None = None,
) -> None:
    """Write ``path`` by the rules of the module doc: ``fill(f)`` writes the content into
    an open text (or ``binary``) file. StorageError naming ``path`` on any OSError."""
    target = output_target(path, what)
    mode = "wb" if binary else "w"
    text = {} if binary else {"encoding": "utf-8", "newline": newline}
    try:
        if target.direct:
            try:
                with open(target.real, mode, **text) as f:
                    fill(f)
            except OSError as exc:
                kind = _DIRECT_KINDS.get(_kind(path))
                if kind is None:  # a file behind /dev/stdout: the usual message
                    raise
                raise StorageError(  # no free space to speak of: a device or a FIFO
                    f"{_head(what, path)}: {exc.strerror or exc}; it is not a file but {kind}, "
                    "which refused the write; give a file path."
                ) from exc
            return
        real = target.real
        real.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _new_temp_file(real)
        try:
            with os.fdopen(fd, mode, **text) as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            if target.exists:
                os.chmod(tmp, real.stat().st_mode & 0o777)
            os.replace(tmp, real)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except StorageError:
        raise
    except OSError as exc:
        raise storage_error(exc, path, what) from exc


def _new_temp_file(real: Path) -> tuple[int, str]:
    """A new ``.<name>.<random>.tmp`` beside ``real``, open for writing. Created with mode
    0666, so the kernel applies the umask (and a folder's default ACL) as for any new file;
    ``tempfile.mkstemp``'s 0600 would make every file zfctl writes private to its owner."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = real.parent / f".{real.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", str(real.parent))


def write_text(path: str | os.PathLike, text: str, what: str = "cannot write") -> None:
    """Write ``text`` (UTF-8) to ``path`` by the rules of the module doc."""
    write_file(path, lambda f: f.write(text), what=what)


def write_json_atomic(path: str | os.PathLike, obj, what: str = "cannot write") -> None:
    """Write ``obj`` as indented JSON to ``path`` by the rules of the module doc (atomic
    for a file: never half written)."""
    write_text(path, jsonout.dumps(obj, indent=2) + "\n", what)  # strict: NaN/inf as null


def open_append(path: str | os.PathLike, what: str = "cannot open", **kw) -> IO[Any]:
    """``open(path, "a", **kw)`` after ``output_target``'s checks (a directory, block
    device or socket is refused); StorageError naming ``path`` when it cannot be opened."""
    target = output_target(path, what)
    try:
        target.real.parent.mkdir(parents=True, exist_ok=True)
        return open(target.real, "a", **kw)
    except OSError as exc:
        raise storage_error(exc, path, what) from exc


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str = "cannot write") -> Iterator[None]:
    """Turn an OSError raised inside into a StorageError naming ``path``, the reason and
    the free space there (full disk, read-only file system, no permission)."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise storage_error(exc, path, what) from exc
