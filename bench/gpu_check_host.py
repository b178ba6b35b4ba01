"""gpu-check's host, link and environment parts: one part per process, one JSON result.

    python bench/gpu_check_host.py env|host|link --accel cuda|sim --scale gpu|rehearsal|tiny

- ``env``: whether torch sees a CUDA device (``cuda_available``: what decides a GPU run or a
  rehearsal), the machine (tests/cuda/gpu_report.py's ``environment()``: GPU, driver, torch,
  packages) plus the core split and torch's parallel settings, and ``nvidia-smi topo -m``.
- ``host``: the host memory's bandwidth (read, write, copy; 1 thread, the engine's host
  threads, every core), the accumulate (``zenflow.ops.accumulate_``: ``dst += scale * src``,
  bf16 in, fp32 sum, 10 bytes per element) and the CPU Adam (``zenflow.ops.adamw_step_``
  over an fp32 window sum writing the bf16 image: 30 bytes per element) alone, and both at
  once on two threads of ``host_threads`` OpenMP threads each (what a window end does while
  the next step's pieces arrive).
- ``link`` (cuda only): host->device and device->host bandwidth from pinned memory (and
  pageable, for contrast), both directions at once, timed with CUDA events; and the pinned
  allocator's rounding: ``torch.empty(n, pin_memory=True)`` for n just above powers of two,
  the allocator's ``host_memory_stats`` and the process's locked / pinned pages
  (/proc/self/status VmLck, VmPin) before and after.

Every figure is measured here, by this process; a figure that needs a CUDA device says
"not measured: no CUDA device" instead. The result is printed as one line
``GPU_CHECK_RESULT {json}`` (bench/gpu_check.py reads it; everything else printed goes to
the log). Owns these measurements only: it must not import the engine's internals beyond
``zenflow.ops`` and the accelerator factory, and never writes a file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

NO_CUDA = "not measured: no CUDA device"
# Elements per host buffer, by scale: 64M fp32 (256 MiB) is far beyond any cache; the
# rehearsals use less so that they fit their budget on a small shared CPU box.
HOST_NUMEL = {"gpu": 64 << 20, "rehearsal": 16 << 20, "tiny": 1 << 20}
LINK_BYTES = 256 << 20  # one link buffer: 256 MiB
# Pinned requests just above powers of two (and one exact, for contrast): 1 MiB to 256 MiB.
PIN_SIZES = (1 << 20, (1 << 20) + 4096, (16 << 20) + 4096, (128 << 20) + 4096,
             (256 << 20) + 4096)  # fmt: skip
ACC_BYTES = 10  # accumulate: read src bf16 (2), read and write the fp32 sum (8)
ADAM_BYTES = 30  # Adam: read+write param, m, v fp32 (24), read fp32 grad (4), write bf16 (2)


# The cases' settings (bench/gpu_check_case.py), here without torch so that the estimate the
# check asks for (bench/gpu_check.py) is of the same config. Steps per phase: step 1 is the
# warm-up round, step 2 the first selection; the re-selection is due SELECT_EVERY steps
# after it, at a window end inside the sync phase.
TOPK, INTERVAL = 0.1, 4
PHASES = {"warm": 4, "timed": 8, "sync": 6, "profile": 4}
SELECT_EVERY = PHASES["timed"] + 3


def case_config(mode: str, micro_batch: int, step_store: str | None = None) -> dict:
    """The DeepSpeed-style config of a case of ``mode`` (the zenflow block only for zenflow:
    no early phase, one warm-up round, a re-selection every SELECT_EVERY steps;
    ``step_store``: its ``zfctl.step_store``, else the default)."""
    raw = {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }  # fmt: skip
    if mode == "zenflow":
        raw["zero_optimization"]["zenflow"] = {
            "topk_ratio": TOPK, "update_interval": INTERVAL, "overlap_step": True,
            "select_strategy": "step", "select_interval": SELECT_EVERY,
            "full_warm_up_rounds": 1,
        }  # fmt: skip
        if step_store is not None:
            raw["zfctl"] = {"step_store": step_store}
    return raw


def emit(result: dict) -> None:
    """The part's result, as the one line bench/gpu_check.py reads."""
    print("GPU_CHECK_RESULT " + json.dumps(result, default=str), flush=True)


def best_s(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up call (seconds)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def core_split(accel_kind: str) -> dict:
    """The cores this process may use and the engine's split of them for ZenFlow with
    overlap (the default ``pt_reserved_cores_perc``): training thread vs host work."""
    from zenflow.config.schema import ZenFlowConfig
    from zenflow.engine.accelerator import cores, make_accelerator
    from zenflow.engine.accumulator import CoreShare

    reserved = float(ZenFlowConfig().pt_reserved_cores_perc)
    accel = make_accelerator(accel_kind)
    try:
        training, host = accel.compute_threads(reserved, True)
        share = CoreShare(host, accel.host_yields)
    finally:
        accel.close()
    return {"cores": cores(), "cpu_count": os.cpu_count(), "pt_reserved_cores_perc": reserved,
            "training_threads": training, "host_threads": host,
            # while a window's Adam runs: its threads and the accumulator's (CoreShare)
            "adam_threads": share.adam_threads,
            "accumulate_threads_beside_adam": share.beside_adam,
            # set for a measurement's other arm (accelerator/cuda.py)
            "training_threads_env": os.environ.get("ZENFLOW_CUDA_TRAINING_THREADS")}  # fmt: skip


def parallel_info() -> list[str]:
    """torch's parallel settings (ATen backend, OpenMP / MKL threads, the OpenMP runtime)."""
    try:
        text = torch.__config__.parallel_info()
    except Exception as exc:  # noqa: BLE001 - informational
        return [f"unavailable: {exc}"]
    return [line.strip() for line in text.splitlines() if line.strip()][:16]


def part_env(args) -> dict:
    spec = importlib.util.spec_from_file_location(
        "gpu_report", ROOT / "tests" / "cuda" / "gpu_report.py"
    )
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    env = report.environment()
    env["core_split"] = core_split("cuda" if torch.cuda.is_available() else "sim")
    env["parallel_info"] = parallel_info()
    env["omp_env"] = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP"))}
    try:  # one runtime where the native op shares torch's libgomp (issue 28 item 6)
        from zenflow.ops import loader

        if loader.ops_mode() != "reference":
            loader.load_native()
        env["openmp_runtimes"] = loader.openmp_runtimes()
    except Exception as exc:  # noqa: BLE001 - informational
        env["openmp_runtimes"] = f"unavailable: {exc}"
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                              timeout=20)  # fmt: skip
        env["nvidia_smi_topo"] = topo.stdout.splitlines()[:24] if topo.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        env["nvidia_smi_topo"] = None if torch.cuda.is_available() else NO_CUDA
    return env


# ------------------------------------------------------------------------------- host
def memory_bandwidth(n: int, threads: list[int]) -> dict:
    """GB/s of a read (sum), a write (fill) and a copy over ``n`` fp32, per thread count."""
    x = torch.rand(n)
    y = torch.empty(n)
    out = {}
    before = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            out[f"{t}t"] = {
                "read_gbs": 4 * n / best_s(lambda: x.sum()) / 1e9,
                "write_gbs": 4 * n / best_s(lambda: y.fill_(1.0)) / 1e9,
                "copy_gbs": 8 * n / best_s(lambda: y.copy_(x)) / 1e9,  # read 4 + write 4
            }
    finally:
        torch.set_num_threads(before)
    return out


class HostOps:
    """The engine's two host ops on buffers of ``n`` elements."""

    def __init__(self, n: int):
        from zenflow import ops

        self.ops = ops
        self.n = n
        self.src = torch.randn(n).bfloat16()  # a step's landed pieces (training dtype)
        self.acc = torch.zeros(n)  # the window's fp32 sum
        self.p, self.g = torch.randn(n), torch.randn(n)
        self.m, self.v = torch.zeros(n), torch.zeros(n)
        self.img = torch.empty(n, dtype=torch.bfloat16)
        self.step = 0

    def accumulate(self, threads: int) -> None:
        self.ops.accumulate_(self.acc, self.src, 0.5, num_threads=threads)

    def adam(self, threads: int) -> None:
        self.step += 1
        self.ops.adamw_step_(self.p, self.g, self.m, self.v, step=self.step, lr=1e-4,
                             beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                             param_bf16=self.img, grad_scale=0.25, num_threads=threads)  # fmt: skip


def together(ops: HostOps, acc_threads: int, adam_threads: int, seconds: float) -> dict:
    """The accumulate and the Adam at once, each in its own thread on its OpenMP threads
    (the engine's split while a window's Adam runs), for ``seconds``: each one's GB/s while
    the other runs."""
    done = {}
    start = threading.Barrier(2)

    def loop(name, fn, nbytes, threads):
        start.wait()
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn(threads)
            k += 1
        done[name] = {"gbs": nbytes * ops.n * k / (time.perf_counter() - t0) / 1e9, "calls": k,
                      "threads": threads}  # fmt: skip

    workers = [
        threading.Thread(target=loop, args=("accumulate", ops.accumulate, ACC_BYTES, acc_threads)),
        threading.Thread(target=loop, args=("adam", ops.adam, ADAM_BYTES, adam_threads)),
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return done


def part_host(args) -> dict:
    from zenflow import ops as zops

    split = core_split(args.accel)
    n = HOST_NUMEL[args.scale]
    threads = sorted({1, split["host_threads"], split["cores"]})
    out = {"numel": n, "core_split": split, "threads_measured": threads,
           "parallel_info": parallel_info(),
           "bytes_per_element": {"accumulate": ACC_BYTES, "adam": ADAM_BYTES}}  # fmt: skip
    print(f"host: {n:,} elements, threads {threads}, split {split}", flush=True)
    emit(out)  # each stage's result as it comes: a budget cut keeps what was measured
    out["memory_gbs"] = memory_bandwidth(n, threads)
    print(f"host: memory {json.dumps(out['memory_gbs'])}", flush=True)
    emit(out)
    hops = HostOps(n)
    alone = {}
    for t in threads:
        alone[f"{t}t"] = {
            "accumulate_gbs": ACC_BYTES * n / best_s(lambda t=t: hops.accumulate(t)) / 1e9,
            "adam_gbs": ADAM_BYTES * n / best_s(lambda t=t: hops.adam(t)) / 1e9,
        }
    out["alone"] = alone
    print(f"host: alone {json.dumps(alone)}", flush=True)
    emit(out)
    h = split["host_threads"]
    secs = 2.0 if args.scale == "gpu" else 1.0
    acc_t, adam_t = split["accumulate_threads_beside_adam"], split["adam_threads"]
    out["together"] = {"seconds": secs, **together(hops, acc_t, adam_t, secs)}
    print(f"host: together {json.dumps(out['together'])}", flush=True)
    # what a window end costs per element on this host, both ops at once at the engine's
    # split: the accumulate every step, the Adam once per window of S steps
    acc_gbs = out["together"]["accumulate"]["gbs"]
    adam_gbs = out["together"]["adam"]["gbs"]
    out["kernel"] = zops.native_status()  # after the ops ran: built (or why not)
    out["ns_per_element"] = {
        "accumulate_together": ACC_BYTES / acc_gbs if acc_gbs else None,
        "adam_together": ADAM_BYTES / adam_gbs if adam_gbs else None,
        "accumulate_alone": ACC_BYTES / alone[f"{h}t"]["accumulate_gbs"],
        "adam_alone": ADAM_BYTES / alone[f"{h}t"]["adam_gbs"],
    }
    return out


# ------------------------------------------------------------------------------- link
def _pinned_allocated() -> int | None:
    """Bytes the CUDA host (pinned) allocator holds, blocks as allocated (rounded)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    try:
        s = stats()
    except Exception:  # noqa: BLE001 - older torch: not available
        return None
    for key in sorted(s):  # "allocated_bytes.current" (names moved between versions)
        if "allocated_bytes" in key and key.endswith("current"):
            return int(s[key])
    return None


def link_bandwidth(nbytes: int, repeats: int = 5) -> dict:
    """GB/s of one copy of ``nbytes``, by direction and host memory kind (CUDA events)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned.fill_(1)
    pageable.fill_(1)

    def timed(dst, src):
        times = []
        for _ in range(repeats + 1):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        times = sorted(times[1:])
        return {
            "gbs_best": nbytes / times[0] / 1e9,
            "gbs_median": nbytes / times[len(times) // 2] / 1e9,
        }

    out = {"bytes": nbytes,
           "h2d_pinned": timed(dev, pinned), "d2h_pinned": timed(pinned, dev),
           "h2d_pageable": timed(dev, pageable), "d2h_pageable": timed(pageable, dev)}  # fmt: skip
    # both directions at once, each on its own stream (the engine's two copy streams)
    dev2 = torch.empty_like(dev)
    pinned2 = torch.empty_like(pinned)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        with torch.cuda.stream(s1):
            dev.copy_(pinned, non_blocking=True)
        with torch.cuda.stream(s2):
            pinned2.copy_(dev2, non_blocking=True)
    torch.cuda.synchronize()
    out["bidirectional_pinned_gbs"] = 2 * repeats * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def pinned_rounding() -> dict:
    """What the pinned allocator takes for each request (blocks kept until all are made)."""
    from zenflow.hardware.probes import proc_status_bytes

    rows, keep = [], []
    for size in PIN_SIZES:
        a0, lck0, pin0 = _pinned_allocated(), proc_status_bytes("VmLck"), proc_status_bytes("VmPin")
        t0 = time.perf_counter()
        keep.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
        dt = time.perf_counter() - t0
        a1, lck1, pin1 = _pinned_allocated(), proc_status_bytes("VmLck"), proc_status_bytes("VmPin")
        row = {"requested": size, "alloc_ms": dt * 1e3}
        if a0 is not None and a1 is not None:
            row["allocator_bytes"] = a1 - a0
            row["ratio"] = (a1 - a0) / size
        if lck0 is not None and lck1 is not None:
            row["vmlck_bytes"] = lck1 - lck0
        if pin0 is not None and pin1 is not None:
            row["vmpin_bytes"] = pin1 - pin0
        rows.append(row)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    return {"requests": rows, "worst_ratio": max(ratios) if ratios else None,
            "source": "torch.cuda.host_memory_stats" if ratios else
            "host_memory_stats unavailable: see vmlck_bytes / vmpin_bytes",
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
            or os.environ.get("PYTORCH_ALLOC_CONF")}  # fmt: skip


def part_link(args) -> dict:
    if args.accel != "cuda" or not torch.cuda.is_available():
        from zenflow.engine.accelerator import make_accelerator

        sim = make_accelerator("sim")
        model = {"bandwidth_gbs": sim.bandwidth / 1e9, "latency_us": sim.latency * 1e6}
        sim.close()
        return {"h2d_pinned": NO_CUDA, "d2h_pinned": NO_CUDA, "h2d_pageable": NO_CUDA,
                "d2h_pageable": NO_CUDA, "bidirectional_pinned_gbs": NO_CUDA,
                "pinned_rounding": NO_CUDA,
                "sim_link_model": {**model, "note": "the sim's modelled link (a setting, not "
                                   "a measurement)"}}  # fmt: skip
    out = link_bandwidth(LINK_BYTES)
    print(f"link: {json.dumps(out)}", flush=True)
    emit(out)
    out["pinned_rounding"] = pinned_rounding()
    print(f"link: pinned {json.dumps(out['pinned_rounding'])}", flush=True)
    return out


PARTS = {"env": part_env, "host": part_host, "link": part_link}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--accel", choices=["cuda", "sim"], default="cuda")
    ap.add_argument("--scale", choices=sorted(HOST_NUMEL), default="gpu")
    args = ap.parse_args(argv)
    emit(PARTS[args.part](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
