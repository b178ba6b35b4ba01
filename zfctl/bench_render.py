"""Pure rendering of ``zfctl bench`` results: the plain dict of ``run_bench`` in, Rich out."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

# Two-line headers of at most 7 characters: the table fits 80 columns, numbers never cut.
COLUMNS = ("mean\nms", "median\nms", "stall\nms", "device\nB/param", "traffic\nx model",
           "vs ds-\noffload", "x\nfloor")  # fmt: skip


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def engine_label(name: str, entry: dict) -> str:
    """The row name: deepspeed-zenflow says which overlap setting it is reported in."""
    variant = entry.get("variant")
    if not variant:
        return name
    return f"{name} ({'overlap' if variant == 'overlap_step=true' else 'sync'})"


def table_rows(result: dict) -> list[list[str]]:
    """The table's cells, one row per engine, in ENGINES order."""
    rows = []
    for name, e in result["engines"].items():
        rows.append(
            [
                engine_label(name, e),
                _num(e["step_ms"], ".1f"),
                _num(e["step_ms_median"], ".1f"),
                _num(e["stall_ms"], ".1f"),
                _num(e["device_bytes_per_param"], ".2f"),
                _num(e["bytes_per_step_over_model"], ".2f"),
                _times(e.get("speedup_vs_deepspeed_offload")),
                _times(e.get("ratio_to_floor")),
            ]
        )
    return rows


def render_table(result: dict) -> Table:
    cfg = result["config"]
    title = (
        f"zfctl bench: {cfg['model']} ({result['params'] / 1e6:.1f}M params), micro-batch "
        f"{cfg['micro_batch']}, seq {cfg['seq_len']}, on {result['device']}; {cfg['rounds']} "
        f"rounds x {cfg['steps']} steps per engine (after {cfg['warmup_steps']} warm-up)"
    )
    t = Table(title=escape(title), title_justify="left", box=box.SIMPLE_HEAD,
              collapse_padding=True, pad_edge=False)  # fmt: skip
    t.add_column("engine", overflow="fold", min_width=17)  # "deepspeed-offload"
    for name in COLUMNS:
        t.add_column(name, justify="right", no_wrap=True)
    for row in table_rows(result):
        t.add_row(*(escape(c) for c in row))
    return t


def footnotes(result: dict) -> list[str]:
    """What the numbers mean, and what was skipped or adapted."""
    cfg = result["config"]
    zf = cfg["zenflow"]
    lines = [
        f"model: {cfg['model_source']}",
        "step ms: forward + backward + the engine's step, wall time; means cover whole "
        f"windows of update_interval {zf['update_interval']} (topk_ratio {zf['topk_ratio']}); "
        "speed-ups compare means",
        "traffic x model: bytes copied per step (d2h + h2d) / model bytes; device B/param: "
        "device bytes per parameter; '-': not reported by that engine (DeepSpeed reports no "
        "stall and no copy traffic)",
    ]
    ds = result["engines"].get("deepspeed-zenflow")
    if ds and ds.get("variants"):
        other = ", ".join(
            f"{k}: mean {v['step_ms']:.1f} ms, median {v['step_ms_median']:.1f} ms"
            for k, v in ds["variants"].items()
        )
        lines.append(
            f"deepspeed-zenflow measured in both settings ({other}); the better one "
            f"({ds['variant']}) is shown"
        )
    lines += list(result.get("notes") or [])
    return lines


def render_result(result: dict) -> Group:
    parts: list = [render_table(result)]
    parts += [Text(line, style="dim") for line in footnotes(result)]
    return Group(*parts)


def progress_line(event: dict, rounds: int) -> str | None:
    """A plain progress line for a progress event (None: nothing to say)."""
    kind = event.get("event")
    if kind == "run":
        if "round" in event and not event["contender"].startswith("preparing"):
            return f"round {event['round'] + 1}/{rounds}: {event['contender']}"
        return event["contender"]
    if kind == "done" and event.get("mean_ms") is not None:
        where = f"round {event['round'] + 1}/{rounds}: {event['contender']}"
        return f"{where} mean {event['mean_ms']:.1f} ms"
    if kind == "note":
        return f"note: {event['text']}"
    return None
