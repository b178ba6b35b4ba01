"""Turn user errors into one red line and exit code 2 (STYLE.md: a traceback is for bugs)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def err_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def print_user_error(exc: BaseException) -> None:
    """First line red, the rest (e.g. one line per config problem) plain."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    console = err_console()
    console.print(f"[bold red]error:[/] [red]{escape(lines[0])}[/]")
    for line in lines[1:]:
        console.print(escape(line))


def handle_user_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a Typer command: ``zenflow.errors.UserInputError`` (config problems, missing
    model or data, bad checkpoints) -> message on stderr and exit 2; Ctrl-C -> exit 130.
    The wrapper keeps the signature (functools.wraps), so Typer sees the same options."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from zenflow.errors import UserInputError

        try:
            return func(*args, **kwargs)
        except UserInputError as exc:
            print_user_error(exc)
            raise typer.Exit(EXIT_USER_ERROR) from None
        except KeyboardInterrupt:
            err_console().print("[yellow]interrupted[/]")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper


def user_error(message: str) -> Exception:
    """A UserInputError for problems found in the CLI layer itself (flag combinations)."""
    from zenflow.errors import UserInputError

    return UserInputError(message)
