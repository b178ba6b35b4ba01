"""`zfctl estimate MODEL`: will it fit? Bytes per engine on the device and the host.

Thin: parse flags, call ``zenflow.hardware.estimate`` (config only, meta device), print its
plain dict as JSON or render it with ``zfctl.estimate_render``. Torch and zenflow are
imported inside the command so ``zfctl --help`` stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from zenflow import jsonout
from zenflow.config.architectures import architecture_names
from zfctl import panels
from zfctl.errors import check_config_file, user_error


def estimate(
    model: Annotated[
        str,
        typer.Argument(
            help="Hub id (from the cache), local model directory, or an architecture name: "
            + ", ".join(architecture_names())
            + ". Only the config is read."
        ),
    ],
    head: Annotated[
        str, typer.Option(help="classification or causal-lm.", rich_help_panel=panels.MODEL)
    ] = "classification",
    num_labels: Annotated[
        int,
        typer.Option(
            min=1, max=100_000, help="Labels of the classifier.", rich_help_panel=panels.MODEL
        ),
    ] = 2,
    micro_batch: Annotated[
        int | None,
        typer.Option(min=1, help="Micro-batch (config, else 8).", rich_help_panel=panels.TRAINING),
    ] = None,
    seq_len: Annotated[
        int, typer.Option(min=1, help="Tokens per example.", rich_help_panel=panels.TRAINING)
    ] = 128,
    bf16: Annotated[
        bool | None,
        typer.Option(
            "--bf16/--no-bf16",
            help="bf16 weights and grads.",
            rich_help_panel=panels.TRAINING,
        ),
    ] = None,
    gradient_checkpointing: Annotated[
        bool,
        typer.Option(
            "--gradient-checkpointing",
            help="Recompute activations.",
            rich_help_panel=panels.TRAINING,
        ),
    ] = False,
    gradient_accumulation_steps: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Micro-batches per step.",
            rich_help_panel=panels.TRAINING,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="DeepSpeed JSON config (default: templates/zenflow.json, what zfctl finetune "
            "runs).",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override a config key, as zfctl finetune's --set: dotted.json.path=value.",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    topk_ratio: Annotated[
        float | None,
        typer.Option(help="topk_ratio (config, else 0.1).", rich_help_panel=panels.ENGINE),
    ] = None,
    overlap_step: Annotated[
        bool | None,
        typer.Option(
            "--overlap-step/--no-overlap-step",
            help="A second host accumulator slot.",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    grad_accumulation: Annotated[
        str | None,
        typer.Option(help="host or device: where grads sum.", rich_help_panel=panels.ENGINE),
    ] = None,
    stream_grads: Annotated[
        bool | None,
        typer.Option(
            "--stream-grads/--no-stream-grads",
            help="Gradients leave during backward.",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    copy_buckets: Annotated[
        int | None,
        typer.Option(min=2, help="Gradient buffers for the link.", rich_help_panel=panels.ENGINE),
    ] = None,
    host_state: Annotated[
        str | None,
        typer.Option(
            help="exact or compact: zfctl.host_state (config, else exact).",
            rich_help_panel=panels.ENGINE,
        ),
    ] = None,
    device_mem: Annotated[
        str | None,
        typer.Option(
            help="Device memory, e.g. 24GiB (default: CUDA device 0's).",
            rich_help_panel=panels.DEVICES,
        ),
    ] = None,
    host_mem: Annotated[
        str | None,
        typer.Option(
            help="Host memory, like --device-mem (default: this machine's MemAvailable).",
            rich_help_panel=panels.DEVICES,
        ),
    ] = None,
    gpu: Annotated[
        str,
        typer.Option(
            help="GPU profile for the step time: h100-sxm, a100-80g, rtx4090, l40s, ...",
            rich_help_panel=panels.DEVICES,
        ),
    ] = "h100-sxm",
    mfu: Annotated[
        float,
        typer.Option(
            help="Share of the GPU's bf16 peak a step gets.", rich_help_panel=panels.DEVICES
        ),
    ] = 0.45,
    host_bw: Annotated[
        float | None,
        typer.Option(
            help="Host memory bandwidth, GB/s (default 50; zfctl tune-hw measures it).",
            rich_help_panel=panels.DEVICES,
        ),
    ] = None,
    summary: Annotated[
        bool,
        typer.Option(
            "--summary",
            help="Only the summary table, not the itemised ones.",
            rich_help_panel=panels.OUTPUT,
        ),
    ] = False,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the estimate as one JSON object.", rich_help_panel=panels.OUTPUT
        ),
    ] = False,
) -> None:
    """Estimate device and host memory of each engine for MODEL, before anything is allocated.

    Every option: README.md, "Option reference"."""
    from zenflow.config import load_config, parse_set_args
    from zenflow.hardware import estimate as est
    from zenflow.hardware import predict
    from zfctl.init_cmd import template_path

    check_config_file(config)
    # --set as zfctl finetune applies it; the flags below win over both
    cfg = load_config(config if config is not None else template_path("zenflow"),
                      overrides=parse_set_args(set_ or []))  # fmt: skip
    if grad_accumulation is not None and grad_accumulation not in ("host", "device"):
        raise user_error(f"--grad-accumulation {grad_accumulation!r}: use host or device.")
    if host_bw is not None and not 0 < host_bw < 1e6:
        raise user_error(f"--host-bw {host_bw:g}: give the host's memory bandwidth in GB/s, "
                         "e.g. 50 (zfctl tune-hw measures it).")  # fmt: skip
    box = predict.box_of(gpu, mfu)  # refused here, before the model is read
    dev = est.parse_size(device_mem, "--device-mem") if device_mem is not None else None
    hst = est.parse_size(host_mem, "--host-mem") if host_mem is not None else None
    settings = est.settings_from_config(
        cfg, topk_ratio=topk_ratio, bf16=bf16, overlap_step=overlap_step,
        micro_batch=micro_batch, seq_len=seq_len,
        gradient_checkpointing=gradient_checkpointing,
        gradient_accumulation_steps=gradient_accumulation_steps,
        grad_accumulation=grad_accumulation, stream_grads=stream_grads,
        copy_buckets=copy_buckets, host_state=host_state,
    )  # fmt: skip
    census = est.resolve_census(model, head=head, num_labels=num_labels)
    data = est.estimate(census, settings, est.detect_budget(dev, hst), head=head).to_json()
    bw = predict.DEFAULT_HOST_BW if host_bw is None else host_bw * 1e9
    # each ZenFlow row that fits: its host work with the step store its memory check took
    # ("q8"); a row that does not fit runs nothing, and is predicted as configured
    stores = {e["host_state"]: e["step_store"] for e in data["engines"].values()
              if e.get("host_state") and e.get("step_store") and e["fits"]}  # fmt: skip
    data["step_time"] = predict.predict(census, settings, box, bw, stores)
    data["step_time"]["host_bw_source"] = "--host-bw" if host_bw is not None else "default"
    if json_output:
        typer.echo(jsonout.dumps(data, indent=2))
        return
    from zfctl.estimate_render import render
    from zfctl.predict_render import render_host_and_time

    console = Console(highlight=False, emoji=False)
    render(console, data, items=not summary)
    render_host_and_time(console, data)  # the whole run's host, the state, the step time
