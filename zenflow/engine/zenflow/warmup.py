"""Whole-gradient steps: warm-up and the first selection.

Warm-up steps (a full host AdamW of every ZenFlow weight) and the first selection (its
column scores need the whole gradient) send the whole gradient to the host instead of
pieces, in contiguous chunks (``route``: its landing buffers). This room owns what those
steps do with it once it has landed: the full synchronous host step and the device image of
its result (bf16), and the first selection from the whole gradient, after which the
selected columns' gradient is on the device and the rest in the window sum, as a streamed
step would have left them. Must not touch the pieces' path, the window's host job or the
hand-over itself (``handover``).
"""

from __future__ import annotations

import time

import torch

from zenflow.engine.accelerator import DONE
from zenflow.engine.baselines import host_full_step
from zenflow.engine.selection import column_scores
from zenflow.engine.zenflow.handover import Handover
from zenflow.engine.zenflow.host_layout import gather
from zenflow.engine.zenflow.route import GradRoute
from zenflow.engine.zenflow.state import ZfWeight
from zenflow.engine.zenflow.window import Window


class Warmup:
    """The steps that take the whole gradient on the host.

    ``mode``: the ZenFlowMode (its engine, weights, settings, copy pipeline and the step's
    plan); ``grad_route``: where the whole gradients landed; ``handover``: the selection;
    ``window``: the auto interval's statistics the first selection's masses start."""

    def __init__(self, mode, grad_route: GradRoute, handover: Handover, window: Window):
        self.m = mode
        self.e = mode.e
        self.grad_route = grad_route
        self.handover = handover
        self.window = window
        self.images: dict[str, torch.Tensor] = {}  # warm-up: bf16 results for the device

    def warmup_step(self, hp, coef: float) -> None:
        """Full synchronous update: ZenFlow weights by the host AdamW, the rest on device."""
        e = self.e
        e.rec.warmup = True
        t0 = time.perf_counter()
        e.dense_update(hp)
        e.rec.devopt_s += time.perf_counter() - t0
        # device counts start when a column is selected: it carries the host's count
        owned = [w for w in self.m.zweights if w.owned]
        if self.m.zero_copy:
            items = [(w.spec.param, w.host, w.col_inner, w.grad(), None) for w in owned]
            host_full_step(e, items, hp, 1.0, in_place=True)
        else:
            self.grad_route.wait_landing()
            items = [(w.spec.param, w.host, w.col_inner, self._landing_grad(w),
                      self._warmup_image(w)) for w in owned]  # fmt: skip
            host_full_step(e, items, hp, coef)
        if e.dp.enabled:  # each owner's updated weights to every rank
            for w in self.m.zweights:
                e.dp.broadcast_(w.spec.param.data, w.owner)

    def _landing_grad(self, w: ZfWeight) -> torch.Tensor:
        """``w``'s whole gradient as it landed on the host, shaped as the weight."""
        land = self.grad_route.landing.get(w.spec.name)
        if land is None:  # no gradient this step
            return torch.zeros(w.spec.param.shape, dtype=torch.float32)
        return land.view(w.spec.param.shape)

    def _warmup_image(self, w: ZfWeight) -> torch.Tensor | None:
        """Where a bf16 weight's warm-up result is written for the device: a pinned buffer of
        its own, kept for the warm-up steps and freed after the first selection."""
        p = w.spec.param
        if p.dtype != torch.bfloat16:
            return None
        if w.spec.name not in self.images:
            self.images[w.spec.name] = self.e.accel.host_empty(
                p.shape, p.dtype, self.e.pin_link, "landing"
            )
        return self.images[w.spec.name]

    def first_selection(self, t: int, coef: float) -> None:
        """The first selection, from the whole gradient on its owner's host: score, select,
        hand over; then the selected columns' gradient goes to the device buffer and the
        rest into the window sum, as a streamed step would have left them."""
        e, dp = self.e, self.e.dp
        self.grad_route.wait_landing()
        scores, host_scores = [], []
        for w in self.m.zweights:
            if w.owned:
                with e.accel.host_scope():  # the landed gradient: host work
                    host_scores.append(column_scores(self._landing_grad(w), w.cd))
                if dp.enabled:  # all-reduced on the device
                    scores.append(host_scores[-1].to(e.device))
            else:
                scores.append(torch.zeros(w.n_cols, dtype=torch.float32, device=e.device))
        # data parallel: the scores are all-reduced in place; one rank: top-k on the host
        if dp.enabled:
            self.handover.select(t, scores)
        else:
            self.handover.select(t, host_scores, host_scores)
        if self.m.update_interval is None:  # the step's masses, from the same scores
            if dp.enabled:  # the averaged scores are on the device: one read
                masses = []
                for w, sc in zip(self.m.zweights, scores, strict=True):
                    masses += [sc[w.sel_dev].sum(), sc[w.nonsel_dev].sum()]
                self.window.auto_update(e.accel.read(masses), coef)
            else:  # the scores were computed on the host: no read
                masses = []
                for w, sc in zip(self.m.zweights, host_scores, strict=True):
                    masses += [float(sc[w.sel_host].sum()), float(sc[w.nonsel_host].sum())]
                self.window.auto_update(masses, coef)
        acc = self.m.transport.accumulator
        for w in self.m.zweights:
            if w.owned:
                with e.accel.host_scope():  # the landed gradient's parts: host memory
                    self._split_landed(w, acc)
                acc.drain()  # the window sum is written before the next weight's landing
                w.fresh[0] = False
            if dp.enabled:
                dp.broadcast_(w.grad_sel, w.owner)
        self._release_landing()

    def _split_landed(self, w: ZfWeight, acc) -> None:
        """``w``'s landed gradient: its selected columns to the device buffer, the rest into
        the window sum."""
        e = self.e
        g = self._landing_grad(w)
        sel = gather(self.m, g, w.cd, w.sel_host).to(w.grad_sel.dtype)
        e.accel.compute_wait(e.accel.copy_h2d(w.grad_sel, sel))
        ns = self._compact_out(w, g)
        gather(self.m, g, w.cd, w.nonsel_host, out=ns.view(w.compact_shape()))
        if ns.dtype != self.m.link_dtype:  # as the pieces cross the link (compact)
            ns = ns.to(self.m.link_dtype)
        acc.add(DONE, ns, w.acc[0], self.m.plan.gate, True, None)

    def _compact_out(self, w: ZfWeight, g: torch.Tensor) -> torch.Tensor:
        """A flat buffer of N elements in ``g``'s dtype that overlaps neither ``g`` (the
        landing) nor, in another dtype, the window sum: the compacted non-selected columns
        go there before they are scaled into the window sum (an fp32 gradient: the window
        sum itself, scaled in place; else one weight's temporary)."""
        if g.dtype == w.acc[0].dtype:
            return w.acc[0]
        return torch.empty(w.compact_numel, dtype=g.dtype)

    def _release_landing(self) -> None:
        """Landing buffers live while whole-gradient steps remain (warm-up, the first
        selection), then go back to the allocator (the ones of their own)."""
        if self.handover.selected:
            self.grad_route.release_landing()
            self.images.clear()
