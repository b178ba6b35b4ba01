"""The tasks' metrics: accuracy, binary f1 and Matthews correlation, Pearson and Spearman.

``METRICS`` names them (a task lists its own, the headline first), ``compute_metrics``
scores a task's predictions, ``metrics_for`` picks a table task's by its label count.
Plain Python over lists of ids or values; empty or unequal inputs are a ``ValueError``. A
correlation of one pair is undefined: None (JSON null), never a made-up 0.0.

Owns: the formulas. Must not: import torch or run a model (``evaluate`` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zenflow.train.data.task import GlueTask


def accuracy(preds: Sequence[int], labels: Sequence[int]) -> float:
    _same_length(preds, labels)
    return sum(int(p) == int(y) for p, y in zip(preds, labels, strict=True)) / len(labels)


def _confusion(preds, labels) -> tuple[int, int, int, int]:
    tp = fp = fn = tn = 0
    for p, y in zip(preds, labels, strict=True):
        p, y = int(p), int(y)
        if p == 1 and y == 1:
            tp += 1
        elif p == 1:
            fp += 1
        elif y == 1:
            fn += 1
        else:
            tn += 1
    return tp, fp, fn, tn


def f1(preds: Sequence[int], labels: Sequence[int]) -> float:
    """Binary F1 of the positive class (1); 0.0 when there are no true or predicted positives."""
    _same_length(preds, labels)
    tp, fp, fn, _ = _confusion(preds, labels)
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews(preds: Sequence[int], labels: Sequence[int]) -> float:
    """Matthews correlation coefficient (binary); 0.0 when undefined (a constant margin)."""
    _same_length(preds, labels)
    tp, fp, fn, tn = _confusion(preds, labels)
    denom = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denom == 0 else (tp * tn - fp * fn) / denom


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation; 0.0 when either side is constant; None for a single pair (no
    correlation is defined)."""
    _same_length(xs, ys)
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    vx = sum((x - mx) ** 2 for x in xs)
    vy = sum((y - my) ** 2 for y in ys)
    return 0.0 if vx == 0 or vy == 0 else cov / math.sqrt(vx * vy)


def _ranks(xs: Sequence[float]) -> list[float]:
    """1-based ranks, ties get the average of their positions."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman rank correlation (Pearson of average ranks); None for a single pair."""
    _same_length(xs, ys)
    return pearson(_ranks(xs), _ranks(ys))


def _same_length(a, b) -> None:
    if len(a) != len(b) or len(a) == 0:
        raise ValueError(f"metric inputs must be non-empty and equal length ({len(a)}, {len(b)})")


METRICS = {
    "accuracy": accuracy,
    "f1": f1,
    "matthews": matthews,
    "pearson": pearson,
    "spearman": spearman,
}


def compute_metrics(task: GlueTask, preds: Sequence, labels: Sequence) -> dict[str, float | None]:
    """The task's metrics, keyed by name, in the table's order (None where undefined)."""
    out: dict[str, float | None] = {}
    for name in task.metrics:
        value = METRICS[name](preds, labels)
        out[name] = None if value is None else float(value)
    return out


def metrics_for(num_labels: int) -> tuple[str, ...]:
    """Names in data.METRICS; the first is the headline. Binary f1 and matthews score class
    id 1 (the later class in sorted order) as the positive one."""
    if num_labels == 1:
        return ("pearson", "spearman")
    return ("accuracy", "f1", "matthews") if num_labels == 2 else ("accuracy",)
