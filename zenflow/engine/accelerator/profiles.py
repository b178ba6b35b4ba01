"""Named GPU boxes for ``sim``: scale the simulated link so that compute:link matches one.

The simulated device computes on a CPU core, thousands of times slower than a GPU, while
its modelled link (25 GB/s) is a real PCIe figure: copies look nearly free next to compute,
and a pipeline that would stall on a GPU box does not stall on sim (issue 15, S4). A
profile fixes that with time dilation: it measures the sim core's matrix-multiply rate in
the training dtype on the training thread's cores, divides by the named GPU's, and scales
the link's bandwidth by that factor (and stretches the per-copy latency by its inverse), so
that one step's compute and one step's copies take the same share of a step as on the box.

What a profile does not model: the sim device's memory bandwidth (elementwise device work,
such as gathers and the device AdamW, costs relatively more on a CPU core than on HBM, by
the ratio printed as ``elementwise``), and the host (its cores and memory run at this
machine's speed, not the box's). Each result prints the profile and the scaling.

Owns the named boxes and the calibration (measured once per process and setting); the sim
backend (``sim.py``) only reads the calibrated bandwidth and latency. It must not construct
an accelerator or touch the copy engines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from zenflow.errors import EngineError


@dataclass(frozen=True)
class SimProfile:
    """A GPU box: its dense matrix-multiply rate and its host link, per direction."""

    name: str
    title: str
    matmul_flops: float  # dense bf16 matmul, achieved on a large product (FLOP/s)
    link_bytes: float  # host<->device, pinned, per direction (bytes/s)
    hbm_bytes: float  # device memory bandwidth (bytes/s), for the elementwise ratio
    # per copy, on the copy engine: the gap between back-to-back asynchronous copies queued
    # on one stream (~1-2 us of DMA set-up; the ~5 us launch is paid by the issuing host
    # thread, beside the previous copy, not by the copy engine)
    latency_s: float = 2e-6
    # dense bf16 peak from the datasheet (FLOP/s): `zfctl estimate --gpu` predicts a step's
    # compute at a stated share of it (zenflow.hardware.predict); 0: matmul_flops
    peak_flops: float = 0.0


# Figures: H100 SXM 80GB, 798 TFLOP/s measured on an 8192^3 bf16 product on a lent H100 of
# this project's workplace (device tool notes, 2026-11-13), 3.35 TB/s HBM3; PCIe 5.0 x16
# is 64 GB/s raw per direction, ~50 GB/s for large pinned copies. A100 80GB PCIe: 312
# TFLOP/s peak bf16, ~280 achieved, 1.9 TB/s; PCIe 4.0 x16 ~25 GB/s. RTX 4090: 165 TFLOP/s
# dense bf16 (fp32 accumulate), ~150 achieved, 1.0 TB/s; PCIe 4.0 x16 ~25 GB/s.
# Datasheet dense bf16 peaks (no sparsity): H100 SXM5 989, A100 (40 and 80 GB) 312, L40S
# 362, RTX 4090 165 TFLOP/s; achieved matmul rates for the boxes not measured here are ~90%
# of peak. HBM: A100 40GB 1.56, 80GB 2.0, L40S 0.86 TB/s. h100-sxm names the box
# h100-pcie5 was measured on (an SXM5 part; its host link is PCIe 5.0 x16 either way).
PROFILES: dict[str, SimProfile] = {
    p.name: p
    for p in (
        SimProfile("h100-pcie5", "NVIDIA H100 on PCIe 5.0 x16", 798e12, 50e9, 3.35e12,
                   peak_flops=989e12),
        SimProfile("h100-sxm", "NVIDIA H100 SXM5 80GB, host link PCIe 5.0 x16", 798e12, 50e9,
                   3.35e12, peak_flops=989e12),
        SimProfile("a100-pcie4", "NVIDIA A100 80GB on PCIe 4.0 x16", 280e12, 25e9, 1.9e12,
                   peak_flops=312e12),
        SimProfile("a100-40g", "NVIDIA A100 40GB, PCIe 4.0 x16", 280e12, 25e9, 1.56e12,
                   peak_flops=312e12),
        SimProfile("a100-80g", "NVIDIA A100 80GB, PCIe 4.0 x16", 280e12, 25e9, 2.0e12,
                   peak_flops=312e12),
        SimProfile("l40s", "NVIDIA L40S 48GB, PCIe 4.0 x16", 325e12, 25e9, 0.86e12,
                   peak_flops=362e12),
        SimProfile("rtx4090", "NVIDIA RTX 4090 on PCIe 4.0 x16", 150e12, 25e9, 1.0e12,
                   peak_flops=165e12),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """A profile applied to this machine: the measured sim rates and the scaled link."""

    profile: SimProfile
    sim_matmul_flops: float
    sim_copy_bytes: float
    threads: int
    dtype: str

    @property
    def scale(self) -> float:
        """Sim compute over the box's: the time dilation factor (< 1)."""
        return self.sim_matmul_flops / self.profile.matmul_flops

    @property
    def bandwidth(self) -> float:
        return self.profile.link_bytes * self.scale

    @property
    def latency(self) -> float:
        return self.profile.latency_s / self.scale

    @property
    def elementwise(self) -> float:
        """How much dearer elementwise device work is on sim than on the box, relative to
        matrix multiplies (1 would be faithful)."""
        sim_ratio = self.sim_matmul_flops / self.sim_copy_bytes
        box_ratio = self.profile.matmul_flops / self.profile.hbm_bytes
        return box_ratio / sim_ratio

    def describe(self) -> str:
        return (
            f"{self.profile.name} ({self.profile.title}: {self.profile.matmul_flops / 1e12:g} "
            f"TFLOP/s, link {self.profile.link_bytes / 1e9:g} GB/s); sim core "
            f"{self.sim_matmul_flops / 1e9:.1f} GFLOP/s {self.dtype} on {self.threads} "
            f"thread(s) = {self.scale:.3g}x the box, so the link runs at "
            f"{self.bandwidth / 1e6:.3g} MB/s with {self.latency * 1e3:.3g} ms per copy; "
            f"elementwise device work is {self.elementwise:.1f}x dearer than on the box"
        )

    def to_dict(self) -> dict:
        return {
            "profile": self.profile.name,
            "title": self.profile.title,
            "box_matmul_tflops": self.profile.matmul_flops / 1e12,
            "box_link_gbs": self.profile.link_bytes / 1e9,
            "sim_matmul_gflops": self.sim_matmul_flops / 1e9,
            "sim_copy_gbs": self.sim_copy_bytes / 1e9,
            "threads": self.threads,
            "dtype": self.dtype,
            "scale": self.scale,
            "sim_link_mbs": self.bandwidth / 1e6,
            "sim_latency_ms": self.latency * 1e3,
            "elementwise_penalty": self.elementwise,
        }


def profile(name: str) -> SimProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise EngineError(
            f"sim profile {name!r} is not known: use one of {', '.join(PROFILES)}."
        ) from None


def _best_rate(fn, work: float, repeats: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return work / best


def measure_matmul_flops(threads: int, dtype: torch.dtype, n: int = 1024) -> float:
    """The sim core's dense matrix-multiply rate (FLOP/s) on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        return _best_rate(lambda: a @ b, 2.0 * n**3)
    finally:
        torch.set_num_threads(before)


def measure_copy_bytes(threads: int, numel: int = 1 << 23) -> float:
    """The sim core's memory bandwidth for a large fp32 copy (bytes read and written/s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        src = torch.randn(numel)
        dst = torch.empty_like(src)
        return _best_rate(lambda: dst.copy_(src), 8.0 * numel)
    finally:
        torch.set_num_threads(before)


_CACHE: dict[tuple, Calibration] = {}


def calibrate(name: str, threads: int, dtype: torch.dtype = torch.float32) -> Calibration:
    """Measure this machine's sim core (once per process and setting) against ``name``."""
    box = profile(name)
    key = (name, threads, dtype)
    if key not in _CACHE:
        _CACHE[key] = Calibration(
            box, measure_matmul_flops(threads, dtype), measure_copy_bytes(threads), threads,
            str(dtype).replace("torch.", ""),
        )  # fmt: skip
    return _CACHE[key]
