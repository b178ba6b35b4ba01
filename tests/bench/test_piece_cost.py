"""bench/piece_cost.py: the training thread's CPU per piece and per weight on sim, fitted
over the weights, and the 7B step it comes to."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bench import piece_cost as pc


def test_fit_recovers_a_per_weight_and_a_per_piece_cost():
    weights = [{"pieces": p, "cpu_s": 20e-6 + 70e-6 * p} for p in (1, 2, 3, 5, 8)]
    a, b = pc.fit(weights)
    assert a == pytest.approx(20e-6) and b == pytest.approx(70e-6)
    assert pc.fit([{"pieces": 2, "cpu_s": 1.0}, {"pieces": 2, "cpu_s": 3.0}]) == (2.0, 0.0)


def test_at_scale_counts_the_models_weights_and_pieces():
    s = pc.at_scale("llama-7b", 0.1, per_weight=100e-6, per_piece=50e-6)
    assert s["weights"] == 226 and s["bucket_elements"] == 48 * 2**20
    assert s["pieces"] == 230  # 48M-element pieces: a layer weight in one (432 in 16M)
    assert s["cpu_ms"] == pytest.approx((226 * 100e-6 + s["pieces"] * 50e-6) * 1e3)


def test_the_bench_measures_a_sim_run(capsys):
    argv = ["--layers", "2", "--width", "64", "--warmup", "6", "--steps", "4",
            "--piece-elems", "512", "--model", "gpt2", "--json"]  # fmt: skip
    assert pc.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert "llama and qwen2" in out["stack"]["skipped"]  # gpt2 has no scaled stack
    assert out["pieces_per_step"] > out["weights"] > 0  # several pieces per weight
    assert out["route_cpu_ms_per_step"] > 0 and out["step_cpu_ms"]["device"] > 0
    assert out["at_scale"]["model"] == "gpt2" and out["at_scale"]["cpu_ms"] > 0
    # the accelerator's calls are counted apart: each piece is one device-to-host copy
    assert out["accel_calls_per_piece"]["copy_d2h"] == pytest.approx(1.0)
    assert out["at_scale_engine"]["cpu_ms"] > 0 and out["engine_per_weight_device_step_us"] > 0
    # the re-selecting run's weights carry per-column counts when its device step is timed
    assert out["per_column"]["weights"] > 0
    assert out["per_column"]["per_weight_device_step_us"] > 0


def test_the_bench_collects_garbage_after_its_warm_up_not_in_its_measured_steps(
    monkeypatch, capsys
):
    """A full collection due after set-up (0.2 s at 600k objects) must not land in a
    measured step: the bench collects once, after the warm-up steps of each run."""
    from zenflow import ZenFlowEngine

    steps, at = [0], []
    step = ZenFlowEngine.step

    def counted(self, *a, **k):
        steps[0] += 1
        return step(self, *a, **k)

    monkeypatch.setattr(ZenFlowEngine, "step", counted)
    # the bench's own calls only (its module's ``gc``), not torch's or anyone else's
    monkeypatch.setattr(pc, "gc", SimpleNamespace(collect=lambda *a: at.append(steps[0])))
    argv = ["--layers", "2", "--width", "64", "--warmup", "5", "--steps", "4",
            "--piece-elems", "512", "--model", "gpt2", "--json"]  # fmt: skip
    assert pc.main(argv) == 0
    capsys.readouterr()
    assert len(at) >= 3  # device AdamW, ZenFlow, ZenFlow re-selecting
    assert [n % (5 + 4) for n in at] == [5] * len(at)  # each after its run's warm-up


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


def test_the_stack_has_the_models_weights_and_pieces():
    """llama-7b's stack scaled to width 64 has its 226 weights, and its buckets make the
    model's own 230 pieces: what is measured on it is a 7B step's calls, one for one."""
    st = pc.Stack("llama-7b", 64)
    assert st.factor == 64 and st.cfg.hidden_size == 64 and st.cfg.vocab_size == 500
    assert st.bucket_elems == 48 * 2**20 // 64**2
    model = st.build()
    from zenflow import ZenFlowEngine
    from zenflow.engine.accelerator import make_accelerator

    with ZenFlowEngine(model, pc.config(True), mode="zenflow", accelerator=make_accelerator("sim"),
                       bucket_elems=st.bucket_elems, min_numel=st.min_numel) as eng:  # fmt: skip
        batch = torch.randint(1, st.cfg.vocab_size, (1, 8))
        for _ in range(2):  # warm-up and the first selection: the pieces are planned
            with eng.autocast():
                loss = st.loss(model, batch)
            eng.backward(loss)
            eng.step(loss)
            eng.zero_grad()
        ws = eng.impl.zweights
        assert len(ws) == len(st.census.zenflow_weights) == 226
        assert sum(len(w.pieces) for w in ws) == 230
    with pytest.raises(ValueError, match="llama and qwen2"):
        pc.Stack("gpt2", 64)


def test_the_bench_measures_a_llama_stack(capsys):
    argv = ["--layers", "2", "--width", "64", "--warmup", "6", "--steps", "4",
            "--piece-elems", "512", "--model", "llama-1b", "--stack-also", str(4 << 20),
            "--json"]  # fmt: skip
    assert pc.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    st, also = out["stack"], out["stack_also"]
    # the same stack in smaller pieces: more of them, the model's count in that bucket
    assert also["model_bucket_elements"] == 4 << 20 and "device" not in also["step_cpu_ms"]
    assert also["pieces"] > st["pieces"] and abs(also["pieces"] - also["model_pieces"]) <= 2
    # llama-1b's 128,256-token vocabulary does not divide by 32: its embedding's pieces
    # may round one apart (llama-7b's stack matches exactly, above)
    assert st["weights"] == st["model_weights"] == 113
    assert abs(st["pieces"] - st["model_pieces"]) <= 1
    # the hooks timed whole: the route is part of them (in the metered run, which times it)
    assert st["metered"]["hooks_ms"] > st["metered"]["route_ms"] > 0
    assert st["hooks_ms"] > 0 and st["device_step_ms"] > 0 and st["metered"]["accel_ms"] > 0
    assert st["cpu_ms"] == pytest.approx(st["hooks_ms"] + st["device_step_ms"])
    assert 0 < st["engine_cpu_ms"] < st["cpu_ms"]
    assert st["step_cpu_ms"]["zenflow"] > st["step_cpu_ms"]["device"] > 0


def test_an_unmetered_run_leaves_the_accelerators_calls_untimed(monkeypatch):
    """The figures' run times the step, the hooks and the device step and nothing inside
    them: the accelerator's calls stay its own methods (a metered run wraps them)."""
    made, real = [], pc.make_accelerator
    monkeypatch.setattr(pc, "make_accelerator", lambda name: made.append(real(name)) or made[-1])
    args = SimpleNamespace(layers=1, width=32, vocab=64, seq=4, piece_elems=None, warmup=4,
                           steps=4, device="sim")  # fmt: skip
    for metered in (False, True):
        out = pc.run("zenflow", args, metered=metered)
        accel = made[-1]
        own = all(getattr(getattr(accel, n), "__func__", None) is getattr(type(accel), n)
                  for n in pc.ACCEL_CALLS)  # fmt: skip
        assert own is not metered
        assert (out["weights"] == []) is not metered
        assert (sum(out["accel_calls_per_step"].values()) == 0) is not metered
