"""bench/piece_cost.py: the training thread's CPU per piece and per weight on sim, fitted
over the weights, and the 7B step it comes to."""

from __future__ import annotations

import json

import pytest

from bench import piece_cost as pc


def test_fit_recovers_a_per_weight_and_a_per_piece_cost():
    weights = [{"pieces": p, "cpu_s": 20e-6 + 70e-6 * p} for p in (1, 2, 3, 5, 8)]
    a, b = pc.fit(weights)
    assert a == pytest.approx(20e-6) and b == pytest.approx(70e-6)
    assert pc.fit([{"pieces": 2, "cpu_s": 1.0}, {"pieces": 2, "cpu_s": 3.0}]) == (2.0, 0.0)


def test_at_scale_counts_the_models_weights_and_pieces():
    s = pc.at_scale("llama-7b", 0.1, per_weight=100e-6, per_piece=50e-6)
    assert s["weights"] == 226 and s["bucket_elements"] == 16 * 2**20
    assert 400 < s["pieces"] < 460  # 16M-element pieces (about 1,530 in 4M buckets)
    assert s["cpu_ms"] == pytest.approx((226 * 100e-6 + s["pieces"] * 50e-6) * 1e3)


def test_the_bench_measures_a_sim_run(capsys):
    argv = ["--layers", "2", "--width", "64", "--warmup", "6", "--steps", "4",
            "--piece-elems", "512", "--model", "gpt2", "--json"]  # fmt: skip
    assert pc.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pieces_per_step"] > out["weights"] > 0  # several pieces per weight
    assert out["route_cpu_ms_per_step"] > 0 and out["step_cpu_ms"]["device"] > 0
    assert out["at_scale"]["model"] == "gpt2" and out["at_scale"]["cpu_ms"] > 0
    # the accelerator's calls are counted apart: each piece is one device-to-host copy
    assert out["accel_calls_per_piece"]["copy_d2h"] == pytest.approx(1.0)
    assert out["at_scale_engine"]["cpu_ms"] > 0 and out["engine_per_weight_device_step_us"] > 0
    # the re-selecting run's weights carry per-column counts when its device step is timed
    assert out["per_column"]["weights"] > 0
    assert out["per_column"]["per_weight_device_step_us"] > 0


def test_the_bench_gives_gpu_check_one_result_line_and_refuses_part_windows(capsys):
    argv = ["--layers", "2", "--width", "64", "--warmup", "6", "--steps", "4",
            "--piece-elems", "512", "--model", "gpt2", "--result"]  # fmt: skip
    assert pc.main(argv) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("GPU_CHECK")]
    assert len(lines) == 1
    out = json.loads(lines[0].removeprefix("GPU_CHECK_RESULT "))
    assert out["device"] == "sim" and out["window"]["at_scale"]["cpu_ms"] > 0
    assert out["window"]["per_piece_us"] > 0 and out["window"]["step_cpu_ms"]["zenflow"] > 0
    with pytest.raises(SystemExit) as exc:  # 6 steps: one window and a half
        pc.main(["--steps", "6"])
    assert exc.value.code == 2
    assert "multiple of the update interval" in capsys.readouterr().err


def test_the_engine_part_of_a_fit_leaves_out_the_accelerators_calls():
    weights = [{"pieces": p, "cpu_s": 20e-6 + 70e-6 * p, "accel_s": 30e-6 * p}
               for p in (1, 2, 4)]  # fmt: skip
    a, b = pc.fit(weights, "engine_s")
    assert a == pytest.approx(20e-6) and b == pytest.approx(40e-6)
