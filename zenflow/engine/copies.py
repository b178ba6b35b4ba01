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


@dataclass(frozen=True)
class Piece:
    """A block of one weight's non-selected columns, moved as one copy.

    A weight whose columns are its last dim (nn.Linear [out, in], an embedding) is cut by
    ROWS: rows ``lo:hi`` with all their non-selected columns, so each piece reads and writes
    whole contiguous rows once. A weight whose columns are dim 0 (Conv1D [in, out]: each
    column is a contiguous row of storage) is cut by non-selected positions ``lo:hi``.
    """

    lo: int
    hi: int
    by_rows: bool
    shape: tuple[int, ...]  # the gathered piece's shape

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def select(self, t: torch.Tensor, nonsel: torch.Tensor):
        """(view of ``t``, dim, index): ``view.index_select(dim, index)`` is this piece of a
        full-shape tensor ``t`` (gradient, weight, master, window sum); ``index_add_`` /
        ``index_copy_`` on the view write it back in place."""
        if self.by_rows:
            return t[self.lo : self.hi], 1, nonsel
        return t, 0, nonsel[self.lo : self.hi]


def plan_pieces(shape: tuple[int, ...], cd: int, n_nonsel: int, bucket_elems: int) -> list[Piece]:
    """Cut a 2-D weight's ``n_nonsel`` non-selected columns (along ``cd``) into pieces of at
    most ``bucket_elems`` elements (at least one row, or one column, per piece)."""
    if n_nonsel == 0:
        return []
    if cd == len(shape) - 1:  # columns are the last dim: cut by rows
        rows = shape[0]
        per = max(1, bucket_elems // n_nonsel)
        return [Piece(lo, min(rows, lo + per), True, (min(rows, lo + per) - lo, n_nonsel))
                for lo in range(0, rows, per)]  # fmt: skip
    other = shape[1]
    per = max(1, bucket_elems // other)
    return [Piece(lo, min(n_nonsel, lo + per), False, (min(n_nonsel, lo + per) - lo, other))
            for lo in range(0, n_nonsel, per)]  # fmt: skip


BUCKET_SHARE = 32  # two buckets hold at most 2/32 of the offloaded elements (~6%)


def bucket_elems_for(numels: list[int], units: list[int], requested: int | None) -> int:
    """Elements per copy bucket: the requested size (``reduce_bucket_size``, default 4M),
    capped at 1/32 of the offloaded elements so small models keep their device copy buffers
    small (two bf16 buckets: at most 0.125 device bytes per parameter), and never below the
    largest ``unit`` (the longest row or column: a piece holds at least one)."""
    total = sum(numels)
    want = min(requested or DEFAULT_BUCKET_ELEMS, max(1, total // BUCKET_SHARE), max(numels))
    return max(want, max(units, default=1), 1)


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
    """Pinned host buffers for device->host pieces: one per piece of a step, so the training
    thread never waits for the accumulator within a step (the host sums a step's pieces
    while the device runs the next forward/backward; it waits only when the host falls a
    whole step behind, for that piece). The accumulator gives each buffer back after adding
    it. Host bytes: one step's non-selected gradient in the training dtype."""

    def __init__(self, accel: Accelerator, dtype: torch.dtype, pin: bool, shapes: dict):
        self._buf = {key: accel.host_empty(shape, dtype, pin) for key, shape in shapes.items()}
        self._free = {key: threading.Event() for key in shapes}
        for ev in self._free.values():
            ev.set()

    def take(self, key) -> torch.Tensor:
        """The buffer of piece ``key``, once the accumulator is done with its last use."""
        self._free[key].wait()
        self._free[key].clear()
        return self._buf[key]

    def give(self, key) -> None:
        self._free[key].set()
