"""The accelerator layer: every device-specific thing the engine does goes through here.

Streams, events, asynchronous copies, pinned host memory, device-memory accounting and the
core split (ZENFLOW.md sections 2b-2c). Three backends with one interface:

- ``cuda``: torch.cuda. Copies run on a dedicated copy stream, ordered against the compute
  stream by events; host buffers are pinned. (Written against torch.cuda's documented API;
  no GPU was available to this project, so this branch has not run.)
- ``cpu``: the device IS the host. Copies are synchronous ``copy_`` calls (still counted:
  they cost memory bandwidth); ``shared_memory`` tells the engine it may take zero-copy
  paths.
- ``sim``: a simulated accelerator for machines without a GPU. It runs on the CPU but
  behaves as a separate device: device and host tensors are separate allocations; every copy
  between them is carried out by a copy-engine thread (one per direction, like a GPU's two
  DMA engines) at a modelled bandwidth and latency and completes an event; in strict mode a
  copy's destination is poisoned (NaN, or the most negative integer) from enqueue until the
  copy completes, so a read that does not wait for its event corrupts the result; device
  memory is accounted per holder with an optional budget that raises
  :class:`DeviceOutOfMemory`; "device compute" (the training thread) runs on a reserved share
  of the cores and the host side (worker, accumulator, copy engines) on the rest.

The engine never calls torch.cuda, ``pin_memory`` or ``non_blocking`` itself.

Events: ``query()`` -> bool, ``synchronize()`` blocks the calling thread. Ordering rules the
engine follows (the same on every backend): a copy reads its source when it executes, so
the source must not change until the copy's event completes; a copy's destination must not
be read until its event completes (``wait`` on the host, ``compute_wait`` for device work).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch

from zenflow.errors import EngineError

KINDS = ("cpu", "sim", "cuda")
# Modelled PCIe for ``sim``: 25 GB/s per direction and 10 us per copy, what a PCIe 4.0 x16
# link sustains for large pinned copies (32 GB/s raw, ~80% achieved) and the launch cost of
# a cudaMemcpyAsync. Overridable per instance.
SIM_BANDWIDTH = 25e9
SIM_LATENCY_S = 10e-6


def cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class DeviceOutOfMemory(EngineError):
    """The (simulated) device's memory budget would be exceeded."""


@dataclass
class Traffic:
    """Bytes copied between device and host, counted at each copy (ZENFLOW.md section 4)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0

    def reset(self) -> None:
        self.d2h_bytes = 0
        self.h2d_bytes = 0


class DoneEvent:
    """An event that has already completed (synchronous backends)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = DoneEvent()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Accelerator:
    """Common interface and the memory accounting shared by every backend."""

    kind = "?"
    shared_memory = False  # device and host are the same memory (zero-copy paths allowed)

    def __init__(self, device: torch.device, *, budget_bytes: int | None = None):
        self.device = device
        self.budget_bytes = budget_bytes
        self.traffic = Traffic()
        self._held: dict[str, int] = defaultdict(int)  # holder tag -> bytes
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- memory
    def _account(self, tag: str, nbytes: int) -> None:
        with self._lock:
            total = sum(self._held.values()) + nbytes
            if self.budget_bytes is not None and nbytes > 0 and total > self.budget_bytes:
                held = sorted(self._held.items(), key=lambda kv: -kv[1])[:3]
                top = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in held) or "nothing"
                raise DeviceOutOfMemory(
                    f"{self.kind} device out of memory: {tag} needs {nbytes / 2**20:.1f} MiB "
                    f"but {total - nbytes:,} of the {self.budget_bytes:,}-byte budget are "
                    f"held (largest holders: {top}). Fix: lower topk_ratio, enable bf16, use "
                    "a smaller micro-batch, or raise the device memory budget."
                )
            self._held[tag] += nbytes

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

    def empty(self, shape, dtype, tag: str) -> torch.Tensor:
        """An uninitialised device tensor, accounted under ``tag``."""
        return self.track(torch.empty(shape, dtype=dtype, device=self.device), tag)

    def zeros(self, shape, dtype, tag: str) -> torch.Tensor:
        return self.empty(shape, dtype, tag).zero_()

    def host_empty(self, shape, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
        """An uninitialised host tensor (pinned where the backend supports it and ``pin``)."""
        return torch.empty(shape, dtype=dtype)

    def host_zeros(self, shape, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
        return self.host_empty(shape, dtype, pin).zero_()

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
        dst = self.host_empty(src.shape, src.dtype)
        self.copy_d2h(dst, src).synchronize()
        return dst

    def to_device(self, src: torch.Tensor, tag: str) -> torch.Tensor:
        """A new accounted device tensor holding host ``src``, ready for device work."""
        dst = self.empty(src.shape, src.dtype, tag)
        self.compute_wait(self.copy_h2d(dst, src))
        return dst

    def record_compute(self):
        """An event completing when the device work issued so far has run."""
        return DONE

    def compute_wait(self, event) -> None:
        """Make later device work wait for ``event`` (CUDA: on the device, not the host)."""
        event.synchronize()

    def synchronize(self) -> None:
        """Wait for all device work and copies."""

    def close(self) -> None:
        """Stop background threads (idempotent)."""

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

    __slots__ = ("_done", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"sim copy engine failed: {self.error}") from self.error

    def _set(self) -> None:
        self._done.set()


def poison_(t: torch.Tensor) -> None:
    """Fill with a value no computation should see: NaN, or the most negative integer."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


class _CopyEngine:
    """One DMA engine: a thread executing copies in order. A copy of B bytes occupies the
    engine for latency + B / bandwidth of wall time and its data lands at the END of that
    time (the host-side memcpy is started just early enough, from a running estimate of its
    own speed), so the destination holds poison, not data, until just before the event
    completes and a reader that skips the wait is caught. The source is read then too: a
    source changed while its copy is in flight shows up as well."""

    def __init__(self, name: str, bandwidth: float, latency: float):
        self.bandwidth = bandwidth
        self.latency = latency
        self.busy_s = 0.0  # modelled busy time, for tests and stats
        self._memcpy_rate = 5e9  # bytes/s of the host-side copy, a running estimate
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"zenflow-sim-{name}", daemon=True)
        self._thread.start()

    def submit(self, dst, src, after, event: SimEvent) -> None:
        self._q.put((dst, src, after, event))

    def _run(self) -> None:
        torch.set_num_threads(1)  # copies stay off the device's reserved cores
        while True:
            item = self._q.get()
            if item is None:
                return
            dst, src, after, event = item
            try:
                if after is not None:
                    after.synchronize()
                t0 = time.perf_counter()
                n = _nbytes(src)
                model = self.latency + n / self.bandwidth
                self.busy_s += model
                start = model - n / self._memcpy_rate
                if start > 0:
                    time.sleep(start)
                c0 = time.perf_counter()
                dst.copy_(src)
                took = time.perf_counter() - c0
                if n >= 1 << 16 and took > 0:
                    self._memcpy_rate = 0.8 * self._memcpy_rate + 0.2 * n / took
                left = model - (time.perf_counter() - t0)
                if left > 0:
                    time.sleep(left)
            except BaseException as e:  # surfaced by the waiter
                event.error = e
            event._set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)


class SimAccelerator(Accelerator):
    """A separate device simulated on the CPU (see the module docstring)."""

    kind = "sim"

    def __init__(
        self,
        *,
        bandwidth: float = SIM_BANDWIDTH,
        latency: float = SIM_LATENCY_S,
        strict: bool = False,
        budget_bytes: int | None = None,
    ):
        super().__init__(torch.device("cpu"), budget_bytes=budget_bytes)
        self.strict = strict
        self.bandwidth = bandwidth
        self.latency = latency
        self._engines = {
            "d2h": _CopyEngine("d2h", bandwidth, latency),
            "h2d": _CopyEngine("h2d", bandwidth, latency),
        }
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
        if self.strict:
            poison_(dst)  # readers that do not wait for the event see poison
        event = SimEvent()
        self._engines[direction].submit(dst, src, after, event)
        return event

    def copy_d2h(self, dst, src, after=None):
        return self._copy(dst, src, "d2h", after)

    def copy_h2d(self, dst, src, after=None):
        return self._copy(dst, src, "h2d", after)

    def busy_s(self, direction: str) -> float:
        """Modelled busy seconds of one copy engine so far."""
        return self._engines[direction].busy_s

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for e in self._engines.values():
                e.close()

    def describe(self) -> str:
        return (
            f"sim (simulated accelerator on the CPU: {self.bandwidth / 1e9:g} GB/s copies, "
            f"{self.latency * 1e6:g} us latency{', strict' if self.strict else ''})"
        )


class CudaEvent:
    """torch.cuda.Event with the interface above."""

    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


class CudaAccelerator(Accelerator):
    """A CUDA device: a dedicated copy stream, events, pinned host buffers.

    Not run here (no GPU in this project): written against torch.cuda's documented API.
    """

    kind = "cuda"

    def __init__(self, device: torch.device, *, pin: bool = True):
        super().__init__(device)
        self.pin = pin
        # one stream per direction, like the GPU's two copy engines (and sim's)
        self.streams = {"d2h": torch.cuda.Stream(device=device),
                        "h2d": torch.cuda.Stream(device=device)}  # fmt: skip

    def host_empty(self, shape, dtype=torch.float32, pin: bool = False) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=pin and self.pin)

    def _copy(self, dst, src, direction: str, after, dev_tensor):
        compute = torch.cuda.current_stream(self.device)
        stream = self.streams[direction]
        ready = torch.cuda.Event()
        ready.record(compute)  # the source (d2h) / the destination's last reader (h2d)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if after is not None:
                stream.wait_event(after.event)
            dst.copy_(src, non_blocking=True)
            # the caching allocator must not reuse the device block before the copy ran
            dev_tensor.record_stream(stream)
            done = torch.cuda.Event()
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

    def record_compute(self):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return CudaEvent(ev)

    def compute_wait(self, event) -> None:
        if isinstance(event, CudaEvent):
            torch.cuda.current_stream(self.device).wait_event(event.event)
        else:
            event.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def device_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def rng_state(self) -> dict:
        return {"cuda": torch.cuda.get_rng_state(self.device)}

    def set_rng_state(self, state: dict) -> None:
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def describe(self) -> str:
        return f"cuda ({torch.cuda.get_device_name(self.device)})"


def device_synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (for timing a phase); a no-op off CUDA, where
    device work runs synchronously on the calling thread."""
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
) -> Accelerator:
    """The accelerator for ``kind`` ("cpu", "sim", "cuda"; None = cuda if present, else cpu).

    An Accelerator instance is returned as is (tests pass doubles)."""
    if isinstance(kind, Accelerator):
        return kind
    kind = kind or default_kind()
    if kind == "cpu":
        return CpuAccelerator(budget_bytes=budget_bytes)
    if kind == "sim":
        return SimAccelerator(
            strict=strict, budget_bytes=budget_bytes, bandwidth=bandwidth or SIM_BANDWIDTH
        )
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
