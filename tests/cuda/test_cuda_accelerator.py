"""The CUDA accelerator's own contract (zenflow/engine/accelerator/cuda.py CudaAccelerator),
checked where a missing wait would show: copies ordered against long-running kernels,
device blocks reused while a copy still reads them, pinned buffers really page-locked and
locked at the size asked.

``torch.cuda._sleep(cycles)`` keeps a stream busy without touching memory: a copy issued
behind it that did not wait for its event would read or be read too early.
"""

from __future__ import annotations

import threading

import pytest
import torch
from cudahelp import CUDA_TIER, REAL_CUDA, record

pytestmark = [*CUDA_TIER, REAL_CUDA]

# ~10-50 ms on a current GPU (the clock varies): long against a 4 MiB copy (~0.2 ms)
SPIN = 50_000_000
N = 1 << 20  # elements: 4 MiB of fp32


@pytest.fixture
def accel():
    from zenflow.engine.accelerator import make_accelerator

    a = make_accelerator("cuda")
    yield a
    a.close()
    torch.cuda.synchronize()


def test_pinned_host_buffers_and_counted_copies(accel):
    h = accel.host_empty((N,), torch.float32, pin=True, tag="staging")
    plain = accel.host_empty((N,), torch.float32, pin=False, tag="host")
    assert h.is_pinned() and not plain.is_pinned()
    assert accel.pinned_bytes() >= 4 * N
    h.copy_(torch.arange(N, dtype=torch.float32))
    d = accel.empty((N,), torch.float32, "staging")
    assert accel.held()["staging"] == 4 * N
    accel.compute_wait(accel.copy_h2d(d, h))
    back = accel.host_empty((N,), torch.float32, pin=True)
    accel.copy_d2h(back, d).synchronize()
    assert torch.equal(back, h)
    assert accel.traffic.h2d_bytes == accel.traffic.d2h_bytes == 4 * N


def test_pinned_memory_is_what_was_asked(accel):
    """Issue 27: a pinned buffer is pageable memory registered with the driver: what is
    locked is what was asked (to the page), not torch's power-of-two caching block; it is
    really pinned (an asynchronous copy from a view of it), and it is unlocked (and
    uncounted) once its last view is gone; reads go through the one reused read buffer."""
    import gc

    asked = 3 * N + 5  # far from a power of two: the caching allocator would lock 16 MiB
    before = accel.pinned_bytes()
    h = accel.host_empty((asked,), torch.float32, pin=True, tag="link")
    page = 4096
    assert accel.pinned_bytes() - before == -(-4 * asked // page) * page
    assert accel.caching_pinned_bytes() == 0
    view = h[N:]
    assert view.is_pinned()
    view.copy_(torch.arange(view.numel(), dtype=torch.float32))
    d = accel.empty(view.shape, torch.float32, "staging")
    accel.compute_wait(accel.copy_h2d(d, view))
    assert torch.equal(d.cpu(), view)
    del h
    gc.collect()
    assert accel.pinned_bytes() - before > 0  # the view keeps the pages locked
    del view
    gc.collect()
    assert accel.pinned_bytes() == before
    x = torch.arange(5 * N, device=accel.device, dtype=torch.float32)
    accel.read_buffer_bytes = 4 * N  # smaller than x: the read goes in several fills
    assert torch.equal(accel.to_host(x), x.cpu())
    assert accel.pinned_held()["read_buffer"] >= 4 * N
    assert torch.equal(accel.to_host(x[:7]), x[:7].cpu())  # the same buffer, reused
    assert accel.pinned_held()["read_buffer"] < 2 * 4 * N


def test_device_to_host_copy_waits_for_the_compute_stream(accel):
    """A value written by the compute stream behind a long kernel reaches the host copy."""
    x = torch.zeros(N, device=accel.device)
    torch.cuda._sleep(SPIN)
    x.fill_(3.0)
    h = accel.host_empty((N,), torch.float32, pin=True)
    ev = accel.copy_d2h(h, x)
    ev.synchronize()
    assert bool((h == 3.0).all()), "the copy ran before the compute stream wrote its source"


def test_compute_waits_for_a_host_to_device_copy(accel):
    """Device work after ``compute_wait(event)`` sees the whole copy, even when the copy
    stream is held up behind other work."""
    h = accel.host_empty((N,), torch.float32, pin=True)
    h.fill_(5.0)
    d = accel.zeros((N,), torch.float32, "staging")
    with torch.cuda.stream(accel.streams["h2d"]):
        torch.cuda._sleep(SPIN)  # the copy engine is busy: the copy starts late
    ev = accel.copy_h2d(d, h)
    accel.compute_wait(ev)
    total = d.sum()  # compute stream
    assert accel.read([total]) == [5.0 * N]


def test_a_device_source_is_not_reused_before_its_copy_ran(accel):
    """The caching allocator must not hand a freed source block to new work while a copy
    on the copy stream still reads it (``record_stream``)."""
    h = accel.host_empty((N,), torch.float32, pin=True)
    with torch.cuda.stream(accel.streams["d2h"]):
        torch.cuda._sleep(SPIN)  # the copy will run late
    x = torch.full((N,), 7.0, device=accel.device)
    ev = accel.copy_d2h(h, x)
    del x  # freed while the copy is queued
    y = torch.full((N,), -1.0, device=accel.device)  # same size: the freed block if allowed
    ev.synchronize()
    assert bool((h == 7.0).all()), "the copy read a block reused by later work"
    del y


def test_copies_reuse_their_events_and_stay_ordered(accel):
    """Issue 28 item 3: a copy's events come from the accelerator's pool and go back when
    dropped (the copy stream's wait event at once), so 200 copies, each behind a kernel
    that changes its source, make only a handful of events, and every copy still reads its
    source after that kernel and before the next one."""
    src = torch.arange(N, dtype=torch.float32, device=accel.device)
    outs = [accel.host_empty((N,), torch.float32, pin=True) for _ in range(2)]
    busy = [None, None]  # each landing buffer's last copy, as a bucket holds it
    for i in range(200):
        j = i % 2
        if busy[j] is not None:
            busy[j].synchronize()
        torch.cuda._sleep(SPIN // 100)  # the compute stream runs behind the host
        src.add_(1)
        busy[j] = accel.copy_d2h(outs[j], src)
        accel.compute_wait(accel.record_compute())  # a mark made and dropped, like a bucket's
    for ev in busy:
        ev.synchronize()
    base = torch.arange(N, dtype=torch.float32)
    assert torch.equal(outs[1], base + 200) and torch.equal(outs[0], base + 199)
    created = accel.events.created
    record("event_pool", copies=200, events_created=created)
    assert created <= 8, created


def test_pooled_pinned_inputs_stay_correct(accel):
    """``to_device_input`` reuses one pinned buffer per shape: earlier inputs keep their
    values once the buffer is refilled."""
    outs, srcs = [], []
    for i in range(4):
        t = torch.arange(N, dtype=torch.float32) * (i + 1)
        srcs.append(t)
        outs.append(accel.to_device_input(t))
    for t, o in zip(srcs, outs, strict=True):
        assert torch.equal(o.cpu(), t)


def test_copies_from_a_bound_background_thread(accel):
    """Host threads (accumulator, worker) bind the device first, then wait on events."""
    x = torch.full((N,), 2.0, device=accel.device)
    ev = accel.record_compute()
    seen = {}

    def body():
        accel.bind_thread()
        seen["device"] = torch.cuda.current_device()
        ev.synchronize()
        h = accel.host_empty((N,), torch.float32, pin=True)
        accel.copy_d2h(h, x).synchronize()
        seen["sum"] = float(h.sum())

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=60)
    assert seen == {"device": accel.device.index, "sum": 2.0 * N}


def test_timing_reads_and_memory_counters(accel):
    start = accel.mark()
    torch.cuda._sleep(SPIN // 10)
    end = accel.mark()
    reads = accel.syncs.reads
    assert accel.read([torch.ones((), device=accel.device) * 2]) == [2.0]
    assert accel.syncs.reads == reads + 1
    ms = accel.elapsed_ms(start, end)
    assert ms > 0
    assert accel.device_bytes() == torch.cuda.memory_allocated(accel.device)
    assert accel.peak_bytes() == torch.cuda.max_memory_allocated(accel.device)
    record("accelerator_timing", sleep_ms=ms, device=accel.describe())


def test_peak_held_is_per_step(accel):
    """``peak_held`` after ``reset_peak`` describes the time since the reset (as on sim)."""
    t = accel.empty((4 * N,), torch.float32, "grads")  # 16 MiB, freed before the reset
    del t
    accel.reset_peak()
    small = accel.empty((N,), torch.float32, "staging")
    assert accel.peak_held().get("grads", 0) == 0, accel.peak_held()
    assert accel.peak_held()["staging"] == 4 * N
    assert accel.held().get("grads", 0) == 0
    del small
