"""bench/window_lr.py: the window treatments' pace against AdamW, on synthetic gradients."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "window_lr.py"
_spec = importlib.util.spec_from_file_location("bench_window_lr", SCRIPT)
wlr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wlr)


def test_a_window_step_moves_noise_sqrt_s_and_signal_s_times_its_lr():
    """S = 4. Pure noise: the window's mean has half a step's noise, so one Adam step on it
    moves an element twice as far (relative to its lr) as an AdamW step moves it in
    expectation over the same four steps' worth of lr: "last" spreads 1/2 as far as AdamW,
    "sum" 2x, "sqrt" 1x. Pure signal: Adam's step is lr-sized either way, so the drift is
    the lr's share: "last" 1/4, "sum" 1, "sqrt" 1/2."""
    noise, signal = wlr.study(interval=4, steps=200, n=20_000, snrs=(0.0, 10.0))
    assert noise["last"]["spread"] == pytest.approx(0.5, rel=0.08)
    assert noise["sum"]["spread"] == pytest.approx(2.0, rel=0.08)
    assert noise["sqrt"]["spread"] == pytest.approx(1.0, rel=0.08)
    assert signal["last"]["drift"] == pytest.approx(0.25, rel=0.05)
    assert signal["sum"]["drift"] == pytest.approx(1.0, rel=0.05)
    assert signal["sqrt"]["drift"] == pytest.approx(0.5, rel=0.05)


def test_bad_arguments_exit_2(capsys):
    assert wlr.main(["--interval", "0"]) == 2
    assert "--interval >= 1" in capsys.readouterr().err
