"""Rendering of the estimate's whole-run host figures and predicted step times (pure: the
plain dicts of ``zenflow.hardware.estimate.Estimate.to_json`` and ``zenflow.hardware.predict.
predict`` in, Rich text and tables out). Shared by `zfctl estimate` and `zfctl tune-hw`.

Must not compute a figure of its own beyond formatting.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from zfctl.estimate_render import fmt_bytes


def host_note(data: dict) -> str:
    """What "host peak" means, with the runtime it includes."""
    return (
        "Host peak: the largest moment of a whole run (set-up, first selection, steps, "
        "checkpoints, re-selection, evaluation, final save; each engine's table has it), plus "
        f"the process's runtime ({fmt_bytes(data['host_runtime_bytes'])}, measured: Python, "
        "torch, transformers, the tokenizer and the data). The host must hold it."
    )


def host_state_line(data: dict) -> str | None:
    """ZenFlow's host state verdict, coloured: which zfctl.host_state fits, by how much."""
    states = data.get("host_states") or {}
    sentence = states.get("sentence")
    if not sentence:
        return None
    colour = "green" if states.get("choice") else "red"
    return f"[{colour}]{escape(sentence)}[/{colour}]"


def fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms"


def step_title(st: dict) -> str:
    """The line above the step table: tokens per step, the GPU, the link, the host."""
    return (
        f"Predicted step, {st['tokens_per_step']:,} tokens: {st['gpu']} at {st['mfu']:.0%} of "
        f"{st['peak_tflops']:g} TFLOP/s, link {st['link_gbs']:g} GB/s, host {st['host_bw_gbs']:g} "
        "GB/s:"
    )


def step_table(st: dict) -> Table:
    """One row per engine: the predicted step, its bound and its terms."""
    table = Table(title=None)
    table.add_column("engine", no_wrap=True)
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("bound", no_wrap=True)
    table.add_column("compute", justify="right", no_wrap=True)
    table.add_column("link", justify="right", no_wrap=True)
    table.add_column("host", justify="right", no_wrap=True)
    for row, eng in st["engines"].items():
        t = eng["terms_s"]
        compute = t.get("compute", 0.0) + t.get("device", 0.0)
        link = t.get("d2h", 0.0) + t.get("h2d", 0.0)
        host = t.get("host", 0.0) + t.get("window", 0.0)
        table.add_row(
            escape(row), fmt_s(eng["step_s"]), eng["bound"], fmt_s(compute),
            fmt_s(link) if "d2h" in t else "-", fmt_s(host) if "host" in t else "-",
        )  # fmt: skip
    return table


def step_note(st: dict) -> str:
    """How the prediction is made, and ZenFlow's break-even tokens per step."""
    source = (
        "given by --host-bw"
        if st.get("host_bw_source") == "--host-bw"
        else ("measured here" if st.get("host_bw_source") == "measured" else "the default")
    )
    be = st["break_even_tokens"]
    others = "; ".join(
        f"{name} {v['exact']:,} / {v['compact']:,}"
        for name, v in st["break_even_by_gpu"].items()
        if name != st["gpu"]
    )
    hb = st["host_bytes_per_element"]
    return (
        f"Compute is 6 x params x tokens (x 4/3 recomputing activations) at {st['mfu']:.0%} of "
        f"the GPU's bf16 peak. Gradients leave during backward on every offloading engine; "
        f"offload then runs its CPU Adam and sends the weights back (serial); zenflow's host "
        f"works beside the step, its window's return (and without overlap_step its window's "
        f"host Adam) is added; link: both directions, the bound is the largest term. Host "
        f"bandwidth {st['host_bw_gbs']:g} GB/s is "
        f"{source}; zenflow's host moves {hb['exact']:.1f} bytes per non-selected element per "
        f"step (exact) or {hb['compact']:.1f} (compact) at S={st['update_interval']}. "
        f"Break-even (zenflow's compute = its host time): {be['exact']:,} tokens per step "
        f"(exact) / {be['compact']:,} (compact) with {st['gpu']} on this host; below it the "
        f"step waits for the host. Other GPUs on this host (exact / compact): {others}."
    )


def render_host_and_time(console: Console, data: dict) -> None:
    """The host peak note, the host state verdict, the step-time table and its note."""
    if "host_runtime_bytes" in data:
        console.print(escape(host_note(data)))
    line = host_state_line(data)
    if line:
        console.print(line)
    st = data.get("step_time")
    if st:
        console.print(escape(step_title(st)))
        console.print(step_table(st))
        console.print(escape(step_note(st)))
