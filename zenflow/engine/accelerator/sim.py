"""The ``sim`` backend: a separate accelerator simulated on the CPU, for machines without
a GPU.

It runs on the CPU but behaves as a separate device: device and host tensors are separate
allocations; every copy between them is carried out by a copy-engine thread (one per
direction, like a GPU's two DMA engines) at a modelled bandwidth and latency and completes
an event. Strict mode poisons a copy's destination (NaN, or the most negative integer) from
enqueue until the copy completes, so a read that does not wait for its event corrupts the
result, and checksums a copy's source at enqueue and again when the copy runs, so a buffer
rewritten before its copy completed fails loudly (the source guard; the guards themselves
are in ``sim_guards.py``). Lag mode starts every copy late by a random delay, as a GPU
running behind the CPU would, and makes device-side waits on host->device copies what they
are on a GPU: ``compute_wait`` returns at once (the device work after it sees the copied
values, as on an in-order stream) while the copy engine reads the source late, so a host
buffer rewritten under a pending copy is caught by the guard where a blocking wait would
have hidden it. ``synchronize`` waits for every copy engine (a hidden full sync shows up as
stall). Device memory is accounted per holder (``base.py``), with a peak and an optional
budget that raises ``DeviceOutOfMemory``; "device compute" (the training thread) runs on a
reserved share of the cores and the host side (worker, accumulator, copy engines) on the
rest. Device memory is a memory of its own where the native library is built: tensors made
inside ``device_scope`` come from the device pool (``zenflow.ops.sim_pool``, a caching
allocator like CUDA's), not from glibc's heap, so the device's churn never fragments the
host's heap, and ``memory_peak_bytes`` is what the device holds in the process's RSS (the
figure a host-memory measurement subtracts). A profile (``profiles.py``) scales the link
so that compute:link matches a named GPU box; it is measured there and only read here.

Owns :class:`SimAccelerator`, its events and its copy engines; it must not touch torch.cuda.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
import weakref
from collections import deque

import torch

from zenflow.engine.accelerator.base import DONE, Accelerator, _nbytes
from zenflow.engine.accelerator.sim_guards import SourceChanged, _AfterGuard, checksum, poison_
from zenflow.ops import sim_pool

# Modelled PCIe for ``sim``: 25 GB/s per direction and 10 us per copy, what a PCIe 4.0 x16
# link sustains for large pinned copies (32 GB/s raw, ~80% achieved) and the launch cost of
# a cudaMemcpyAsync. Overridable per instance, and by a profile.
SIM_BANDWIDTH = 25e9
SIM_LATENCY_S = 10e-6
# Copy log entries kept for the overlap figure (a few steps' worth of pieces).
_COPY_LOG = 4096
# Registration and running of SimEvent completion hooks (strict mode only: rare).
_HOOKS_LOCK = threading.Lock()


class SimEvent:
    """Completes when the copy engine has finished the copy.

    Made for every copy on the training thread, so it is light: a bare lock held from
    creation to completion (a waiter takes and gives it back) and a flag, not a
    ``threading.Event`` (a condition and two locks built in Python). Completion hooks
    (strict mode's guard) are registered and run under one module lock."""

    __slots__ = ("_pending", "_complete", "error", "device_ordered", "_hooks")

    def __init__(self, device_ordered: bool = False) -> None:
        self._pending = threading.Lock()
        self._pending.acquire()  # released by ``_set``: any thread may release a bare lock
        self._complete = False
        self.error: BaseException | None = None
        self._hooks: list = []  # run at completion, before any waiter wakes
        # lag mode's host->device copies: device work queued after them sees their values
        # (an in-order device stream), so a device-side wait need not block the host
        self.device_ordered = device_ordered

    def query(self) -> bool:
        return self._complete

    def synchronize(self) -> None:
        if not self._complete:
            with self._pending:  # held until the copy completed
                pass
        if self.error is not None:
            raise RuntimeError(f"sim copy engine failed: {self.error}") from self.error

    def on_complete(self, fn) -> None:
        """Run ``fn()`` at the instant the event completes, before a waiter can act on it
        (now, if it has completed)."""
        with _HOOKS_LOCK:
            if not self._complete:
                self._hooks.append(fn)
                return
        fn()

    def _set(self) -> None:
        with _HOOKS_LOCK:
            for fn in self._hooks:
                fn()
            self._hooks = []
            self._complete = True
        self._pending.release()


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
            # the copy's tensors are not the engine's to keep: a device tensor held here
            # until the next copy would stay in the device accounting (and the host's)
            item = dst = src = after = None

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
        device_pool: bool = True,
    ):
        super().__init__(torch.device("cpu"), budget_bytes=budget_bytes)
        # the device pool (False: device tensors share glibc's heap with the host's)
        self.pool = bool(device_pool) and sim_pool.install()
        self._outside = 0  # device bytes made outside the pool (``note_device_tensors``)
        if self.pool:
            sim_pool.open_device()
            sim_pool.reset_peak()
        self._pool_close = weakref.finalize(self, sim_pool.close_device) if self.pool else None
        self.strict = strict
        self.bandwidth = bandwidth
        self.latency = latency
        self.lag_s = float(lag_s)
        self.lag_seed = int(lag_seed)
        self.profile = profile  # a calibrated profiles.Calibration, or None
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
            if self._pool_close is not None:
                self._pool_close()  # the cache goes back when no device is open

    # ---------------------------------------------------------------- device memory
    def device_scope(self):
        return sim_pool.mode(sim_pool.DEVICE) if self.pool else contextlib.nullcontext()

    def host_scope(self):
        return sim_pool.mode(sim_pool.HOST) if self.pool else contextlib.nullcontext()

    def note_device_tensors(self, tensors) -> None:
        """Device tensors made before the device was (the model's weights and buffers, built
        on the CPU): their bytes outside the pool count in ``memory_peak_bytes``."""
        seen, n = set(), 0
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() in seen or (self.pool and sim_pool.owns(t)):
                continue
            seen.add(st.data_ptr())
            n += st.nbytes()
        self._outside = n

    def memory_peak_bytes(self) -> int | None:
        if not self.pool:
            return None
        return sim_pool.stats()["resident_peak"] + self._outside

    def memory_allocated_peak_bytes(self) -> int | None:
        if not self.pool:
            return None
        return sim_pool.stats()["in_use_peak"] + self._outside

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
        if not self.pool:
            why = sim_pool.why_not() or "device_pool=False"
            text += f"; device memory in the host's heap (no device pool: {why})"
        return text
