"""What a run says about itself: the header of ``RunStarted`` and summary.json.

``run`` is the trainer's session (``zenflow.train.trainer._Run``): its spec, config, task,
engine, counts and checkpoints. ``zenflow_settings`` names the zenflow block the engine runs
with, the defaults included when the config has none; ``step_counts`` is what the dashboard
counts over the steps a resumed run already did.
"""

from __future__ import annotations

import dataclasses
import math

from zenflow.engine.stats import TIMING_FIELDS


def finite_mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


def zenflow_settings(config, engine_mode: str, resolved: dict) -> dict | None:
    """The zenflow block the engine runs with (the defaults when the config has none and
    the engine is zenflow), its "auto" values resolved; None when not used."""
    from zenflow.config import ZenFlowConfig

    zf_cfg = config.zenflow
    if zf_cfg is None and engine_mode == "zenflow":
        zf_cfg = ZenFlowConfig()
    if zf_cfg is None:
        return None
    zf = dataclasses.asdict(zf_cfg)
    zf.update({k: v for k, v in resolved.items() if k in zf})
    return zf


def step_counts(records: list[dict]) -> dict:
    """What the dashboard counts over a run, from its metrics lines (a resumed run's start)."""
    steps = [r for r in records if r.get("type") == "step"]
    return {
        "host_updates": sum(1 for r in steps if r.get("host_update")),
        "selection_changes": sum(int(r.get("selection_changed") or 0) for r in steps),
        "skipped": sum(1 for r in steps if r.get("skipped")),
    }


def run_header(run, start_step: int, start_counts: dict | None = None) -> dict:
    """What RunStarted carries: everything worth showing before the first step."""
    cfg = run.config
    zf = zenflow_settings(run.config, run.spec.engine_mode, run.engine.resolved)
    return {
        "run_dir": str(run.run_dir),
        "model": run.spec.model,
        "task": run.task.name,
        "objective": run.spec.objective,
        "init": run.spec.init,
        "engine_mode": run.spec.engine_mode,
        "sources": run.sources,
        "params": run.params,
        "model_bytes": run.engine.model_bytes,
        "device": run.engine.resolved.get("device_description", str(run.device)),
        "world_size": run.par.world,
        # examples, not rows: packed causal-LM rows hold several (data.SFTData.examples)
        "train_examples": getattr(run.task_data.train, "examples", len(run.task_data.train)),
        "dev_examples": len(run.task_data.dev),
        "eval_examples": min(
            len(run.task_data.dev), run.spec.max_eval_samples or len(run.task_data.dev)
        ),
        "micro_batch": run.micro_batch,
        "gradient_accumulation_steps": run.gas,
        "seq_len": run.spec.seq_len,
        "steps_per_epoch": run.spe,
        "total_steps": run.total_steps,
        "start_step": start_step,
        "resumed_from": str(run.resumed_from) if run.resumed_from else None,
        "lr": cfg.optimizer.lr,
        "scheduler": cfg.scheduler.type,
        "bf16": run.engine.resolved.get("bf16", cfg.bf16),  # "auto" resolved for the device
        "gradient_clipping": cfg.gradient_clipping,
        "zenflow": zf,
        "engine_resolved": dict(run.engine.resolved),
        "config_source": cfg.source,
        "config_ignored": list(cfg.ignored),
        "metrics": list(run.task.metrics),
        "seed": run.spec.seed,
        # Counts of the steps before start_step (a resumed run's dashboard goes on).
        "start_counts": start_counts or {},
        # the run's notes, and the run directory's (what --overwrite kept; rank 0 only)
        "notes": list(run.notes) + list(getattr(run.dir, "notes", None) or ()),
    }


def _dp_costs(run) -> dict | None:
    """Rank 0's collective traffic, and what re-selection's score all-reduce cost next to
    all-reducing the gradients it scores (one float per column instead of the matrix)."""
    dp = getattr(run.engine, "dp", None)
    if dp is None or not dp.enabled:
        return None
    return {
        "collective_bytes_sent": dp.bytes_sent,
        "selection_score_floats": dp.score_floats,
        "selection_gradient_floats_instead": dp.score_grad_equivalent,
    }


def _device_bytes_per_param(steps: list[dict], params: int, key: str = "device_bytes"):
    """The largest ``key`` (bytes) of the steps per parameter; None where not reported."""
    seen = [int(m[key]) for m in steps if m.get(key)]
    return max(seen) / params if seen and params else None


def _host_peak(run, steps: list[dict]) -> int | None:
    """The engine's whole-run host peak (its accelerator's accounting, which the final
    checkpoint is included in), else the most a step reported."""
    accel = getattr(run.engine, "accel", None)
    if accel is not None and hasattr(accel, "host_peak_bytes"):
        return int(accel.host_peak_bytes())
    return _most(steps, "host_peak_bytes")


def _device_memory_peak(run, what: str = "memory_peak_bytes") -> int | None:
    """The whole run's device memory peak as the device's allocator holds it (sim with its
    pool, ``what`` "memory_peak_bytes": what the simulated device held in the process's RSS;
    "memory_allocated_peak_bytes": the most its live tensors held); None where not
    measured."""
    accel = getattr(run.engine, "accel", None)
    peak = getattr(accel, what)() if hasattr(accel, what) else None
    return int(peak) if peak is not None else None


def _most(steps: list[dict], key: str) -> int | None:
    seen = [int(m[key]) for m in steps if m.get(key) is not None]
    return max(seen) if seen else None


def run_summary(run, lines: list[dict], wall_s: float, status: str) -> dict:
    """summary.json: the run's numbers computed from its metrics ``lines``."""
    steps = [m for m in lines if m.get("type") == "step"]
    evals = [m for m in lines if m.get("type") == "eval"]
    return {
        "status": status,
        "run_dir": str(run.run_dir),
        "model": run.spec.model,
        "task": run.task.name,
        "engine_mode": run.spec.engine_mode,
        **_progress(run, steps, evals),
        **_traffic(run, steps),
        **_throughput(run, steps, wall_s),
        **_memory(run, steps),
        "world_size": run.par.world,
        "device": run.engine.resolved.get("device_description", str(run.device)),
        "data_parallel": _dp_costs(run),
        "sources": run.sources,
        "config": _config_record(run),
        "checkpoint": str(run.checkpoints.last) if run.checkpoints.last else None,
    }


def _progress(run, steps: list[dict], evals: list[dict]) -> dict:
    """How far the run got: steps, losses, the last evaluation, the non-finite steps."""
    n = len(steps)
    losses = [m.get("loss") for m in steps]
    last_eval = {k: v for k, v in evals[-1].items() if k != "type"} if evals else None
    return {
        "steps": n,
        "total_steps": run.total_steps,
        "epochs": n / run.spe,
        "final_loss": losses[-1] if losses else None,
        "final_loss_mean_last_10": finite_mean(losses[-10:]),
        "eval": last_eval,
        "validation": {k: last_eval[k] for k in run.task.metrics} if last_eval else None,
        "validation_accuracy": (last_eval or {}).get("accuracy"),
        # steps the engine skipped as non-finite (no state changed); a run that diverged
        # also says where (set by the trainer: zenflow.train.divergence)
        "skipped_steps": sum(1 for m in steps if m.get("skipped")),
        "last_good_step": None,
        "divergence": None,
        "non_finite_steps": sum(
            1
            for m in steps
            if m.get("skipped") or m.get("loss") is None or not math.isfinite(m["loss"])
        ),
    }


def _traffic(run, steps: list[dict]) -> dict:
    """Phase times, the stall, the copy traffic per step (and per model size), the host
    updates and re-selections."""
    n = len(steps)
    model_bytes = run.engine.model_bytes
    # a value read back as missing (None: runs.read_metrics) counts as 0
    d2h = sum(int(m.get("d2h_bytes") or 0) for m in steps)
    h2d = sum(int(m.get("h2d_bytes") or 0) for m in steps)
    timing = {f: finite_mean(m.get(f) for m in steps) for f in TIMING_FIELDS}
    windows = [m["window_len"] for m in steps if m.get("window_len")]
    return {
        "timing_ms_mean": timing,
        "stall_fraction": (
            timing["stall_ms"] / timing["wall_ms"]
            if timing["stall_ms"] is not None and timing["wall_ms"]
            else None
        ),
        "d2h_bytes_total": d2h,
        "h2d_bytes_total": h2d,
        "bytes_per_step": (d2h + h2d) / n if n else None,
        "bytes_per_step_x_model": (d2h + h2d) / n / model_bytes if n else None,
        "d2h_per_step_x_model": d2h / n / model_bytes if n else None,
        "h2d_per_step_x_model": h2d / n / model_bytes if n else None,
        "host_updates": sum(1 for m in steps if m.get("host_update")),
        "mean_window_len": sum(windows) / len(windows) if windows else None,
        "selection_changes": sum(int(m.get("selection_changed", 0)) for m in steps),
    }


def _throughput(run, steps: list[dict], wall_s: float) -> dict:
    """Samples and tokens trained on, in how long, and the model's size."""
    samples = len(steps) * run.global_micro * run.gas  # every rank's samples (data parallel)
    tokens = samples * run.spec.seq_len
    train_s = sum(float(m.get("wall_ms") or 0.0) for m in steps) / 1e3
    return {
        "samples": samples,
        "tokens": tokens,
        "train_s": train_s,
        "samples_per_s": samples / train_s if train_s > 0 else None,
        "tokens_per_s": tokens / train_s if train_s > 0 else None,
        "wall_s": wall_s,
        "model_bytes": run.engine.model_bytes,
        "params": run.params,
    }


def _memory(run, steps: list[dict]) -> dict:
    """Device and host memory per parameter, and the sync counters."""
    return {
        # device memory of weights, grads and engine state (activations excluded), the
        # largest seen at a step, per parameter (rank 0's device)
        "device_bytes_per_param": _device_bytes_per_param(steps, run.params),
        # the peak during a step (backward included: gradients and buckets in flight)
        "device_peak_bytes_per_param": _device_bytes_per_param(
            steps, run.params, "device_peak_bytes"
        ),
        # host memory of engine state and buffers, and of it the page-locked (pinned) part
        "host_bytes_per_param": _device_bytes_per_param(steps, run.params, "host_bytes"),
        "pinned_host_bytes": _most(steps, "pinned_host_bytes"),
        "pinned_host_bytes_per_param": _device_bytes_per_param(
            steps, run.params, "pinned_host_bytes"
        ),
        # the whole run's peak: the engine's host allocations (set-up, selections,
        # checkpoints included), and the device's largest step peak
        "host_peak_bytes": _host_peak(run, steps),
        "device_peak_bytes": _most(steps, "device_peak_bytes"),
        # sim: the simulated device's pool at its largest (activations and its cache
        # included), the bytes of the process's RSS that are the device's
        "device_memory_peak_bytes": _device_memory_peak(run),
        # sim: the most its live tensors held at once (CUDA's max_memory_allocated over the
        # whole run): what a device budget must hold, activations included
        "device_allocated_peak_bytes": _device_memory_peak(run, "memory_allocated_peak_bytes"),
        # the sync counter: the most full device syncs / device-to-host reads in one step
        "full_syncs_max": _most(steps, "full_syncs"),
        "d2h_reads_max": _most(steps, "d2h_reads"),
        **_host_measured(run),
    }


def _host_measured(run) -> dict:
    """The host memory the run's process held, measured: its peak resident set since it
    started (``probes.process_rss_peak``, the kernel's VmHWM; rank 0's process, a resumed
    run's its own session's), and of it the host's: on sim less the simulated device's pool
    at its largest (its memory lives in this process; the benchmarks' "host peak"; None
    without the pool), on CUDA all of it (pinned pages included), on a CPU device all of it
    (the device is this memory). Beside it the preflight's whole-run host peak of the run's
    engine (``zfctl estimate``'s), where it was checked."""
    from zenflow.hardware.probes import process_rss_peak

    rss = process_rss_peak()
    host = rss
    if run.device_kind == "sim":
        pool = _device_memory_peak(run)
        host = rss - pool if pool is not None else None
    return {
        "process_rss_peak_bytes": rss,
        "host_rss_peak_bytes": host,
        "host_peak_estimate_bytes": run.spec.host_peak_estimate,
    }


def _config_record(run) -> dict:
    """The settings the run trained with (summary.json's "config")."""
    cfg = run.config
    return {
        "source": cfg.source,
        "lr": cfg.optimizer.lr,
        "optimizer": cfg.optimizer.type,
        "weight_decay": cfg.optimizer.weight_decay,
        "scheduler": cfg.scheduler.type,
        "micro_batch": run.micro_batch,
        "gradient_accumulation_steps": run.gas,
        "seq_len": run.spec.seq_len,
        "gradient_clipping": cfg.gradient_clipping,
        "bf16": run.engine.resolved.get("bf16", cfg.bf16),
        "zenflow": zenflow_settings(cfg, run.spec.engine_mode, run.engine.resolved),
        "engine_resolved": dict(run.engine.resolved),
    }
