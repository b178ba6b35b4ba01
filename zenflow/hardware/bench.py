"""``zfctl bench``: the same model and batch through each engine, alternating, in one table.

Engines (``ENGINES``): ``floor`` (forward+backward only, no optimizer), ``device`` (plain
AdamW: our engine's mode "device"), ``lora`` (LoRA adapters of rank 8 on the same model,
``zenflow.train.lora``, trained by the device mode's AdamW; its device bytes per parameter
are over the base's parameters), ``offload`` (ours, ZeRO-Offload), ``zenflow-sync`` and
``zenflow-overlap`` (ours, ZenFlow with ``overlap_step`` false/true), ``deepspeed-offload``
and ``deepspeed-zenflow`` (DeepSpeed 0.19.6's own, through ``DeepSpeedAdapter``, with the
same zenflow block). ``deepspeed-zenflow`` is measured with ``overlap_step`` false and true
and reported in its better setting, named.

Method (what makes the numbers honest):

- **Alternation.** Round r runs every engine once, in the same order: A B C A B C ...
  (``plan``), so a machine that drifts (other users, thermal) hits every engine alike.
- **Same treatment.** Every engine runs every round in a fresh child process (DeepSpeed
  needs one: its process group, communication backend and optimizer process are global
  state; ours then get the same treatment, so no engine profits from a warm process).
  Children fork from a server that has already imported torch and transformers, so a round
  starts in well under a second; DeepSpeed's children import deepspeed themselves. Each child
  has a deadline: past it the parent kills its whole process group and says which engine,
  which round, and where its log is.
- **Whole windows.** Each round runs ``full_warm_up_rounds`` + ``warmup_windows`` windows of
  ``update_interval`` steps unmeasured (the first windows select columns and fill the
  overlap pipeline), then a whole number of windows measured, so every window-end step (the
  host step, or the wait for it with overlap) is in the mean once per window. Every engine
  runs the same step counts.
- **Step time** is the wall time of one training iteration as the trainer runs it:
  forward, backward, the engine's step and ``zero_grad`` (a CUDA synchronise before the clock
  is read). Speed-ups compare means (the mean over whole windows is what a run takes).

Columns: mean and median step ms; stall ms (mean of ``StepStats.stall_ms``; "-" where the
engine does not report it); device bytes per parameter (the largest ``StepStats.device_bytes``
over the measured steps / parameters, when the engine reports it); bytes per step over model
bytes (counted copies, d2h + h2d); speed-up against ``deepspeed-offload`` (its mean / this
mean) and ratio to ``floor`` (this mean / floor's mean).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shutil
import signal
import statistics
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zenflow import jsonout
from zenflow.errors import UserInputError
from zenflow.outputs import write_text

ENGINES = ("floor", "device", "lora", "offload", "zenflow-sync", "zenflow-overlap",
           "deepspeed-offload", "deepspeed-zenflow")  # fmt: skip
DEEPSPEED_ENGINES = ("deepspeed-offload", "deepspeed-zenflow")
DEVICES = ("cpu", "sim", "cuda")
# The two settings deepspeed-zenflow is measured in; the better one is reported.
DS_ZENFLOW_VARIANTS = {"deepspeed-zenflow[overlap_step=false]": False,
                       "deepspeed-zenflow[overlap_step=true]": True}  # fmt: skip
# The zenflow block when --config gives none: selection once, never again during the bench.
DEFAULT_BLOCK = {"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step",
                 "select_interval": 1_000_000, "full_warm_up_rounds": 0}  # fmt: skip
DEFAULT_DEADLINE_S = 900.0  # per child; a cold DeepSpeed op build (1.5 min) fits well


class BenchError(UserInputError):
    """A benchmark child failed or passed its deadline; the message names it and its log."""


@dataclass(frozen=True)
class BenchSpec:
    """What ``zfctl bench`` runs. ``steps`` is rounded up to whole windows."""

    model: str = "gpt2"  # an id, a directory, or an architecture: gpt2, 4x512, LxW
    micro_batch: int = 4
    seq_len: int = 32
    steps: int = 8  # measured steps per engine per round
    rounds: int = 3
    warmup_windows: int = 2  # unmeasured windows per round (after full warm-up rounds)
    device: str = "cpu"  # cpu | sim | cuda
    engines: tuple[str, ...] = ENGINES
    zenflow: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_BLOCK))
    seed: int = 0
    deadline_s: float = DEFAULT_DEADLINE_S


def parse_engines(text: str) -> tuple[str, ...]:
    """``"a,b,..."`` -> engine names, in ``ENGINES`` order; unknown names are an error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad or not names:
        raise UserInputError(
            f"--engines {text!r}: {'unknown ' + ', '.join(bad) if bad else 'no engine named'}; "
            f"choose from {', '.join(ENGINES)}."
        )
    return tuple(n for n in ENGINES if n in names)


def zenflow_block(config_path: str | os.PathLike | None) -> dict:
    """The zenflow block to benchmark: ``DEFAULT_BLOCK``, or the one in a DeepSpeed config.

    The block is validated by zenflow's parser. ``update_interval`` must be an integer (the
    bench runs whole windows). Unless the file selects by steps with an integer interval,
    selection happens once and not again during the bench (both engines alike).
    """
    if config_path is None:
        return dict(DEFAULT_BLOCK)
    from zenflow.config import load_config

    cfg = load_config(config_path)
    if cfg.zenflow is None:
        raise UserInputError(
            f"--config {config_path} has no zero_optimization.zenflow block; pass a config "
            "written by `zfctl init` (or omit --config for the default block)."
        )
    zf = cfg.zenflow
    if zf.update_interval == "auto":
        raise UserInputError(
            f'--config {config_path}: update_interval is "auto"; zfctl bench measures whole '
            "windows and needs an integer update_interval (e.g. 4)."
        )
    block = {
        "topk_ratio": zf.topk_ratio,
        "update_interval": int(zf.update_interval),
        "full_warm_up_rounds": int(zf.full_warm_up_rounds),
        "pt_reserved_cores_perc": zf.pt_reserved_cores_perc,
        "select_strategy": "step",
        "select_interval": DEFAULT_BLOCK["select_interval"],
    }
    if zf.select_strategy == "step" and zf.select_interval != "auto":
        block["select_interval"] = int(zf.select_interval)
    return block


def contenders(engines: tuple[str, ...]) -> list[str]:
    """The runs of one round: ``deepspeed-zenflow`` becomes its two overlap settings."""
    out: list[str] = []
    for name in engines:
        out += list(DS_ZENFLOW_VARIANTS) if name == "deepspeed-zenflow" else [name]
    return out


def plan(engines: tuple[str, ...], rounds: int) -> list[tuple[int, str]]:
    """(round, contender) in run order: every round runs every contender, same order."""
    return [(r, c) for r in range(rounds) for c in contenders(engines)]


def window_steps(spec: BenchSpec) -> tuple[int, int]:
    """(warm-up steps, measured steps) per round: whole windows of ``update_interval``."""
    s = int(spec.zenflow["update_interval"])
    measured = -(-max(1, spec.steps) // s) * s  # rounded up to whole windows
    warmup = int(spec.zenflow.get("full_warm_up_rounds", 0)) + spec.warmup_windows * s
    return warmup, measured


def ds_config(spec: BenchSpec, contender: str) -> dict:
    """The DeepSpeed JSON every engine of the bench reads (ours through ``load_config``)."""
    raw: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": spec.device == "cuda"},
        },
    }
    overlap = None
    if contender == "zenflow-sync":
        overlap = False
    elif contender == "zenflow-overlap":
        overlap = True
    elif contender in DS_ZENFLOW_VARIANTS:
        overlap = DS_ZENFLOW_VARIANTS[contender]
    if overlap is not None:
        raw["zero_optimization"]["zenflow"] = {**spec.zenflow, "overlap_step": overlap}
    return raw


# ------------------------------------------------------------------------------ summary


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def summarize_runs(runs: list[dict], model_bytes: int, params: int) -> dict:
    """Mean/median step ms, stall, traffic and device bytes of one contender's rounds."""
    records = [rec for run in runs for rec in run["records"]]
    ms = [rec["ms"] for rec in records]
    stall = [rec["stall_ms"] for rec in records]
    traffic = [rec["bytes"] for rec in records]
    device = [rec["device_bytes"] for rec in records if rec.get("device_bytes") is not None]
    return {
        "step_ms": statistics.fmean(ms),
        "step_ms_median": statistics.median(ms),
        "stall_ms": None if any(v is None for v in stall) else _mean(stall),
        "bytes_per_step_over_model": None
        if any(v is None for v in traffic)
        else _mean(traffic) / model_bytes,
        "device_bytes_per_param": max(device) / params if device else None,
        "steps": len(records),
        "windows": sum(1 for rec in records if rec["window_len"]),
        "round_step_ms": [statistics.fmean(r["ms"] for r in run["records"]) for run in runs],
    }


def summarize(results: dict[str, list[dict]], model_bytes: int, params: int) -> dict:
    """Per engine summaries (deepspeed-zenflow: its better setting, named), with speed-ups."""
    engines: dict[str, dict] = {}
    variants: dict[str, dict] = {}
    for contender, runs in results.items():
        summary = summarize_runs(runs, model_bytes, params)
        if contender in DS_ZENFLOW_VARIANTS:
            variants[contender] = summary
        else:
            engines[contender] = summary
    if variants:
        best = min(variants, key=lambda c: variants[c]["step_ms"])
        setting = best[best.index("[") + 1 : -1]
        engines["deepspeed-zenflow"] = {
            **variants[best],
            "variant": setting,
            "variants": {c[c.index("[") + 1 : -1]: v for c, v in variants.items()},
        }
    ds = engines.get("deepspeed-offload", {}).get("step_ms")
    floor = engines.get("floor", {}).get("step_ms")
    ordered = {name: engines[name] for name in ENGINES if name in engines}
    for entry in ordered.values():
        entry["speedup_vs_deepspeed_offload"] = ds / entry["step_ms"] if ds else None
        entry["ratio_to_floor"] = entry["step_ms"] / floor if floor else None
    return ordered


# ------------------------------------------------------------------------------ running


def _forkserver():
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    # Imported once by the server; every child forks with them loaded (no deepspeed: its
    # accelerator is chosen at first use, from the child's environment).
    preload = ["torch", "transformers.models.gpt2.modeling_gpt2", "zenflow.engine.schedule",
               "zenflow.hardware.bench_worker"]  # fmt: skip
    ctx.set_forkserver_preload(preload)
    return ctx


def run_child(job: dict) -> dict:
    """Run one job in a child process with a deadline; its result dict, or BenchError."""
    from zenflow.hardware.bench_worker import child_main

    ctx = _forkserver()
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=child_main, args=(child_conn, job), name=f"zfctl-bench-{job['engine']}"
    )
    proc.start()
    child_conn.close()
    what = f"{job['engine']} (round {job.get('round', 0) + 1})"
    try:
        # A little longer than the child's own faulthandler deadline, which prints stacks.
        if not parent_conn.poll(job["deadline_s"] + 30):
            _kill_group(proc)
            raise BenchError(
                f"{what} did not finish within {job['deadline_s']:.0f} s and was stopped; its "
                f"output (and every thread's stack) is in {job['log']}."
            )
        try:
            result = parent_conn.recv()
        except EOFError:
            proc.join(30)
            raise BenchError(
                f"{what} ended without a result (exit code {proc.exitcode}); its output is in "
                f"{job['log']}."
            ) from None
    finally:
        proc.join(60)
        if proc.is_alive():
            _kill_group(proc)
        _remove_shm(job)
    if not result.get("ok"):
        if result.get("user_error"):
            raise UserInputError(result["message"])
        raise BenchError(f"{what} failed: {result['message']}. Its output is in {job['log']}.")
    return result


def _kill_group(proc) -> None:
    """SIGKILL the child's process group (it called setsid: its pid is the group id), and the
    child itself should it not have got that far."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.is_alive():
        proc.kill()
    proc.join(30)


def _remove_shm(job: dict) -> None:
    """DeepSpeed's CPU comm segment of a child killed before the adapter removed it."""
    env = job.get("env") or {}
    if "MASTER_PORT" in env:
        name = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{env['MASTER_PORT']}_0"
        with contextlib.suppress(OSError):
            (Path("/dev/shm") / name).unlink()


def _check_device(spec: BenchSpec) -> None:
    if spec.device not in DEVICES:
        raise UserInputError(f"--device {spec.device!r}: choose one of {', '.join(DEVICES)}.")
    if spec.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserInputError("--device cuda: torch sees no CUDA device; use --device cpu.")


def run_bench(
    spec: BenchSpec,
    on_progress: Callable[[dict], None] | None = None,
    runner: Callable[[dict], dict] = run_child,
) -> dict:
    """Run the benchmark; returns the JSON document ``zfctl bench --json`` writes.

    ``on_progress`` receives plain dicts: ``{"event": "start", "total": n}``, then
    ``"run"`` (before each child: round, contender, index) and ``"done"`` (after it: mean ms),
    and ``"note"`` lines. ``runner`` runs one job (tests may pass their own).
    """
    emit = on_progress or (lambda _event: None)
    _check_spec(spec)
    engines, skipped, notes = _engines_here(spec)
    warmup, measured = window_steps(spec)
    if measured != spec.steps:
        notes.append(
            f"--steps {spec.steps} rounded up to {measured}: whole windows of "
            f"update_interval {spec.zenflow['update_interval']}"
        )
    schedule = plan(engines, spec.rounds)
    logdir = Path(tempfile.mkdtemp(prefix="zfctl-bench-"))
    uses_ds = any(e in DEEPSPEED_ENGINES for e in engines)
    emit({"event": "start", "total": len(schedule) + int(uses_ds)})
    for line in notes:
        emit({"event": "note", "text": line})
    base = {"model": spec.model, "micro_batch": spec.micro_batch, "seq_len": spec.seq_len,
            "device": spec.device, "seed": spec.seed, "deadline_s": spec.deadline_s,
            "warmup": warmup, "measured": measured}  # fmt: skip
    if uses_ds:
        _prepare_deepspeed(spec, base, logdir, emit, runner)
    results, first = _run_schedule(spec, schedule, base, logdir, emit, runner)
    shutil.rmtree(logdir, ignore_errors=True)  # kept on failure (BenchError names it)
    model_bytes, params = int(first["model_bytes"]), int(first["params"])
    return {
        "engines": summarize(results, model_bytes, params),
        "model_bytes": model_bytes,
        "params": params,
        "config": {
            "model": spec.model,
            "model_source": first["model_source"],
            "micro_batch": spec.micro_batch,
            "seq_len": spec.seq_len,
            "rounds": spec.rounds,
            "steps": measured,
            "warmup_steps": warmup,
            "zenflow": dict(spec.zenflow),
            "engines": list(engines),
            "order": [c for _, c in schedule],
            "resolved": {c: runs[0]["resolved"] for c, runs in results.items()},
            "threads": {c: runs[0]["threads"] for c, runs in results.items()},
        },
        "device": spec.device,
        "skipped": skipped,
        "notes": notes,
        "machine": _machine(),
    }


def _check_spec(spec: BenchSpec) -> None:
    """Refuse what cannot run before any child starts."""
    from zenflow.hardware.bench_worker import preset_shape

    if spec.rounds < 1 or spec.steps < 1 or spec.micro_batch < 1 or spec.seq_len < 2:
        raise UserInputError(
            "--rounds, --steps and --micro-batch must be at least 1, --seq-len at least 2."
        )
    if spec.warmup_windows < 0:
        raise UserInputError("--warmup-windows must be 0 or more.")
    preset_shape(spec.model)  # a malformed LxW preset fails here, before any child starts
    _check_device(spec)


def _engines_here(spec: BenchSpec) -> tuple[tuple[str, ...], dict[str, str], list[str]]:
    """(engines that run on ``spec.device``, skipped ones with why, notes saying so)."""
    notes: list[str] = []
    skipped: dict[str, str] = {}
    engines = spec.engines
    if spec.device == "sim":
        for name in (e for e in engines if e in DEEPSPEED_ENGINES):
            skipped[name] = "DeepSpeed runs on cpu or cuda only, not on the sim accelerator"
        engines = tuple(e for e in engines if e not in DEEPSPEED_ENGINES)
        for name, why in skipped.items():
            notes.append(f"{name} skipped: {why}")
    if not engines:
        raise UserInputError("No engine left to run on --device sim; add one of ours.")
    return engines, skipped, notes


def _ds_accelerator(spec: BenchSpec) -> str:
    """DeepSpeed's accelerator for ``spec.device`` (DS_ACCELERATOR)."""
    return "cuda" if spec.device == "cuda" else "cpu"


def _prepare_deepspeed(
    spec: BenchSpec,
    base: dict,
    logdir: Path,
    emit: Callable[[dict], None],
    runner: Callable[[dict], dict],
) -> None:
    """Build DeepSpeed's ops once, in a child of their own, before the first round."""
    accel = _ds_accelerator(spec)
    emit({"event": "run", "round": 0, "contender": "preparing DeepSpeed's ops", "index": 0})
    builders = ["CPUAdamBuilder"] + (["ShareMemCommBuilder"] if accel == "cpu" else [])
    log = str(logdir / "prepare-deepspeed.log")
    env = {"DS_ACCELERATOR": accel}
    runner({**base, "engine": "prepare-deepspeed", "builders": builders, "log": log, "env": env})
    emit({"event": "done", "contender": "preparing DeepSpeed's ops", "mean_ms": None})


def _run_schedule(
    spec: BenchSpec,
    schedule: list[tuple[int, str]],
    base: dict,
    logdir: Path,
    emit: Callable[[dict], None],
    runner: Callable[[dict], dict],
) -> tuple[dict[str, list[dict]], dict]:
    """Every (round, contender) of ``schedule`` in order, one child each: their results by
    contender (rounds in order), and the first result (the model's size and source)."""
    results: dict[str, list[dict]] = {}
    first: dict | None = None
    for index, (rnd, contender) in enumerate(schedule):
        emit({"event": "run", "round": rnd, "contender": contender, "index": index})
        job = {**base, "engine": contender, "round": rnd,
               "ds_config": ds_config(spec, contender),
               "log": str(logdir / f"r{rnd}-{contender}.log")}  # fmt: skip
        if contender.startswith("deepspeed-"):
            # Only names DeepSpeed's shared-memory segment; removed after the child.
            port = str(20000 + (os.getpid() * 64 + index) % 40000)
            job["env"] = {"DS_ACCELERATOR": _ds_accelerator(spec), "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": port}  # fmt: skip
        result = runner(job)
        first = first or result
        results.setdefault(contender, []).append(result)
        emit({"event": "done", "round": rnd, "contender": contender,
              "mean_ms": statistics.fmean(r["ms"] for r in result["records"])})  # fmt: skip
    assert first is not None
    return results, first


def _machine() -> dict:
    import platform

    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count()
    info = {"cores": cores, "torch": torch.__version__, "python": platform.python_version(),
            "date": _dt.date.today().isoformat()}  # fmt: skip
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["deepspeed"] = version("deepspeed")
    return info


def write_json(result: dict, path: str | os.PathLike) -> None:
    """``--json FILE``: the result, strict JSON (no NaN)."""
    write_text(path, jsonout.dumps(result, indent=2) + "\n", "--json: cannot write")
