"""The bucketed copy pipeline between the device and the host (separate-memory devices).

Non-selected gradient columns leave the device in *pieces*: a piece is a run of a weight's
non-selected columns (positions ``c0:c1`` of its sorted non-selected index list) small
enough that ``rows * (c1 - c0) <= bucket_elems``. Each piece is gathered on the device into
one of two device buckets (training dtype), copied to a pinned host staging buffer by the
copy engine, and handed to the host accumulator; updated columns come back the same way in
reverse (a host image piece -> a device bucket -> scattered into the weight by index).

Device memory for copies is therefore ``2 * bucket_elems`` elements of the training dtype,
whatever the model size (ZENFLOW.md 2b: staging "small, per bucket"). Two buckets let the
gather of piece i+1 overlap the copy of piece i; a bucket is reused only after its last copy
completed (d2h) or its last scatter ran (h2d): the event rules of ``zenflow.engine.
accelerator``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from zenflow.engine.accelerator import DONE, Accelerator

DEFAULT_BUCKET_ELEMS = 1 << 22  # 4M elements: 8 MiB of bf16 per device bucket
HOST_STAGING_BUFFERS = 4  # pinned d2h staging buffers in flight to the accumulator


@dataclass(frozen=True)
class Piece:
    """Non-selected positions ``c0:c1`` of one weight (columns along ``cd``)."""

    c0: int
    c1: int
    shape: tuple[int, ...]  # the gathered piece's shape: the weight's with c1-c0 columns

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def plan_pieces(shape: tuple[int, ...], cd: int, n_nonsel: int, bucket_elems: int) -> list[Piece]:
    """Split ``n_nonsel`` non-selected columns of a weight of ``shape`` into pieces of at
    most ``bucket_elems`` elements (at least one column per piece)."""
    rows = 1
    for i, s in enumerate(shape):
        if i != cd:
            rows *= s
    per = max(1, bucket_elems // max(1, rows))
    out = []
    for c0 in range(0, n_nonsel, per):
        c1 = min(n_nonsel, c0 + per)
        s = list(shape)
        s[cd] = c1 - c0
        out.append(Piece(c0, c1, tuple(s)))
    return out


BUCKET_SHARE = 64  # two buckets hold at most 2/64 of the offloaded elements (~3%)


def bucket_elems_for(numels: list[int], rows: list[int], requested: int | None) -> int:
    """Elements per copy bucket: the requested size (``reduce_bucket_size``, default 4M),
    capped at 1/64 of the offloaded elements so small models keep their device copy buffers
    small (the device-bytes goal counts them), and never below one column of the tallest
    weight (a piece holds at least one column)."""
    total = sum(numels)
    want = min(requested or DEFAULT_BUCKET_ELEMS, max(1, total // BUCKET_SHARE), max(numels))
    return max(want, max(rows, default=1), 1)


class DeviceBuckets:
    """Two device buffers of ``elems`` elements (training dtype) and each one's last event."""

    def __init__(self, accel: Accelerator, elems: int, dtype: torch.dtype):
        self.accel = accel
        self._flat = [accel.empty((elems,), dtype, "staging") for _ in range(2)]
        self._busy = [DONE, DONE]
        self._next = 0

    def take(self, shape) -> tuple[int, torch.Tensor]:
        """The next bucket viewed as ``shape``, after its previous use completed (device
        side: the gather/H2D that reuses it waits for that event)."""
        i = self._next
        self._next = 1 - i
        self.accel.compute_wait(self._busy[i])
        n = 1
        for s in shape:
            n *= s
        return i, self._flat[i][:n].view(shape)

    def mark(self, i: int, event) -> None:
        self._busy[i] = event

    def drain(self) -> None:
        for ev in self._busy:
            ev.synchronize()
        self._busy = [DONE, DONE]


class HostStaging:
    """A small pool of pinned host buffers for device->host pieces.

    The training thread takes a buffer for each piece (blocking while all are with the
    accumulator: counted as stall by the caller), the accumulator gives it back after adding
    it into the fp32 sum.
    """

    def __init__(self, accel: Accelerator, elems: int, dtype: torch.dtype, pin: bool, n: int):
        self._free = [accel.host_empty((elems,), dtype, pin) for _ in range(n)]
        self._cv = threading.Condition()

    def take(self, shape) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        with self._cv:
            while not self._free:
                self._cv.wait()
            buf = self._free.pop()
        return buf[:n].view(shape)

    def give(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        with self._cv:
            self._free.append(base)
            self._cv.notify()
