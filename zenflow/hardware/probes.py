"""Hardware probes: what the machine has (ZENFLOW.md sections 2 and 7).

Parsers of /proc and /sys text (``parse_cpuinfo``, ``parse_meminfo``, ...) are pure; the
probes (``probe_cpu``, ``probe_memory``, ``probe_accelerator``) return frozen dataclasses of
plain numbers. Timed measurements of the training work itself are in ``zenflow.hardware.measure``
and the decisions drawn from both in ``zenflow.hardware.tuning``.

Torch is imported inside the functions that need it, so the parsers stay cheap.
"""

from __future__ import annotations

import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# SIMD features the native CPU Adam (and torch's CPU kernels) can use. "amx" is true when
# any amx_* flag is present (amx_tile, amx_bf16, amx_int8).
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx")


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


PROC_STATUS = Path("/proc/self/status")


def proc_status_bytes(field: str, status: Path = PROC_STATUS) -> int | None:
    """``field`` of /proc/self/status or /proc/meminfo (a "kB" line: VmRSS, VmHWM, VmLck,
    MemAvailable, ...) in bytes; None where unreadable or absent."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_rss_peak(status: Path = PROC_STATUS) -> int:
    """This process's peak resident set since its program started, in bytes, pinned pages
    included: the kernel's high-water mark (``VmHWM``), what ``/usr/bin/time -v`` reports
    as its maximum resident set size. Where there is no /proc, getrusage's ru_maxrss (KiB
    on Linux, bytes on macOS), which also keeps a peak from before the program's exec."""
    peak = proc_status_bytes("VmHWM", status)
    if peak is not None:
        return peak
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(usage) if sys.platform == "darwin" else int(usage) * 1024


def process_rss(status: Path = PROC_STATUS) -> int | None:
    """This process's resident set now, in bytes (``VmRSS``); None without /proc."""
    return proc_status_bytes("VmRSS", status)


def host_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The machine's memory available now (``MemAvailable``), in bytes; None without /proc.
    Read at every step: one file read and a scan that stops at its line (about 19 us here,
    against 53 through ``parse_meminfo``)."""
    return proc_status_bytes("MemAvailable", meminfo)


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
    copy_s = median_seconds(lambda: b.copy_(a), repeats)
    add_s = median_seconds(lambda: torch.add(a, b, out=c), repeats)
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
    kind: str  # "cuda", "sim" or "cpu"
    name: str
    memory_bytes: int | None = None
    free_bytes: int | None = None  # free device memory when probed (torch.cuda.mem_get_info)
    # GB/s of one-way copies host->device (h2d) and device->host (d2h), from pinned and
    # pageable host memory, and both directions at once on two streams (pinned).
    h2d_pinned_gbs: float | None = None
    d2h_pinned_gbs: float | None = None
    h2d_pageable_gbs: float | None = None
    d2h_pageable_gbs: float | None = None
    bidir_pinned_gbs: float | None = None
    # True: the bandwidths are the simulated accelerator's model, not a measurement.
    modelled: bool = False
    latency_us: float | None = None  # per copy (the simulated accelerator's model)


def probe_sim() -> AcceleratorProbe:
    """The simulated accelerator's modelled copy bandwidth and latency (per direction; its
    two copy engines run at once, like a GPU's). Its memory is the host's RAM."""
    from zenflow.engine.accelerator import make_accelerator

    sim = make_accelerator("sim")
    try:
        gbs = sim.bandwidth / 1e9
        return AcceleratorProbe(
            kind="sim",
            name=sim.describe(),
            h2d_pinned_gbs=gbs,
            d2h_pinned_gbs=gbs,
            bidir_pinned_gbs=2 * gbs,
            modelled=True,
            latency_us=sim.latency * 1e6,
        )
    finally:
        sim.close()


def probe_accelerator(
    buffer_mb: int = 256, repeats: int = 5, kind: str | None = None
) -> AcceleratorProbe:
    """The device tune-hw tunes for: ``kind`` "cuda" (device name, memory and measured copy
    bandwidths), "sim" (``probe_sim``) or "cpu" (no accelerator: device = host); None:
    cuda when available, else cpu."""
    import torch

    if kind == "sim":
        return probe_sim()
    if kind == "cpu" or not torch.cuda.is_available():
        return AcceleratorProbe(kind="cpu", name="CPU (no accelerator: device = host)")
    from zenflow.engine.accelerator import CudaAccelerator

    # The copies the engine makes, through its accelerator layer: device buffers, pinned and
    # pageable host buffers, one copy stream per direction, events.
    dev = torch.device("cuda", torch.cuda.current_device())
    accel = CudaAccelerator(dev, pin=True)
    props = torch.cuda.get_device_properties(dev)
    n = buffer_mb * 2**20
    dev_buf = accel.empty((n,), torch.uint8, "probe")
    dev_buf2 = accel.empty((n,), torch.uint8, "probe")
    pinned = accel.host_empty((n,), torch.uint8, pin=True)
    pinned2 = accel.host_empty((n,), torch.uint8, pin=True)
    pageable = accel.host_empty((n,), torch.uint8, pin=False)

    def timed(copies: Callable[[], list]) -> float:
        def run() -> None:
            for ev in copies():
                ev.synchronize()

        run()  # warm-up
        return median_seconds(run, repeats)

    gbs = n / 1e9
    free, _total = torch.cuda.mem_get_info(dev)  # before the probe's own buffers count
    free += 2 * n  # the probe's two device buffers are freed with it
    return AcceleratorProbe(
        kind="cuda",
        name=props.name,
        memory_bytes=int(props.total_memory),
        free_bytes=int(free),
        h2d_pinned_gbs=gbs / timed(lambda: [accel.copy_h2d(dev_buf, pinned)]),
        d2h_pinned_gbs=gbs / timed(lambda: [accel.copy_d2h(pinned, dev_buf)]),
        h2d_pageable_gbs=gbs / timed(lambda: [accel.copy_h2d(dev_buf, pageable)]),
        d2h_pageable_gbs=gbs / timed(lambda: [accel.copy_d2h(pageable, dev_buf)]),
        bidir_pinned_gbs=2
        * gbs
        / timed(lambda: [accel.copy_h2d(dev_buf, pinned), accel.copy_d2h(pinned2, dev_buf2)]),
    )


# --------------------------------------------------------------------------------------
# Timing helper (shared with zenflow.hardware.measure)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
