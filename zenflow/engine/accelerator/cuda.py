"""The ``cuda`` backend: torch.cuda.

Copies run on two dedicated copy streams (one per direction), ordered against the compute
stream by events; host buffers the device reads or writes are pinned; events the host waits
on block instead of spinning, and are reused from a pool (``EventPool``) once nobody holds
them; phases are timed with CUDA events, never with a full synchronize. Device memory is
read from the caching allocator's counters. Of the backends only this one calls torch.cuda,
``pin_memory`` or ``non_blocking``; it must not import the sim or its guards.

Pinned memory is what it says: a pinned buffer is pageable memory (``torch.empty``)
registered with the driver (``cudaHostRegister``) over whole pages of its own, and
unregistered by a finalizer before it is freed, so what is locked is what was asked (to the
page), never the power-of-two block torch's caching pinned allocator would round it up to
and keep for the process. Only the model inputs' small buffers still come from that
allocator, and are counted at its rounded size.
"""

from __future__ import annotations

import mmap
import os
import warnings
import weakref

import torch

from zenflow.engine.accelerator.base import Accelerator, _nbytes
from zenflow.engine.accelerator.numa import pci_numa_node

PAGE = 4096


def _unregister(ptr: int) -> None:
    """Unlock a registered range (finalizer; before its memory is freed)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


def page_aligned_empty(shape, dtype) -> torch.Tensor:
    """An uninitialised (zero-filled) host tensor on pages of its own: an anonymous mapping
    of whole pages, so its storage starts on a page boundary. torch asks the driver whether
    a tensor is pinned with its storage's first byte (``is_pinned``), so the registered
    range must start there, not inside the storage."""
    numel = 1
    for s in shape:
        numel *= int(s)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(PAGE, -(-numel * itemsize // PAGE) * PAGE)
    with warnings.catch_warnings():  # the mapping is writable; torch warns for any buffer
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return flat[: numel * itemsize].view(dtype).view(tuple(shape))


def registered_empty(shape, dtype) -> torch.Tensor:
    """An uninitialised host tensor on pages of its own, registered with the driver (pinned:
    ``is_pinned()`` is True and non_blocking copies from/to it are asynchronous)."""
    t = page_aligned_empty(shape, dtype)
    storage = t.untyped_storage()
    ptr, locked = storage.data_ptr(), storage.nbytes()
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, locked, 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {locked:,} bytes failed (cudaError {err})")
    # the storage dies (and the finalizer unlocks its pages before they are unmapped) only
    # once the last tensor on it is gone, views included
    weakref.finalize(storage, _unregister, ptr)
    return t


class CudaEvent:
    """torch.cuda.Event with the event interface of ``base.py`` (query, synchronize).
    With ``pool``, the event goes back there when this holder is dropped (``EventPool``)."""

    __slots__ = ("event", "pool")

    def __init__(self, event, pool: EventPool | None = None):
        self.event = event
        self.pool = pool

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def __del__(self) -> None:
        pool = self.pool
        if pool is not None:
            pool.give(self.event)


def _cuda_event(timing: bool = False):
    # blocking=True: a host thread waiting on it sleeps instead of spinning on a core the
    # core split gave to someone else.
    return torch.cuda.Event(blocking=True, enable_timing=timing)


EVENT_POOL_MAX = 256  # events kept for reuse: more than the copies and marks ever in flight


class EventPool:
    """Reused CUDA events (issue 28 item 3): every copy records two events and every mark
    one, and a new torch.cuda.Event costs its creation at the first record and its
    destruction when dropped. An event comes back here when the last holder of its
    ``CudaEvent`` drops it, so no host code can wait on its old record any more; a wait
    the device queued before took the record it saw (CUDA: a stream waits for the event's
    most recent record at the time of the wait call), so recording it again, even before
    that record completed, changes no ordering. An event only waited on at once (a copy
    stream's wait for the compute stream) goes back at once (``give``). Thread-safe: a
    list's pop and append are atomic, and a holder may be dropped on any thread."""

    __slots__ = ("_free", "_make", "created")

    def __init__(self, make=_cuda_event):
        self._free: list = []
        self._make = make
        self.created = 0  # events made (the rest were reused)

    def take(self):
        """An event to record: a reused one, else a new one."""
        try:
            return self._free.pop()
        except IndexError:
            self.created += 1
            return self._make()

    def give(self, event) -> None:
        """``event`` is free to record again (nobody holds it)."""
        if len(self._free) < EVENT_POOL_MAX:
            self._free.append(event)

    def holder(self, event) -> CudaEvent:
        """``event``, recorded, for the engine to hold; back here once dropped."""
        return CudaEvent(event, self)


# On CUDA the training thread launches kernels and runs the engine's Python; its CPU tensor
# work is small. The host's memory-bound kernels scale with threads (an H200 box, make
# gpu-check: the accumulate 70 GB/s on 8 threads, 112 on 16; the CPU Adam 75 and 100), so
# of pt_reserved_cores_perc's share the training thread keeps this many (issue 28 item 6).
# ZENFLOW_CUDA_TRAINING_THREADS replaces it (a measurement's other arm, e.g. 8 for the
# even split an H200 box ran before).
CUDA_TRAINING_THREADS = 2
TRAINING_THREADS_ENV = "ZENFLOW_CUDA_TRAINING_THREADS"


def cuda_training_threads() -> int:
    """How many of its reserved cores the training thread keeps on CUDA: the environment's
    ``ZENFLOW_CUDA_TRAINING_THREADS``, else ``CUDA_TRAINING_THREADS``."""
    text = os.environ.get(TRAINING_THREADS_ENV, "").strip()
    if not text:
        return CUDA_TRAINING_THREADS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{TRAINING_THREADS_ENV}={text!r} is not a whole number of threads "
            f"(1 or more); unset it for the default {CUDA_TRAINING_THREADS}"
        )
    return value


def cuda_core_split(training: int, host: int) -> tuple[int, int]:
    """(training, host) threads on a CUDA device from the reserved-share split: the training
    thread keeps at most ``cuda_training_threads()``, the host gets the rest."""
    kept = max(1, min(training, cuda_training_threads()))
    return kept, host + training - kept


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
        self.events = EventPool()

    def _pin(self, shape, dtype) -> torch.Tensor:
        return registered_empty(shape, dtype)

    host_yields = True
    lends_host_cores = True

    def compute_threads(
        self, reserved_share: float, overlap: bool, ranks_per_node: int = 1
    ) -> tuple[int, int]:
        """The base split, then the training thread keeps at most ``cuda_training_threads()``
        of its reserved cores and the host work takes the rest (``cuda_core_split``)."""
        return cuda_core_split(*super().compute_threads(reserved_share, overlap, ranks_per_node))

    def _pinned_size(self, nbytes: int) -> int:
        return max(PAGE, -(-nbytes // PAGE) * PAGE)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def numa_node(self, index: int | None = None) -> int | None:
        i = self.device.index if index is None else index
        props = torch.cuda.get_device_properties(0 if i is None else i)
        try:  # the sysfs PCI address, as nvidia-smi topo reads it
            address = (f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:"
                       f"{props.pci_device_id:02x}.0")  # fmt: skip
        except AttributeError:  # a torch without the PCI fields
            return None
        return pci_numa_node(address)

    def _copy(self, dst, src, direction: str, after, dev_tensor):
        compute = torch.cuda.current_stream(self.device)
        stream = self.streams[direction]
        events = self.events
        ready = events.take()
        ready.record(compute)  # the source (d2h) / the destination's last reader (h2d)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            events.give(ready)  # the wait is queued: nobody else reads this record
            if after is not None:
                if isinstance(after, CudaEvent):
                    stream.wait_event(after.event)
                else:
                    after.synchronize()
            dst.copy_(src, non_blocking=True)
            # the caching allocator must not reuse the device block before the copy ran
            dev_tensor.record_stream(stream)
            done = events.take()
            done.record(stream)
        if direction == "d2h":
            self.traffic.d2h_bytes += _nbytes(src)
        else:
            self.traffic.h2d_bytes += _nbytes(src)
        return events.holder(done)

    def copy_d2h(self, dst, src, after=None):
        return self._copy(dst, src, "d2h", after, src)

    def copy_h2d(self, dst, src, after=None):
        return self._copy(dst, src, "h2d", after, dst)

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
        else:  # small and few (one per input name and shape): the caching allocator's
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.count_caching_pinned(buf, "inputs")
        buf.copy_(t)
        out = buf.to(self.device, non_blocking=True)
        done = _cuda_event()
        done.record(torch.cuda.current_stream(self.device))
        self._input_pool[key] = (buf, done)
        return out

    def record_compute(self):
        ev = self.events.take()
        ev.record(torch.cuda.current_stream(self.device))
        return self.events.holder(ev)

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
