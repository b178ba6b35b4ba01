"""Moving gradients from the device to the host, for the modes that offload (ZenFlow's
non-selected columns, whole gradients during warm-up and in the offload engine).

One ``Transport`` per engine holds the device buckets, the pinned staging buffers, the
accumulator thread and, with data parallelism, the reductions in flight. Two kinds of
movement:

- ``land_piece``: a gathered piece (a bucket) of a window sum goes on the copy engine
  straight to its place in its weight's pinned step store, where its add waits for the
  step's gate (``accumulator``; ``store_free`` first waits, once per weight and step, for
  the previous step's adds still reading that store);
- ``send_piece``: a gathered piece of a step's micro-batch sum goes to a slot of the pinned
  staging ring (``copies.StagingRing``) and the accumulator adds it into that sum;
- ``send_whole``: a whole gradient goes to a host landing buffer in contiguous chunks, each
  through a device bucket (the gradient is freed at once; only buckets are in flight), or
  through the ring into an fp32 sum (micro-batches summed on the host).

Data parallel (``zenflow.engine.distributed``): a piece is summed into its owner rank's
bucket by an asynchronous reduce issued from the backward hook, so the reductions overlap
backward as DDP's do; the owner copies it to the host once the reduce completed. Work in
flight is completed in issue order (every rank issues the same collectives in the same
order: hooks fire in the same order on every rank), before its bucket is reused and at
the step (``complete``).

Waiting is timed: a hook that waits for a free bucket, a staging buffer or a reduction is
the pipeline stalling backward (``take_wait``).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from zenflow.engine.accelerator import DONE
from zenflow.engine.accumulator import Accumulator
from zenflow.engine.copies import RING_SLOTS, DeviceBuckets, HostStaging, StagingRing
from zenflow.engine.distributed import grad_norm


class Transport:
    """The device buckets, the staging ring, the accumulator and the reductions in flight
    of one engine. ``link_dtype``: the dtype pieces cross the link in (the training dtype;
    bf16 with the compact host state)."""

    def __init__(self, engine, bucket_elems: int, buckets: int, kernels, link_dtype=None):
        e = engine
        self.e = e
        self.accel = e.accel
        self.dp = e.dp
        self.dtype = e.dtype
        self.pin = e.pin_link
        self.bucket_elems = bucket_elems
        self.buckets = DeviceBuckets(e.accel, bucket_elems, e.dtype, buckets)
        self.link_dtype = link_dtype or e.dtype
        # pieces gathered in the training dtype cross in the link's (bf16 for the compact
        # host state of an fp32 model): cast on the device into buckets of their own
        self.link_buckets = None
        if self.link_dtype != e.dtype:
            self.link_buckets = DeviceBuckets(e.accel, bucket_elems, self.link_dtype, buckets)
        self._ring_slots = max(RING_SLOTS, buckets)
        self._rings: dict[torch.dtype, StagingRing] = {}
        self.accumulator = Accumulator(kernels.accumulate, e.host_cores, e.accel.bind_thread,
                                       kernels.keep_i8)  # fmt: skip
        self._staging: dict = {}
        self._pending: deque = deque()  # (work, bucket index or None, continuation)
        self._bucket_pending: dict[int, int] = {}  # bucket -> serial of its pending item
        self._serial = 0
        self._done_serial = 0
        self.wait_s = 0.0

    # ------------------------------------------------------------------ buffers
    def staging(self, group: str, shapes: dict | None = None, pin: bool | None = None,
                tag: str = "staging", views: dict | None = None):  # fmt: skip
        """The pinned host buffers of ``group``, created once: key -> shape, or key -> a
        view of a buffer the caller owns."""
        if group not in self._staging:
            self._staging[group] = HostStaging(
                self.accel, self.dtype, self.pin if pin is None else pin, shapes or {}, tag,
                views,
            )  # fmt: skip
        return self._staging[group]

    def drop_staging(self, group: str) -> None:
        st = self._staging.pop(group, None)
        if st is not None:
            st.wait_all()

    def take_bucket(self, shape):
        i = self.buckets._next
        if i in self._bucket_pending:  # a reduction still reads it: finish up to there
            self.complete(upto=self._bucket_pending[i])
        t0 = time.perf_counter()
        out = self.buckets.take(shape)
        self.wait_s += time.perf_counter() - t0
        return out

    def take_staging(self, staging: HostStaging, key) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = staging.take(key)
        self.wait_s += time.perf_counter() - t0
        return buf

    def ring(self, dtype: torch.dtype | None = None) -> StagingRing:
        """The staging ring of ``dtype`` (default: the link's; a whole gradient crosses in
        the training dtype), made on first use."""
        dtype = dtype or self.link_dtype
        if dtype not in self._rings:
            self._rings[dtype] = StagingRing(self.accel, dtype, self._ring_slots,
                                             self.bucket_elems, self.pin)  # fmt: skip
        return self._rings[dtype]

    def take_slot(self, ring: StagingRing, shape) -> tuple[int, torch.Tensor]:
        """A slot of ``ring`` (a wait here is the link stalling backward)."""
        t0 = time.perf_counter()
        out = ring.take(shape)
        self.wait_s += time.perf_counter() - t0
        return out

    def take_wait(self) -> float:
        w, self.wait_s = self.wait_s, 0.0
        return w

    # ------------------------------------------------------------------ movement
    def _on_link(self, bucket_i: int, bucket: torch.Tensor):
        """(buckets, index, tensor) of what crosses the link for ``bucket``: itself, or its
        cast to the link's dtype, made on the device in a link bucket of its own."""
        if self.link_buckets is None:
            return self.buckets, bucket_i, bucket
        j, cast = self.link_buckets.take(bucket.shape)
        cast.copy_(bucket)
        # read on the compute stream, where its next gather is queued too: no event
        self.buckets.mark(bucket_i, DONE)
        return self.link_buckets, j, cast

    def send_piece(self, bucket_i: int, bucket: torch.Tensor, dst, gate, overwrite: bool,
                   stat=None, wait=None, keep=None) -> None:  # fmt: skip
        """Copy a gathered ``bucket`` (in the link's dtype) to a ring slot, then add it into
        ``dst`` (the piece's compact view of a sum) with ``gate`` (after ``wait``) once the
        adds queued before it ran (micro-batches summed on the host: no gate); ``keep``:
        the slot's 8-bit copy and the correction before it (``Accumulator.add``)."""
        buckets, bucket_i, bucket = self._on_link(bucket_i, bucket)
        ring = self.ring(bucket.dtype)
        i, staged = self.take_slot(ring, bucket.shape)
        ev = self.accel.copy_d2h(staged, bucket)
        buckets.mark(bucket_i, ev)
        self.accumulator.add(ev, staged, dst, gate, overwrite, lambda: ring.give(i), stat, wait,
                             keep)  # fmt: skip

    def store_free(self, key) -> None:
        """Wait until no add of the previous step reads ``key``'s step store (a wait here is
        the host stalling backward), before that weight's first piece of the step lands."""
        t0 = time.perf_counter()
        self.accumulator.wait_free(key)
        self.wait_s += time.perf_counter() - t0

    def land_piece(self, bucket_i: int, bucket: torch.Tensor, store: torch.Tensor, dst, gate,
                   overwrite: bool, key, wait=None) -> None:  # fmt: skip
        """Copy a gathered ``bucket`` straight into ``store`` (its place in its weight's
        pinned step store: no ring slot, no host copy), then add it into ``dst`` with the
        step's ``gate`` (after ``wait``), in order (``Accumulator.land``). The caller waited
        for ``store_free(key)`` before the weight's first piece of the step."""
        buckets, bucket_i, bucket = self._on_link(bucket_i, bucket)
        ev = self.accel.copy_d2h(store, bucket)
        buckets.mark(bucket_i, ev)
        self.accumulator.land(ev, store, dst, gate, overwrite, key, wait=wait)

    def send_whole(self, g: torch.Tensor, chunks, owner: int, *, landing=None, sums=None,
                   staging=None, first: bool = True, stat=None, sq_out: list | None = None,
                   events: list | None = None) -> None:  # fmt: skip
        """A whole gradient ``g`` to its owner's host, chunk by chunk through the device
        buckets (so the gradient itself is free at once and only buckets are in flight):
        into ``landing`` (flat, training dtype; the copy events go to ``events``), or, with
        ``sums`` (flat fp32), through ``staging`` (per chunk; None: the ring) into that sum
        (``first``: overwrite).
        Data parallel: each chunk is reduced into the owner's bucket first; the owner's
        chunk squares go to ``sq_out`` (the averaged gradient's norm)."""
        dp, accel = self.dp, self.accel
        flat = g.reshape(-1)
        for lo, hi in chunks:
            i, bucket = self.take_bucket((hi - lo,))
            bucket.copy_(flat[lo:hi])

            def onward(i=i, bucket=bucket, lo=lo, hi=hi):
                if dp.enabled:
                    if not dp.owns(owner):
                        self.buckets.mark(i, accel.record_compute())
                        return
                    bucket.mul_(1.0 / dp.world)
                    if sq_out is not None:
                        sq_out.append(grad_norm(bucket).square())
                if sums is None:
                    ev = accel.copy_d2h(landing[lo:hi], bucket)
                    self.buckets.mark(i, ev)
                    events.append(ev)
                    return
                if staging is None:
                    ring = self.ring(bucket.dtype)
                    slot, staged = self.take_slot(ring, (hi - lo,))
                    release = lambda ring=ring, slot=slot: ring.give(slot)  # noqa: E731
                else:
                    key = (lo, hi)
                    staged = self.take_staging(staging, key)
                    release = lambda key=key: staging.give(key)  # noqa: E731
                ev = accel.copy_d2h(staged, bucket)
                self.buckets.mark(i, ev)
                self.accumulator.add(ev, staged, sums[lo:hi], None, first, release, stat)

            if dp.enabled:
                self.after_reduce(dp.reduce_async(bucket, owner), i, onward)
            else:
                onward()

    # ------------------------------------------------------------------ data parallel
    def after_reduce(self, work, bucket_i: int | None, continuation) -> None:
        """Queue ``continuation`` to run once ``work`` (a collective reading bucket
        ``bucket_i``, or None) completed."""
        self._serial += 1
        self._pending.append((self._serial, work, bucket_i, continuation))
        if bucket_i is not None:
            self._bucket_pending[bucket_i] = self._serial

    def complete(self, upto: int | None = None) -> None:
        """Finish the collectives in flight (in issue order) up to serial ``upto`` (all)."""
        while self._pending and (upto is None or self._pending[0][0] <= upto):
            serial, work, bucket_i, continuation = self._pending.popleft()
            t0 = time.perf_counter()
            if work is not None:
                work.wait()
            self.wait_s += time.perf_counter() - t0
            if bucket_i is not None and self._bucket_pending.get(bucket_i) == serial:
                del self._bucket_pending[bucket_i]
            continuation()

    def close(self) -> None:
        self.accumulator.close()
