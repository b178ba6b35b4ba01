"""The accelerator interface and what every backend shares: memory accounting, the sync
count, the core split.

The engine does every device-specific thing through an :class:`Accelerator`: streams,
events, asynchronous copies, pinned host memory, device- and host-memory accounting, the
core split, phase timing and the count of synchronisations (ZENFLOW.md sections 2b-2c). This
module holds the interface and its default (synchronous) behaviour; the backends override
the copies, events and timing: ``cpu.py``, ``sim.py``, ``cuda.py``. It must not know any
backend: no torch.cuda, no copy engine, no guard.

Events: ``query()`` -> bool, ``synchronize()`` blocks the calling thread. Ordering rules the
engine follows (the same on every backend): a copy reads its source when it executes, so
the source must not change until the copy's event completes; a copy's destination must not
be read until its event completes (``wait`` on the host, ``compute_wait`` for device work).

Synchronisation count (``syncs``): ``synchronize()`` (a full device sync) and ``read()`` (a
device-to-host read of a few scalars, which waits for the device work before it) are the
only two ways the engine and the trainer wait for the device on the training thread; each
is counted, per step, in ``StepStats.full_syncs`` / ``d2h_reads``.

Device memory is accounted per holder, with a peak and an optional budget that raises
:class:`DeviceOutOfMemory` (sim and cpu; cuda reads the caching allocator's counters).
``cores`` is looked up at each call (a test may monkeypatch ``base.cores``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

from zenflow.engine.accelerator.reads import DeviceReader
from zenflow.errors import EngineError


def cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class DeviceOutOfMemory(EngineError):
    """The device's memory (a simulated budget, or CUDA's) would be exceeded."""


OOM_FIX = (
    "Fix: enable bf16, lower topk_ratio, use --gradient-checkpointing or a smaller "
    "micro-batch / sequence, or a device with more memory (zfctl estimate shows what fits)."
)


@dataclass
class Traffic:
    """Bytes copied between device and host, counted at each copy (ZENFLOW.md section 4)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0

    def reset(self) -> None:
        self.d2h_bytes = 0
        self.h2d_bytes = 0


@dataclass
class SyncCounts:
    """Waits for the device on the training thread: full syncs and device->host reads."""

    full: int = 0
    reads: int = 0

    def reset(self) -> None:
        self.full = 0
        self.reads = 0


class DoneEvent:
    """An event that has already completed (synchronous backends)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = DoneEvent()


# The reused pinned buffer device-to-host reads go through (checkpoints, hand-overs): a
# bucket of 4M fp32 elements; the zenflow mode sets it to its bucket's bytes.
READ_BUFFER_BYTES = 16 << 20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Accelerator:
    """Common interface, the memory accounting and the sync count shared by every backend."""

    kind = "?"
    shared_memory = False  # device and host are the same memory (zero-copy paths allowed)
    models_pinning = False  # host buffers asked to be pinned are pinned (or modelled so)
    # the host's threads: the accumulator yields half of them to a running window's Adam
    # (CUDA: the host also has the cores the training thread does not need; accumulator.CoreShare)
    host_yields = False
    # host work that blocks the step on the training thread while the host's own kernels
    # are idle (the first selection) takes the host's threads too (CUDA: the training
    # thread keeps 2 cores, too few for that torch work; engine_setup.lent_cores)
    lends_host_cores = False

    def __init__(self, device: torch.device, *, budget_bytes: int | None = None):
        self.device = device
        self.budget_bytes = budget_bytes
        self.traffic = Traffic()
        self.syncs = SyncCounts()
        self._held: dict[str, int] = defaultdict(int)  # holder tag -> device bytes
        self._host: dict[str, int] = defaultdict(int)  # holder tag -> host bytes
        self._pinned = 0
        self._caching_pinned = 0
        self._pinned_tags: dict[str, int] = defaultdict(int)  # holder tag -> locked bytes
        self._host_peak = 0
        self.read_buffer_bytes = READ_BUFFER_BYTES
        self._read_buf: torch.Tensor | None = None
        self._peak = 0
        self._peak_held: dict[str, int] = {}
        self._total = 0  # the sum of ``_held``, kept as it changes (a hook accounts a gradient)
        self._tracked: dict[int, tuple] = {}  # id(weakref) -> (weakref, tag, bytes) of ``track``
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- device memory
    def _account(self, tag: str, nbytes: int) -> None:
        with self._lock:
            total = self._total + nbytes
            if self.budget_bytes is not None and nbytes > 0 and total > self.budget_bytes:
                held = sorted(self._held.items(), key=lambda kv: -kv[1])[:3]
                top = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in held) or "nothing"
                raise DeviceOutOfMemory(
                    f"{self.kind} device out of memory: {tag} needs {nbytes / 2**20:.1f} MiB "
                    f"but {total - nbytes:,} of the {self.budget_bytes:,}-byte budget are "
                    f"held (largest holders: {top}). {OOM_FIX}"
                )
            self._held[tag] += nbytes
            self._total = total
            if total > self._peak:
                self._peak = total
                self._peak_held = {k: v for k, v in self._held.items() if v}

    def _unaccount(self, tag: str, nbytes: int) -> None:
        with self._lock:
            self._held[tag] -= nbytes
            self._total -= nbytes

    def track(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Account ``t`` (a device tensor) under ``tag`` until it is freed (a weak reference
        whose callback unaccounts it: every streamed gradient is tracked, so this is kept
        light)."""
        n = _nbytes(t)
        self._account(tag, n)
        ref = weakref.ref(t, self._freed)
        self._tracked[id(ref)] = (ref, tag, n)
        return t

    def _freed(self, ref) -> None:
        _, tag, n = self._tracked.pop(id(ref))
        self._unaccount(tag, n)

    def set_held(self, tag: str, nbytes: int) -> None:
        """Set the bytes of a holder the engine does not allocate itself (the model's
        weights, autograd's gradients, torch's optimizer state)."""
        with self._lock:
            old = self._held.get(tag, 0)
        self._account(tag, nbytes - old) if nbytes > old else self._unaccount(tag, old - nbytes)

    def held(self) -> dict[str, int]:
        """Device bytes per holder, as accounted."""
        with self._lock:
            return {k: v for k, v in self._held.items() if v}

    def device_bytes(self) -> int:
        """Device memory held by weights, gradients and engine state (activations excluded:
        call it between steps). CUDA reads the allocator; the others the accounting."""
        return sum(self.held().values())

    def peak_bytes(self) -> int:
        """The largest ``device_bytes`` since ``reset_peak`` (backward included: streamed
        gradients and buckets in flight are accounted when they exist)."""
        with self._lock:
            return max(self._peak, self._total)

    def peak_held(self) -> dict[str, int]:
        """Device bytes per holder at the moment of the peak (accounting backends)."""
        with self._lock:
            if self._total >= self._peak:
                return {k: v for k, v in self._held.items() if v}
            return dict(self._peak_held)

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._total
            self._peak_held = {k: v for k, v in self._held.items() if v}

    def empty(self, shape, dtype, tag: str) -> torch.Tensor:
        """An uninitialised device tensor, accounted under ``tag``."""
        with self.device_scope():
            return self.track(torch.empty(shape, dtype=dtype, device=self.device), tag)

    def zeros(self, shape, dtype, tag: str) -> torch.Tensor:
        return self.empty(shape, dtype, tag).zero_()

    def device_scope(self):
        """Inside: this thread's new tensors are device memory (sim: from its device pool,
        ``zenflow.ops.sim_pool``; elsewhere the device argument decides, and this is a
        no-op). Device work on the training thread runs inside it."""
        return contextlib.nullcontext()

    def host_scope(self):
        """Inside: this thread's new tensors are host memory, also within a
        ``device_scope`` (sim: from glibc's heap; elsewhere a no-op)."""
        return contextlib.nullcontext()

    def note_device_tensors(self, tensors) -> None:
        """The device tensors made before the engine (the model's weights and buffers); sim
        counts those outside its pool in ``memory_peak_bytes``."""

    def memory_peak_bytes(self) -> int | None:
        """The device's memory peak as its allocator holds it, since it was opened (sim with
        its pool: the pool's resident peak plus the device tensors made outside it; None
        where not measured)."""
        return None

    def memory_allocated_peak_bytes(self) -> int | None:
        """The most bytes live device tensors held at once since the device was opened,
        activations and temporaries included (sim with its pool: its bytes in use at their
        peak plus the device tensors made outside it; None where not measured: CUDA's
        counter is reset every step, ``peak_bytes``)."""
        return None

    # ---------------------------------------------------------------- host memory
    def _pin(self, shape, dtype) -> torch.Tensor:
        """A host tensor whose pages are locked (cuda: registered) or modelled so (sim)."""
        return torch.empty(shape, dtype=dtype)

    def _pinned_size(self, nbytes: int) -> int:
        """Bytes locked for a pinned request of ``nbytes`` (cuda: whole pages)."""
        return nbytes

    def host_empty(self, shape, dtype=torch.float32, pin: bool = False, tag: str = "host"):
        """An uninitialised host tensor, accounted under ``tag``; pinned (page-locked) when
        ``pin`` and the backend pins (cuda: pageable memory registered with the driver, so
        what is locked is what was asked, to the page) or models pinning (sim). Pin what
        the device reads or writes directly: staging, the compact master, landing buffers,
        the read buffer; never the moments."""
        pinned = pin and self.models_pinning
        with self.host_scope():
            t = self._pin(shape, dtype) if pinned else torch.empty(shape, dtype=dtype)
        n = _nbytes(t)
        locked = self._pinned_size(n) if pinned else 0
        self._host_add(tag, n, locked)
        # on the storage: freed when the last tensor on it (views included) is gone
        weakref.finalize(t.untyped_storage(), self._host_free, tag, n, locked)
        return t

    def adopt_host(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Account a host tensor the engine was given (the masters taken at set-up) under
        ``tag`` until it is freed, so the host peak sees it."""
        n = _nbytes(t)
        self._host_add(tag, n, 0)
        weakref.finalize(t.untyped_storage(), self._host_free, tag, n, 0)
        return t

    def _host_add(self, tag: str, n: int, locked: int) -> None:
        with self._lock:
            self._host[tag] += n
            self._pinned += locked
            self._pinned_tags[tag] += locked
            self._host_peak = max(self._host_peak, sum(self._host.values()))

    def _host_free(self, tag: str, n: int, locked: int) -> None:
        with self._lock:
            self._host[tag] -= n
            self._pinned -= locked
            self._pinned_tags[tag] -= locked

    def count_caching_pinned(self, t: torch.Tensor, tag: str) -> None:
        """Account a buffer from torch's caching pinned allocator (``pin_memory=True``) at
        the size it locks: the next power of two (its block rounding), kept for the
        process (the allocator caches freed blocks)."""
        n = _nbytes(t)
        locked = 1 << max(0, (n - 1).bit_length())
        with self._lock:
            self._host[tag] += locked
            self._pinned += locked
            self._pinned_tags[tag] += locked
            self._caching_pinned += locked
            self._host_peak = max(self._host_peak, sum(self._host.values()))

    def host_zeros(self, shape, dtype=torch.float32, pin: bool = False, tag: str = "host"):
        return self.host_empty(shape, dtype, pin, tag).zero_()

    def host_held(self) -> dict[str, int]:
        """Host bytes per holder allocated through this layer (engine state and buffers)."""
        with self._lock:
            return {k: v for k, v in self._host.items() if v}

    def host_peak_bytes(self) -> int:
        """The largest total of ``host_held`` since the accelerator was made (the whole run:
        set-up, steps, hand-overs, checkpoints)."""
        with self._lock:
            return self._host_peak

    def pinned_bytes(self) -> int:
        """Page-locked host bytes as locked (cuda: registered pages, and the caching
        allocator's power-of-two blocks; modelled on sim)."""
        with self._lock:
            return self._pinned

    def pinned_held(self) -> dict[str, int]:
        """Of ``pinned_bytes``, what each holder locks."""
        with self._lock:
            return {k: v for k, v in self._pinned_tags.items() if v}

    def caching_pinned_bytes(self) -> int:
        """Of ``pinned_bytes``, what came from torch's caching pinned allocator."""
        with self._lock:
            return self._caching_pinned

    def read_buffer(self) -> torch.Tensor:
        """The one reused pinned host buffer (bytes) device-to-host reads go through
        (checkpoints, hand-overs): made on first use, ``read_buffer_bytes`` long."""
        if self._read_buf is None:
            self._read_buf = self.host_empty((self.read_buffer_bytes,), torch.uint8, True,
                                             "read_buffer")  # fmt: skip
        return self._read_buf

    # ---------------------------------------------------------------- copies
    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """Copy device ``src`` into host ``dst`` (same shape); returns its event."""
        raise NotImplementedError

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """Copy host ``src`` into device ``dst`` (same shape); returns its event.
        ``after``: an event the copy must wait for before it starts (``dst`` free)."""
        raise NotImplementedError

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        """A new host tensor holding device ``src``, waited for (checkpoints, set-up), read
        through the reused pinned read buffer."""
        return self.reader(counted=False).read([src])[0]

    def read_tensor(self, src: torch.Tensor) -> torch.Tensor:
        """A device tensor on the host, waited for, counted as a device-to-host read (the
        training thread's wait for the device)."""
        return self.reader(counted=True).read([src])[0]

    def reader(self, counted: bool = True):
        """A ``DeviceReader`` batching device-to-host reads through the read buffer
        (``counted``: each wait is a device-to-host read in ``syncs.reads``)."""
        return DeviceReader(self, counted)

    def to_device(self, src: torch.Tensor, tag: str) -> torch.Tensor:
        """A new accounted device tensor holding host ``src``, ready for device work."""
        dst = self.empty(src.shape, src.dtype, tag)
        self.compute_wait(self.copy_h2d(dst, src))
        return dst

    def to_device_input(self, t: torch.Tensor, key: str = "") -> torch.Tensor:
        """A model input (a batch) on the device, without a host wait where the backend can
        (cuda: from pinned memory, non-blocking). ``key``: the input's name (a batch's
        input_ids and attention_mask have one shape; each keeps its own pinned buffer)."""
        return t.to(self.device)

    def record_compute(self):
        """An event completing when the device work issued so far has run."""
        return DONE

    def compute_wait(self, event) -> None:
        """Make later device work wait for ``event`` (CUDA: on the device, not the host)."""
        event.synchronize()

    def synchronize(self) -> None:
        """Wait for all device work and copies: a full sync, counted. The engine and the
        trainer never call it in a step (phases are timed with ``mark``)."""
        self.syncs.full += 1

    def read(self, values: list[torch.Tensor]) -> list[float]:
        """Device scalars to Python floats in one device-to-host read (counted): the one
        wait for the device that a step may do (loss, norm and the auto-interval masses
        together)."""
        self.syncs.reads += 1
        if not values:
            return []
        return torch.stack([v.detach().reshape(()).double() for v in values]).cpu().tolist()

    # ---------------------------------------------------------------- timing
    def mark(self):
        """A point on the device's timeline (phase timing without a sync)."""
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        """Milliseconds between two marks; call it after the device passed ``end`` (the
        step's read guarantees that for marks taken before it)."""
        return (end - start) * 1e3

    def note_compute(self, start: float, end: float) -> None:
        """The device was busy computing from ``start`` to ``end`` (perf_counter seconds):
        what the overlap figure measures copies against (sim only)."""

    def overlap_share(self) -> float | None:
        """Share of the link bytes of the copies completed since the last call that moved
        while device compute was busy (sim); None where it is not measured."""
        return None

    def close(self) -> None:
        """Stop background threads (idempotent)."""

    def bind_thread(self) -> None:
        """Call first in every background thread that touches the device (cuda: the
        thread's current device; without it a rank's thread opens a context on GPU 0)."""

    # ---------------------------------------------------------------- threads
    def compute_threads(
        self, reserved_share: float, overlap: bool, ranks_per_node: int = 1
    ) -> tuple[int, int]:
        """(threads for device compute on the training thread, threads for host work), out
        of this rank's share of the cores. A separate device (sim, cuda) keeps its reserved
        share whether or not the host step overlaps."""
        n = max(1, cores() // max(1, ranks_per_node))
        host = max(1, round(n * (1 - reserved_share)))
        return max(1, n - host), host

    def rng_state(self) -> dict:
        """RNG state of the device, by device type (CPU state is saved by the caller)."""
        return {}

    def set_rng_state(self, state: dict) -> None:
        return None

    def describe(self) -> str:
        return self.kind

    def numa_node(self, index: int | None = None) -> int | None:
        """The NUMA node the device ``index`` (default: this one) hangs off, where the
        kernel knows it (CUDA: its PCI address); None for a device that is the host's."""
        return None
