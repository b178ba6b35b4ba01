"""tune-hw's decisions and the whole tune run (ZENFLOW.md sections 3 and 7).

``choose(TuneInputs) -> Choices`` is a pure function of measured numbers, so its rules are
tested with synthetic figures. ``run_tune`` wires the probes (``zenflow.hardware.probes``) and the
measurements (``zenflow.hardware.measure``) into it and returns the hw.json dict;
``update_config`` writes the chosen keys into a config's zenflow block.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zenflow.hardware.measure import (
    OverlapProbe,
    load_probe_model,
    measure_cpu_adam,
    measure_engine,
    measure_fwd_bwd,
    measure_overlap,
    resolve_adam,
)
from zenflow.hardware.probes import probe_accelerator, probe_cpu, probe_memory
from zenflow.train.runs import write_json_atomic

UPDATE_INTERVAL_MIN = 1
UPDATE_INTERVAL_MAX = 64

# Host bytes per offloaded (2-D) parameter: fp32 master (4) + exp_avg (4) + exp_avg_sq (4)
# + fp32 gradient accumulator (4) = 16; with overlap_step a second accumulator (4) lets the
# next window accumulate while the worker reads the last one = 20.
HOST_BYTES_PER_PARAM = 16
HOST_BYTES_PER_PARAM_OVERLAP = 20

CPU_ONLY_NOTE = (
    "The device is the CPU: 'device' and 'host' are the same memory and the same cores, so "
    "copies between them cost memory bandwidth, not PCIe, and pinned memory does not apply. "
    "Overlapping the host step only pays if the worker gets cores the training thread does "
    "not need; both options were measured and the faster one chosen."
)


# --------------------------------------------------------------------------------------
# Decision logic (pure)


@dataclass(frozen=True)
class TuneInputs:
    """The measured numbers ``choose`` decides from. Times in ms, rates in params/s."""

    cores: int  # cores this process may use
    params_total: int
    params_2d: int
    fb_all_ms: float  # forward+backward with all cores
    fb_split_ms: float  # forward+backward with the training thread's share
    train_threads: int  # the training share measured for fb_split_ms (1..cores-1)
    adam_rate_worker: float  # host Adam params/s on the worker's cores (cores - train)
    adam_rate_all: float  # host Adam params/s on all cores
    mem_available_bytes: int
    memlock_bytes: int | None = None  # None = unlimited
    accelerator: str = "cpu"
    accelerator_memory_bytes: int | None = None
    topk_ratio: float | None = None  # fixed by the user; None = choose
    overlap: OverlapProbe | None = None  # a real concurrent measurement, if taken


@dataclass(frozen=True)
class Choices:
    topk_ratio: float
    update_interval: int
    select_strategy: str
    select_interval: str | int
    overlap_step: bool
    pt_reserved_cores_perc: float
    reasons: dict[str, str]
    windows: dict[str, float | bool | int]  # the per-window figures behind overlap_step
    memory: dict[str, object]  # the memory check

    def zenflow_block(self) -> dict:
        """The keys this tool sets in a config's zero_optimization.zenflow block."""
        return {
            "topk_ratio": self.topk_ratio,
            "update_interval": self.update_interval,
            "select_strategy": self.select_strategy,
            "select_interval": self.select_interval,
            "overlap_step": self.overlap_step,
            "pt_reserved_cores_perc": self.pt_reserved_cores_perc,
        }


def interval_to_hide(host_ms: float, fb_ms: float) -> int:
    """Smallest S in 1..64 with host_ms <= S * fb_ms (the host step hides under the window)."""
    if fb_ms <= 0:
        return UPDATE_INTERVAL_MAX
    s = math.ceil(host_ms / fb_ms - 1e-9)
    return min(UPDATE_INTERVAL_MAX, max(UPDATE_INTERVAL_MIN, s))


def choose_topk(params_2d: int) -> tuple[float, str]:
    """0.1 below 1B params of 2-D weights, 0.05 below 10B, else 0.01."""
    why = (
        "the device keeps fp32 moments for the selected columns and updates them every step, "
        "so device memory and per-step work grow with k"
    )
    if params_2d < 1e9:
        return 0.1, f"{_count(params_2d)} 2-D params (< 1B): the ZenFlow default 0.1; {why}"
    if params_2d < 1e10:
        return 0.05, f"{_count(params_2d)} 2-D params (1B-10B): lowered to 0.05; {why}"
    return 0.01, f"{_count(params_2d)} 2-D params (>= 10B): top 1% carries most of the norm; {why}"


def memory_needed(
    params_total: int, params_2d: int, topk: float, overlap: bool, accelerator: str
) -> dict[str, int]:
    """Bytes of host memory the run needs (activations not included).

    host_state: the offloaded state of the 2-D weights (16 bytes/param, 20 with overlap).
    On a CPU-only machine the "device" side lives in the same memory too: fp32 weights and
    gradients (8 bytes/param) and device moments for selected columns and 1-D params
    (8 bytes/param of those).
    """
    per = HOST_BYTES_PER_PARAM_OVERLAP if overlap else HOST_BYTES_PER_PARAM
    host_state = params_2d * per
    device_side = 0
    if accelerator == "cpu":
        selected = int(topk * params_2d) + (params_total - params_2d)
        device_side = params_total * 8 + selected * 8
    return {"host_state": host_state, "device_side_in_host": device_side,
            "total": host_state + device_side, "bytes_per_param": per}  # fmt: skip


def choose(inp: TuneInputs) -> Choices:
    """Decide the zenflow block from measured numbers. Pure; every choice has a reason."""
    reasons: dict[str, str] = {}
    if inp.topk_ratio is not None:
        topk = inp.topk_ratio
        reasons["topk_ratio"] = f"fixed by --topk {topk:g}"
    else:
        topk, reasons["topk_ratio"] = choose_topk(inp.params_2d)
    host_numel = inp.params_2d * (1.0 - topk)
    host_all_ms = host_numel / inp.adam_rate_all * 1e3
    host_worker_ms = host_numel / inp.adam_rate_worker * 1e3
    can_split = inp.cores >= 2 and 1 <= inp.train_threads < inp.cores
    worker = inp.cores - inp.train_threads

    ov = inp.overlap
    if not can_split:
        s = interval_to_hide(host_all_ms, inp.fb_all_ms)
        reasons["update_interval"] = (
            f"host Adam over {_count(host_numel)} offloaded params takes {host_all_ms:.0f} ms "
            f"on {inp.cores} core(s), forward+backward {inp.fb_all_ms:.0f} ms: S={s} "
            f"amortises it ({s}x{inp.fb_all_ms:.0f}={s * inp.fb_all_ms:.0f} ms)"
        )
        on_ms, off_ms, measured = math.inf, s * inp.fb_all_ms + host_all_ms, False
        overlap = False
        reasons["overlap_step"] = (
            f"off: {inp.cores} core(s) leaves no core for a worker; window {off_ms:.0f} ms"
        )
        perc = 0.5
        reasons["pt_reserved_cores_perc"] = "0.5 (unused: no core split on this machine)"
    else:
        # With a concurrent measurement, decide from the figures measured under contention.
        fb = ov.on_fb_ms if ov else inp.fb_split_ms
        host = ov.on_host_ms if ov else host_worker_ms
        s = interval_to_hide(host, fb)
        basis = "measured while both ran" if ov else "measured separately"
        reasons["update_interval"] = (
            f"host Adam over {_count(host_numel)} offloaded params takes {host:.0f} ms on "
            f"{worker} worker core(s), forward+backward {fb:.0f} ms on {inp.train_threads} "
            f"training core(s) ({basis}): S={s} hides it ({s}x{fb:.0f}={s * fb:.0f} ms)"
        )
        if s == UPDATE_INTERVAL_MAX and host > s * fb:
            reasons["update_interval"] += "; capped at 64, the host step is not fully hidden"
        measured = bool(ov and ov.update_interval == s)
        if measured:
            on_ms, off_ms = ov.on_window_ms, ov.off_window_ms
            how = "measured"
        elif ov:  # S moved after the measurement: scale its parts to the new S
            on_ms = max(s * ov.on_fb_ms, ov.on_host_ms)
            off_ms = s * ov.off_fb_ms + ov.off_host_ms
            how = f"modelled from the parts of the S={ov.update_interval} measurement"
        else:
            on_ms = max(s * fb, host)
            off_ms = s * inp.fb_all_ms + host_all_ms
            how = "modelled from component times"
        overlap = on_ms < off_ms
        reasons["overlap_step"] = (
            f"{'on' if overlap else 'off'}: per {s}-step window ({how}) overlap on "
            f"({inp.train_threads}+{worker} cores) {on_ms:.0f} ms vs off ({inp.cores} cores) "
            f"{off_ms:.0f} ms"
        )
        perc = inp.train_threads / inp.cores
        reasons["pt_reserved_cores_perc"] = (
            f"{perc:.2f}: {inp.train_threads} of {inp.cores} cores for the training thread, "
            f"{worker} for the worker" + ("" if overlap else " (only used with overlap_step on)")
        )
    reasons["select_interval"] = (
        "auto: re-select once per epoch (important columns stay for many steps); nothing "
        "measured here argues for another cadence"
    )
    mem = memory_needed(inp.params_total, inp.params_2d, topk, overlap, inp.accelerator)
    mem_ok = mem["total"] <= inp.mem_available_bytes
    memory: dict[str, object] = {
        **mem,
        "available": inp.mem_available_bytes,
        "ok": mem_ok,
        "pinned_needed": None,
        "memlock": inp.memlock_bytes,
        "pinned_ok": None,
    }
    if inp.accelerator != "cpu":
        memory["pinned_needed"] = mem["host_state"]
        memory["pinned_ok"] = inp.memlock_bytes is None or inp.memlock_bytes >= mem["host_state"]
    windows = {"update_interval": s, "on_ms": on_ms, "off_ms": off_ms, "measured": measured,
               "host_all_ms": host_all_ms, "host_worker_ms": host_worker_ms}  # fmt: skip
    return Choices(
        topk_ratio=topk,
        update_interval=s,
        select_strategy="auto",
        select_interval="auto",
        overlap_step=overlap,
        pt_reserved_cores_perc=round(perc, 4),
        reasons=reasons,
        windows=windows,
        memory=memory,
    )


def memory_verdict(memory: dict) -> str:
    """One plain line: OK / not OK for host memory and (with CUDA) pinned memory."""
    gb = 1e9
    line = (
        f"host memory {'OK' if memory['ok'] else 'NOT OK'}: needs {memory['total'] / gb:.2f} GB "
        f"(offloaded state {memory['bytes_per_param']} B/param of 2-D weights = "
        f"{memory['host_state'] / gb:.2f} GB"
    )
    if memory["device_side_in_host"]:
        line += f", device-side weights/grads/moments {memory['device_side_in_host'] / gb:.2f} GB"
    line += f"; activations not included) of {memory['available'] / gb:.2f} GB available"
    if memory["pinned_ok"] is not None:
        lim = memory["memlock"]
        lim_s = "unlimited" if lim is None else f"{lim / gb:.2f} GB"
        line += (
            f"; pinned memory {'OK' if memory['pinned_ok'] else 'NOT OK'}: needs "
            f"{memory['pinned_needed'] / gb:.2f} GB, locked-memory limit {lim_s}"
        )
    else:
        line += "; pinned memory: not applicable without CUDA"
    return line


# --------------------------------------------------------------------------------------
# The whole run


@dataclass
class TuneSettings:
    model: str = "gpt2"
    micro_batch: int = 8
    seq_len: int = 128
    quick: bool = False
    topk_ratio: float | None = None
    engine_check: bool = True  # also time real ZenFlowEngine steps each way (not deciding)
    progress: Callable[[str], None] | None = field(default=None, repr=False)


def run_tune(settings: TuneSettings) -> dict:
    """Probe, measure and choose; returns the hw.json content (plain JSON-able dict)."""
    import torch

    say = settings.progress or (lambda _msg: None)
    quick = settings.quick
    repeats = 3 if quick else 5  # forward+backward and overlap windows; the rest is cheap
    notes: list[str] = []

    say("probing CPU, memory and accelerator")
    load_1min = os.getloadavg()[0]  # before this run adds its own load
    cpu = probe_cpu()
    mem = probe_memory(buffer_mb=64 if quick else 256, repeats=5)
    acc = probe_accelerator(buffer_mb=64 if quick else 256, repeats=5)
    cores = max(1, min(cpu.usable_cores, torch.get_num_threads() or cpu.usable_cores))
    if acc.kind == "cpu":
        notes.append(CPU_ONLY_NOTE)
    if load_1min > 0.5:
        notes.append(
            f"Other processes were using the CPU (1-minute load {load_1min:.1f} on {cores} "
            "cores) when measuring started: the figures are noisy; rerun on an idle machine "
            "for firm numbers."
        )

    # Training share candidates: half the cores; without --quick also three quarters.
    shares = sorted({max(1, cores // 2)} | (set() if quick else {max(1, 3 * cores // 4)}))
    shares = [t for t in shares if t < cores] or [cores]

    say("resolving the native CPU Adam" + ("" if quick else " (builds on first use)"))
    adam = resolve_adam(allow_build=not quick)
    if adam[2]:
        notes.append(f"CPU Adam measured with the plain PyTorch reference: {adam[2]}.")
    adam_numel = (8 if quick else 16) * 2**20
    say(f"measuring CPU Adam ({adam[1]}) on {adam_numel / 2**20:.0f}M params")
    adam_all = measure_cpu_adam(adam_numel, cores, 5, adam)
    adam_by_threads = {cores: adam_all}
    for t in shares:
        w = cores - t
        if w >= 1 and w not in adam_by_threads:
            adam_by_threads[w] = measure_cpu_adam(adam_numel, w, 5, adam)

    say(f"building {settings.model} (micro-batch {settings.micro_batch}, seq {settings.seq_len})")
    pm = load_probe_model(settings.model, settings.micro_batch, settings.seq_len)
    if "random" in pm.source.lower():
        notes.append(f"Model {pm.name}: {pm.source}; timings do not depend on the weights.")
    say("measuring forward+backward")
    fb_by_threads = {cores: measure_fwd_bwd(pm, cores, repeats)}
    for t in shares:
        if t not in fb_by_threads:
            fb_by_threads[t] = measure_fwd_bwd(pm, t, repeats)

    def inputs(train: int, overlap: OverlapProbe | None = None) -> TuneInputs:
        worker = cores - train
        return TuneInputs(
            cores=cores,
            params_total=pm.params_total,
            params_2d=pm.params_2d,
            fb_all_ms=fb_by_threads[cores],
            fb_split_ms=fb_by_threads[train],
            train_threads=train,
            adam_rate_worker=adam_by_threads[worker if worker >= 1 else cores].params_per_s,
            adam_rate_all=adam_all.params_per_s,
            mem_available_bytes=mem.available_bytes,
            memlock_bytes=mem.memlock_bytes,
            accelerator=acc.kind,
            accelerator_memory_bytes=acc.memory_bytes,
            topk_ratio=settings.topk_ratio,
            overlap=overlap,
        )

    # Pick the training share with the shortest modelled per-step time, then measure it.
    def per_step(c: Choices) -> float:
        return min(c.windows["on_ms"], c.windows["off_ms"]) / c.update_interval

    train = min(shares, key=lambda t: per_step(choose(inputs(t))))
    choices = choose(inputs(train))
    overlaps: list[OverlapProbe] = []
    if cores >= 2:
        for _ in range(2 if quick else 3):
            s = choices.update_interval
            host_numel = int(pm.params_2d * (1 - choices.topk_ratio))
            say(f"measuring one {s}-step window with overlap on ({train}+{cores - train}) and off")
            ov = measure_overlap(
                pm,
                update_interval=s,
                train_threads=train,
                worker_threads=cores - train,
                all_threads=cores,
                host_numel=host_numel,
                adam=adam,
                repeats=2 if quick else 3,
            )
            overlaps.append(ov)
            choices = choose(inputs(train, ov))
            if choices.update_interval == s:
                break
    method = "components (forward+backward and host Adam, run concurrently on threads)"
    if overlaps and not choices.windows["measured"]:
        method += "; window at the final S modelled from the concurrent figures"
    engine_runs: list[dict] = []
    if cores >= 2 and settings.engine_check:
        say("cross-checking with real engine steps, overlap on and off")
        try:
            block = choices.zenflow_block()
            engine_runs = [measure_engine(pm, block, on) for on in (True, False)]
        except Exception as exc:  # the engine is optional here: say why it was skipped
            notes.append(f"Engine cross-check skipped: {type(exc).__name__}: {exc}")
    if engine_runs:
        on_ms, off_ms = (r["ms_per_step"] for r in engine_runs)
        agree = (on_ms < off_ms) == choices.overlap_step
        method += (
            f"; engine cross-check (not used to decide): overlap on {on_ms:.0f} ms/step, "
            f"off {off_ms:.0f} ms/step, {'agrees' if agree else 'disagrees'}"
        )

    return {
        "date": _now(),
        "versions": _versions(),
        "settings": {
            "model": settings.model,
            "micro_batch": settings.micro_batch,
            "seq_len": settings.seq_len,
            "quick": quick,
        },
        "method": method,
        "probes": {
            "load_1min_before": load_1min,
            "cpu": dataclasses.asdict(cpu),
            "memory": dataclasses.asdict(mem),
            "accelerator": dataclasses.asdict(acc),
            "cpu_adam": {str(k): dataclasses.asdict(v) for k, v in sorted(adam_by_threads.items())},
            "model": {
                "name": pm.name,
                "source": pm.source,
                "params_total": pm.params_total,
                "params_2d": pm.params_2d,
                "micro_batch": pm.micro_batch,
                "seq_len": pm.seq_len,
            },
            "fwd_bwd_ms": {str(k): v for k, v in sorted(fb_by_threads.items())},
            "overlap": [dataclasses.asdict(o) for o in overlaps],
            "engine": engine_runs,
        },
        "choices": choices.zenflow_block(),
        "reasons": choices.reasons,
        "windows": choices.windows,
        "memory_check": {**choices.memory, "verdict": memory_verdict(choices.memory)},
        "notes": notes,
    }


# --------------------------------------------------------------------------------------
# Config file and hw.json


def read_config_document(path: Path) -> dict:
    """Read and validate a DeepSpeed JSON config before measuring, so errors come fast.

    Unreadable files, bad JSON and invalid values raise ``ConfigError`` (all problems of
    the file together). Returns the file's JSON object as written.
    """
    from zenflow.config import load_config

    return copy.deepcopy(dict(load_config(path).raw))


def update_config(path: Path, doc: dict, block: dict, *, write: bool) -> dict:
    """Set ``block``'s keys in the config's zenflow block, validate, and (if asked) write.

    Every other key is kept. Returns {"old": previous zenflow block, "new": the chosen
    keys as they will be written, "written": bool}.
    """
    from zenflow.config import apply_overrides, load_config

    old = ((doc.get("zero_optimization") or {}).get("zenflow")) or {}
    overrides = {f"zero_optimization.zenflow.{k}": v for k, v in block.items()}
    new_doc = apply_overrides(copy.deepcopy(doc), overrides)
    load_config(copy.deepcopy(new_doc))  # the result must be a valid config
    new = new_doc["zero_optimization"]["zenflow"]
    changed = any(old.get(k, _UNSET) != new[k] for k in block)
    if write and changed:
        write_json_atomic(path, new_doc)
    return {"old": dict(old), "new": {k: new[k] for k in block}, "written": write and changed}


_UNSET = object()


# --------------------------------------------------------------------------------------
# Helpers


def _count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _versions() -> dict[str, str]:
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "deepspeed", "zfctl"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out
