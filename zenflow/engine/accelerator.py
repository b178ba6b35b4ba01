"""The accelerator layer: every device-specific thing the engine does goes through here.

Streams, events, asynchronous copies, pinned host memory, device- and host-memory
accounting, the core split, phase timing and the count of synchronisations (ZENFLOW.md
sections 2b-2c). Three backends with one interface:

- ``cuda``: torch.cuda. Copies run on two dedicated copy streams (one per direction),
  ordered against the compute stream by events; host buffers are pinned; events the host
  waits on block instead of spinning; phases are timed with CUDA events, never with a full
  synchronize.
- ``cpu``: the device IS the host. Copies are synchronous ``copy_`` calls (still counted:
  they cost memory bandwidth); ``shared_memory`` tells the engine it may take zero-copy
  paths.
- ``sim``: a simulated accelerator for machines without a GPU. It runs on the CPU but
  behaves as a separate device: device and host tensors are separate allocations; every copy
  between them is carried out by a copy-engine thread (one per direction, like a GPU's two
  DMA engines) at a modelled bandwidth and latency and completes an event. Strict mode
  poisons a copy's destination (NaN, or the most negative integer) from enqueue until the
  copy completes, so a read that does not wait for its event corrupts the result, and
  checksums a copy's source at enqueue and again when the copy runs, so a buffer rewritten
  before its copy completed fails loudly (the source guard). Lag mode starts every copy late
  by a random delay, as a GPU running behind the CPU would, and makes device-side waits on
  host->device copies what they are on a GPU: ``compute_wait`` returns at once (the device
  work after it sees the copied values, as on an in-order stream) while the copy engine
  reads the source late, so a host buffer rewritten under a pending copy is caught by the
  guard where a blocking wait would have hidden it. ``synchronize`` waits for every
  copy engine (a hidden full sync shows up as stall). Device memory is accounted per holder,
  with a peak and an optional budget that raises :class:`DeviceOutOfMemory`; "device
  compute" (the training thread) runs on a reserved share of the cores and the host side
  (worker, accumulator, copy engines) on the rest. A profile (``zenflow.engine.
  sim_profiles``) scales the link so that compute:link matches a named GPU box.

The engine never calls torch.cuda, ``pin_memory`` or ``non_blocking`` itself.

Events: ``query()`` -> bool, ``synchronize()`` blocks the calling thread. Ordering rules the
engine follows (the same on every backend): a copy reads its source when it executes, so
the source must not change until the copy's event completes; a copy's destination must not
be read until its event completes (``wait`` on the host, ``compute_wait`` for device work).

Synchronisation count (``syncs``): ``synchronize()`` (a full device sync) and ``read()`` (a
device-to-host read of a few scalars, which waits for the device work before it) are the
only two ways the engine and the trainer wait for the device on the training thread; each
is counted, per step, in ``StepStats.full_syncs`` / ``d2h_reads``.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass

import torch

from zenflow.errors import EngineError

KINDS = ("cpu", "sim", "cuda")
# Modelled PCIe for ``sim``: 25 GB/s per direction and 10 us per copy, what a PCIe 4.0 x16
# link sustains for large pinned copies (32 GB/s raw, ~80% achieved) and the launch cost of
# a cudaMemcpyAsync. Overridable per instance, and by a profile.
SIM_BANDWIDTH = 25e9
SIM_LATENCY_S = 10e-6
# Copy log entries kept for the overlap figure (a few steps' worth of pieces).
_COPY_LOG = 4096


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def checksum(t: torch.Tensor) -> int:
    """A cheap checksum of a tensor's bytes (the source guard): the sum of its 16- or 32-bit
    words, position-weighted so that swapped words change it too."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    if flat.element_size() % 4 == 0:
        words = flat.view(torch.int32)
    elif flat.element_size() == 2:
        words = flat.view(torch.int16)
    else:
        words = flat.view(torch.uint8)
    w = words.to(torch.int64)
    return int(w.sum()) * 1_000_003 + int((w * (torch.arange(w.numel()) % 251)).sum())


class Accelerator:
    """Common interface, the memory accounting and the sync count shared by every backend."""

    kind = "?"
    shared_memory = False  # device and host are the same memory (zero-copy paths allowed)
    models_pinning = False  # host buffers asked to be pinned are pinned (or modelled so)

    def __init__(self, device: torch.device, *, budget_bytes: int | None = None):
        self.device = device
        self.budget_bytes = budget_bytes
        self.traffic = Traffic()
        self.syncs = SyncCounts()
        self._held: dict[str, int] = defaultdict(int)  # holder tag -> device bytes
        self._host: dict[str, int] = defaultdict(int)  # holder tag -> host bytes
        self._pinned = 0
        self._peak = 0
        self._peak_held: dict[str, int] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- device memory
    def _account(self, tag: str, nbytes: int) -> None:
        with self._lock:
            total = sum(self._held.values()) + nbytes
            if self.budget_bytes is not None and nbytes > 0 and total > self.budget_bytes:
                held = sorted(self._held.items(), key=lambda kv: -kv[1])[:3]
                top = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in held) or "nothing"
                raise DeviceOutOfMemory(
                    f"{self.kind} device out of memory: {tag} needs {nbytes / 2**20:.1f} MiB "
                    f"but {total - nbytes:,} of the {self.budget_bytes:,}-byte budget are "
                    f"held (largest holders: {top}). {OOM_FIX}"
                )
            self._held[tag] += nbytes
            if total > self._peak:
                self._peak = total
                self._peak_held = {k: v for k, v in self._held.items() if v}

    def _unaccount(self, tag: str, nbytes: int) -> None:
        with self._lock:
            self._held[tag] -= nbytes

    def track(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        """Account ``t`` (a device tensor) under ``tag`` until it is freed."""
        n = _nbytes(t)
        self._account(tag, n)
        weakref.finalize(t, self._unaccount, tag, n)
        return t

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
            return max(self._peak, sum(self._held.values()))

    def peak_held(self) -> dict[str, int]:
        """Device bytes per holder at the moment of the peak (accounting backends)."""
        with self._lock:
            if sum(self._held.values()) >= self._peak:
                return {k: v for k, v in self._held.items() if v}
            return dict(self._peak_held)

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = sum(self._held.values())
            self._peak_held = {k: v for k, v in self._held.items() if v}

    def empty(self, shape, dtype, tag: str) -> torch.Tensor:
        """An uninitialised device tensor, accounted under ``tag``."""
        return self.track(torch.empty(shape, dtype=dtype, device=self.device), tag)

    def zeros(self, shape, dtype, tag: str) -> torch.Tensor:
        return self.empty(shape, dtype, tag).zero_()

    # ---------------------------------------------------------------- host memory
    def _pin(self, t_shape, dtype) -> torch.Tensor:
        return torch.empty(t_shape, dtype=dtype)

    def host_empty(self, shape, dtype=torch.float32, pin: bool = False, tag: str = "host"):
        """An uninitialised host tensor, accounted under ``tag``; pinned (page-locked) when
        ``pin`` and the backend pins (cuda) or models pinning (sim). Pin only what crosses
        the link: staging, images, landing buffers; never the master or the moments."""
        pinned = pin and self.models_pinning
        t = self._pin(shape, dtype) if pinned else torch.empty(shape, dtype=dtype)
        n = _nbytes(t)
        with self._lock:
            self._host[tag] += n
            if pinned:
                self._pinned += n
        weakref.finalize(t, self._host_free, tag, n, pinned)
        return t

    def _host_free(self, tag: str, n: int, pinned: bool) -> None:
        with self._lock:
            self._host[tag] -= n
            if pinned:
                self._pinned -= n

    def host_zeros(self, shape, dtype=torch.float32, pin: bool = False, tag: str = "host"):
        return self.host_empty(shape, dtype, pin, tag).zero_()

    def host_held(self) -> dict[str, int]:
        """Host bytes per holder allocated through this layer (engine state and buffers)."""
        with self._lock:
            return {k: v for k, v in self._host.items() if v}

    def pinned_bytes(self) -> int:
        """Page-locked host bytes (modelled on sim)."""
        with self._lock:
            return self._pinned

    # ---------------------------------------------------------------- copies
    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """Copy device ``src`` into host ``dst`` (same shape); returns its event."""
        raise NotImplementedError

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """Copy host ``src`` into device ``dst`` (same shape); returns its event.
        ``after``: an event the copy must wait for before it starts (``dst`` free)."""
        raise NotImplementedError

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        """A new host tensor holding device ``src``, waited for (checkpoints, hand-over)."""
        dst = torch.empty(src.shape, dtype=src.dtype)
        self.copy_d2h(dst, src).synchronize()
        return dst

    def read_tensor(self, src: torch.Tensor) -> torch.Tensor:
        """A device tensor on the host, waited for, counted as a device-to-host read (the
        training thread's wait for the device): a re-selection's hand-over, once."""
        self.syncs.reads += 1
        return self.to_host(src)

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
            n = max(1, cores() // max(1, ranks_per_node))
            return min(torch.get_num_threads(), n), n
        return super().compute_threads(reserved_share, overlap, ranks_per_node)

    def describe(self) -> str:
        return "cpu (the device is the CPU itself: device and host share memory)"


class SimEvent:
    """Completes when the copy engine has finished the copy."""

    __slots__ = ("_done", "error", "device_ordered", "_hooks", "_lock")

    def __init__(self, device_ordered: bool = False) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self._hooks: list = []  # run at completion, before any waiter wakes
        self._lock = threading.Lock()
        # lag mode's host->device copies: device work queued after them sees their values
        # (an in-order device stream), so a device-side wait need not block the host
        self.device_ordered = device_ordered

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"sim copy engine failed: {self.error}") from self.error

    def on_complete(self, fn) -> None:
        """Run ``fn()`` at the instant the event completes, before a waiter can act on it
        (now, if it has completed)."""
        with self._lock:
            if not self._done.is_set():
                self._hooks.append(fn)
                return
        fn()

    def _set(self) -> None:
        with self._lock:
            for fn in self._hooks:
                fn()
            self._hooks = []
            self._done.set()


def poison_(t: torch.Tensor) -> None:
    """Fill with a value no computation should see: NaN, or the most negative integer."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


class SourceChanged(RuntimeError):
    """The sim's source guard: a copy's source changed between enqueue and execution."""


class _AfterGuard:
    """The source guard of a copy with ``after``: the source's checksum taken at the instant
    ``after`` completes (``SimEvent.on_complete``), so a rewrite right after that instant is
    caught however late the copy engine gets to the copy."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: int | None = None


class _CopyEngine:
    """One DMA engine: a thread executing copies in order. A copy of B bytes occupies the
    engine for latency + B / bandwidth of wall time and its data lands at the END of that
    time (the host-side memcpy is started just early enough, from a running estimate of its
    own speed), so the destination holds poison, not data, until just before the event
    completes and a reader that skips the wait is caught. The source is read then too: with
    the guard on, its checksum taken at enqueue (or once the copy's ``after`` event
    completed, when that writes the source) is compared first. With ``lag`` each copy
    starts up to that many seconds late (a GPU running behind the host); a lag mode
    host->device copy was delivered at enqueue (``dst`` None) and only reads its source."""

    def __init__(self, name: str, sim: SimAccelerator):
        self.name = name
        self.sim = sim
        self.busy_s = 0.0  # modelled busy time, for tests and stats
        self._memcpy_rate = 5e9  # bytes/s of the host-side copy, a running estimate
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._rng = random.Random(sim.lag_seed * 2 + (name == "h2d"))
        self._thread = threading.Thread(target=self._run, name=f"zenflow-sim-{name}", daemon=True)
        self._thread.start()

    def submit(self, dst, src, after, event: SimEvent, guard: int | None) -> None:
        self._q.put((dst, src, after, event, guard))

    def _run(self) -> None:
        torch.set_num_threads(1)  # copies stay off the device's reserved cores
        sim = self.sim
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, threading.Event):  # a synchronize() marker
                item.set()
                continue
            dst, src, after, event, guard = item
            try:
                if after is not None:
                    after.synchronize()
                    if isinstance(guard, _AfterGuard):  # the source ``after`` left in it
                        guard = guard.value
                if sim.lag_s > 0:
                    time.sleep(self._rng.uniform(0.0, sim.lag_s))
                t0 = time.perf_counter()
                n = _nbytes(src)
                model = sim.latency + n / sim.bandwidth
                self.busy_s += model
                start = model - n / self._memcpy_rate
                if start > 0:
                    time.sleep(start)
                if guard is not None and checksum(src) != guard:
                    raise SourceChanged(
                        f"sim source guard: the source of a {self.name} copy of {n:,} bytes "
                        f"{tuple(src.shape)} {src.dtype} changed between enqueue and execution "
                        "(a buffer was rewritten before its copy's event completed: a missing "
                        "wait)"
                    )
                c0 = time.perf_counter()
                if dst is not None:  # None: delivered at enqueue (lag mode's host->device)
                    dst.copy_(src)
                took = time.perf_counter() - c0
                if n >= 1 << 16 and took > 0:
                    self._memcpy_rate = 0.8 * self._memcpy_rate + 0.2 * n / took
                left = model - (time.perf_counter() - t0)
                if left > 0:
                    time.sleep(left)
                sim._log_copy(t0, time.perf_counter(), n)
            except BaseException as e:  # surfaced by the waiter, and kept
                event.error = e
                if isinstance(e, SourceChanged):
                    sim.guard_violations.append(str(e))
            event._set()

    def drain(self) -> None:
        """Block until every copy queued before this call has run."""
        marker = threading.Event()
        self._q.put(marker)
        marker.wait()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)


class SimAccelerator(Accelerator):
    """A separate device simulated on the CPU (see the module docstring)."""

    kind = "sim"
    models_pinning = True

    def __init__(
        self,
        *,
        bandwidth: float = SIM_BANDWIDTH,
        latency: float = SIM_LATENCY_S,
        strict: bool = False,
        budget_bytes: int | None = None,
        lag_s: float = 0.0,
        lag_seed: int = 0,
        profile=None,
    ):
        super().__init__(torch.device("cpu"), budget_bytes=budget_bytes)
        self.strict = strict
        self.bandwidth = bandwidth
        self.latency = latency
        self.lag_s = float(lag_s)
        self.lag_seed = int(lag_seed)
        self.profile = profile  # a calibrated sim_profiles.Calibration, or None
        self.guard_violations: list[str] = []
        self._copies: deque = deque(maxlen=_COPY_LOG)  # (start, end, bytes)
        self._compute: deque = deque(maxlen=_COPY_LOG)  # (start, end)
        self._log_lock = threading.Lock()
        self._overlap_since = 0.0
        self._engines = {"d2h": _CopyEngine("d2h", self), "h2d": _CopyEngine("h2d", self)}
        self._closed = False

    def _copy(self, dst, src, direction: str, after):
        if dst.shape != src.shape:
            raise ValueError(f"sim copy: shapes differ, {tuple(dst.shape)} <- {tuple(src.shape)}")
        if dst.data_ptr() == src.data_ptr() and dst.numel():
            raise ValueError("sim copy: source and destination share storage")
        if direction == "d2h":
            self.traffic.d2h_bytes += _nbytes(src)
        else:
            self.traffic.h2d_bytes += _nbytes(src)
        if self._closed:  # after close() (e.g. a final state_dict): a plain blocking copy
            if after is not None:
                after.synchronize()
            dst.copy_(src)
            return DONE
        guard = None
        if self.strict:  # the source guard: compared again when the copy runs
            if after is None or not isinstance(after, SimEvent):  # none, or already done
                guard = checksum(src)
            else:
                guard = _AfterGuard()
                after.on_complete(lambda g=guard: setattr(g, "value", checksum(src)))
        if direction == "h2d" and self.lag_s > 0 and after is None:
            # A GPU running behind the host: the device stream runs the copy before any
            # work queued after it, so that work sees the values (delivered now) while
            # ``compute_wait`` returns at once; the copy engine reads the source late
            # (lag + modelled time), and the guard fails if the host rewrote it meanwhile.
            dst.copy_(src)
            event = SimEvent(device_ordered=True)
            self._engines[direction].submit(None, src, None, event, guard)
            return event
        if self.strict:
            poison_(dst)  # readers that do not wait for the event see poison
        event = SimEvent()
        self._engines[direction].submit(dst, src, after, event, guard)
        return event

    def compute_wait(self, event) -> None:
        """Device work after this waits for ``event``: on sim the host waits, except for
        lag mode's host->device copies, whose values the device already sees (in order)."""
        if getattr(event, "device_ordered", False):
            return
        event.synchronize()

    def copy_d2h(self, dst, src, after=None):
        return self._copy(dst, src, "d2h", after)

    def copy_h2d(self, dst, src, after=None):
        return self._copy(dst, src, "h2d", after)

    def synchronize(self) -> None:
        """Wait for every copy engine (a full sync on a GPU waits for its copy streams too)."""
        super().synchronize()
        if not self._closed:
            for engine in self._engines.values():
                engine.drain()

    def busy_s(self, direction: str) -> float:
        """Modelled busy seconds of one copy engine so far."""
        return self._engines[direction].busy_s

    # ---------------------------------------------------------------- overlap figure
    def _log_copy(self, start: float, end: float, nbytes: int) -> None:
        with self._log_lock:
            self._copies.append((start, end, nbytes))

    def note_compute(self, start: float, end: float) -> None:
        if end > start:
            with self._log_lock:
                self._compute.append((start, end))

    def overlap_share(self) -> float | None:
        """Share of the bytes of copies that ended since the last call which moved while
        the device computed: each copy's bytes are spread evenly over its interval and the
        part inside recorded compute intervals counts."""
        with self._log_lock:
            since = self._overlap_since
            copies = [c for c in self._copies if c[1] > since]
            compute = sorted(self._compute)
            if copies:
                self._overlap_since = max(c[1] for c in copies)
        total = sum(c[2] for c in copies)
        if total == 0:
            return None
        inside = 0.0
        for start, end, nbytes in copies:
            length = end - start
            if length <= 0:
                continue
            covered = 0.0
            for c0, c1 in compute:
                if c1 <= start:
                    continue
                if c0 >= end:
                    break
                covered += min(end, c1) - max(start, c0)
            inside += nbytes * min(1.0, covered / length)
        return inside / total

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for e in self._engines.values():
                e.close()

    def describe(self) -> str:
        mode = ", ".join(
            x for x in ("strict" if self.strict else "", f"lag <= {self.lag_s * 1e3:g} ms"
                        if self.lag_s else "") if x
        )  # fmt: skip
        text = (
            f"sim (simulated accelerator on the CPU: {self.bandwidth / 1e9:.4g} GB/s copies, "
            f"{self.latency * 1e6:g} us latency{', ' + mode if mode else ''})"
        )
        if self.profile is not None:
            text += f"; profile {self.profile.describe()}"
        return text


class CudaEvent:
    """torch.cuda.Event with the interface above."""

    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


def _cuda_event(timing: bool = False):
    # blocking=True: a host thread waiting on it sleeps instead of spinning on a core the
    # core split gave to someone else.
    return torch.cuda.Event(blocking=True, enable_timing=timing)


class CudaAccelerator(Accelerator):
    """A CUDA device: two copy streams, events, pinned host buffers, the caching
    allocator's counters for device memory."""

    kind = "cuda"
    models_pinning = True

    def __init__(self, device: torch.device, *, pin: bool = True):
        super().__init__(device)
        self.pin = pin
        self.models_pinning = pin
        torch.cuda.set_device(device)
        # one stream per direction, like the GPU's two copy engines (and sim's)
        self.streams = {"d2h": torch.cuda.Stream(device=device),
                        "h2d": torch.cuda.Stream(device=device)}  # fmt: skip
        self._input_pool: dict[tuple, torch.Tensor] = {}

    def _pin(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def _copy(self, dst, src, direction: str, after, dev_tensor):
        compute = torch.cuda.current_stream(self.device)
        stream = self.streams[direction]
        ready = _cuda_event()
        ready.record(compute)  # the source (d2h) / the destination's last reader (h2d)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if after is not None:
                if isinstance(after, CudaEvent):
                    stream.wait_event(after.event)
                else:
                    after.synchronize()
            dst.copy_(src, non_blocking=True)
            # the caching allocator must not reuse the device block before the copy ran
            dev_tensor.record_stream(stream)
            done = _cuda_event()
            done.record(stream)
        if direction == "d2h":
            self.traffic.d2h_bytes += _nbytes(src)
        else:
            self.traffic.h2d_bytes += _nbytes(src)
        return CudaEvent(done)

    def copy_d2h(self, dst, src, after=None):
        return self._copy(dst, src, "d2h", after, src)

    def copy_h2d(self, dst, src, after=None):
        return self._copy(dst, src, "h2d", after, dst)

    def to_host(self, src: torch.Tensor) -> torch.Tensor:
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self.copy_d2h(dst, src).synchronize()
        return dst

    def to_device_input(self, t: torch.Tensor, key: str = "") -> torch.Tensor:
        # A pageable host->device copy waits for the compute stream (a hidden sync per
        # micro-batch); from a pinned buffer it is queued. The buffer is reused once the
        # copy that last read it is done: one buffer per input name and shape, so the
        # second input of a batch never waits for the first one's copy.
        key = (key, tuple(t.shape), t.dtype)
        entry = self._input_pool.get(key)
        if entry is not None:
            entry[1].synchronize()
            buf = entry[0]
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t)
        out = buf.to(self.device, non_blocking=True)
        done = _cuda_event()
        done.record(torch.cuda.current_stream(self.device))
        self._input_pool[key] = (buf, done)
        return out

    def record_compute(self):
        ev = _cuda_event()
        ev.record(torch.cuda.current_stream(self.device))
        return CudaEvent(ev)

    def compute_wait(self, event) -> None:
        if isinstance(event, CudaEvent):
            torch.cuda.current_stream(self.device).wait_event(event.event)
        else:
            event.synchronize()

    def synchronize(self) -> None:
        self.syncs.full += 1
        torch.cuda.synchronize(self.device)

    def mark(self):
        ev = _cuda_event(timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def elapsed_ms(self, start, end) -> float:
        return float(start.elapsed_time(end))

    def device_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        super().reset_peak()  # the per-holder peak (peak_held) is per step too
        torch.cuda.reset_peak_memory_stats(self.device)

    def rng_state(self) -> dict:
        return {"cuda": torch.cuda.get_rng_state(self.device)}

    def set_rng_state(self, state: dict) -> None:
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def describe(self) -> str:
        return f"cuda ({torch.cuda.get_device_name(self.device)})"


def device_synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device``; a no-op off CUDA. Not for timing: use an
    accelerator's ``mark``/``elapsed_ms`` (a full sync drains the engine's copy streams)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    a named GPU box (``zenflow.engine.sim_profiles.PROFILES``); the sim core's compute rate
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
            from zenflow.engine.sim_profiles import calibrate

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
