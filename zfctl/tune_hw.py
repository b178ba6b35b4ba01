"""`zfctl tune-hw`: probe this machine, measure, and choose the zenflow block.

Thin: parse flags, call ``zenflow.hardware.tune_run.run_tune``, render its plain dict with
Rich, write hw.json and (with ``--config``) the config's zenflow block. Both paths are
checked (``zenflow.outputs.check_writable``) before anything is probed. Torch and zenflow are
imported inside the command so ``zfctl --help`` stays light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zenflow import jsonout
from zfctl import panels

GIB = 2**30
DEVICES = ("cpu", "sim", "cuda")


def tune_hw(
    model: Annotated[
        str | None,
        typer.Option(
            help="Model to time: hub id, directory, or builtin:gpt2-4x512.",
            rich_help_panel=panels.MODEL,
        ),
    ] = None,
    micro_batch: Annotated[
        int | None,
        typer.Option(
            "--micro-batch",
            min=1,
            help="Micro-batch size (default 8).",
            rich_help_panel=panels.TRAINING,
        ),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            min=1,
            help="Sequence length (default 128).",
            rich_help_panel=panels.TRAINING,
        ),
    ] = None,
    bf16: Annotated[
        bool | None,
        typer.Option(
            "--bf16/--no-bf16", help="The run's training dtype.", rich_help_panel=panels.TRAINING
        ),
    ] = None,
    gradient_checkpointing: Annotated[
        bool,
        typer.Option(
            "--gradient-checkpointing",
            help="Time recomputed activations.",
            rich_help_panel=panels.TRAINING,
        ),
    ] = False,
    topk: Annotated[
        float | None,
        typer.Option(
            "--topk",
            help="Fix topk_ratio (0 < x <= 1) instead of choosing it.",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="DeepSpeed JSON config whose zenflow block to update.",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    write: Annotated[
        bool,
        typer.Option(
            "--write",
            help="Write the choices into --config (else show the diff).",
            rich_help_panel=panels.ENGINE,
        ),
    ] = False,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="cuda, sim or cpu (default: cuda if available).",
            rich_help_panel=panels.DEVICES,
        ),
    ] = None,
    device_mem: Annotated[
        str | None,
        typer.Option(
            "--device-mem",
            help="Device memory for topk's bound, e.g. 24GiB.",
            rich_help_panel=panels.DEVICES,
        ),
    ] = None,
    gpu: Annotated[
        str,
        typer.Option(
            "--gpu",
            help="GPU profile to predict the step time for (h100-sxm, rtx4090, ...).",
            rich_help_panel=panels.DEVICES,
        ),
    ] = "h100-sxm",
    mfu: Annotated[
        float,
        typer.Option(
            "--mfu",
            help="Share of the GPU's bf16 peak a step gets.",
            rich_help_panel=panels.DEVICES,
        ),
    ] = 0.45,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="Small probes, small model, fewer repeats (about a minute).",
            rich_help_panel=panels.DEVICES,
        ),
    ] = False,
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="Where to write hw.json (checked before probing).",
            rich_help_panel=panels.OUTPUT,
        ),
    ] = Path("hw.json"),
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the hw.json content instead of tables.",
            rich_help_panel=panels.OUTPUT,
        ),
    ] = False,
) -> None:
    """Probe CPU, memory and accelerator, measure, and choose ZenFlow's settings.

    Every option: README.md, "Option reference"."""
    if write and config is None:
        raise typer.BadParameter("--write needs --config FILE to write into.", param_hint="--write")
    if topk is not None and not 0.0 < topk <= 1.0:
        raise typer.BadParameter(f"{topk} is not in 0 < x <= 1.", param_hint="--topk")
    if device is not None and device not in DEVICES:
        raise typer.BadParameter(
            f"{device!r} is not one of {', '.join(DEVICES)}.", param_hint="--device"
        )

    from zenflow.hardware import measure, predict, tune_run, tuning
    from zenflow.hardware.estimate import parse_size
    from zenflow.outputs import check_writable, write_json_atomic

    predict.box_of(gpu, mfu)  # refused here, before measuring
    dev_mem = parse_size(device_mem, "--device-mem") if device_mem is not None else None
    device = tune_run.resolve_device(device, dev_mem)  # refused here, before measuring
    config_doc = tuning.read_config_document(config) if config is not None else None
    # Every file it will write is checked before minutes of probing: measurements are
    # never lost to a path that cannot be written.
    check_writable(output, "--output: cannot write")
    if write and config is not None:
        check_writable(config, "--config ... --write: cannot write")
    if bf16 is None:
        bf16 = config_bf16(config_doc, device) if config_doc is not None else device != "cpu"
    err = Console(stderr=True, emoji=False)
    settings = tune_run.TuneSettings(
        model=model or (measure.BUILTIN_SMALL if quick else "gpt2"),
        micro_batch=micro_batch or (4 if quick else 8),
        seq_len=seq_len or (32 if quick else 128),
        quick=quick,
        topk_ratio=topk,
        device=device,
        bf16=bf16,
        device_mem=dev_mem,
        gradient_checkpointing=gradient_checkpointing,
        layout=config_layout(config_doc) if config_doc is not None else {},
        gpu=gpu,
        mfu=mfu,
        progress=lambda msg: err.print(f"[dim]tune-hw: {msg}…[/dim]", highlight=False),
    )
    result = tune_run.run_tune(settings)
    write_json_atomic(output, result, "--output: cannot write")

    update = None
    if config is not None:
        update = tuning.update_config(config, config_doc, result["choices"], write=write,
                                      zfctl=result.get("zfctl_choices"))  # fmt: skip
    if json_output:
        typer.echo(jsonout.dumps(result, indent=2))
        return
    out = Console(emoji=False)
    render(out, result)
    out.print(f"wrote {escape(str(output))}", highlight=False)
    if update is not None:
        render_config_update(out, config, update, write)


def config_layout(doc: dict) -> dict:
    """The config document's settings that change the memory layout topk is bounded by:
    micro-batch accumulation and where it is summed, streaming, the copy buckets, the step
    store and whether clipping needs it."""
    import copy

    from zenflow.config import load_config
    from zenflow.hardware.estimate import settings_from_config

    s = settings_from_config(load_config(copy.deepcopy(doc)))
    return {
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "grad_accumulation": s.grad_accumulation,
        "stream_grads": s.stream_grads,
        "copy_buckets": s.copy_buckets,
        "step_store": s.step_store,
        "clipping": s.clipping,
    }


def config_bf16(doc: dict, device: str | None = None) -> bool:
    """The config document's bf16.enabled, as zenflow's parser reads it ("auto" resolved
    for ``device``, as the engine resolves it)."""
    import copy

    from zenflow.config import load_config
    from zenflow.engine.engine_setup import resolve_bf16

    return resolve_bf16(load_config(copy.deepcopy(doc)).bf16, device)


def render(console: Console, result: dict) -> None:
    """Tables of the choices and probe figures, the memory check and the notes."""
    choices, reasons = result["choices"], result["reasons"]
    notes = result["notes"]
    cpu_only = result.get("cpu_only", False)
    for note in notes:  # said first and plainly: nothing to win from offloading here
        if note.startswith("CPU-only"):
            console.print(f"[bold yellow]{escape(note)}[/bold yellow]", highlight=False)
    device = result.get("device", "cpu")
    title = f"ZenFlow settings for this machine ({device}" + (", CPU-only)" if cpu_only else ")")
    table = Table(title=title, title_justify="left")
    table.add_column("setting", style="bold")
    table.add_column("value")
    table.add_column("measured reason", overflow="fold")
    reason_key = {"select_strategy": "select_interval"}
    for key, value in choices.items():
        reason = reasons.get(key, "") if key not in reason_key else "with select_interval"
        table.add_row(key, escape(json.dumps(value)), escape(reason))
    if "host_state" in reasons:  # the zfctl block's key: which host state fits this host
        state = (result.get("zfctl_choices") or {}).get("host_state")
        shown = json.dumps(state) if state else "(none fits)"
        table.add_row("zfctl.host_state", escape(shown), escape(reasons["host_state"]))
        store = (result.get("zfctl_choices") or {}).get("step_store")
        if store:
            table.add_row("zfctl.step_store", f'"{store}"', "with zfctl.host_state: see its reason")
    console.print(table)

    probes = Table(title="Probes", title_justify="left")
    probes.add_column("probe", style="bold")
    probes.add_column("figure", overflow="fold")
    for name, figure in probe_rows(result):
        probes.add_row(escape(name), escape(figure))
    console.print(probes)

    mem = result["memory_check"]
    colour = "green" if mem["ok"] and mem["pinned_ok"] is not False else "red"
    console.print(f"[{colour}]{escape(mem['verdict'])}[/{colour}]", highlight=False)
    console.print(f"method: {escape(result['method'])}", highlight=False)
    if result.get("step_time"):
        from zfctl.predict_render import step_note, step_table, step_title

        console.print(escape(step_title(result["step_time"])), highlight=False)
        console.print(step_table(result["step_time"]))
        console.print(escape(step_note(result["step_time"])), highlight=False)
    for note in notes:
        if not note.startswith("CPU-only"):
            console.print(f"[yellow]note:[/yellow] {escape(note)}", highlight=False)


def probe_rows(result: dict) -> list[tuple[str, str]]:
    """(probe, figure) rows from the hw.json dict."""
    p = result["probes"]
    return _machine_rows(p) + _measured_rows(p) + _window_rows(p)


def _machine_rows(p: dict) -> list[tuple[str, str]]:
    """What the machine is: CPU, SIMD, memory and its bandwidth, the accelerator and its
    link (``p``: hw.json's probes)."""
    cpu, mem, acc = p["cpu"], p["memory"], p["accelerator"]
    have = [f for f, on in cpu["simd"].items() if on]
    lack = [f for f, on in cpu["simd"].items() if not on]
    lock = mem["memlock_bytes"]
    rows = [
        ("CPU", f"{cpu['model']}: {cpu['logical_cores']} logical / {cpu['physical_cores']} "
                f"physical cores, {cpu['usable_cores']} usable, {cpu['numa_nodes']} NUMA node(s)"),
        ("SIMD", f"{' '.join(have) or 'none of ' + ', '.join(lack)}"
                 + (f" (no {' '.join(lack)})" if have and lack else "")),
        ("memory", f"{mem['total_bytes'] / GIB:.1f} GiB total, "
                   f"{mem['available_bytes'] / GIB:.1f} GiB available"),
        ("memory bandwidth", f"copy {mem['copy_gbs']:.1f} GB/s, add {mem['add_gbs']:.1f} GB/s "
                             f"({mem['buffer_bytes'] // 2**20} MiB buffers, median)"),
        ("locked-memory limit", "unlimited" if lock is None else f"{lock / 2**20:.0f} MiB"),
        ("accelerator", acc["name"] if acc["kind"] != "cuda"
         else f"{acc['name']}, {acc['memory_bytes'] / GIB:.1f} GiB"),
    ]  # fmt: skip
    if acc["kind"] == "sim":
        rows.append((
            "copy bandwidth",
            f"modelled: {acc['d2h_pinned_gbs']:.1f} GB/s per direction (d2h and h2d at "
            f"once), {acc['latency_us']:.0f} us per copy",
        ))  # fmt: skip
    elif acc["kind"] == "cuda":
        rows.append((
            "copy bandwidth",
            f"h2d {acc['h2d_pinned_gbs']:.1f} / d2h {acc['d2h_pinned_gbs']:.1f} GB/s pinned, "
            f"h2d {acc['h2d_pageable_gbs']:.1f} / d2h {acc['d2h_pageable_gbs']:.1f} GB/s "
            f"pageable, both at once {acc['bidir_pinned_gbs']:.1f} GB/s pinned",
        ))  # fmt: skip
    return rows


def _measured_rows(p: dict) -> list[tuple[str, str]]:
    """What was timed on it: CPU Adam, the model's forward+backward, the device's AdamW,
    and the link and device memory figures used."""
    mdl = p["model"]
    rows: list[tuple[str, str]] = []
    adam = ", ".join(
        f"{a['num_threads']} thread(s) {a['params_per_s'] / 1e6:.0f}M params/s"
        for a in p["cpu_adam"].values()
    )
    backend = next(iter(p["cpu_adam"].values()))["backend"]
    rows.append((f"CPU Adam ({backend})", adam))
    rows.append((
        "model",
        f"{mdl['name']}: {mdl['params_total'] / 1e6:.1f}M params "
        f"({mdl['params_2d'] / 1e6:.1f}M in 2-D weights); {mdl['source']}",
    ))  # fmt: skip
    fb = ", ".join(f"{t} thread(s) {ms:.0f} ms" for t, ms in p["fwd_bwd_ms"].items())
    dtype = mdl.get("dtype", "fp32")
    rows.append((f"forward+backward (mb {mdl['micro_batch']}, seq {mdl['seq_len']}, {dtype})", fb))
    if p.get("device_adam"):
        dev = ", ".join(
            f"{a['num_threads']} thread(s) {a['params_per_s'] / 1e6:.0f}M params/s"
            if a["device"] == "cpu"
            else f"{a['params_per_s'] / 1e6:.0f}M params/s"
            for a in p["device_adam"].values()
        )
        first = next(iter(p["device_adam"].values()))
        rows.append((f"device AdamW ({first['device']}, topk 1.0)", dev))
    if p.get("link"):
        rows.append(("host<->device bandwidth", p["link"]["source"]))
    if p.get("device_memory"):
        dm = p["device_memory"]
        rows.append(("device memory", f"{dm['device_bytes'] / GIB:.1f} GiB ({dm['source']})"))
    return rows


def _window_rows(p: dict) -> list[tuple[str, str]]:
    """One ZenFlow window timed with the host step overlapped and not, and the engine's
    own steps."""
    rows: list[tuple[str, str]] = []
    for ov in p["overlap"]:
        rows.append((
            f"window S={ov['update_interval']}",
            f"overlap on ({ov['train_threads']}+{ov['worker_threads']} cores) "
            f"{ov['on_window_ms']:.0f} ms (fwd+bwd {ov['on_fb_ms']:.0f} ms/step, host step "
            f"{ov['on_host_ms']:.0f} ms, wait {ov['on_wait_ms']:.0f} ms); overlap off "
            f"({ov['all_threads']} cores) {ov['off_window_ms']:.0f} ms (fwd+bwd "
            f"{ov['off_fb_ms']:.0f} ms/step, host step {ov['off_host_ms']:.0f} ms)",
        ))  # fmt: skip
    if p.get("engine"):
        on, off = p["engine"]
        rows.append((
            f"engine steps (S={on['update_interval']})",
            f"overlap on {on['ms_per_step']:.0f} ms/step, off {off['ms_per_step']:.0f} ms/step "
            f"(mean of {on['steps']} steps after a warm-up window, "
            f"host kernel {on['host_kernel']})",
        ))  # fmt: skip
    return rows


def render_config_update(console: Console, path: Path, update: dict, written: bool) -> None:
    """The zenflow block's changes, one line per key, and whether the file was written."""
    old, new = update["old"], update["new"]
    changed = False
    for key in new:
        before = old.get(key, "<unset>")
        if before == new[key]:
            continue
        changed = True
        path_of = key if key.startswith("zfctl.") else f"zero_optimization.zenflow.{key}"
        console.print(
            escape(f"  {path_of}: {json.dumps(before)} -> {json.dumps(new[key])}"),
            highlight=False,
        )
    if not changed:
        console.print(
            f"{escape(str(path))}: zenflow block already matches, nothing to change",
            highlight=False,
        )
    elif written:
        console.print(
            f"[green]updated {escape(str(path))}[/green] (other keys kept)", highlight=False
        )
    else:
        console.print(
            f"{escape(str(path))} not changed: add --write to apply the lines above",
            highlight=False,
        )
