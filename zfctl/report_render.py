"""Rendering of `zfctl report` data: Rich tables per run and side by side, and the PNG plot.

Pure functions of the plain dicts that ``zfctl.report.run_report`` and ``compare`` build
(and of the runs as ``zenflow.train.runs.read_run`` returns them, for the per-step plot series).
matplotlib is imported only inside ``write_plot``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from zfctl.dashboard import fmt_bytes, fmt_duration, fmt_num, host_peak_text

# The parts of a step stacked in the plot; what is left up to wall_ms is data loading,
# batch copies and the rest of the engine's step.
PLOT_PARTS = ("forward_ms", "backward_ms", "device_opt_ms", "stall_ms")
ZENFLOW_KEYS = (
    "topk_ratio", "update_interval", "select_strategy", "select_interval", "overlap_step",
    "full_warm_up_rounds",
)  # fmt: skip


def _finite(x: Any) -> float | None:
    """``x`` as a finite float, else None (missing, text, NaN, inf)."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _ratio(a: Any, b: Any) -> float | None:
    a, b = _finite(a), _finite(b)
    return a / b if a is not None and b else None


def _get(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...`` or None when a level is missing or not a dict."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


# ---------------------------------------------------------------------------- rendering

Row = Callable[[str, str], None]  # row(label, text): one row of a run's table


def _duration(seconds: Any) -> str:
    """Seconds with a decimal below a minute (short runs), else h:mm:ss / m:ss."""
    s = _finite(seconds)
    return "-" if s is None else f"{s:.1f} s" if s < 60 else fmt_duration(s)


def _ms(x: Any) -> str:
    return fmt_num(_finite(x), ".1f")


def _metrics_text(validation: Any) -> str:
    if not isinstance(validation, dict):
        return "-"
    shown = [f"{k} {v:.4f}" for k, v in validation.items() if _finite(v) is not None]
    return ", ".join(shown) or "-"


def _count(n: Any) -> str:
    n = _finite(n)
    if n is None:
        return "-"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def _status_text(r: dict) -> str:
    status = str(r.get("status") or "-")
    divergence = r.get("divergence")
    if isinstance(divergence, dict):  # zenflow.train.divergence
        return (
            f"{status} at step {divergence.get('step')}: {divergence.get('reason')}; last good "
            f"step {r.get('last_good_step')}"
        )
    if r.get("has_summary"):
        return status
    if r.get("checkpoint"):
        return f"{status} (no summary.json; checkpoint at step {r.get('checkpoint_step')})"
    return f"{status} (no summary.json, no checkpoint; numbers from metrics.jsonl)"


def _step_split(t: dict) -> str:
    """wall = forward + backward + engine step + other (data loading, batch copies)."""
    parts = [t.get("forward_ms"), t.get("backward_ms"), t.get("step_ms")]
    other = None
    if t.get("wall_ms") is not None and all(p is not None for p in parts):
        other = t["wall_ms"] - sum(parts)
    return (
        f"wall {_ms(t.get('wall_ms'))} = forward {_ms(t.get('forward_ms'))} + backward "
        f"{_ms(t.get('backward_ms'))} + engine step {_ms(t.get('step_ms'))} + other {_ms(other)}"
    )


def _config_text(c: dict) -> str:
    def show(key: str) -> str:
        return "-" if c.get(key) is None else str(c[key])

    parts = [
        f"lr {fmt_num(_finite(c.get('lr')), '.3g')} ({show('optimizer')}, weight decay "
        f"{fmt_num(_finite(c.get('weight_decay')), '.3g')}, {c.get('scheduler') or 'constant'})",
        f"micro batch {show('micro_batch')} x grad accum {show('gradient_accumulation_steps')}",
        f"seq len {show('seq_len')}",
        f"clip {fmt_num(_finite(c.get('gradient_clipping')))}",
        f"bf16 {show('bf16')}",
    ]
    kernel = _get(c, "engine_resolved", "host_kernel")
    if kernel:
        parts.append(f"host kernel {kernel}")
    return ", ".join(parts)


def _zenflow_text(zf: dict, engine_mode: Any, resolved: Any) -> str:
    text = ", ".join(f"{k} {zf.get(k, '-')}" for k in ZENFLOW_KEYS)
    every = _get(resolved, "select_every_steps")
    if every is not None and engine_mode in (None, "zenflow"):
        text += f" (re-selection every {every} steps)"
    if engine_mode not in (None, "zenflow"):
        text += f" (not used: engine {engine_mode})"
    return text


def render_run(r: dict) -> Table:
    """One run's table: what ran, where the step time went, traffic, throughput, quality."""
    t = Table(title=f"run {escape(r.get('name') or '-')}", show_header=False, title_justify="left")
    t.add_column(style="bold", no_wrap=True)
    t.add_column()

    def row(label: str, text: str) -> None:
        t.add_row(label, escape(text))

    _what_ran_rows(row, r)
    _step_time_rows(row, r.get("timing_ms_mean") or {}, r)
    _traffic_rows(row, r)
    _quality_rows(row, r)
    _setup_rows(row, r)
    return t


def _what_ran_rows(row: Row, r: dict) -> None:
    """Where the run is, how it ended, what it trained, how far and for how long."""
    row("run dir", r.get("run_dir") or "-")
    row("status", _status_text(r))
    row("model / task / engine", f"{r.get('model')} / {r.get('task')} / {r.get('engine_mode')}")
    total = r.get("total_steps")
    epochs = _finite(r.get("epochs"))
    row(
        "steps",
        f"{r.get('steps') if r.get('steps') is not None else '-'}"
        + (f" of {total}" if total is not None else "")
        + (f" ({epochs:.3g} epochs)" if epochs is not None else ""),
    )
    row(
        "wall time",
        f"{_duration(r.get('wall_s'))} (training steps {_duration(r.get('train_s'))})",
    )


def _step_time_rows(row: Row, timing: dict, r: dict) -> None:
    """Where the mean step's time went (``timing``: the run's timing_ms_mean)."""
    row("mean ms / step", _step_split(timing))
    row(
        "engine step ms",
        f"device opt {_ms(timing.get('device_opt_ms'))}, stall {_ms(timing.get('stall_ms'))}, "
        f"transfer {_ms(timing.get('transfer_ms'))}",
    )
    stall = _pct(r.get("stall_fraction"))
    row("stall", "-" if stall == "-" else f"{stall} % of wall time")


def _traffic_rows(row: Row, r: dict) -> None:
    """Bytes over the link per step, device bytes per parameter, samples and tokens/s."""
    n = _finite(r.get("steps"))
    d2h, h2d = _ratio(r.get("d2h_bytes_total"), n), _ratio(r.get("h2d_bytes_total"), n)
    x_model = _finite(r.get("bytes_per_step_x_model"))
    row(
        "bytes / step",
        f"{fmt_bytes(_finite(r.get('bytes_per_step')))} ("
        + (f"{x_model:.2f}x model; " if x_model is not None else "")
        + f"d2h {fmt_bytes(d2h)}, h2d {fmt_bytes(h2d)})",
    )
    row("device memory", f"{fmt_num(_finite(r.get('device_bytes_per_param')), '.2f')} B/param "
        "(weights, grads, optimizer state)")  # fmt: skip
    host = host_peak_text(r)
    if host is not None:  # measured by the run (summary.json); older runs did not
        row("host peak", host)
    row(
        "throughput",
        f"{fmt_num(_finite(r.get('samples_per_s')), '.1f')} samples/s, "
        f"{fmt_num(_finite(r.get('tokens_per_s')), '.0f')} tokens/s",
    )


def _quality_rows(row: Row, r: dict) -> None:
    """The loss at the end, the last evaluation, and the host updates and selections."""
    row(
        "final loss",
        f"{fmt_num(_finite(r.get('final_loss')), '.4f')} (mean of last 10 "
        f"{fmt_num(_finite(r.get('final_loss_mean_last_10')), '.4f')}; "
        f"{r.get('non_finite_steps') or 0} non-finite steps, {r.get('skipped_steps') or 0} "
        "skipped)",
    )
    validation = _metrics_text(r.get("validation"))
    if validation != "-":
        validation += (
            f", eval loss {fmt_num(_finite(r.get('eval_loss')), '.4f')} "
            f"(step {r.get('eval_step') if r.get('eval_step') is not None else '-'})"
        )
    row("validation", validation)
    row(
        "host updates",
        f"{r.get('host_updates') if r.get('host_updates') is not None else '-'}, mean window "
        f"{fmt_num(_finite(r.get('mean_window_len')), '.1f')} steps, "
        f"{r.get('selection_changes') if r.get('selection_changes') is not None else '-'} "
        "selection changes",
    )


def _setup_rows(row: Row, r: dict) -> None:
    """The model's size, where numbers came from, the config, and how to continue."""
    if r.get("params") is not None or r.get("model_bytes") is not None:
        row(
            "model size",
            f"{_count(r.get('params'))} params, {fmt_bytes(_finite(r.get('model_bytes')))}",
        )
    sources = r.get("sources")
    if isinstance(sources, dict) and sources:
        row("sources", ", ".join(f"{k} {v}" for k, v in sources.items()))
    config = r.get("config") or {}
    row("config", _config_text(config))
    if isinstance(config.get("zenflow"), dict):
        resolved = config.get("engine_resolved")
        row("zenflow", _zenflow_text(config["zenflow"], r.get("engine_mode"), resolved))
    if r.get("checkpoint"):
        row("checkpoint", str(r["checkpoint"]))
    if r.get("resume_command"):
        row("resume with", r["resume_command"])


def _pct(fraction: Any) -> str:
    x = _finite(fraction)
    return "-" if x is None else f"{100 * x:.1f}"


def _speedup(x: Any) -> str:
    x = _finite(x)
    return "-" if x is None else f"{x:.2f}x"


def _vs_first(row: dict, key: str) -> str:
    return _speedup(row.get(key)) if row.get("comparable", True) else "not comparable"


# (label, formatter of one comparison row)
COMPARISON_ROWS = (
    ("status", lambda c: str(c.get("status") or "-")),
    ("model / task", lambda c: f"{c.get('model')} / {c.get('task')}"),
    ("engine", lambda c: str(c.get("engine_mode") or "-")),
    ("steps", lambda c: str(c.get("steps") if c.get("steps") is not None else "-")),
    ("wall ms / step", lambda c: _ms(c.get("mean_wall_ms"))),
    ("forward ms", lambda c: _ms(c.get("mean_forward_ms"))),
    ("backward ms", lambda c: _ms(c.get("mean_backward_ms"))),
    ("engine step ms", lambda c: _ms(c.get("mean_step_ms"))),
    ("device opt ms", lambda c: _ms(c.get("mean_device_opt_ms"))),
    ("stall ms", lambda c: _ms(c.get("mean_stall_ms"))),
    ("stall %", lambda c: _pct(c.get("stall_fraction"))),
    ("bytes / step", lambda c: fmt_bytes(_finite(c.get("bytes_per_step")))),
    ("x model / step", lambda c: fmt_num(_finite(c.get("bytes_per_step_x_model")), ".2f")),
    ("device B/param", lambda c: fmt_num(_finite(c.get("device_bytes_per_param")), ".2f")),
    ("samples/s", lambda c: fmt_num(_finite(c.get("samples_per_s")), ".1f")),
    ("tokens/s", lambda c: fmt_num(_finite(c.get("tokens_per_s")), ".0f")),
    ("final loss", lambda c: fmt_num(_finite(c.get("final_loss")), ".4f")),
    ("accuracy", lambda c: fmt_num(_finite(c.get("validation_accuracy")), ".4f")),
    ("speed-up vs first", lambda c: _vs_first(c, "speedup_vs_first")),
    ("samples/s vs first", lambda c: _vs_first(c, "samples_per_s_vs_first")),
)  # fmt: skip


def render_comparison(rows: list[dict]) -> Table:
    """Runs side by side, one column each; speed-ups are against the first column."""
    t = Table(title="comparison (speed-up against #1)", title_justify="left")
    t.add_column("", style="bold", no_wrap=True)
    for i, c in enumerate(rows, 1):
        t.add_column(escape(f"#{i} {c.get('name') or '-'}"), justify="right")
    for label, fmt in COMPARISON_ROWS:
        t.add_row(label, *(escape(fmt(c)) for c in rows))
    return t


def render_learning_curve(curve: dict) -> Table:
    """The runs' metric at the steps they all evaluated (one row per step), each with its
    difference from #1 in points."""
    metric = curve["metric"]
    t = Table(title=f"learning curve: {metric} at matching steps (points vs #1)",
              title_justify="left")  # fmt: skip
    t.add_column("step", justify="right", style="bold")
    for i, r in enumerate(curve["runs"], 1):
        t.add_column(escape(f"#{i} {r.get('name') or '-'}"), justify="right")
    live_any = False
    for step in curve["steps"]:
        cells = []
        for i, r in enumerate(curve["runs"]):
            v, d = r["values"][step], r["vs_first"][step]
            mark = "*" if step in r.get("live", {}) else ""
            live_any |= bool(mark)
            cells.append(f"{v:.4f}{mark}" if i == 0 else f"{v:.4f}{mark} ({100 * d:+.2f})")
        t.add_row(str(step), *cells)
    if live_any:
        t.caption = ("* live weights: ZenFlow host updates were pending at that evaluation "
                     "(a run's final evaluation is of its flushed model)")  # fmt: skip
        t.caption_justify = "left"
    return t


# ---------------------------------------------------------------------------- plot


def _series(steps: list[dict], key: str, missing: float) -> list[float]:
    out = []
    for m in steps:
        v = _finite(m.get(key))
        out.append(missing if v is None else v)
    return out


def write_plot(runs: list[dict], reports: list[dict], path: Path) -> None:
    """Loss over steps for every run (eval accuracy as points on a second axis), then one
    panel per run with the step time split stacked (forward, backward, device optimizer,
    stall) under its wall time; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    n = len(runs)
    fig = Figure(figsize=(10, 3.2 * (1 + n)), layout="constrained")
    axes = fig.subplots(1 + n, 1, sharex=True, squeeze=False)[:, 0]
    ax_loss = axes[0]
    ax_acc = None
    for i, (run, rep) in enumerate(zip(runs, reports, strict=True)):
        label = f"#{i + 1} {rep.get('name')} ({rep.get('engine_mode') or '-'})"
        color = f"C{i % 10}"
        steps = run.get("metrics") or []
        xs = _series(steps, "step", math.nan)
        ax_loss.plot(xs, _series(steps, "loss", math.nan), color=color, lw=1, label=label)
        evals = [e for e in run.get("evals") or [] if _finite(e.get("accuracy")) is not None]
        if evals:
            if ax_acc is None:
                ax_acc = ax_loss.twinx()
                ax_acc.set_ylabel("eval accuracy")
            ax_acc.plot(
                _series(evals, "step", math.nan),
                _series(evals, "accuracy", math.nan),
                "o--",
                color=color,
                ms=5,
                lw=0.8,
                label=f"#{i + 1} accuracy",
            )
        ax = axes[1 + i]
        if i:  # one y scale for every run's time panel: a faster run looks lower
            ax.sharey(axes[1])
        ax.set_title(f"{label}: step time by part", fontsize=9, loc="left")
        ax.set_ylabel("ms")
        if not steps:
            ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center")
            continue
        parts = [_series(steps, f, 0.0) for f in PLOT_PARTS]
        names = [f.removesuffix("_ms").replace("_", " ") for f in PLOT_PARTS]
        ax.margins(y=0.25)  # room for the legend above the wall line
        ax.stackplot(xs, *parts, labels=names, alpha=0.8)
        ax.plot(xs, _series(steps, "wall_ms", math.nan), color="k", lw=0.8, label="wall")
        ax.legend(loc="upper right", fontsize=8, ncol=5)
    ax_loss.set_title("training loss (lines), eval accuracy (points)", fontsize=9, loc="left")
    ax_loss.set_ylabel("loss")
    handles, labels = ax_loss.get_legend_handles_labels()
    if ax_acc is not None:
        more = ax_acc.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax_loss.legend(handles, labels, loc="upper right", fontsize=8)
    axes[-1].set_xlabel("step")
    from zenflow.outputs import write_file

    write_file(path, lambda f: fig.savefig(f, format="png", dpi=110), what="--plot: cannot write",
               binary=True)  # fmt: skip
