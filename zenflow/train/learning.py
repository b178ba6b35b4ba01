"""Learning curves of runs, and how two sets of runs compare across seeds.

A run's curve is its evaluations by step (``{step: value}`` of one metric, e.g. accuracy).
Comparing an engine with a reference (AdamW) over seeds is a paired comparison: both arms
of one seed start from the same weights and see the same batches in the same order, so
the seed's difference carries the comparison and the seed-to-seed spread cancels out of
it. ``paired_gap`` gives the mean difference with a two-sided 95% Student-t interval over
the seeds both arms have.

Used by ``bench/accuracy.py`` (engines x seeds x settings) and ``zfctl report A B`` (the
learning curves of two runs at matching steps). ``weights_seen`` / ``weights_text``: which
weights a ZenFlow evaluation saw (live, with host updates pending, or flushed).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

# Two-sided 95% Student-t quantiles t(0.975, df) for df = 1..30.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t95(df: int) -> float:
    """The two-sided 95% Student-t quantile for ``df`` degrees of freedom (df >= 1); past
    30, 1.96 + 2.4/df (within 0.003 of the exact value)."""
    if df < 1:
        raise ValueError(f"t95: df must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def eval_curve(evals: Iterable[Mapping], key: str = "accuracy") -> dict[int, float]:
    """``{step: value}`` of ``key`` over a run's eval records (a later record of the same
    step wins, as when a resumed run redid an evaluation); records without a finite
    value of ``key`` are left out."""
    curve: dict[int, float] = {}
    for rec in evals:
        step, value = rec.get("step"), rec.get(key)
        if isinstance(step, int) and isinstance(value, (int, float)) and math.isfinite(value):
            curve[step] = float(value)
    return curve


def describe(values: Iterable[float]) -> dict | None:
    """n, mean, sample standard deviation (None for one value), min and max; None when
    there are no values."""
    xs = [float(v) for v in values]
    if not xs:
        return None
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else None
    return {"n": n, "mean": mean, "sd": sd, "min": min(xs), "max": max(xs)}


def paired_gap(values: Mapping, reference: Mapping) -> dict | None:
    """The mean of ``values[s] - reference[s]`` over the keys (seeds) both have, with its
    two-sided 95% Student-t interval (``lo``/``hi`` None with one pair); None when no key
    is shared."""
    seeds = sorted(set(values) & set(reference), key=str)
    diffs = [float(values[s]) - float(reference[s]) for s in seeds]
    d = describe(diffs)
    if d is None:
        return None
    half = t95(d["n"] - 1) * d["sd"] / math.sqrt(d["n"]) if d["n"] > 1 else None
    return {
        "n": d["n"],
        "mean": d["mean"],
        "sd": d["sd"],
        "lo": None if half is None else d["mean"] - half,
        "hi": None if half is None else d["mean"] + half,
        "seeds": seeds,
    }


def matching_steps(curves: Iterable[Mapping[int, float]]) -> list[int]:
    """The steps every curve has, ascending."""
    common: set[int] | None = None
    for c in curves:
        common = set(c) if common is None else common & set(c)
    return sorted(common or ())


WEIGHTS_FIELDS = ("weights", "pending_host_updates", "pending_steps")  # weights_seen's keys


def weights_seen(engine) -> dict:
    """A ZenFlow evaluation's account of the weights it evaluated, for its metrics line:
    "live" while host updates are pending (the in-flight one, the open window's), with how
    many and how many steps of non-selected gradients they hold; "flushed" when every host
    update is in the weights (a run's final evaluation, after its flush). {} for an engine
    whose weights are always current (``pending_host`` None or absent)."""
    pending = getattr(engine, "pending_host", lambda: None)()
    if pending is None:
        return {}
    n = int(pending["host_updates"])
    return {"weights": "live" if n else "flushed", "pending_host_updates": n,
            "pending_steps": int(pending["steps"])}  # fmt: skip


def weights_text(metrics: dict) -> str:
    """``weights_seen``'s words for the dashboard and the report ("" when the line has
    none: an engine whose weights are always current)."""
    seen = metrics.get("weights")
    if seen == "flushed":
        return "flushed weights"
    if seen != "live":
        return ""
    n, steps = metrics.get("pending_host_updates"), metrics.get("pending_steps")
    return (f"live weights: {n} host update{'s' if n != 1 else ''} pending "
            f"({steps} steps of non-selected gradients)")  # fmt: skip
