"""The zfctl Typer application: one command per module, errors handled in one place.

Commands import torch and the engine lazily, so ``zfctl --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from zfctl import __version__
from zfctl.errors import handle_user_errors

app = typer.Typer(
    help="Fine-tune language models with the optimizer in CPU memory (ZenFlow: stall-free "
    "offloading).\n\nTypical flow: zfctl init -> zfctl tune-hw -> zfctl finetune -> "
    "zfctl report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"zfctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """zfctl: ZenFlow fine-tuning."""


def _register() -> None:
    from zfctl import (
        bench_cmd,
        env_cmd,
        estimate_cmd,
        eval_cmd,
        finetune,
        init_cmd,
        report,
        tune_hw,
    )

    app.command("init")(handle_user_errors(init_cmd.init))
    app.command("tune-hw")(handle_user_errors(tune_hw.tune_hw))
    app.command("estimate")(handle_user_errors(estimate_cmd.estimate))
    app.command("finetune")(handle_user_errors(finetune.finetune))
    app.command("report")(handle_user_errors(report.report))
    app.command("eval")(handle_user_errors(eval_cmd.eval_))
    app.command("env")(handle_user_errors(env_cmd.env))
    app.command("bench")(handle_user_errors(bench_cmd.bench))


_register()


def main() -> None:
    app()
