"""Which rows go where, seeded: the held-out eval split, each epoch's order, the
micro-batches, the steps of an epoch.

Every choice is a function of the seed (and the epoch) only, so a resumed run sees the
same rows in the same order as an uninterrupted one. ``batches`` and ``eval_batches``
take any ``source.Rows`` (classification ``Encoded`` rows, causal-LM ``SFTData`` rows).

Owns: splitting, order and batching. Must not: tokenise or read files.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from zenflow.errors import DataError
from zenflow.train.data.readers import plural
from zenflow.train.data.source import Rows


def seeded_split(rows: Sequence, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): ``round(eval_fraction * n)`` random rows held out, at least 1, and at
    least 1 left to train. Deterministic for a seed; by row, not stratified by class. Both
    parts keep the file's order."""
    n = len(rows)
    if not 0 < eval_fraction < 1:
        raise DataError(f"The eval fraction must be between 0 and 1, got {eval_fraction}.")
    if n < 2:
        raise DataError(
            f"Cannot hold out eval rows from {plural(n, 'row')}; give at least 2 rows or an "
            "eval file."
        )
    n_eval = min(max(1, round(eval_fraction * n)), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


def steps_per_epoch(n_examples: int, micro_batch: int, grad_accum: int = 1) -> int:
    """Optimizer steps in one epoch: the last incomplete step's examples are dropped."""
    per_step = micro_batch * grad_accum
    if n_examples < per_step:
        raise DataError(
            f"The training split has {n_examples} examples, fewer than one optimizer step "
            f"needs ({micro_batch} micro-batch x {grad_accum} accumulation = {per_step}). "
            "Lower --micro-batch or gradient_accumulation_steps, or use more data."
        )
    return n_examples // per_step


def epoch_permutation(n: int, seed: int, epoch: int):
    """The example order of one epoch: a function of (seed, epoch) only."""
    import torch

    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + epoch) % (2**63))
    return torch.randperm(n, generator=g)


def batches(
    encoded: Rows, micro_batch: int, seed: int, epoch: int, start_index: int = 0
) -> Iterator[tuple[int, dict]]:
    """Shuffled micro-batches of one epoch, resumable.

    Yields ``(next_index, batch)`` where ``next_index`` is the position in the epoch's order
    after this batch (pass it back as ``start_index`` to continue). The incomplete last
    micro-batch is dropped so every batch has the same shape.
    """
    if start_index % micro_batch:
        raise ValueError(f"start_index {start_index} is not a multiple of {micro_batch}")
    order = epoch_permutation(len(encoded), seed, epoch)
    n_full = len(encoded) // micro_batch * micro_batch
    for i in range(start_index, n_full, micro_batch):
        yield i + micro_batch, encoded.take(order[i : i + micro_batch].tolist())


def eval_batches(encoded: Rows, batch_size: int, limit: int | None = None) -> Iterator[dict]:
    """In-order batches of the first ``limit`` examples (all when None); last may be short."""
    n = len(encoded) if limit is None else min(limit, len(encoded))
    for i in range(0, n, batch_size):
        yield encoded.take(range(i, min(i + batch_size, n)))
