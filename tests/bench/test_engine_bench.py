"""bench/engine.py: every mode side by side on sim, and the floor waits for its device."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from zenflow.engine.accelerator import SimAccelerator

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "engine.py"
_spec = importlib.util.spec_from_file_location("bench_engine", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = ["--layers", "1", "--width", "64", "--vocab", "256", "--batch", "2", "--seq", "16",
        "--rounds", "1", "--steps", "4", "--warmup", "4", "--json"]  # fmt: skip
BEHIND_S = 0.05


class BehindSim(SimAccelerator):
    """The simulated device, running BEHIND_S behind the host as a GPU does: the work issued
    before a wait completes only then, so a wait for the device (a read) takes BEHIND_S.
    A step that never waits never pays it, and its work is charged to whoever waits next."""

    def read(self, values):
        time.sleep(BEHIND_S)
        return super().read(values)


def _run(capsys, argv, make_accel=None) -> dict:
    assert bench.main(argv, make_accel=make_accel) == 0
    return json.loads(capsys.readouterr().out)


def test_the_floor_waits_for_its_device_once_per_step(capsys):
    """Without the wait the floor's iteration is its host time (a few ms here); with it,
    each iteration includes the device's backlog, and the wait is the one counted read."""
    out = _run(capsys, [*TINY, "--device", "sim", "--modes", "floor,device"], BehindSim)
    floor, device = out["results"]["floor"], out["results"]["device"]
    assert floor["d2h_reads_max"] == 1
    assert floor["iter_ms_median"] >= BEHIND_S * 1e3
    assert device["iter_ms_median"] >= BEHIND_S * 1e3  # an engine's step waits the same way
    # forward+backward is timed by the accelerator's marks, before the wait
    assert floor["fwd_bwd_ms_median"] < floor["iter_ms_median"] - BEHIND_S * 1e3 * 0.9


def test_every_mode_on_sim_reads_the_device_at_most_once_a_step(capsys):
    out = _run(capsys, [*TINY, "--device", "sim"])
    assert list(out["results"]) == list(bench.MODES)
    for mode, r in out["results"].items():
        assert r["d2h_reads_max"] == 1, mode
        assert r["full_syncs_max"] == 0, mode
        assert 0 < r["fwd_bwd_ms_median"] <= r["iter_ms_median"], mode
    assert out["results"]["zenflow-overlap"]["bytes_per_step"] > 0
