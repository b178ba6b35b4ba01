"""The ``cpu`` backend: the device IS the host.

Copies are synchronous ``copy_`` calls (still counted: they cost memory bandwidth);
``shared_memory`` tells the engine it may take zero-copy paths. Without overlap the training
thread and the host step take turns on every core. Owns :class:`CpuAccelerator` only: the
shared accounting stays in ``base.py``.
"""

from __future__ import annotations

import torch

from zenflow.engine.accelerator import base
from zenflow.engine.accelerator.base import DONE, Accelerator, _nbytes


class CpuAccelerator(Accelerator):
    """The device is the CPU: same memory, synchronous copies (counted)."""

    kind = "cpu"
    shared_memory = True

    def __init__(self, budget_bytes: int | None = None):
        super().__init__(torch.device("cpu"), budget_bytes=budget_bytes)

    def _copy(self, dst, src, direction: str):
        dst.copy_(src)
        if direction == "d2h":
            self.traffic.d2h_bytes += _nbytes(src)
        else:
            self.traffic.h2d_bytes += _nbytes(src)
        return DONE

    def copy_d2h(self, dst, src, after=None):
        return self._copy(dst, src, "d2h")

    def copy_h2d(self, dst, src, after=None):
        return self._copy(dst, src, "h2d")

    def compute_threads(
        self, reserved_share: float, overlap: bool, ranks_per_node: int = 1
    ) -> tuple[int, int]:
        # Without overlap the training thread and the host step take turns on every core.
        if not overlap:
            n = max(1, base.cores() // max(1, ranks_per_node))
            return min(torch.get_num_threads(), n), n
        return super().compute_threads(reserved_share, overlap, ranks_per_node)

    def describe(self) -> str:
        return "cpu (the device is the CPU itself: device and host share memory)"
