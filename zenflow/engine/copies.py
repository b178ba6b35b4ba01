"""The bucketed copy pipeline between the device and the host (separate-memory devices).

Non-selected gradient columns leave the device in *pieces*. A weight's non-selected
columns, gathered along its column axis, form its *compact* block
(``W.index_select(column_dim, nonsel)``: ``[rows, n]`` for an nn.Linear, ``[n, other]`` for
a Conv1D or an embedding); a piece is a run of the compact block's rows, so pieces are
contiguous, in order, in the compact layout (``Piece.offset``). Each piece is gathered on
the device into a device bucket (training dtype), copied to a pinned host staging buffer
on the copy engine, and handed to the host accumulator, which adds it into the window's
fp32 sum, kept in the same compact layout (a contiguous multiply-add: ``zenflow.ops.
accumulate_``). Updated columns come back the same way in reverse: the host step writes
the compact bf16 image of the updated columns, piece by piece it goes to a device bucket
and is scattered into the weight by index.

A *whole* gradient (warm-up steps, the first selection, the offload engine) goes to the
host without a gather: its flat storage is cut into contiguous chunks of at most a bucket
(``plan_chunks``), each copied into a bucket and from there to the host, so the gradient
can be freed at once and the device never holds more than the buckets in flight.

Device memory for copies is ``buckets * bucket_elems`` elements of the training dtype,
whatever the model size (ZENFLOW.md 2b: staging "small, per bucket"). Several buckets let
the gather of piece i+1 overlap the copy of piece i; a bucket is reused only after its last
copy completed (d2h) or its last scatter ran (h2d): the event rules of ``zenflow.engine.
accelerator``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from zenflow.engine.accelerator import DONE, Accelerator

DEFAULT_BUCKET_ELEMS = 1 << 22  # 4M elements: 8 MiB of bf16 per device bucket (offload)
# ZenFlow's pieces: 48M elements, 96 MiB of bf16, a copy long enough for PCIe (4 ms at
# 25 GB/s) and short against a large layer's backward. Each piece costs the training
# thread the same Python and launches whatever its size (bench/piece_cost.py), so a 7B
# model's step makes 230 pieces (432 in 16M, 1,530 in 4M): each of its layer weights,
# the MLP's 40M non-selected elements too, goes in one. Models under about 3B parameters
# change little (a bucket is at most 1/64 of the offloaded elements: llama-1b's 19M).
PIECE_ELEMS = 48 << 20
DEVICE_BUCKETS = 2  # one copying while the next fills; data parallel keeps more in flight
DP_DEVICE_BUCKETS = 4


AUTO_IN_FLIGHT_SHARE = 32  # "auto": up to 1/32 of the offloaded elements waiting for the link
AUTO_MAX_BUCKETS = 16
AUTO_MAX_IN_FLIGHT = 1 << 26  # ... and at most 64M elements (128 MiB of bf16) in all


def bucket_count(requested, data_parallel: bool, offloaded: int = 0, elems: int = 1) -> int:
    """Device copy buckets for ``zfctl.copy_buckets`` (an int, or "auto"), never fewer than
    the least (2; 4 with data parallelism, whose reductions keep buckets in flight too).

    "auto": room for 1/32 of the ``offloaded`` elements in buckets of ``elems``, at most 16
    buckets and 64M elements. A bucket is 1/64 of the offloaded elements up to its cap
    (``bucket_elems_for``), so a small model keeps the least (1/32 of its elements in 2
    buckets), and a large one, whose buckets are capped, gets up to 64M elements (128 MiB in
    bf16, 0.02 bytes per parameter at 7B: 16 of offload's 4M chunks) to absorb the burst of
    a layer's gradients while the link catches up, or the least where that is more
    (ZenFlow's 48M pieces: two, 192 MiB in bf16, 0.03 bytes per parameter at 7B)."""
    least = DP_DEVICE_BUCKETS if data_parallel else DEVICE_BUCKETS
    if requested not in (None, "auto"):
        return max(least, int(requested))
    want = offloaded // (AUTO_IN_FLIGHT_SHARE * max(1, elems))
    return max(least, min(AUTO_MAX_BUCKETS, AUTO_MAX_IN_FLIGHT // max(1, elems), want))


@dataclass(frozen=True)
class Piece:
    """Rows ``lo:hi`` of a weight's compact block of non-selected columns, moved as one copy.

    Columns along the last dim (nn.Linear [out, in], columns = in): compact ``[out, n]``,
    the piece is weight rows ``lo:hi`` with all their non-selected columns. Columns along
    dim 0 (Conv1D [in, out], an embedding [tokens, dim]): compact ``[n, other]``, the piece
    is non-selected positions ``lo:hi`` (each a contiguous row of storage).
    """

    lo: int
    hi: int
    by_rows: bool
    shape: tuple[int, ...]  # the gathered piece's shape
    offset: int = 0  # first element in the compact layout

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def select(self, t: torch.Tensor, nonsel: torch.Tensor):
        """(view of ``t``, dim, index): ``view.index_select(dim, index)`` is this piece of a
        full-shape tensor ``t`` (gradient, weight, master); ``index_copy_`` on the view
        writes it back in place."""
        if self.by_rows:  # a piece of every row is the tensor itself: no view to make
            whole = self.lo == 0 and self.hi == t.shape[0]
            return (t if whole else t[self.lo : self.hi]), 1, nonsel
        whole = self.lo == 0 and self.hi == nonsel.shape[0]
        return t, 0, (nonsel if whole else nonsel[self.lo : self.hi])

    def of(self, compact_flat: torch.Tensor) -> torch.Tensor:
        """This piece's view of a flat buffer in the compact layout (window sum, image)."""
        return compact_flat[self.offset : self.offset + self.numel].view(self.shape)


def plan_pieces(shape: tuple[int, ...], cd: int, n_nonsel: int, bucket_elems: int) -> list[Piece]:
    """Cut a 2-D weight's ``n_nonsel`` non-selected columns (along ``cd``) into pieces of at
    most ``bucket_elems`` elements (at least one row, or one column, per piece)."""
    if n_nonsel == 0:
        return []
    if cd == len(shape) - 1:  # columns are the last dim: cut by rows
        rows = shape[0]
        per = max(1, bucket_elems // n_nonsel)
        return [
            Piece(lo, min(rows, lo + per), True, (min(rows, lo + per) - lo, n_nonsel),
                  lo * n_nonsel)
            for lo in range(0, rows, per)
        ]  # fmt: skip
    other = shape[1]
    per = max(1, bucket_elems // other)
    return [
        Piece(lo, min(n_nonsel, lo + per), False, (min(n_nonsel, lo + per) - lo, other),
              lo * other)
        for lo in range(0, n_nonsel, per)
    ]  # fmt: skip


def plan_chunks(numel: int, bucket_elems: int) -> list[tuple[int, int]]:
    """Contiguous (start, end) chunks of a flat tensor of ``numel`` elements, each at most
    ``bucket_elems`` (a whole gradient copied straight from its storage)."""
    step = max(1, bucket_elems)
    return [(s, min(numel, s + step)) for s in range(0, numel, step)]


BUCKET_SHARE = 64  # each bucket holds at most 1/64 of the offloaded elements


def bucket_elems_for(numels: list[int], units: list[int], requested: int | None) -> int:
    """Elements per copy bucket (a ZenFlow piece at most): the requested size (the engine's
    ``bucket_request``, default ``PIECE_ELEMS``, 48M), capped at 1/64 of the offloaded
    elements so small models keep their device copy buffers small (two bf16 buckets: at
    most 1/16 device byte per parameter), and never below the largest ``unit`` (the longest
    row or column: a piece holds at least one)."""
    total = sum(numels)
    want = min(requested or PIECE_ELEMS, max(1, total // BUCKET_SHARE), max(numels))
    return max(want, max(units, default=1), 1)


def chunk_bucket_elems(total: int, largest: int, requested: int | None = None) -> int:
    """Elements per bucket when buckets carry whole gradients in flat chunks (the offload
    engine): the same cap as ``bucket_elems_for`` (1/64 of the elements, at most the
    largest gradient), with no row to keep whole."""
    return max(1, min(requested or DEFAULT_BUCKET_ELEMS, max(1, total // BUCKET_SHARE),
                      max(1, largest)))  # fmt: skip


BUCKET_VIEWS = 256  # views of the device buckets kept for reuse (a few per weight shape)


class DeviceBuckets:
    """``count`` device buffers of ``elems`` elements (training dtype) and each one's last
    event, used round robin."""

    def __init__(self, accel: Accelerator, elems: int, dtype: torch.dtype, count: int = 2):
        self.accel = accel
        self.elems = elems
        self._flat = [accel.empty((elems,), dtype, "staging") for _ in range(count)]
        self._busy = [DONE] * count
        self._next = 0
        # (index, shape, dtype) -> the bucket's view: a weight's pieces share a few shapes,
        # so a step slices nothing (bounded: cleared when a model has very many shapes)
        self._views: dict[tuple, torch.Tensor] = {}

    def take(self, shape, dtype: torch.dtype | None = None) -> tuple[int, torch.Tensor]:
        """The next bucket viewed as ``shape``, after its previous use completed (device
        side: the gather/H2D that reuses it waits for that event); ``dtype``: its bytes
        viewed as a dtype no wider than the buckets' (a bf16 piece in an fp32 bucket)."""
        i = self._next
        self._next = (i + 1) % len(self._flat)
        self.accel.compute_wait(self._busy[i])
        key = (i, tuple(shape), dtype)
        view = self._views.get(key)
        if view is None:
            n = 1
            for s in shape:
                n *= s
            flat = self._flat[i]
            if dtype is not None and dtype != flat.dtype:
                flat = flat.view(dtype)
            if len(self._views) >= BUCKET_VIEWS:
                self._views.clear()
            view = self._views[key] = flat[:n].view(shape)
        return i, view

    def mark(self, i: int, event) -> None:
        self._busy[i] = event

    def drain(self) -> None:
        for ev in self._busy:
            ev.synchronize()
        self._busy = [DONE] * len(self._flat)


RING_SLOTS = 4  # the link's staging ring: at least 4 bucket-sized slots


class StagingRing:
    """The pinned staging of the device->host link: ``slots`` bucket-sized buffers (one
    pinned allocation, made on first use), taken in order and given back by the
    accumulator once it has moved or added the piece (``accumulator``). The training thread
    waits only when the ring is full (the wait is the transport's, counted as stall). Host
    bytes: ``slots * elems`` of the link's dtype, whatever the model size."""

    def __init__(self, accel: Accelerator, dtype: torch.dtype, slots: int, elems: int,
                 pin: bool):  # fmt: skip
        self.accel = accel
        self.dtype = dtype
        self.slots = slots
        self.elems = elems
        self.pin = pin
        self._flat: torch.Tensor | None = None
        self._free = [threading.Event() for _ in range(slots)]
        for ev in self._free:
            ev.set()
        self._next = 0

    def take(self, shape) -> tuple[int, torch.Tensor]:
        """The next slot viewed as ``shape``, once the accumulator gave it back."""
        if self._flat is None:
            self._flat = self.accel.host_empty((self.slots * self.elems,), self.dtype,
                                               self.pin, "link")  # fmt: skip
        i = self._next
        self._next = (i + 1) % self.slots
        self._free[i].wait()
        self._free[i].clear()
        n = 1
        for s in shape:
            n *= s
        lo = i * self.elems
        return i, self._flat[lo : lo + n].view(shape)

    def give(self, i: int) -> None:
        self._free[i].set()

    def wait_all(self) -> None:
        for ev in self._free:
            ev.wait()


class HostStaging:
    """Pinned host buffers for device->host copies, one per key (the offload engine's chunks
    of micro-batch sums): the accumulator gives each buffer back after adding it."""

    def __init__(self, accel: Accelerator | None, dtype: torch.dtype, pin: bool, shapes: dict,
                 tag: str = "staging", views: dict | None = None):  # fmt: skip
        if views is not None:  # views of buffers the caller owns (a weight's link buffer)
            self._buf = dict(views)
        else:
            self._buf = {
                key: accel.host_empty(shape, dtype, pin, tag) for key, shape in shapes.items()
            }
        self._free = {key: threading.Event() for key in self._buf}
        for ev in self._free.values():
            ev.set()

    def take(self, key) -> torch.Tensor:
        """The buffer of ``key``, once the accumulator is done with its last use."""
        self._free[key].wait()
        self._free[key].clear()
        return self._buf[key]

    def give(self, key) -> None:
        self._free[key].set()

    def wait_all(self) -> None:
        for ev in self._free.values():
            ev.wait()
