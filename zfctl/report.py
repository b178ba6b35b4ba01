"""`zfctl report`: what finished or interrupted runs cost and reached; several side by side.

``run_report`` turns one run directory (as ``zenflow.train.runs.read_run`` returns it) into plain
data: the numbers of its summary.json, or, for a run without one (interrupted, crashed or
still running), the same keys computed from its metrics.jsonl. ``compare`` adds the
speed-up of each run against the first. The Rich tables (``zfctl.report_render``) and
``--json`` show that same data; ``report_render.write_plot`` draws loss and the step-time
split over steps (matplotlib, imported only when ``--plot`` is given).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from zenflow import jsonout
from zenflow.engine.stats import TIMING_FIELDS
from zenflow.train.learning import WEIGHTS_FIELDS
from zenflow.train.runs import checkpoint_step
from zfctl.errors import err_console, user_error
from zfctl.report_render import (
    _finite,
    _get,
    _ratio,
    render_comparison,
    render_learning_curve,
    render_run,
    write_plot,
)

# Keys of an eval line that are not task metrics.
EVAL_EXTRA = ("type", "step", "eval_loss", "eval_samples", *WEIGHTS_FIELDS)
# The summary.json keys a report carries over as they are.
SUMMARY_KEYS = (
    "model", "task", "engine_mode", "steps", "total_steps", "epochs", "final_loss",
    "final_loss_mean_last_10", "validation", "validation_accuracy", "non_finite_steps",
    "timing_ms_mean", "stall_fraction", "d2h_bytes_total", "h2d_bytes_total", "bytes_per_step",
    "bytes_per_step_x_model", "host_updates", "mean_window_len", "selection_changes",
    "samples", "tokens", "train_s", "samples_per_s", "tokens_per_s", "wall_s", "model_bytes",
    "params", "sources", "device_bytes_per_param", "device", "world_size", "skipped_steps",
    "last_good_step", "divergence", "process_rss_peak_bytes", "host_rss_peak_bytes",
    "host_peak_estimate_bytes",
)  # fmt: skip


# ---------------------------------------------------------------------------- small helpers


def _mean(values) -> float | None:
    vals = [v for v in map(_finite, values) if v is not None]
    return sum(vals) / len(vals) if vals else None


# ---------------------------------------------------------------------------- data


def _config_highlights(config: dict, spec: dict) -> dict:
    """The training settings worth seeing, from config.json (resolved DeepSpeed config plus
    the run spec); used when summary.json is missing or lacks one."""
    zf = _get(config, "zero_optimization", "zenflow")
    return {
        "source": spec.get("config_source"),
        "lr": _get(config, "optimizer", "params", "lr"),
        "optimizer": _get(config, "optimizer", "type"),
        "weight_decay": _get(config, "optimizer", "params", "weight_decay"),
        "scheduler": _get(config, "scheduler", "type"),
        "micro_batch": spec.get("micro_batch") or config.get("train_micro_batch_size_per_gpu"),
        "gradient_accumulation_steps": config.get("gradient_accumulation_steps"),
        "seq_len": spec.get("seq_len"),
        "gradient_clipping": config.get("gradient_clipping"),
        "bf16": _get(config, "bf16", "enabled"),
        "zenflow": zf if isinstance(zf, dict) else None,
        "engine_resolved": config.get("engine_resolved"),
    }


def _from_metrics(steps: list[dict], evals: list[dict], config: dict, spec: dict) -> dict:
    """What summary.json would say, computed from the step and eval lines the same way the
    trainer does (zenflow.train.trainer ``summary``); what they cannot tell is None."""
    n = len(steps)
    timing = {f: _mean(m.get(f) for m in steps) for f in TIMING_FIELDS}
    d2h = sum(_finite(m.get("d2h_bytes")) or 0 for m in steps)
    h2d = sum(_finite(m.get("h2d_bytes")) or 0 for m in steps)
    micro_batch = _finite(spec.get("micro_batch") or config.get("train_micro_batch_size_per_gpu"))
    gas = _finite(config.get("gradient_accumulation_steps")) or 1
    seq_len = _finite(spec.get("seq_len"))
    samples = int(n * micro_batch * gas) if micro_batch else None
    tokens = int(samples * seq_len) if samples is not None and seq_len else None
    train_s = sum(_finite(m.get("wall_ms")) or 0 for m in steps) / 1e3
    losses = [m.get("loss") for m in steps]
    windows = [m.get("window_len") for m in steps if _finite(m.get("window_len"))]
    last_eval = evals[-1] if evals else {}
    validation = {
        k: v for k, v in last_eval.items() if k not in EVAL_EXTRA and _finite(v) is not None
    }
    return {
        "model": spec.get("model"),
        "task": spec.get("task"),
        "engine_mode": spec.get("engine_mode"),
        "steps": n,
        "total_steps": spec.get("max_steps"),
        "epochs": _finite(steps[-1].get("epoch")) if steps else None,
        "final_loss": _finite(losses[-1]) if losses else None,
        "final_loss_mean_last_10": _mean(losses[-10:]),
        "validation": validation or None,
        "validation_accuracy": _finite(last_eval.get("accuracy")),
        "non_finite_steps": sum(
            1 for m in steps if m.get("skipped") or _finite(m.get("loss")) is None
        ),
        "skipped_steps": sum(1 for m in steps if m.get("skipped")),
        "last_good_step": None,  # said by summary.json when the run diverged
        "divergence": None,
        "timing_ms_mean": timing,
        "stall_fraction": _ratio(timing["stall_ms"], timing["wall_ms"]),
        "d2h_bytes_total": d2h,
        "h2d_bytes_total": h2d,
        "bytes_per_step": (d2h + h2d) / n if n else None,
        "bytes_per_step_x_model": None,  # the model size is only in summary.json
        "host_updates": sum(1 for m in steps if m.get("host_update")),
        "mean_window_len": _mean(windows),
        "selection_changes": int(sum(_finite(m.get("selection_changed")) or 0 for m in steps)),
        "samples": samples,
        "tokens": tokens,
        "train_s": train_s,
        "samples_per_s": samples / train_s if samples is not None and train_s > 0 else None,
        "tokens_per_s": tokens / train_s if tokens is not None and train_s > 0 else None,
        "wall_s": None,  # the session's wall clock is only in summary.json
        "model_bytes": None,
        "params": None,
        # the host peak the process measured, and the preflight's: only in summary.json
        "process_rss_peak_bytes": None,
        "host_rss_peak_bytes": None,
        "host_peak_estimate_bytes": None,
        "sources": config.get("sources"),
        "eval_step": last_eval.get("step"),
        "eval_loss": _finite(last_eval.get("eval_loss")),
        "config": _config_highlights(config, spec),
    }


def run_report(run: dict) -> dict:
    """One run as plain data (what ``--json`` prints for it).

    ``run`` is what ``zenflow.train.runs.read_run`` returns. A finished run reports its
    summary.json; a run without one gets the same keys computed from metrics.jsonl and the
    status "interrupted" (a checkpoint exists: ``checkpoint``, ``checkpoint_step`` and
    ``resume_command`` say how to continue) or "unfinished" (none). A run still in progress
    looks like an interrupted one. Missing values are None.
    """
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    spec = config.get("run") if isinstance(config.get("run"), dict) else {}
    summary = run.get("summary") if isinstance(run.get("summary"), dict) else None
    data = _from_metrics(run.get("metrics") or [], run.get("evals") or [], config, spec)
    if summary is not None:
        data.update({k: summary[k] for k in SUMMARY_KEYS if k in summary})
        if isinstance(summary.get("eval"), dict):
            data["eval_step"] = summary["eval"].get("step")
            data["eval_loss"] = _finite(summary["eval"].get("eval_loss"))
        if isinstance(summary.get("config"), dict):
            data["config"] = {**data["config"], **summary["config"]}
    timing = data.get("timing_ms_mean") if isinstance(data.get("timing_ms_mean"), dict) else {}
    data["timing_ms_mean"] = {f: _finite(timing.get(f)) for f in TIMING_FIELDS}
    checkpoint = run.get("checkpoint") or (summary or {}).get("checkpoint")
    if summary is not None:
        status = summary.get("status") or "finished"
    else:
        status = "interrupted" if checkpoint else "unfinished"
    run_dir = str(run.get("run_dir") or (summary or {}).get("run_dir") or "")
    return {
        "run_dir": run_dir,
        "warnings": list(run.get("warnings") or []),
        "name": Path(run_dir).name,
        "status": status,
        "has_summary": summary is not None,
        **data,
        "checkpoint": checkpoint,
        "checkpoint_step": checkpoint_step(checkpoint),
        "resume_command": (
            resume_command(spec, run_dir) if summary is None and checkpoint else None
        ),
    }


def resume_command(spec: dict, run_dir: str) -> str:
    """The ``zfctl finetune`` line that continues ``run_dir`` (settings come from the run)."""
    args = ["zfctl", "finetune", str(spec.get("model") or "MODEL")]
    args += ["--task", str(spec.get("task") or "TASK"), "--resume", run_dir]
    source = spec.get("config_source")
    if source and source != "<dict>":
        args += ["--config", str(source)]
    if spec.get("data_dir"):
        args += ["--data-dir", str(spec["data_dir"])]
    return " ".join(args)


def _comparable(first: dict, other: dict) -> str | None:
    """Why ``other``'s speed cannot be compared with ``first``'s (another task or model),
    or None when it can."""
    from zenflow.train.runs import same_model

    diffs = []
    if first.get("task") != other.get("task"):
        diffs.append(f"task {other.get('task')} vs {first.get('task')}")
    a, b = first.get("model"), other.get("model")
    if a != b and not (a is not None and b is not None and same_model(str(a), str(b))):
        diffs.append(f"model {b} vs {a}")
    return "; ".join(diffs) or None


def comparison_warnings(reports: list[dict]) -> list[str]:
    """One line per run that trains something else than the first (no speed-up shown)."""
    out = []
    for i, r in enumerate(reports[1:], 2):
        why = _comparable(reports[0], r)
        if why:
            out.append(
                f"#{i} {r.get('name')} is not comparable with #1 {reports[0].get('name')} "
                f"({why}): no speed-up shown for it."
            )
    return out


def compare(reports: list[dict]) -> list[dict]:
    """One row per run, in the given order, with the key numbers and the speed-up against
    the first run: ``speedup_vs_first`` = first run's mean wall ms per step / this run's,
    ``samples_per_s_vs_first`` = this run's samples/s / the first run's (None when either
    side is unknown, or when the run trains another task or model than the first:
    ``comparable`` False, see ``comparison_warnings``)."""
    if not reports:
        return []
    first = reports[0]
    rows = []
    for r in reports:
        timing = r.get("timing_ms_mean") or {}
        comparable = _comparable(first, r) is None
        rows.append(
            {
                "run_dir": r.get("run_dir"),
                "name": r.get("name"),
                "status": r.get("status"),
                "model": r.get("model"),
                "task": r.get("task"),
                "engine_mode": r.get("engine_mode"),
                "steps": r.get("steps"),
                **{f"mean_{f}": timing.get(f) for f in TIMING_FIELDS},
                "stall_fraction": r.get("stall_fraction"),
                "bytes_per_step": r.get("bytes_per_step"),
                "bytes_per_step_x_model": r.get("bytes_per_step_x_model"),
                "device_bytes_per_param": r.get("device_bytes_per_param"),
                "samples_per_s": r.get("samples_per_s"),
                "tokens_per_s": r.get("tokens_per_s"),
                "final_loss": r.get("final_loss"),
                "validation_accuracy": r.get("validation_accuracy"),
                "comparable": comparable,
                "speedup_vs_first": _ratio(
                    (first.get("timing_ms_mean") or {}).get("wall_ms"), timing.get("wall_ms")
                )
                if comparable
                else None,
                "samples_per_s_vs_first": _ratio(r.get("samples_per_s"), first.get("samples_per_s"))
                if comparable
                else None,
            }
        )
    return rows


def learning_curve(runs: list[dict], reports: list[dict]) -> dict | None:
    """The runs' evaluations at the steps every run evaluated, against the first run: for
    2+ runs, ``{"metric": m, "steps": [...], "runs": [{"name", "values": {step: v},
    "vs_first": {step: v - first's}, "eval_loss": {step: loss}, "live": {step: host updates
    pending} (ZenFlow evaluations of live weights)}]}``. The metric is the
    first run's accuracy, else its task's first metric; None for one run, or when the runs
    share no evaluated step (``report_warnings`` says so)."""
    from zenflow.train.learning import eval_curve, matching_steps

    if len(runs) < 2:
        return None
    first = reports[0].get("validation") or {}
    metric = "accuracy" if "accuracy" in first else next(iter(first), "accuracy")
    curves = [eval_curve(r.get("evals") or [], metric) for r in runs]
    steps = matching_steps(curves)
    if not steps:
        return None
    rows = []
    for run, rep, curve in zip(runs, reports, curves, strict=True):
        loss = eval_curve(run.get("evals") or [], "eval_loss")
        live = {e.get("step"): e.get("pending_host_updates") for e in run.get("evals") or []
                if e.get("weights") == "live"}  # fmt: skip
        rows.append({
            "name": rep.get("name"),
            "values": {s: curve[s] for s in steps},
            "vs_first": {s: curve[s] - curves[0][s] for s in steps},
            "eval_loss": {s: loss.get(s) for s in steps},
            "live": {s: live[s] for s in steps if s in live},
        })  # fmt: skip
    return {"metric": metric, "steps": steps, "runs": rows}


def report_document(reports: list[dict], curve: dict | None = None) -> dict:
    """The ``--json`` document: {"runs": [...], "comparison": [...] and "learning_curve"
    (2+ runs; ``learning_curve``), "warnings": [...]} (warnings: lines skipped in a
    metrics.jsonl, runs not comparable)."""
    doc: dict[str, Any] = {"runs": reports}
    if len(reports) > 1:
        doc["comparison"] = compare(reports)
        doc["learning_curve"] = curve
    doc["warnings"] = report_warnings(reports, curve)
    return jsonout.plain(doc)


def report_warnings(reports: list[dict], curve: dict | None = None) -> list[str]:
    lines = [w for r in reports for w in r.get("warnings") or []]
    if len(reports) > 1:
        lines += comparison_warnings(reports)
        if curve is None and all(r.get("eval_step") is not None for r in reports):
            lines.append("the runs share no evaluated step: no learning curve to compare "
                         "(give them the same --eval-every)")  # fmt: skip
    return lines


# ---------------------------------------------------------------------------- finding runs


def resolve_runs(runs: list[Path] | None, runs_root: Path) -> list[Path]:
    """The run directories to report: the given ones (a name under --runs-root or a file
    inside a run directory also works), or the latest under ``runs_root``."""
    from zenflow.train.runs import holds_run, latest_run, list_runs, not_a_run_reason

    if not runs:
        latest = latest_run(runs_root)
        if latest is None:
            where = "does not exist" if not runs_root.exists() else "holds no run directories"
            raise user_error(
                f"no runs found under {runs_root} ({runs_root} {where}). Run `zfctl finetune "
                "MODEL --task TASK` first, or pass --runs-root DIR or run directories."
            )
        return [latest]
    found, problems = [], []
    for path in runs:
        if not path.exists() and not path.is_absolute() and (runs_root / path).is_dir():
            path = runs_root / path
        if not path.exists():
            problems.append(
                f"run {path} does not exist; pass a run directory written by `zfctl finetune` "
                f"(they are under {runs_root}/), or no RUN for the latest."
            )
        elif path.is_file() and holds_run(path.parent):
            found.append(path.parent)
        elif path.is_dir() and not holds_run(path) and list_runs(path):
            inner = list_runs(path)
            problems.append(
                f"{path} is not a run directory but holds {len(inner)} runs; pass one of them "
                f"(e.g. {inner[-1]}), or --runs-root {path} for the latest."
            )
        elif not (path.is_dir() and holds_run(path)):
            where = path if path.is_dir() else path.parent
            problems.append(
                f"{path} is not a zfctl run directory ({not_a_run_reason(where)}); pass a "
                f"directory under {runs_root}/ written by `zfctl finetune`."
            )
        else:
            found.append(path)
    if len(problems) == 1:
        raise user_error(problems[0])
    if problems:
        raise user_error(f"{len(problems)} RUN paths cannot be reported:\n" + "\n".join(problems))
    return found


def check_plot_path(path: Path) -> None:
    """Refuse a --plot target that cannot be written as a PNG, before any work is done: a
    name without .png, a directory, a device or socket, a folder that does not exist or
    cannot be written (``zenflow.outputs.check_writable``)."""
    from zenflow.outputs import check_writable

    if path.suffix.lower() != ".png":
        raise user_error(
            f"--plot {path}: the plot is written as PNG, so the file name must end in .png "
            f"(e.g. --plot {path.with_name(path.name.rstrip('.') + '.png')})."
        )
    parent = path.parent
    if not parent.is_dir():
        raise user_error(
            f"--plot {path}: folder {parent} does not exist; create it (mkdir -p {parent}) "
            "or choose another path."
        )
    check_writable(path, "--plot: cannot write")


# ---------------------------------------------------------------------------- command


def report(
    runs: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Run directories (default: the latest under --runs-root). Several are "
            "compared side by side, with the speed-up against the first.",
            metavar="RUN",
            show_default=False,
        ),
    ] = None,
    runs_root: Annotated[
        Path,
        typer.Option("--runs-root", help="Where `zfctl finetune` writes its run directories."),
    ] = Path("runs"),
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE.png",
            help="Write loss and step-time breakdown over steps to FILE.png.",
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print one JSON document (runs, comparison), no tables."),
    ] = False,
) -> None:
    """Report runs: step-time split, stall, traffic, throughput, loss, accuracy; compare."""
    from zenflow.train.runs import read_run

    if plot is not None:
        check_plot_path(plot)
    loaded = [read_run(p) for p in resolve_runs(runs, runs_root)]
    reports = [run_report(r) for r in loaded]
    curve = learning_curve(loaded, reports)
    if plot is not None:
        write_plot(loaded, reports, plot)
    warn = err_console()
    for line in report_warnings(reports, curve):  # on stderr, so --json stays one document
        warn.print(f"[yellow]warning:[/] {escape(line)}")
    if as_json:
        typer.echo(jsonout.dumps(report_document(reports, curve), indent=2))
    else:
        console = Console(highlight=False, emoji=False)
        for r in reports:
            console.print(render_run(r))
        if len(reports) > 1:
            console.print(render_comparison(compare(reports)))
            if curve is not None:
                console.print(render_learning_curve(curve))
    if plot is not None:
        note = err_console() if as_json else Console(highlight=False, emoji=False)
        note.print(f"wrote plot to {escape(str(plot))}")
