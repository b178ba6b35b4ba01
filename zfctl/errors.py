"""Every command's boundary: known failures -> one message and exit 2; bugs -> one line,
the traceback in a log file, exit 1 (STYLE.md: a traceback is for bugs).

Exit codes: 0 done; 1 an internal error (a bug); 2 a problem the user can fix (input,
config, data, model, run directory, disk); 3 a fine-tuning run diverged (its loss stayed
non-finite: zenflow.train.divergence; the last good checkpoint is kept); 130 interrupted
by Ctrl-C; 143 stopped by SIGTERM (both after saving a checkpoint when a run was going).
"""

from __future__ import annotations

import errno
import functools
import math
import os
import stat
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import typer
from rich.console import Console
from rich.markup import escape

EXIT_BUG = 1
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
BUG_LOG = "zfctl-error.log"  # zenflow.train.runs.ERROR_LOG, inside a run directory
# Exceptions that are how typer/click end a command, not failures: typer's Exit and Abort
# (RuntimeErrors of their own), the usage errors of typer's vendored click
# (TyperException: BadParameter...) and of click itself.
_PASS_THROUGH = (
    typer.Exit,
    typer.Abort,
    typer.TyperException,
    click.exceptions.Exit,
    click.exceptions.Abort,
    click.ClickException,
)


def err_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


def print_user_error(exc: BaseException | str) -> None:
    """First line red, the rest (e.g. one line per config problem) plain."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    console = err_console()
    console.print(f"[bold red]error:[/] [red]{escape(lines[0])}[/]")
    for line in lines[1:]:
        console.print(escape(line))


def known_failure_message(exc: BaseException) -> str | None:
    """The one message for a failure class the user can fix, or None for a bug.

    ``UserInputError`` carries its own; an OSError names its path, the system's reason,
    the fix and the free space; a UnicodeDecodeError that no reader turned into a message
    naming its file still says which bytes and what to do."""
    from zenflow.errors import UserInputError, os_error_message

    if isinstance(exc, UserInputError):
        return str(exc)
    if isinstance(exc, OSError):
        return os_error_message(exc)
    if isinstance(exc, UnicodeDecodeError):
        return (
            f"an input file is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8."
        )
    return None


def write_bug_log(exc: BaseException, command: str) -> Path | None:
    """Write ``exc``'s traceback into the run directory it names (``attach_log_dir``) or a
    new file in the temp folder; returns the log's path, None when nothing could be
    written."""
    from zenflow.errors import log_dir_of

    text = (
        f"zfctl {command} failed at {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()})\n"
        + "".join(traceback.format_exception(exc))
    )
    candidates = []
    if log_dir_of(exc):
        candidates.append(Path(log_dir_of(exc)) / BUG_LOG)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidates.append(Path(tempfile.gettempdir()) / f"zfctl-error-{stamp}-{os.getpid()}.log")
    for path in candidates:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError:
            continue
        return path
    return None


def handle_user_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Typer command (app.py wraps every one): known failures (``UserInputError``,
    OSError, UnicodeDecodeError) -> one message on stderr and exit 2; Ctrl-C -> exit 130;
    anything else is a bug -> one line saying so and where the traceback was written,
    exit 1. The wrapper keeps the signature (functools.wraps), so Typer sees the same
    options."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            check_numeric_flags(func, kwargs)
            return func(*args, **kwargs)
        except _PASS_THROUGH:
            raise  # typer's and click's own exits and usage errors
        except KeyboardInterrupt:
            err_console().print("[yellow]interrupted[/]")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:
            message = known_failure_message(exc)
            if message is not None:
                print_user_error(message)
                raise typer.Exit(EXIT_USER_ERROR) from None
            report_bug(exc, func.__name__)
            raise typer.Exit(EXIT_BUG) from None

    wrapper.zfctl_boundary = True  # type: ignore[attr-defined]  # tests check every command
    return wrapper


def flag_name(func: Callable[..., Any], param: str) -> str:
    """The command-line spelling of ``func``'s parameter ``param``: the first long name its
    ``typer.Option`` declares, else typer's default (``max_steps`` -> ``--max-steps``)."""
    import typing

    try:
        hints = typing.get_type_hints(func, include_extras=True)
    except Exception:  # an annotation that cannot be resolved: fall back to the default
        hints = {}
    for meta in getattr(hints.get(param), "__metadata__", ()):
        for decl in getattr(meta, "param_decls", None) or ():
            for name in str(decl).split("/"):
                if name.startswith("--"):
                    return name
        if type(meta).__name__ == "ArgumentInfo":
            return param.upper()
    return "--" + param.rstrip("_").replace("_", "-")


def check_numeric_flags(func: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Refuse a number no command can use before the command runs: a float flag that is
    inf or nan (``--lr inf``, or ``--lr 1e400``, which the parser reads as inf) and a whole
    number past ``MAX_INT`` either way (``--max-steps 99999999999999999999999``): every
    count, size and seed of zfctl fits in 31 bits, as every integer of a config does."""
    from zenflow.config.readers import MAX_INT

    for param, value in kwargs.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise user_error(
                f"{flag_name(func, param)} is not a finite number (read as {value}: inf, nan, "
                "or an exponent too large for a float); give an ordinary number such as 1e-5."
            )
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise user_error(
                f"{flag_name(func, param)} {value} is out of range; give a whole number of at "
                f"most {MAX_INT} either way (check for extra digits)."
            )


def check_config_file(config: Path | None) -> None:
    """Refuse a ``--config`` that is not a readable JSON file, naming what it is instead: a
    missing path, a directory, a symbolic link loop or a device / pipe."""
    if config is None:
        return
    try:
        mode = config.stat().st_mode  # follows symbolic links
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise user_error(
                f"--config {config} is a symbolic link loop (the links point back at each "
                "other, never at a file); point it at the JSON file."
            ) from None
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise user_error(
                f"--config {config}: no such file; write one with `zfctl init --output {config}`."
            ) from None
        raise
    if stat.S_ISDIR(mode):
        raise user_error(
            f"--config {config} is a directory; give the JSON file "
            f"(e.g. {config / 'ds_config.json'})."
        )
    if not stat.S_ISREG(mode):
        raise user_error(f"--config {config} is not a regular file; give the JSON file.")


def report_bug(exc: BaseException, command: str) -> None:
    log = write_bug_log(exc, command)
    what = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    where = (
        f"the traceback is in {log}; please attach it to a bug report"
        if log is not None
        else "no log could be written: " + "".join(traceback.format_exception(exc))
    )
    err_console().print(
        f"[bold red]internal error (a bug in zfctl):[/] {escape(what)}; {escape(where)}"
    )


def user_error(message: str) -> Exception:
    """A UserInputError for problems found in the CLI layer itself (flag combinations)."""
    from zenflow.errors import UserInputError

    return UserInputError(message)
