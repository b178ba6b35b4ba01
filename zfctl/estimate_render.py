"""Rendering of `zfctl estimate`: Rich tables from the plain dict
``zenflow.hardware.estimate.Estimate.to_json`` builds (pure functions: data in, tables out)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def fmt_bytes(n: int | float | None) -> str:
    """Binary units, 3 significant figures: "12.3 GiB", "512 MiB", "0 B"."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{int(n)} B"


def fmt_params(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def header_lines(data: dict) -> list[str]:
    """Model, classification, settings and the budget, as plain sentences."""
    lines = [
        f"{data['model']}: {data['params']:,} trainable params ({fmt_params(data['params'])}), "
        f"{data['head']} head; config from {data['source']}, built on the meta device.",
        f"ZenFlow weights: {data['zenflow_weights']} matrices, "
        f"{fmt_params(data['zenflow_params'])} params; dense: {fmt_params(data['dense_params'])}"
        f"; topk_ratio {data['topk_ratio']:g} selects {fmt_params(data['selected_elements'])} "
        f"elements in {data['selected_columns']:,} columns.",
        f"{data['dtype']} weights and grads; overlap_step "
        f"{'on' if data['overlap_step'] else 'off'}; pin_memory "
        f"{'on' if data['pin_memory'] else 'off'} (link buffers only); gradients "
        + (
            "streamed off the device during backward"
            if data.get("stream_grads", True)
            else "whole on the device until the step"
        )
        + (
            f", {data['gradient_accumulation_steps']} micro-batches summed on the "
            f"{data['grad_accumulation']}"
            if data.get("gradient_accumulation_steps", 1) > 1
            else ""
        )
        + f"; activations for micro-batch {data['micro_batch']}, sequence {data['seq_len']}"
        + (", recomputed in backward" if data.get("gradient_checkpointing") else "")
        + ".",
    ]
    if data["device_is_host"]:
        lines.append(
            f"Memory: {fmt_bytes(data['host_mem'])} ({data['host_source']}); "
            f"{data['device_source']}: device and host share this RAM, so device + host must "
            "fit it together, and nothing is pinned."
        )
    else:
        lines.append(
            f"Device: {fmt_bytes(data['device_mem'])} ({data['device_source']}); host: "
            f"{fmt_bytes(data['host_mem'])} ({data['host_source']})."
        )
    return lines


def verdict(data: dict, eng: dict) -> str:
    """What must fit where, and whether it does."""
    if data["device_is_host"]:
        need = (
            f"device + host peak {fmt_bytes(eng['device_bytes'] + eng['host_peak_bytes'])} of "
            f"{fmt_bytes(data['host_mem'])} RAM"
        )
    else:
        need = (
            f"device {fmt_bytes(eng['device_bytes'])} of {fmt_bytes(data['device_mem'])}, "
            f"host peak {fmt_bytes(eng['host_peak_bytes'])} of {fmt_bytes(data['host_mem'])}"
        )
    if eng["fits"]:
        where = {"device": "device", "host": "host", "memory": "RAM"}
        spare = ", ".join(f"{fmt_bytes(v)} {where[k]} to spare"
                          for k, v in eng.get("spare_bytes", {}).items())  # fmt: skip
        return f"{need}: [green]fits[/green]" + (f" ({spare})" if spare else "")
    where = {"device": "device", "host": "host", "memory": "RAM"}
    short = ", ".join(f"{where[k]} short by {fmt_bytes(v)}" for k, v in eng["short_bytes"].items())
    return f"{need}: [bold red]does NOT fit[/bold red] ({short})"


def engine_table(data: dict, mode: str) -> Table:
    """One engine: each buffer with its bytes, bytes per param and formula, the totals and
    the verdict."""
    eng = data["engines"][mode]
    params = data["params"] or 1
    table = Table(title=escape(f"{mode}: {eng['title']}"), title_justify="left")
    table.add_column("side", no_wrap=True)
    table.add_column("holds")
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("B/param", justify="right", no_wrap=True)
    table.add_column("formula", no_wrap=True, style="dim")
    for side in ("device", "host"):
        items = [i for i in eng["items"] if i["side"] == side]
        for n, item in enumerate(items):
            formula = "see below" if item["category"] == "activations" else item["formula"]
            table.add_row(
                side if n == 0 else "", escape(item["what"]), fmt_bytes(item["bytes"]),
                f"{item['bytes'] / params:.2f}", escape(formula),
            )  # fmt: skip
        if side == "device":
            total, per_param = eng["device_bytes"], f"{eng['bytes_per_param']:.2f}"
            note = f"total; state {fmt_bytes(eng['device_state_bytes'])} (B/param: state)"
        else:
            total, per_param = eng["host_bytes"], f"{eng['host_bytes'] / params:.2f}"
            note = f"steady total; pinned {fmt_bytes(eng['pinned_bytes'])}"
        table.add_row(
            "" if items else side, f"[bold]{note}[/bold]", f"[bold]{fmt_bytes(total)}[/bold]",
            f"[bold]{per_param}[/bold]", "",
        )  # fmt: skip
        if side == "host" and "host_peak_bytes" in eng:
            peak = eng["host_peak_bytes"]
            what = (f"whole-run peak ({eng['host_peak_phase']}; runtime "
                    f"{fmt_bytes(eng['host_runtime_bytes'])})")  # fmt: skip
            table.add_row(
                "", f"[bold]{escape(what)}[/bold]", f"[bold]{fmt_bytes(peak)}[/bold]",
                f"[bold]{peak / params:.2f}[/bold]", "see below",
            )  # fmt: skip
        table.add_section()
    table.caption = f"{verdict(data, eng)}."
    table.caption_justify = "left"
    return table


def summary_table(data: dict) -> Table:
    """One row per engine: device, whole-run host peak, pinned, B/param, fits (the three
    largest holders follow the table: ``holder_lines``)."""
    table = Table(title="Will it fit?", title_justify="left")
    table.add_column("engine", no_wrap=True)
    table.add_column("device", justify="right", no_wrap=True)
    table.add_column("host peak", justify="right", no_wrap=True)
    table.add_column("pinned", justify="right", no_wrap=True)
    table.add_column("B/param", justify="right", no_wrap=True)
    table.add_column("fits", no_wrap=True)
    side = "memory" if data["device_is_host"] else "device"
    for mode, eng in data["engines"].items():
        if eng["fits"]:
            spare = eng.get("spare_bytes", {})
            tight = min(spare, key=spare.get) if spare else None  # the side with the least
            fits = "[green]yes[/green]" + (
                f", {'' if tight == side else tight + ' '}{fmt_bytes(spare[tight])} spare"
                if tight is not None else ""
            )  # fmt: skip
        else:
            fits = "[bold red]NO[/bold red]"
            for where, missing in eng["short_bytes"].items():
                fits += f", {'' if where == side else 'host '}short {fmt_bytes(missing)}"
        table.add_row(
            mode, fmt_bytes(eng["device_bytes"]),
            fmt_bytes(eng.get("host_peak_bytes", eng["host_bytes"])),
            fmt_bytes(eng["pinned_bytes"]), f"{eng['bytes_per_param']:.2f}", fits,
        )  # fmt: skip
    return table


def holder_lines(data: dict) -> list[str]:
    """Each engine's three largest holders, one line each."""
    return [
        f"{mode}: "
        + ", ".join(
            f"{h['side']} {h['category']} {fmt_bytes(h['bytes'])}" for h in eng["largest_holders"]
        )  # fmt: skip
        for mode, eng in data["engines"].items()
    ]


def activation_note(data: dict) -> str:
    act = data["activations"]
    if act["bytes"] is None:
        return f"Activations: {act['formula']}; not included."
    recompute = (
        "each layer recomputed in backward"
        if data.get("gradient_checkpointing")
        else "no recomputation"
    )
    return (
        f"Activations ({fmt_bytes(act['bytes'])} on the device, every engine alike) are an "
        f"estimate: {act['formula']} ({act['source']}; {recompute}). B/param is the device state "
        "(weights, grads, optimizer, staging) per trainable param, at the peak of a step "
        "(backward included). Not counted: the framework's own overhead (CUDA context, "
        "allocator fragmentation)."
    )


def render(console: Console, data: dict, *, items: bool = True) -> None:
    """The header, one itemised table per engine (with ``items``), the summary table, and the
    activation note."""
    for line in header_lines(data):
        console.print(escape(line))
    for line in data.get("warnings") or []:
        console.print(f"[yellow]warning:[/] {escape(line)}")
    if items:
        for mode in data["engines"]:
            console.print(engine_table(data, mode))
    console.print(summary_table(data))
    console.print("Largest holders (steady state):")
    for line in holder_lines(data):
        console.print(escape("  " + line))
    console.print(escape(activation_note(data)))
