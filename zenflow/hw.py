"""Hardware probes and the tune-hw decision logic (ZENFLOW.md sections 2, 3 and 7).

Three layers, each plain data:

- parsers of /proc and /sys text (``parse_cpuinfo``, ``parse_meminfo``, ...), pure;
- probes and measurements (``probe_cpu``, ``probe_memory``, ``probe_accelerator``,
  ``measure_cpu_adam``, ``measure_fwd_bwd``, ``measure_overlap``) returning dataclasses;
- ``choose(TuneInputs) -> Choices``: a pure function of measured numbers, so the rules are
  tested with synthetic figures. ``run_tune`` wires the three and returns the hw.json dict.

Torch is imported inside the functions that need it, so the parsers and ``choose`` stay cheap.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import resource
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zenflow.runs import write_json_atomic

# SIMD features the native CPU Adam (and torch's CPU kernels) can use. "amx" is true when
# any amx_* flag is present (amx_tile, amx_bf16, amx_int8).
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx")

UPDATE_INTERVAL_MIN = 1
UPDATE_INTERVAL_MAX = 64

# Host bytes per offloaded (2-D) parameter: fp32 master (4) + exp_avg (4) + exp_avg_sq (4)
# + fp32 gradient accumulator (4) = 16; with overlap_step a second accumulator (4) lets the
# next window accumulate while the worker reads the last one = 20.
HOST_BYTES_PER_PARAM = 16
HOST_BYTES_PER_PARAM_OVERLAP = 20

# Built-in GPT-2 shapes (layers, width, heads; GPT-2 vocabulary), random init. The first is
# the --quick default, the architecture of ZENFLOW.md section 7 (38.4M params); the second
# is a toy for tests.
BUILTIN_SHAPES = {"builtin:gpt2-4x512": (4, 512, 8), "builtin:gpt2-2x128": (2, 128, 4)}
BUILTIN_SMALL = "builtin:gpt2-4x512"

# Hyper-parameters of the timed Adam steps (the time does not depend on them).
_ADAM_HP = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}

CPU_ONLY_NOTE = (
    "The device is the CPU: 'device' and 'host' are the same memory and the same cores, so "
    "copies between them cost memory bandwidth, not PCIe, and pinned memory does not apply. "
    "Overlapping the host step only pays if the worker gets cores the training thread does "
    "not need; both options were measured and the faster one chosen."
)


# --------------------------------------------------------------------------------------
# Parsers (pure)


def parse_cpuinfo(text: str) -> dict:
    """Model name, logical/physical core counts and flags from /proc/cpuinfo text.

    Physical cores are distinct (physical id, core id) pairs; when the file lacks those
    fields (some ARM and VM kernels) physical = logical.
    """
    blocks = [b for b in re.split(r"\n\s*\n", text) if "processor" in b]
    model = ""
    flags: set[str] = set()
    pairs: set[tuple[str, str]] = set()
    for block in blocks:
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        model = model or fields.get("model name", "") or fields.get("Processor", "")
        if not flags:
            flags = set((fields.get("flags") or fields.get("Features") or "").split())
        if "physical id" in fields and "core id" in fields:
            pairs.add((fields["physical id"], fields["core id"]))
    logical = len(blocks)
    physical = len(pairs) if pairs else logical
    return {"model": model, "logical": logical, "physical": physical, "flags": flags}


def parse_meminfo(text: str) -> dict:
    """MemTotal and MemAvailable from /proc/meminfo text, in bytes (kB lines times 1024)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            values[m.group(1)] = int(m.group(2)) * 1024
    total = values.get("MemTotal", 0)
    available = values.get("MemAvailable", values.get("MemFree", 0))
    return {"total_bytes": total, "available_bytes": available}


def simd_support(flags: set[str]) -> dict[str, bool]:
    """The SIMD_FLAGS present in a cpuinfo flag set."""
    out = {f: f in flags for f in SIMD_FLAGS if f != "amx"}
    out["amx"] = any(f.startswith("amx") for f in flags)
    return out


def sys_physical_cores(cpu_root: Path) -> int | None:
    """Distinct (package id, core id) pairs under /sys/devices/system/cpu, or None."""
    pairs = set()
    for topo in cpu_root.glob("cpu[0-9]*/topology"):
        try:
            pkg = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            continue
        pairs.add((pkg, core))
    return len(pairs) or None


def count_numa_nodes(node_root: Path) -> int:
    """Number of nodeN directories under /sys/devices/system/node (1 when absent)."""
    try:
        nodes = [p for p in node_root.iterdir() if re.fullmatch(r"node\d+", p.name)]
    except OSError:
        return 1
    return max(1, len(nodes))


# --------------------------------------------------------------------------------------
# Probes


@dataclass(frozen=True)
class CpuProbe:
    model: str
    logical_cores: int
    physical_cores: int
    usable_cores: int  # os.sched_getaffinity: what this process may run on
    simd: dict[str, bool]
    numa_nodes: int


def probe_cpu(
    cpuinfo: Path = Path("/proc/cpuinfo"),
    cpu_root: Path = Path("/sys/devices/system/cpu"),
    node_root: Path = Path("/sys/devices/system/node"),
) -> CpuProbe:
    """CPU model, cores (physical from /sys topology, else cpuinfo), SIMD flags, NUMA nodes."""
    try:
        info = parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        info = {"model": "", "logical": 0, "physical": 0, "flags": set()}
    logical = info["logical"] or os.cpu_count() or 1
    physical = sys_physical_cores(cpu_root) or info["physical"] or logical
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = logical
    return CpuProbe(
        model=info["model"] or "unknown",
        logical_cores=logical,
        physical_cores=physical,
        usable_cores=usable,
        simd=simd_support(info["flags"]),
        numa_nodes=count_numa_nodes(node_root),
    )


@dataclass(frozen=True)
class MemoryProbe:
    total_bytes: int
    available_bytes: int
    copy_gbs: float  # dst.copy_(src): bytes read + written per second, median
    add_gbs: float  # torch.add(a, b, out=c): 2 reads + 1 write per element, median
    buffer_bytes: int  # size of one buffer used for the bandwidth figures
    memlock_bytes: int | None  # RLIMIT_MEMLOCK soft limit; None = unlimited


def memlock_limit() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def probe_memory(
    buffer_mb: int = 256, repeats: int = 5, meminfo: Path = Path("/proc/meminfo")
) -> MemoryProbe:
    """Total/available memory, memory bandwidth (large fp32 copy and add), memlock limit."""
    import torch

    try:
        mem = parse_meminfo(meminfo.read_text())
    except OSError:
        mem = {"total_bytes": 0, "available_bytes": 0}
    n = buffer_mb * 2**20 // 4
    a = torch.rand(n)
    b = torch.empty(n)
    c = torch.empty(n)
    b.copy_(a)  # touch every page before timing
    c.copy_(a)
    copy_s = _median_seconds(lambda: b.copy_(a), repeats)
    add_s = _median_seconds(lambda: torch.add(a, b, out=c), repeats)
    nbytes = n * 4
    return MemoryProbe(
        total_bytes=mem["total_bytes"],
        available_bytes=mem["available_bytes"],
        copy_gbs=2 * nbytes / copy_s / 1e9,
        add_gbs=3 * nbytes / add_s / 1e9,
        buffer_bytes=nbytes,
        memlock_bytes=memlock_limit(),
    )


@dataclass(frozen=True)
class AcceleratorProbe:
    kind: str  # "cuda" or "cpu"
    name: str
    memory_bytes: int | None = None
    # GB/s of one-way copies host->device (h2d) and device->host (d2h), from pinned and
    # pageable host memory, and both directions at once on two streams (pinned).
    h2d_pinned_gbs: float | None = None
    d2h_pinned_gbs: float | None = None
    h2d_pageable_gbs: float | None = None
    d2h_pageable_gbs: float | None = None
    bidir_pinned_gbs: float | None = None


def probe_accelerator(buffer_mb: int = 256, repeats: int = 5) -> AcceleratorProbe:
    """CUDA device name, memory and copy bandwidths; on a CPU-only machine, kind "cpu"."""
    import torch

    if not torch.cuda.is_available():
        return AcceleratorProbe(kind="cpu", name="CPU (no accelerator: device = host)")
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    n = buffer_mb * 2**20
    dev_buf = torch.empty(n, dtype=torch.uint8, device=dev)
    dev_buf2 = torch.empty(n, dtype=torch.uint8, device=dev)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)

    def timed(fn: Callable[[], object]) -> float:
        def run() -> None:
            fn()
            torch.cuda.synchronize(dev)

        run()  # warm-up
        return _median_seconds(run, repeats)

    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def both_directions() -> None:  # synchronize(dev) in timed() waits for both streams
        with torch.cuda.stream(s1):
            dev_buf.copy_(pinned, non_blocking=True)
        with torch.cuda.stream(s2):
            pinned2.copy_(dev_buf2, non_blocking=True)

    gbs = n / 1e9
    return AcceleratorProbe(
        kind="cuda",
        name=props.name,
        memory_bytes=int(props.total_memory),
        h2d_pinned_gbs=gbs / timed(lambda: dev_buf.copy_(pinned, non_blocking=True)),
        d2h_pinned_gbs=gbs / timed(lambda: pinned.copy_(dev_buf, non_blocking=True)),
        h2d_pageable_gbs=gbs / timed(lambda: dev_buf.copy_(pageable)),
        d2h_pageable_gbs=gbs / timed(lambda: pageable.copy_(dev_buf)),
        bidir_pinned_gbs=2 * gbs / timed(both_directions),
    )


# --------------------------------------------------------------------------------------
# CPU Adam


@dataclass(frozen=True)
class AdamProbe:
    backend: str  # "native" or "reference"
    fallback_reason: str | None  # why the reference ran instead of the native op
    num_threads: int
    numel: int
    ms: float  # median time of one step over numel params
    params_per_s: float


def resolve_adam(allow_build: bool = True) -> tuple[Callable, str, str | None]:
    """(adamw_step fn, backend name, fallback reason). Never falls back silently.

    The native op builds on first use (about a minute); with ``allow_build=False`` an
    op not built yet is left unbuilt and the reference is used, with the reason.
    """
    import torch

    from zenflow import ops

    reference = ops.adamw_step_reference_
    native = getattr(ops, "adamw_step_", None)
    status_fn = getattr(ops, "native_status", None)
    if native is None or status_fn is None:
        return reference, "reference", "the native op is not available in zenflow.ops"
    status = status_fn()
    if status.get("ops") == "reference":
        return reference, "reference", "ZENFLOW_OPS=reference is set"
    ready = status.get("state") in ("built", "cached") or status.get("cached_library")
    if not allow_build and not ready:
        return (
            reference,
            "reference",
            "the native op is not built yet and --quick does not build it (about a minute); "
            "run tune-hw without --quick to build and measure it",
        )
    try:
        t = [torch.zeros(8) for _ in range(4)]
        native(*t, step=1, **_ADAM_HP)  # builds or loads the op
    except Exception as exc:  # a failed build or load: report it, measure the reference
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        return reference, "reference", f"the native op failed to build or load: {first}"
    return native, "native", None


def measure_cpu_adam(
    numel: int,
    num_threads: int,
    repeats: int = 5,
    adam: tuple[Callable, str, str | None] | None = None,
) -> AdamProbe:
    """Median time of one AdamW step over ``numel`` fp32 params on ``num_threads`` threads.

    The reference ignores ``num_threads``, so torch's thread count is set to it while
    measuring (and restored).
    """
    import torch

    fn, backend, reason = adam or resolve_adam()
    param, grad = torch.randn(numel), torch.randn(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    step = [0]

    def one() -> None:
        step[0] += 1
        fn(param, grad, exp_avg, exp_avg_sq, step=step[0], **_ADAM_HP, num_threads=num_threads)

    with _torch_threads(num_threads):
        one()  # warm-up
        seconds = _median_seconds(one, repeats)
    return AdamProbe(backend, reason, num_threads, numel, seconds * 1e3, numel / seconds)


# --------------------------------------------------------------------------------------
# Model forward+backward


@dataclass
class ProbeModel:
    """The model whose forward+backward is timed, with its parameter counts."""

    name: str
    source: str  # where the weights came from, in words
    model: object
    batch: dict
    params_total: int
    params_2d: int
    micro_batch: int
    seq_len: int


def load_probe_model(name: str, micro_batch: int, seq_len: int, seed: int = 0) -> ProbeModel:
    """Build the model (2 labels, like a GLUE task) and a random token batch for timing."""
    import torch

    torch.manual_seed(seed)
    if name in BUILTIN_SHAPES:
        from transformers import GPT2Config, GPT2ForSequenceClassification

        layers, width, heads = BUILTIN_SHAPES[name]
        cfg = GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, num_labels=2, pad_token_id=50256
        )
        model = GPT2ForSequenceClassification(cfg)
        source = f"built-in GPT-2 shape ({layers} layers, width {width}), random init"
    else:
        model, source = _resolve_named_model(name, seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    cfg = model.config
    if getattr(cfg, "pad_token_id", None) is None:
        cfg.pad_token_id = getattr(cfg, "eos_token_id", None) or 0
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if limit and seq_len > limit:
        from zenflow.errors import UserInputError

        raise UserInputError(
            f"--seq-len {seq_len} is longer than {name}'s {limit} positions; use --seq-len "
            f"{limit} or less."
        )
    vocab = cfg.vocab_size
    high = max(2, vocab - 1)
    ids = torch.randint(0, high, (micro_batch, seq_len))
    ids[ids == cfg.pad_token_id] = 1  # no pad tokens: the last position is the sequence end
    batch = {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "labels": torch.randint(0, 2, (micro_batch,)).to(device),
    }
    params = [p for p in model.parameters() if p.requires_grad]
    return ProbeModel(
        name=name,
        source=source,
        model=model,
        batch=batch,
        params_total=sum(p.numel() for p in params),
        params_2d=sum(p.numel() for p in params if p.dim() == 2),
        micro_batch=micro_batch,
        seq_len=seq_len,
    )


def _resolve_named_model(name: str, seed: int) -> tuple[object, str]:
    """The model through zenflow.models: its weights if available, else random init (said)."""
    from zenflow.errors import ModelSourceError
    from zenflow.models import resolve_model

    try:
        resolved = resolve_model(name, task_num_labels=2, init="pretrained", seed=seed)
        return resolved.model, resolved.sources.get("model", "pretrained weights")
    except ModelSourceError as exc:
        first = str(exc).split(". ")[0]
        resolved = resolve_model(name, task_num_labels=2, init="random", seed=seed)
        return resolved.model, f"random init, seed {seed} (weights not available: {first})"


def fwd_bwd_once(pm: ProbeModel) -> None:
    """One forward+backward; waits for the device so wall time covers its work."""
    import torch

    out = pm.model(**pm.batch)
    out.loss.backward()
    pm.model.zero_grad(set_to_none=True)
    if pm.batch["input_ids"].is_cuda:
        torch.cuda.synchronize()


def measure_fwd_bwd(pm: ProbeModel, num_threads: int, repeats: int = 5) -> float:
    """Median ms of one forward+backward on ``num_threads`` torch threads (restored after)."""
    with _torch_threads(num_threads):
        fwd_bwd_once(pm)  # warm-up (allocator, lazy init)
        return _median_seconds(lambda: fwd_bwd_once(pm), repeats) * 1e3


# --------------------------------------------------------------------------------------
# Overlap: host step on a background thread while forward+backward runs


@dataclass(frozen=True)
class OverlapProbe:
    """Both options of ZENFLOW.md section 7, measured at one update interval S.

    on: S forward+backward steps on ``train_threads`` while the host step runs concurrently
    on a worker thread with ``worker_threads``; the window ends when both are done.
    off: S forward+backward steps on all threads, then the host step on all threads.
    """

    update_interval: int
    train_threads: int
    worker_threads: int
    all_threads: int
    host_numel: int
    on_window_ms: float
    on_fb_ms: float  # median forward+backward during the window (with the worker running)
    on_host_ms: float  # median worker time of the host step (with training running)
    on_wait_ms: float  # median time the training thread waited for the worker at the end
    off_window_ms: float
    off_fb_ms: float  # median forward+backward on all threads
    off_host_ms: float  # median host step on all threads, after the window's steps
    repeats: int


def measure_overlap(
    pm: ProbeModel,
    *,
    update_interval: int,
    train_threads: int,
    worker_threads: int,
    all_threads: int,
    host_numel: int,
    adam: tuple[Callable, str, str | None],
    repeats: int = 3,
    chunk_numel: int = 16 * 2**20,
) -> OverlapProbe:
    """Measure one window each way (median of ``repeats`` after a warm-up).

    The host step covers ``host_numel`` params in chunks of at most ``chunk_numel`` (the
    same buffers reused, 16 bytes/param), which costs the same memory traffic as distinct
    buffers once they exceed the caches while capping memory at 256 MiB.
    """
    import torch

    fn = adam[0]
    n = max(1, min(host_numel, chunk_numel))
    param, grad = torch.randn(n), torch.randn(n)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    step = [0]

    def host_step(threads: int) -> None:
        step[0] += 1
        left = host_numel
        while left > 0:
            k = min(left, n)
            fn(
                param[:k],
                grad[:k],
                exp_avg[:k],
                exp_avg_sq[:k],
                step=step[0],
                **_ADAM_HP,
                num_threads=threads,
            )
            left -= k

    on_windows, on_fbs, on_hosts, on_waits = [], [], [], []
    off_windows, off_fbs, off_hosts = [], [], []
    with _torch_threads(train_threads):
        for r in range(repeats + 1):
            host_s: list[float] = []
            failed: list[BaseException] = []

            def worker(out: list[float] = host_s, err: list[BaseException] = failed) -> None:
                t = time.perf_counter()
                try:
                    host_step(worker_threads)
                except BaseException as exc:  # re-raised on the training thread below
                    err.append(exc)
                out.append(time.perf_counter() - t)

            t0 = time.perf_counter()
            th = threading.Thread(target=worker, name="zenflow-hw-host-step")
            th.start()
            fbs = []
            for _ in range(update_interval):
                t = time.perf_counter()
                fwd_bwd_once(pm)
                fbs.append(time.perf_counter() - t)
            t_join = time.perf_counter()
            th.join()
            t1 = time.perf_counter()
            if failed:
                raise failed[0]
            if r:  # the first window is a warm-up
                on_windows.append(t1 - t0)
                on_fbs.append(statistics.median(fbs))
                on_hosts.append(host_s[0])
                on_waits.append(t1 - t_join)
    with _torch_threads(all_threads):
        for r in range(repeats + 1):
            fbs = []
            t0 = time.perf_counter()
            for _ in range(update_interval):
                t = time.perf_counter()
                fwd_bwd_once(pm)
                fbs.append(time.perf_counter() - t)
            t_host = time.perf_counter()
            host_step(all_threads)
            t1 = time.perf_counter()
            if r:
                off_windows.append(t1 - t0)
                off_fbs.append(statistics.median(fbs))
                off_hosts.append(t1 - t_host)
    med = statistics.median
    return OverlapProbe(
        update_interval=update_interval,
        train_threads=train_threads,
        worker_threads=worker_threads,
        all_threads=all_threads,
        host_numel=host_numel,
        on_window_ms=med(on_windows) * 1e3,
        on_fb_ms=med(on_fbs) * 1e3,
        on_host_ms=med(on_hosts) * 1e3,
        on_wait_ms=med(on_waits) * 1e3,
        off_window_ms=med(off_windows) * 1e3,
        off_fb_ms=med(off_fbs) * 1e3,
        off_host_ms=med(off_hosts) * 1e3,
        repeats=repeats,
    )


def measure_engine(pm: ProbeModel, block: dict, overlap: bool, windows: int = 2) -> dict:
    """Mean ms per step of real ZenFlowEngine steps with ``block`` and overlap on or off.

    Runs on a copy of the model: one warm-up window (selection, first host step), then
    ``windows`` whole windows timed, so each host step's cost is counted once per window.
    """
    import torch

    from zenflow.config import load_config
    from zenflow.engine import ZenFlowEngine

    s = int(block["update_interval"])
    raw = {
        "train_micro_batch_size_per_gpu": pm.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": torch.cuda.is_available()},
            "zenflow": {**block, "overlap_step": overlap, "full_warm_up_rounds": 0},
        },
    }
    model = copy.deepcopy(pm.model)
    prev = torch.get_num_threads()
    engine = ZenFlowEngine(model, load_config(raw), mode="zenflow", steps_per_epoch=10**6)
    try:

        def one() -> None:
            with engine.autocast():
                loss = model(**pm.batch).loss
            loss.backward()
            engine.step(loss)
            engine.zero_grad()

        for _ in range(s + 1):  # warm-up window, plus the step that applies its host result
            one()
        t0 = time.perf_counter()
        for _ in range(windows * s):
            one()
        ms = (time.perf_counter() - t0) * 1e3 / (windows * s)
    finally:
        engine.close()
        torch.set_num_threads(prev)
    return {"overlap_step": overlap, "update_interval": s, "steps": windows * s,
            "ms_per_step": ms, "host_kernel": engine.resolved.get("host_kernel")}  # fmt: skip


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


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class _torch_threads:
    """Context manager: torch.set_num_threads(n), restored on exit."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        import torch

        self.prev = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.prev)


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
