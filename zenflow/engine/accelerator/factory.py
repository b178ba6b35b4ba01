"""Picking a backend by name: ``make_accelerator`` ("cpu", "sim", "cuda"; None = cuda if
present, else cpu) and the list of allowed names.

It only chooses and constructs (a sim profile is calibrated here, in ``profiles.py``); it
must not hold backend behaviour.
"""

from __future__ import annotations

import torch

from zenflow.engine.accelerator.base import Accelerator
from zenflow.engine.accelerator.cpu import CpuAccelerator
from zenflow.engine.accelerator.cuda import CudaAccelerator
from zenflow.engine.accelerator.sim import SIM_BANDWIDTH, SIM_LATENCY_S, SimAccelerator
from zenflow.errors import EngineError

KINDS = ("cpu", "sim", "cuda")


def default_kind() -> str:
    """cuda when a CUDA device is available, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_accelerator(
    kind: str | Accelerator | None = None,
    *,
    device: torch.device | None = None,
    pin_memory: bool = True,
    strict: bool = False,
    budget_bytes: int | None = None,
    bandwidth: float | None = None,
    lag_s: float = 0.0,
    sim_profile: str | None = None,
    compute_threads: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> Accelerator:
    """The accelerator for ``kind`` ("cpu", "sim", "cuda"; None = cuda if present, else cpu).

    An Accelerator instance is returned as is (tests pass doubles). ``sim_profile`` (sim):
    a named GPU box (``zenflow.engine.accelerator.profiles.PROFILES``); the sim core's compute rate
    is measured on ``compute_threads`` in ``compute_dtype`` and the link scaled to match."""
    if isinstance(kind, Accelerator):
        return kind
    kind = kind or default_kind()
    if kind == "cpu":
        return CpuAccelerator(budget_bytes=budget_bytes)
    if kind == "sim":
        latency = SIM_LATENCY_S
        calibration = None
        if sim_profile is not None:
            from zenflow.engine.accelerator.profiles import calibrate

            calibration = calibrate(sim_profile, compute_threads or 1, compute_dtype)
            bandwidth = calibration.bandwidth
            latency = calibration.latency
        return SimAccelerator(
            strict=strict, budget_bytes=budget_bytes, bandwidth=bandwidth or SIM_BANDWIDTH,
            latency=latency, lag_s=lag_s, profile=calibration,
        )  # fmt: skip
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise EngineError(
                "accelerator 'cuda' was asked for but torch sees no CUDA device (torch "
                f"{torch.__version__}). Fix: use --device cpu, or --device sim to rehearse a "
                "GPU box, or install a CUDA build of torch on a machine with an NVIDIA GPU."
            )
        dev = device if device is not None and device.type == "cuda" else torch.device("cuda")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return CudaAccelerator(dev, pin=pin_memory)
    raise EngineError(f"accelerator {kind!r} is not allowed: use one of {', '.join(KINDS)}.")
