"""Pure rendering of fine-tuning progress: plain data in, Rich renderables or text out.

``DashboardState`` folds the trainer's events into what is shown; the render functions
never touch the engine, the clock or the terminal (finetune.py owns the Live loop).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table

from zenflow import jsonout
from zenflow.train.learning import weights_text

WINDOW = 20  # steps in the running means
TIME_PARTS = ("forward_ms", "backward_ms", "device_opt_ms", "stall_ms")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_num(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


@dataclass
class DashboardState:
    """Everything the dashboard shows, updated from trainer events (``apply``)."""

    header: dict = field(default_factory=dict)
    step: int = 0
    total_steps: int = 0
    progress: float = 0.0
    eta_s: float | None = None
    epoch: float = 0.0
    loss: float | None = None
    lr: float | None = None
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # step dicts
    host_updates: int = 0
    selection_changed: int = 0
    skipped: int = 0
    last_window: int = 0
    evals: list = field(default_factory=list)  # (step, metrics)
    checkpoint: str | None = None
    summary: dict | None = None
    already_finished: bool = False
    diverged: str | None = None  # "diverged at step N: why" (RunDiverged)
    # finetune --reference: that run's evaluations ({step: metrics}) and its name
    reference: dict = field(default_factory=dict)
    reference_name: str = ""

    def apply(self, event: Any) -> None:
        kind = type(event).__name__
        if kind == "RunStarted":
            self.header = dict(event.header)
            self.total_steps = int(self.header.get("total_steps") or 0)
            self.step = int(self.header.get("start_step") or 0)
            # A resumed run's counts go on from the steps before it.
            counts = self.header.get("start_counts") or {}
            self.host_updates = int(counts.get("host_updates") or 0)
            self.selection_changed = int(counts.get("selection_changes") or 0)
            self.skipped = int(counts.get("skipped") or 0)
        elif kind == "StepEvent":
            s = event.stats
            row = s.to_dict()
            row["samples_per_s"] = event.samples_per_s
            row["tokens_per_s"] = event.tokens_per_s
            self.recent.append(row)
            self.step, self.total_steps = s.step, event.total_steps
            self.progress, self.eta_s, self.epoch = event.progress, event.eta_s, event.epoch
            self.loss, self.lr = s.loss, s.lr
            self.host_updates += int(bool(s.host_update))
            self.selection_changed += int(s.selection_changed)
            self.skipped += int(bool(s.skipped))
            if s.window_len:
                self.last_window = s.window_len
        elif kind == "EvalEvent":
            self.evals.append((event.step, dict(event.metrics)))
        elif kind == "CheckpointSaved":
            self.checkpoint = str(event.path)
        elif kind == "RunFinished":
            self.summary = dict(event.summary)
        elif kind == "RunDiverged":
            self.diverged = f"diverged at step {event.step}: {event.reason}"
        elif kind == "RunAlreadyFinished":
            self.summary = dict(event.summary)
            self.already_finished = True

    def last(self, key: str):
        """``key`` of the latest step, else None."""
        return self.recent[-1].get(key) if self.recent else None

    def mean(self, key: str) -> float | None:
        vals = [r[key] for r in self.recent if isinstance(r.get(key), (int, float))]
        vals = [v for v in vals if math.isfinite(v)]
        return sum(vals) / len(vals) if vals else None

    def step_total_ms(self) -> float | None:
        """Mean wall time of one step: forward + backward + the engine's step."""
        parts = [self.mean("forward_ms"), self.mean("backward_ms"), self.mean("step_ms")]
        return None if any(p is None for p in parts) else sum(parts)

    def bytes_per_step(self) -> float | None:
        d2h, h2d = self.mean("d2h_bytes"), self.mean("h2d_bytes")
        return None if d2h is None or h2d is None else d2h + h2d


def unavailable_note(resolved: dict) -> str:
    """The StepStats fields an engine cannot observe (shown as 0), in words."""
    fields = ", ".join(resolved.get("unavailable_fields") or [])
    engine = resolved.get("engine", "engine")
    return f"{fields} (the {engine} engine does not report them; shown as 0)"


def _metric_text(metrics: dict, names: list[str]) -> str:
    shown = [f"{k} {metrics[k]:.4f}" for k in names if isinstance(metrics.get(k), (int, float))]
    return ", ".join(shown) or "-"


# zfctl-block options that change ZenFlow's arithmetic (opt-in), shown beside the zenflow block
ALGORITHM_OPTIONS = ("window_lr", "select_schedule", "host_state", "host_clipping")


def algorithm_options(header: dict) -> dict:
    """The run's zfctl-block algorithm options as the engine resolved them (zenflow only;
    ``host_clipping`` where the run clips: zfctl.step_store decides it)."""
    resolved = header.get("engine_resolved") or {}
    return {k: resolved[k] for k in ALGORITHM_OPTIONS if resolved.get(k) is not None}


def thread_note(resolved: dict) -> str:
    """The engine's core split and its NUMA binding, as the run header says them."""
    share = resolved.get("host_thread_share") or resolved["host_threads"]
    text = f"{resolved.get('training_threads')} training, host {share}"
    if resolved.get("numa_binding"):
        text += f"; NUMA {resolved['numa_binding']}"
    return text


def engine_notes(resolved: dict | None) -> list[tuple[str, str]]:
    """The header's lines about the engine's own run: the fields it does not report (e.g.
    --engine deepspeed: no stall, no traffic), its core split and NUMA binding."""
    resolved = resolved or {}
    notes = []
    if resolved.get("unavailable_fields"):
        notes.append(("not reported", unavailable_note(resolved)))
    if resolved.get("host_threads"):
        notes.append(("threads", thread_note(resolved)))
    return notes


def render_header(header: dict) -> Panel:
    """Model, task, sources, engine and the resolved config."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    t.add_row(
        "model",
        escape(
            f"{header.get('model')} ({header.get('params', 0) / 1e6:.1f}M params, "
            f"init {header.get('init')})"
        ),
    )
    t.add_row(
        "task",
        escape(
            f"{header.get('task')}: {header.get('train_examples')} train / "
            f"{header.get('eval_examples')} eval examples"
        ),
    )
    for name, src in (header.get("sources") or {}).items():
        t.add_row(f"{name} source", escape(str(src)))
    resolved = header.get("engine_resolved") or {}
    t.add_row(
        "engine",
        escape(
            f"{header.get('engine_mode')} on {header.get('device')}, "
            f"host kernel {resolved.get('host_kernel', '-')}"
            + (
                f", {header['world_size']} data-parallel ranks (shown: the global batch)"
                if (header.get("world_size") or 1) > 1
                else ""
            )
        ),
    )
    for name, text in engine_notes(resolved):
        t.add_row(name, escape(text))
    zf = header.get("zenflow")
    if zf and (header.get("engine_mode") == "zenflow" or resolved.get("zenflow")):
        t.add_row(
            "zenflow",
            escape(
                f"topk {zf.get('topk_ratio')}, update_interval {zf.get('update_interval')}, "
                f"select {zf.get('select_strategy')}/{zf.get('select_interval')}, "
                f"overlap {zf.get('overlap_step')}, warm-up {zf.get('full_warm_up_rounds')}"
                + "".join(f", {k} {v}" for k, v in algorithm_options(header).items())
            ),
        )
    t.add_row(
        "batch",
        escape(
            f"micro {header.get('micro_batch')} x accum {header.get('gradient_accumulation_steps')}"
            f", seq {header.get('seq_len')}, {header.get('steps_per_epoch')} steps/epoch, "
            f"lr {header.get('lr')} ({header.get('scheduler') or 'constant'}), "
            f"bf16 {header.get('bf16')}"
        ),
    )
    t.add_row("run dir", escape(str(header.get("run_dir"))))
    if header.get("resumed_from"):
        t.add_row("resumed", escape(str(header["resumed_from"])))
    for note in header.get("notes") or []:
        t.add_row("[yellow]note[/]", f"[yellow]{escape(str(note))}[/]")
    return Panel(t, title="zfctl finetune", border_style="cyan")


def render_step(state: DashboardState) -> Table:
    """The live numbers: loss, time split, stall, throughput, traffic, windows, eval."""
    t = Table(show_header=False, box=None, padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    total = state.step_total_ms()
    t.add_row(
        "loss",
        f"{fmt_num(state.loss, '.4f')} (mean of last {len(state.recent)}: "
        f"{fmt_num(state.mean('loss'), '.4f')})   lr {fmt_num(state.lr, '.3g')}",
    )
    parts = {p: state.mean(p) for p in TIME_PARTS}
    split = "  ".join(f"{p[:-3].replace('_', ' ')} {fmt_num(v, '.1f')}" for p, v in parts.items())
    t.add_row("step ms", f"{fmt_num(total, '.1f')}  =  {split}")
    stall = parts["stall_ms"]
    stall_pct = 100 * stall / total if stall is not None and total else None
    t.add_row("stall", f"{fmt_num(stall_pct, '.1f')} % of step time")
    t.add_row(
        "throughput",
        f"{fmt_num(state.mean('samples_per_s'), '.1f')} samples/s, "
        f"{fmt_num(state.mean('tokens_per_s'), '.0f')} tokens/s",
    )
    bps = state.bytes_per_step()
    model_bytes = state.header.get("model_bytes") or 0
    x_model = f"{bps / model_bytes:.2f}x model" if bps is not None and model_bytes else "-"
    t.add_row(
        "traffic",
        f"{fmt_bytes(bps)} per step ({x_model}; d2h "
        f"{fmt_bytes(state.mean('d2h_bytes'))}, h2d "
        f"{fmt_bytes(state.mean('h2d_bytes'))})",
    )
    _memory_rows(t, state)
    t.add_row(
        "windows",
        f"last length {state.last_window or '-'}, host updates "
        f"{state.host_updates}, columns moved {state.selection_changed}, "
        + (f"[yellow]skipped steps {state.skipped}[/] (non-finite)" if state.skipped else
           "skipped steps 0"),
    )  # fmt: skip
    if state.diverged:
        t.add_row("[bold red]stopped[/]", f"[red]{escape(state.diverged)}[/]")
    _eval_rows(t, state)
    return t


def _memory_rows(t: Table, state: DashboardState) -> None:
    """Device and host memory, each also per parameter of the model."""
    dev = state.mean("device_bytes")
    params = state.header.get("params") or 0

    def per_param(b):
        return fmt_num(b / params if b and params else None, ".2f")

    peak = state.mean("device_peak_bytes")
    t.add_row(
        "device memory",
        f"{fmt_bytes(dev)} ({per_param(dev)} B/param: weights, grads, optimizer state; "
        f"activations excluded); peak in a step {fmt_bytes(peak)} ({per_param(peak)} B/param)",
    )
    host, pinned = state.mean("host_bytes"), state.mean("pinned_host_bytes")
    t.add_row(
        "host memory",
        f"{fmt_bytes(host)} ({per_param(host)} B/param), of it pinned {fmt_bytes(pinned)} "
        f"({per_param(pinned)} B/param); the process's RSS "
        f"{fmt_bytes(state.mean('process_rss_bytes'))}, {host_available_text(state)}",
    )


def host_available_text(state: DashboardState) -> str:
    """The machine's memory available at the last step, in yellow where it is less than a
    quarter of what the run's process holds (the run has little room left to grow)."""
    avail, rss = state.last("host_available_bytes"), state.last("process_rss_bytes")
    text = f"available {fmt_bytes(avail)}"
    tight = isinstance(avail, int | float) and isinstance(rss, int | float) and avail < rss / 4
    return f"[yellow]{text} (little room left)[/]" if tight else text


def _eval_rows(t: Table, state: DashboardState) -> None:
    """The last evaluation, and --reference's run beside it."""
    if state.evals:
        step, metrics = state.evals[-1]
        names = list(state.header.get("metrics") or []) + ["eval_loss"]
        t.add_row("eval", f"step {step}: {_metric_text(metrics, names)}")
        seen = weights_text(metrics)
        if seen:
            t.add_row("", escape(seen))
        vs = reference_text(state, step, metrics)
        if vs:
            t.add_row("reference", escape(vs))
    else:
        t.add_row("eval", "-")


def reference_text(state: DashboardState, step: int, metrics: dict) -> str:
    """The reference run's main metric at ``step`` and this run's difference in points
    ("" without --reference)."""
    if not state.reference:
        return ""
    names = [n for n in state.header.get("metrics") or [] if n in metrics] or ["eval_loss"]
    name = names[0]
    ref = state.reference.get(step, {}).get(name)
    if not isinstance(ref, (int, float)) or not isinstance(metrics.get(name), (int, float)):
        return f"{state.reference_name}: no {name} at step {step}"
    diff = metrics[name] - ref
    points = f"{100 * diff:+.2f} points" if name != "eval_loss" else f"{diff:+.4f}"
    return f"{state.reference_name}: {name} {ref:.4f} at step {step}, this run {points}"


def render_progress(state: DashboardState) -> Table:
    t = Table.grid(padding=(0, 1))
    t.add_column(width=40)
    t.add_column()
    t.add_row(
        ProgressBar(total=max(state.total_steps, 1), completed=state.step, width=40),
        f"step {state.step}/{state.total_steps}  epoch {state.epoch:.2f}  "
        f"ETA {fmt_duration(state.eta_s)}",
    )
    return t


def render_dashboard(state: DashboardState) -> Group:
    return Group(render_header(state.header), render_progress(state), render_step(state))


def format_plain_line(state: DashboardState) -> str:
    """One line per reported step when stdout is not a terminal."""
    total = state.step_total_ms()
    stall = state.mean("stall_ms")
    stall_pct = 100 * stall / total if stall is not None and total else None
    return (
        f"step {state.step}/{state.total_steps} loss {fmt_num(state.loss, '.4f')} "
        f"lr {fmt_num(state.lr, '.3g')} step_ms {fmt_num(total, '.1f')} "
        f"(fwd {fmt_num(state.mean('forward_ms'), '.1f')} "
        f"bwd {fmt_num(state.mean('backward_ms'), '.1f')} "
        f"opt {fmt_num(state.mean('device_opt_ms'), '.1f')} "
        f"stall {fmt_num(stall, '.1f')}) stall {fmt_num(stall_pct, '.1f')}% "
        f"samples/s {fmt_num(state.mean('samples_per_s'), '.1f')} "
        f"bytes/step {fmt_bytes(state.bytes_per_step())} "
        f"device {fmt_bytes(state.mean('device_bytes'))} "
        f"host {fmt_bytes(state.mean('host_bytes'))} "
        f"pinned {fmt_bytes(state.mean('pinned_host_bytes'))} "
        f"rss {fmt_bytes(state.mean('process_rss_bytes'))} "
        f"avail {fmt_bytes(state.last('host_available_bytes'))} "
        f"host_updates {state.host_updates} skipped {state.skipped} "
        f"ETA {fmt_duration(state.eta_s)}"
    )


def format_plain_header(header: dict) -> list[str]:
    zf = header.get("zenflow") or {}
    lines = [
        f"model {header.get('model')} ({header.get('params', 0) / 1e6:.1f}M params, "
        f"init {header.get('init')}), task {header.get('task')}, "
        f"engine {header.get('engine_mode')} on {header.get('device')}"
        + (
            f", {header['world_size']} data-parallel ranks"
            if (header.get("world_size") or 1) > 1
            else ""
        ),
    ]
    lines += [f"{k} source: {v}" for k, v in (header.get("sources") or {}).items()]
    if zf and header.get("engine_mode") == "zenflow":
        shown = {**zf, **algorithm_options(header)}
        lines.append("zenflow: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    lines += [f"{name}: {text}" for name, text in engine_notes(header.get("engine_resolved"))]
    lines.append(f"run dir: {header.get('run_dir')}")
    if header.get("resumed_from"):
        lines.append(f"resumed from: {header['resumed_from']}")
    lines += [f"note: {note}" for note in header.get("notes") or []]
    return lines


def render_summary(summary: dict) -> Table:
    t = Table(title="run summary", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    timing = summary.get("timing_ms_mean") or {}
    t.add_row("steps", f"{summary.get('steps')} ({summary.get('status')})")
    t.add_row("final loss", fmt_num(summary.get("final_loss"), ".4f"))
    if summary.get("skipped_steps"):
        t.add_row("skipped steps", f"[yellow]{summary['skipped_steps']}[/] (non-finite loss or "
                  "gradient: no update)")  # fmt: skip
    validation = summary.get("validation") or {}
    shown = ", ".join(f"{k} {fmt_num(v, '.4f')}" for k, v in validation.items())  # None: "-"
    t.add_row("validation", shown or "-")
    t.add_row("mean step ms", fmt_num(timing.get("wall_ms"), ".1f"))
    t.add_row("stall", f"{fmt_num(100 * (summary.get('stall_fraction') or 0), '.1f')} %")
    t.add_row(
        "bytes/step",
        f"{fmt_bytes(summary.get('bytes_per_step'))} "
        f"({fmt_num(summary.get('bytes_per_step_x_model'), '.2f')}x model)",
    )
    t.add_row(
        "device B/param",
        f"{fmt_num(summary.get('device_bytes_per_param'), '.2f')} (peak in a step "
        f"{fmt_num(summary.get('device_peak_bytes_per_param'), '.2f')})",
    )
    t.add_row(
        "host B/param",
        f"{fmt_num(summary.get('host_bytes_per_param'), '.2f')} (pinned "
        f"{fmt_num(summary.get('pinned_host_bytes_per_param'), '.2f')})",
    )
    host = host_peak_text(summary)
    if host is not None:
        t.add_row("host peak", host)
    t.add_row("samples/s", fmt_num(summary.get("samples_per_s"), ".1f"))
    t.add_row("wall time", fmt_duration(summary.get("wall_s")))
    t.add_row("run dir", escape(str(summary.get("run_dir"))))
    return t


def host_peak_text(summary: dict) -> str | None:
    """The whole-run host peak the run's process measured, and the preflight's estimate of
    it (summary.json's ``process_rss_peak_bytes``, ``host_rss_peak_bytes`` and
    ``host_peak_estimate_bytes``); None where not measured (runs written before them)."""

    def num(key: str) -> float | None:
        v = summary.get(key)
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        return float(v) if ok and v >= 0 else None

    rss, host, est = (num(k) for k in ("process_rss_peak_bytes", "host_rss_peak_bytes",
                                       "host_peak_estimate_bytes"))  # fmt: skip
    if rss is None:
        return None
    if host is None:  # sim without its pool: the device's memory is in the heap
        return f"process RSS {fmt_bytes(rss)} (the simulated device's memory included)"
    if host != rss:
        text = (f"{fmt_bytes(host)} (process RSS {fmt_bytes(rss)} less the simulated device's "
                f"{fmt_bytes(rss - host)})")  # fmt: skip
    else:
        text = f"{fmt_bytes(host)} (process RSS)"
    if est:
        text += f"; estimate {fmt_bytes(est)}, measured / estimate {host / est:.2f}"
    return text


def event_to_json(event: Any) -> str:
    """One JSON object per event for ``--json``: {"event": name, ...fields}."""
    kind = type(event).__name__
    if kind == "StepEvent":
        body = {
            **event.stats.to_dict(),
            **{
                k: getattr(event, k)
                for k in (
                    "samples_per_s",
                    "tokens_per_s",
                    "progress",
                    "eta_s",
                    "epoch",
                    "total_steps",
                )
            },
        }
    elif kind == "RunInterrupted":
        body = {
            "step": event.step,
            "checkpoint": event.checkpoint,
            "resume_command": event.resume_command,
        }
    elif kind == "RunDiverged":
        body = {
            "step": event.step,
            "reason": event.reason,
            "last_good_step": event.last_good_step,
            "skipped_steps": event.skipped_steps,
            "checkpoint": event.checkpoint,
            "resume_command": getattr(event, "resume_command", None),
            "message": str(event),
        }
    elif dataclasses.is_dataclass(event):
        body = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    else:
        body = {"value": str(event)}
    return jsonout.dumps({"event": kind, **body})  # strict JSON: NaN and inf as null
