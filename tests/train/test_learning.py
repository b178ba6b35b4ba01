"""Learning curves and the paired seed comparison behind bench/accuracy.py and report."""

from __future__ import annotations

import math

import pytest

from zenflow.train.learning import describe, eval_curve, matching_steps, paired_gap, t95


def test_t95_exact_table_and_tail():
    assert t95(1) == 12.706 and t95(4) == 2.776 and t95(30) == 2.042
    assert abs(t95(60) - 2.000) < 0.003 and abs(t95(120) - 1.980) < 0.003
    with pytest.raises(ValueError):
        t95(0)


def test_eval_curve_takes_the_last_record_of_a_step_and_skips_missing_values():
    evals = [
        {"step": 100, "accuracy": 0.7},
        {"step": 200, "accuracy": 0.8, "eval_loss": 0.4},
        {"step": 100, "accuracy": 0.75},  # a resumed run redid step 100
        {"step": 300, "accuracy": None},
        {"step": 400, "accuracy": math.nan},
        {"step": 500},
    ]
    assert eval_curve(evals) == {100: 0.75, 200: 0.8}
    assert eval_curve(evals, "eval_loss") == {200: 0.4}


def test_describe():
    d = describe([0.80, 0.82, 0.84])
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.82)
    assert d["sd"] == pytest.approx(0.02) and (d["min"], d["max"]) == (0.80, 0.84)
    assert describe([0.5])["sd"] is None
    assert describe([]) is None


def test_paired_gap_uses_the_common_seeds_and_a_t_interval():
    arm = {1: 0.80, 2: 0.83, 3: 0.81, 4: 0.90}
    ref = {1: 0.82, 2: 0.84, 3: 0.84}  # seed 4 has no reference: left out
    g = paired_gap(arm, ref)
    diffs = [-0.02, -0.01, -0.03]
    assert g["n"] == 3 and g["seeds"] == [1, 2, 3]
    assert g["mean"] == pytest.approx(-0.02) and g["sd"] == pytest.approx(0.01)
    half = 4.303 * 0.01 / math.sqrt(3)
    assert (g["lo"], g["hi"]) == (pytest.approx(-0.02 - half), pytest.approx(-0.02 + half))
    assert g["lo"] < min(diffs) and max(diffs) < g["hi"] > 0  # 3 seeds: 0 still inside
    # pairing removes the seed-to-seed spread: the same shift on very different seeds
    g = paired_gap({1: 0.70, 2: 0.90}, {1: 0.71, 2: 0.91})
    assert g["mean"] == pytest.approx(-0.01) and g["hi"] - g["lo"] == pytest.approx(0, abs=1e-9)
    one = paired_gap({1: 0.8}, {1: 0.7})
    assert one["mean"] == pytest.approx(0.1) and one["lo"] is None
    assert paired_gap({1: 0.8}, {2: 0.7}) is None


def test_matching_steps():
    assert matching_steps([{100: 1, 200: 2, 300: 3}, {200: 1, 300: 1, 400: 1}]) == [200, 300]
    assert matching_steps([]) == []
