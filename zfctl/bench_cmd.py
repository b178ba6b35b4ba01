"""`zfctl bench`: every engine on the same model and batch, alternating rounds, one table.

Thin: parse flags, call ``zenflow.hardware.bench.run_bench`` (progress on stderr: a Rich
progress bar on a terminal, plain lines otherwise), render its plain dict, and write it with
``--json FILE``. The method (alternation, child processes, whole windows) is described in
``zenflow/hardware/bench.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from zfctl.bench_render import progress_line, render_result
from zfctl.errors import check_config_file

ENGINE_HELP = (
    "Comma-separated engines: floor, device, lora, offload, zenflow-sync, zenflow-overlap, "
    "deepspeed-offload, deepspeed-zenflow (default: all)."
)


def bench(
    model: Annotated[
        str,
        typer.Option(
            help="gpt2 (GPT-2 small architecture, random init), LxW (GPT-2 architecture, L "
            "layers x width W, e.g. 4x512 for quick runs), a hub id or a local directory."
        ),
    ] = "gpt2",
    engines: Annotated[str | None, typer.Option(help=ENGINE_HELP)] = None,
    steps: Annotated[
        int,
        typer.Option(min=1, help="Measured steps per engine per round (whole windows)."),
    ] = 8,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each runs every engine once.")] = 3,
    warmup_windows: Annotated[
        int, typer.Option(min=0, help="Unmeasured windows per round before the measured ones.")
    ] = 2,
    micro_batch: Annotated[int, typer.Option(min=1, help="Micro-batch size.")] = 4,
    seq_len: Annotated[int, typer.Option(min=2, help="Tokens per example.")] = 32,
    device: Annotated[
        str, typer.Option(help="cpu, sim (simulated accelerator: ours only) or cuda.")
    ] = "cpu",
    config: Annotated[
        Path | None,
        typer.Option(
            help="DeepSpeed JSON config whose zenflow block to use (default: topk_ratio 0.1, "
            "update_interval 4, no re-selection during the bench)."
        ),
    ] = None,
    deadline: Annotated[
        float, typer.Option(min=1, help="Seconds one engine's round may take before it is stopped.")
    ] = 900.0,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="Also write the results as JSON to this file.")
    ] = None,
) -> None:
    """Benchmark the engines (ours and DeepSpeed's) on one model and batch shape."""
    from zenflow.hardware import bench as lib

    check_config_file(config)
    if json_file is not None:  # refused now, not after minutes of benchmarking
        from zenflow.outputs import check_writable

        check_writable(json_file, "--json: cannot write")
    spec = lib.BenchSpec(
        model=model,
        micro_batch=micro_batch,
        seq_len=seq_len,
        steps=steps,
        rounds=rounds,
        warmup_windows=warmup_windows,
        device=device,
        engines=lib.parse_engines(engines) if engines is not None else lib.ENGINES,
        zenflow=lib.zenflow_block(config),
        deadline_s=deadline,
    )
    err = Console(stderr=True, highlight=False, emoji=False)
    with _Progress(err, rounds) as progress:
        result = lib.run_bench(spec, on_progress=progress)
    out = Console(highlight=False, emoji=False)
    if not out.is_terminal:  # a file or pipe: wide enough for the whole table
        out = Console(highlight=False, width=130, emoji=False)
    out.print(render_result(result))
    if json_file is not None:
        lib.write_json(result, json_file)
        out.print(f"results: {json_file}")


class _Progress:
    """Progress on stderr: a Rich bar on a terminal, plain lines otherwise."""

    def __init__(self, console: Console, rounds: int):
        self.console = console
        self.rounds = rounds
        self.bar = None
        if console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                "{task.total}"), TimeElapsedColumn(), console=console, transient=True,
            )  # fmt: skip
            self.task = None

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def __call__(self, event: dict) -> None:
        line = progress_line(event, self.rounds)
        line = escape(line) if line is not None else None  # "[overlap_step=true]" is no markup
        if self.bar is None:
            if line is not None and event.get("event") != "run":
                self.console.print(f"bench: {line}")
            elif line is not None:
                self.console.print(f"bench: {line} ...")
            return
        kind = event.get("event")
        if kind == "start":
            self.task = self.bar.add_task("bench", total=event["total"])
        elif kind == "run" and line:
            self.bar.update(self.task, description=line)
        elif kind == "done":
            self.bar.advance(self.task)
            if line:
                self.bar.console.print(f"[dim]{line}[/dim]")
        elif kind == "note" and line:
            self.bar.console.print(f"[yellow]{line}[/yellow]")
