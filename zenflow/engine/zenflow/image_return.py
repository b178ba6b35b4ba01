"""The result return: a host step's result back into the device weights.

Owns the host->device leg: ONLY the non-selected columns, by index. The device reads the
compact fp32 master itself (pinned where the backend pins; no image of it exists), piece
by piece into fp32 device buckets of its own, and casts as it scatters them into W by index
(bf16: round to nearest even, what the host kernel's bf16 image was; the fp32 master is
never overwritten), either at the end of a step (``apply``) or, with overlap, during the
window-end step's backward (``apply_in_backward``). The master is stable from the host
step's end until the next one is submitted, which waits for these copies first
(``window``). Also owns which weights already went back this step and the staleness
figure. Must not touch the window sums, the host job or the worker (``window``), nor the
selected columns (the device step's).

With ``zfctl.return_image`` (a bf16 model on a separate device, one rank) the host step
also writes a bf16 image of its result in the same pass (``images_for``: pinned, one per
weight, kept while windows use it), and the return sends that instead of the master: half
the bytes, the same values (both round to nearest even). The image is stable exactly when
the master is.

With ``overlap_step`` a host step runs while the next window trains and its result reaches
W at the end of that next window: non-selected columns lag by at most 2S steps (S without
overlap).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from zenflow.engine.copies import DeviceBuckets
from zenflow.engine.host import HostJob
from zenflow.engine.zenflow.state import ZfWeight


class ImageReturn:
    """Host results into the device weights (the non-selected columns only).

    ``mode``: the ZenFlowMode (its engine, weights, settings and copy pipeline)."""

    def __init__(self, mode):
        self.m = mode
        self.e = mode.e
        # fp32 device buckets the master's pieces come back into: two of their own when the
        # training dtype is not fp32 or, with overlap, when the window-end step's backward
        # brings the previous host step's result back (``apply_in_backward``: its
        # host->device copies run beside the backward's device->host ones); else the
        # transport's fp32 buckets
        self.h2d: DeviceBuckets | None = None
        self._cast: torch.Tensor | None = None
        self.in_backward = False
        self._h2d_queue: deque = deque()  # (bucket index, bucket, copy event, weight, piece)
        self.applied_early: set[int] = set()  # weights the window end need not apply
        self.applied_in_backward = 0  # weights applied so, over the run (stats, tests)
        self.max_staleness = 0
        # zfctl.return_image: bf16 images of host results (position -> compact image), made
        # by the host steps of the windows that use them, freed when none does any more
        self.images: dict[int, torch.Tensor] = {}
        self.image_setting = "never"
        if mode.transport is not None:
            self.in_backward = mode.overlap and not mode.e.dp.enabled
            if self.in_backward or mode.e.dtype != torch.float32:
                self.h2d = DeviceBuckets(mode.e.accel, mode.bucket_elems, torch.float32, 2)
            if self.h2d is not None and mode.e.dtype != torch.float32:
                # one bucket of the training dtype each returned fp32 piece is cast into
                # before its scatter (on the compute stream, in order: reused at once),
                # accounted, not a new tensor a piece
                self._cast = mode.e.accel.empty((mode.bucket_elems,), mode.e.dtype, "staging")
            if mode.e.dtype == torch.bfloat16 and not mode.e.dp.enabled:
                self.image_setting = mode.e.return_image

    def images_for(self, t: int) -> dict[int, torch.Tensor] | None:
        """The bf16 images the host step of the window ending at step ``t`` writes (by
        weight position), or None when its result goes back as the master itself:
        zfctl.return_image "always", or "early" while zfctl.early's phase runs."""
        setting = self.image_setting
        if setting == "never" or (setting == "early" and self.m.early.early_step(t) is None):
            return None
        accel = self.e.accel
        for w in self.m.zweights:
            if w.owned and w.n_nonsel > 0 and w.position not in self.images:
                self.images[w.position] = accel.host_empty(
                    w.host.master.shape, torch.bfloat16, self.e.pin_link, "images"
                )  # fmt: skip
        return self.images

    def _source(self, w: ZfWeight, job: HostJob) -> torch.Tensor:
        """What ``w``'s result is read from, flat: ``job``'s bf16 image of it, else the
        compact fp32 master."""
        images = job.meta.get("images")
        if images is not None and w.position in images:
            return images[w.position].view(-1)
        return w.host.master.view(-1)

    def apply_in_backward(self, w: ZfWeight, job: HostJob) -> None:
        """The window-end step applies ``job`` at its end; its columns of ``w`` go back now,
        in ``w``'s backward hook (the last micro-batch's: no later forward reads ``w``
        before the step ends), when the worker has written ``w``'s image already. Each
        piece's host->device copy runs while backward goes on; its scatter into the weight
        waits one piece (``_finish_h2d``), so the device never waits for the copy it just
        queued. Values and order are the end-of-step apply's (``apply`` skips ``w``): no
        reader of ``w``'s non-selected columns comes between, the selected columns' update
        touches other columns, and every scatter is done before the step's device update
        (``collect``). A skipped step keeps what it applied: the same values are applied
        again at the window's real end."""
        if w.position not in job.meta.get("ready", ()) or not w.owned:
            return
        t0 = time.perf_counter()
        src = self._source(w, job)
        for pc in w.pieces:
            if len(self._h2d_queue) >= 2:
                self._finish_h2d()
            i, bucket = self.h2d.take(pc.shape, src.dtype)
            ev = self.e.accel.copy_h2d(bucket, pc.of(src))
            job.copies.append(ev)
            self._h2d_queue.append((i, bucket, ev, w, pc))
        self.applied_early.add(w.position)
        self.applied_in_backward += 1
        self.m.transport.wait_s += time.perf_counter() - t0  # a wait here stalls backward

    def _finish_h2d(self) -> None:
        """Scatter the oldest piece copied back in the backward into its weight."""
        i, bucket, ev, w, pc = self._h2d_queue.popleft()
        accel = self.e.accel
        accel.compute_wait(ev)
        dst, dim, idx = pc.select(w.spec.param.data, w.nonsel_dev)
        dst.index_copy_(dim, idx, self._in_dtype(bucket, dst.dtype))
        self.h2d.mark(i, accel.record_compute())

    def _in_dtype(self, bucket: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``bucket`` as ``dtype`` for its scatter: itself, or (an fp32 piece of a bf16
        model, the only other case) cast into the cast bucket."""
        if bucket.dtype == dtype:
            return bucket
        cast = self._cast[: bucket.numel()].view(bucket.shape)
        cast.copy_(bucket)
        return cast

    def finish(self) -> None:
        """Every piece copied back in the backward into its weight, before any update of
        the step (``collect``): the wait counts as stall."""
        t0 = time.perf_counter()
        while self._h2d_queue:
            self._finish_h2d()
        self.e.rec.stall_s += time.perf_counter() - t0

    def apply(self, job: HostJob, t: int) -> None:
        """Copy the host result into the device weights: ONLY the non-selected columns, by
        index, cast to the training dtype (the fp32 master is never overwritten). Weights
        whose columns went back in this step's backward are skipped."""
        e = self.e
        t0 = time.perf_counter()
        early, self.applied_early = self.applied_early, set()
        for w in self.m.zweights:
            if w.position in early:  # went back during this step's backward
                continue
            if self.m.zero_copy:
                self._apply_shared(w)
            else:
                self._apply_pieces(w, job)
        job.applied_step = t
        if self.images and job.meta.get("images") is None:
            # a window without images has ended and its host step has run, after the
            # copies that read the last images (``Window``): nothing reads them any more.
            # Emptied in place: the host log's jobs hold the same dict.
            self.images.clear()
        # Staleness: the oldest gradient in this update is from job.window_start; the device
        # sees it at the end of step t. With overlap t is the end of the NEXT window, so
        # non-selected columns lag by at most 2S steps (S without overlap).
        self.max_staleness = max(self.max_staleness, t - job.window_start + 1)
        e.rec.host_update = True
        e.rec.stall_s += time.perf_counter() - t0

    def _apply_pieces(self, w: ZfWeight, job: HostJob) -> None:
        """``w``'s result through fp32 buckets, piece by piece (data parallel: the owner's
        to every rank)."""
        e, dp = self.e, self.e.dp
        p = w.spec.param.data
        if self.h2d is not None:
            take, buckets = self.h2d.take, self.h2d
        else:  # an fp32 model without overlap: the transport's own (fp32) buckets
            take, buckets = self.m.transport.take_bucket, self.m.transport.buckets
        src = self._source(w, job) if w.owned else None
        image = src is not None and src.dtype != torch.float32  # only into ``self.h2d``
        for pc in w.pieces:
            i, bucket = take(pc.shape, src.dtype) if image else take(pc.shape)
            if w.owned:
                ev = e.accel.copy_h2d(bucket, pc.of(src))
                job.copies.append(ev)
                e.accel.compute_wait(ev)
            if dp.enabled:  # the owner's result to every rank's device
                dp.broadcast_(bucket, w.owner)
            dst, dim, idx = pc.select(p, w.nonsel_dev)
            dst.index_copy_(dim, idx, self._in_dtype(bucket, p.dtype))
            buckets.mark(i, e.accel.record_compute())

    def _apply_shared(self, w: ZfWeight) -> None:
        """A CPU device: the compact master scattered into W (the scatter is the copy,
        counted at W's dtype; data parallel: the owner's to every rank)."""
        e, dp = self.e, self.e.dp
        p = w.spec.param.data
        if w.owned:
            vals = w.host.master.to(p.dtype)
            e.accel.traffic.h2d_bytes += vals.numel() * p.element_size()
        else:
            shape = list(p.shape)
            shape[w.cd] = w.n_cols - w.k
            vals = torch.empty(shape, dtype=p.dtype, device=p.device)
        if dp.enabled:
            dp.broadcast_(vals, w.owner)
        p.index_copy_(w.cd, w.nonsel_dev, vals)
