"""Device-to-host reads through one reused pinned buffer (``Accelerator.read_buffer``).

A checkpoint's device tensors and a hand-over's leaving columns come to the host through
the accelerator's read buffer, never through a new pinned tensor per read (torch's caching
pinned allocator keeps every such block for the rest of the process). Tensors are copied
as bytes in their own dtype, several into one buffer fill when they fit (one wait for the
device per fill), a large one in buffer-sized chunks; each fill is copied out into plain
(pageable) host tensors before the buffer is reused.

Owns ``DeviceReader`` only: the buffer itself, the copies and their events are the
accelerator's. Must not import a backend; the training thread is its only user.
"""

from __future__ import annotations

import torch


class DeviceReader:
    """Reads of device tensors batched through ``accel.read_buffer()``.

    ``add(key, tensors)`` queues the tensors' copies (waiting for earlier ones when the
    buffer is full); ``ready()`` returns the (key, host tensors) read completely so far;
    ``finish()`` waits for the rest and returns them. ``read(tensors)``: one call. With
    ``counted``, every wait for a buffer fill is a device-to-host read (``syncs.reads``).
    On a shared-memory device (cpu) the host tensors are plain copies."""

    def __init__(self, accel, counted: bool):
        self.accel = accel
        self.counted = counted
        self._buf: torch.Tensor | None = None
        self._queued: list = []  # (host bytes view, buffer offset, length)
        self._last = None  # the last queued copy's event (copies complete in order)
        self._used = 0
        self._open: dict = {}  # key -> host tensors, not read completely yet
        self._adding = None  # the key being queued (not complete at a flush inside it)
        self._done: list = []
        self._shared_read = False  # a shared-memory device was read (one wait, counted)

    def _buffer(self) -> torch.Tensor:
        if self._buf is None:
            self._buf = self.accel.read_buffer()
        return self._buf

    def add(self, key, tensors: list[torch.Tensor]) -> None:
        with self.accel.host_scope():
            outs = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
        self._open[key] = outs
        self._adding = key
        for t, out in zip(tensors, outs, strict=True):
            if t.numel() == 0:
                continue
            if self.accel.shared_memory:  # the device is host memory: a copy is the read
                self.accel.copy_d2h(out, t.detach())
                self._shared_read = True
                continue
            self._queue(t.detach().reshape(-1).view(torch.uint8), out.view(-1).view(torch.uint8))
        self._adding = None
        if not self._queued:
            self._close(all_keys=True)

    def _queue(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        cap = self._buffer().numel()
        n = src.numel()
        if self._used and self._used + n > cap:  # does not fit behind what is queued
            self._flush()
        off = 0
        while off < n:
            if self._used == cap:
                self._flush()
            take = min(cap - self._used, n - off)
            lo = self._used
            self._last = self.accel.copy_d2h(self._buf[lo : lo + take], src[off : off + take])
            self._queued.append((dst[off : off + take], lo, take))
            self._used += take
            off += take

    def _flush(self) -> None:
        """Wait for the queued copies (in order on the copy engine: the last one's event)
        and copy them out of the buffer."""
        if self._last is None:
            return
        self._last.synchronize()
        if self.counted:
            self.accel.syncs.reads += 1
        for dst, lo, n in self._queued:
            dst.copy_(self._buf[lo : lo + n])
        self._queued, self._last, self._used = [], None, 0
        self._close(all_keys=False)

    def _close(self, all_keys: bool) -> None:
        """Keys whose copies are all out of the buffer move to ``ready`` (after a flush:
        every key but the one being queued)."""
        keep = {} if all_keys or self._adding not in self._open else \
            {self._adding: self._open.pop(self._adding)}  # fmt: skip
        self._done.extend(self._open.items())
        self._open = keep

    def ready(self) -> list:
        out, self._done = self._done, []
        return out

    def finish(self) -> list:
        self._flush()
        if self.counted and self._shared_read:
            self.accel.syncs.reads += 1  # a shared-memory read: one wait, as elsewhere
        self._shared_read = False
        self._close(all_keys=True)
        return self.ready()

    def read(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self.add(0, tensors)
        return self.finish()[0][1]
