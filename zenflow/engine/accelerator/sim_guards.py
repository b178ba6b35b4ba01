"""Sim's strict-mode guards: what makes a missing wait on a simulated copy fail loudly.

Two guards (see ``sim.py``): the destination of a copy is poisoned (``poison_``: NaN, or the
most negative integer) from enqueue until the copy completes, so a read that does not wait
for its event corrupts the result; and a copy's source is checksummed (``checksum``) at
enqueue, or at the instant its ``after`` event completes (``_AfterGuard``), and again when
the copy engine runs it, so a buffer rewritten before its copy completed raises
:class:`SourceChanged`. This module holds the guards' values and checks only: it must not
queue, time or carry out copies (the copy engine in ``sim.py`` does).
"""

from __future__ import annotations

import torch

from zenflow.ops import sim_pool


def checksum(t: torch.Tensor) -> int:
    """A cheap checksum of a tensor's bytes (the source guard): the sum of its 16- or 32-bit
    words, position-weighted so that swapped words change it too. Its temporaries are the
    simulator's, neither device nor engine memory: they stay out of the device pool."""
    with sim_pool.mode(sim_pool.HOST):
        return _checksum(t)


def _checksum(t: torch.Tensor) -> int:
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
