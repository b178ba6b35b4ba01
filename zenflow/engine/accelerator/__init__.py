"""The accelerator layer: every device-specific thing the engine does goes through here.

Three backends with one interface (``base.Accelerator``: streams, events, asynchronous
copies, pinned host memory, device- and host-memory accounting, the core split, phase timing
and the count of synchronisations; ZENFLOW.md sections 2b-2c):

- ``cuda`` (``cuda.py``): torch.cuda, two copy streams ordered by events, pinned buffers.
- ``cpu`` (``cpu.py``): the device IS the host; synchronous, counted copies.
- ``sim`` (``sim.py``, ``sim_guards.py``, ``profiles.py``): a separate device simulated on
  the CPU, with copy-engine threads, strict-mode guards, lag and named GPU boxes.

``factory.make_accelerator`` picks one by name. The engine never calls torch.cuda,
``pin_memory`` or ``non_blocking`` itself. This file only re-exports the public names.
"""

from zenflow.engine.accelerator.base import (
    DONE,
    OOM_FIX,
    Accelerator,
    DeviceOutOfMemory,
    DoneEvent,
    SyncCounts,
    Traffic,
    cores,
)
from zenflow.engine.accelerator.cpu import CpuAccelerator
from zenflow.engine.accelerator.cuda import CudaAccelerator, CudaEvent, device_synchronize
from zenflow.engine.accelerator.factory import KINDS, default_kind, make_accelerator
from zenflow.engine.accelerator.sim import SIM_BANDWIDTH, SIM_LATENCY_S, SimAccelerator, SimEvent
from zenflow.engine.accelerator.sim_guards import SourceChanged, checksum, poison_

__all__ = [
    "DONE",
    "KINDS",
    "OOM_FIX",
    "SIM_BANDWIDTH",
    "SIM_LATENCY_S",
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "CudaEvent",
    "DeviceOutOfMemory",
    "DoneEvent",
    "SimAccelerator",
    "SimEvent",
    "SourceChanged",
    "SyncCounts",
    "Traffic",
    "checksum",
    "cores",
    "default_kind",
    "device_synchronize",
    "make_accelerator",
    "poison_",
]
