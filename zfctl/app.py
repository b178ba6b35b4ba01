"""The zfctl Typer application (placeholder until the CLI lands)."""

import typer

app = typer.Typer(help="Fine-tune language models with the optimizer in CPU memory (ZenFlow).")


@app.callback()
def _root() -> None:
    """zfctl: ZenFlow fine-tuning."""


def main() -> None:
    app()
