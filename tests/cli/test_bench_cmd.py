"""`zfctl bench` through the CLI, with real child processes on a tiny GPT-2 (2 layers x 64):
every engine asked for is in the table and the JSON with sane values, runs alternate, the
window-end steps are counted, DeepSpeed's engines run behind their deadline, and bad input
exits 2. No timing is asserted (the machine is shared): only that times are positive."""

from __future__ import annotations

import json
import re

import pytest
from clihelp import assert_user_error

OURS = ["floor", "device", "offload", "zenflow-sync", "zenflow-overlap"]
QUICK = ["--model", "2x64", "--rounds", "2", "--steps", "4", "--warmup-windows", "1",
         "--micro-batch", "2", "--seq-len", "8"]  # fmt: skip


def test_bench_our_engines(cli, tmp_path):
    out = tmp_path / "bench.json"
    r = cli("bench", *QUICK, "--engines", ",".join(OURS), "--json", out)
    assert r.exit_code == 0, r.output
    for name in OURS:  # a row per engine, with numbers
        assert re.search(rf"^ {name} +\d+\.\d ", r.output, flags=re.M), (name, r.output)
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu"
    assert doc["model_bytes"] == 4 * doc["params"] > 0  # fp32
    assert list(doc["engines"]) == OURS
    # instrumented alternation: A B C D E A B C D E
    assert doc["config"]["order"] == OURS * 2
    assert doc["config"]["steps"] == 4 and doc["config"]["warmup_steps"] == 4
    for name, e in doc["engines"].items():
        assert e["steps"] == 8, name  # 2 rounds x 4 measured steps
        assert e["step_ms"] > 0 and e["step_ms_median"] > 0, name
        assert len(e["round_step_ms"]) == 2, name
        assert e["speedup_vs_deepspeed_offload"] is None  # not in this run
        assert e["ratio_to_floor"] == pytest.approx(
            e["step_ms"] / doc["engines"]["floor"]["step_ms"]
        )
    eng = doc["engines"]
    # floor has no optimizer: no traffic, no stall; device AdamW copies nothing either
    assert eng["floor"]["bytes_per_step_over_model"] == 0 and eng["floor"]["stall_ms"] == 0
    assert eng["device"]["bytes_per_step_over_model"] == 0
    # ZeRO-Offload: every gradient down and every weight up, each step
    assert eng["offload"]["bytes_per_step_over_model"] == pytest.approx(2.0)
    assert eng["offload"]["stall_ms"] > 0
    for name in ("zenflow-sync", "zenflow-overlap"):
        assert 0 < eng[name]["bytes_per_step_over_model"] < 2.0, name  # less than offload
        # one window of 4 per round, and its window-end step is among the measured ones
        assert eng[name]["windows"] == 2, name
    # the resolved engine settings behind each row
    resolved = doc["config"]["resolved"]
    assert resolved["zenflow-sync"]["overlap_step"] is False
    assert resolved["zenflow-overlap"]["overlap_step"] is True
    assert resolved["offload"]["mode"] == "offload"


def test_bench_deepspeed_engines(cli, tmp_path):
    """DeepSpeed's engines, each round in its own child with a deadline (a cold op build
    fits inside it); deepspeed-zenflow is measured in both overlap settings."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "bench.json"
    r = cli("bench", *QUICK, "--rounds", "1", "--engines",
            "floor,deepspeed-offload,deepspeed-zenflow", "--json", out)  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    eng = doc["engines"]
    assert list(eng) == ["floor", "deepspeed-offload", "deepspeed-zenflow"]
    assert doc["config"]["order"] == ["floor", "deepspeed-offload",
                                      "deepspeed-zenflow[overlap_step=false]",
                                      "deepspeed-zenflow[overlap_step=true]"]  # fmt: skip
    ds = eng["deepspeed-zenflow"]
    assert set(ds["variants"]) == {"overlap_step=false", "overlap_step=true"}
    best = min(ds["variants"], key=lambda k: ds["variants"][k]["step_ms"])
    assert ds["variant"] == best and ds["step_ms"] == ds["variants"][best]["step_ms"]
    assert ds["windows"] == 1  # the window end of DeepSpeed's ZenFlow is counted too
    for name in ("deepspeed-offload", "deepspeed-zenflow"):
        e = eng[name]
        assert e["steps"] == 4 and e["step_ms"] > 0
        assert e["stall_ms"] is None and e["bytes_per_step_over_model"] is None  # unobservable
        assert e["device_bytes_per_param"] is None
    assert eng["deepspeed-offload"]["speedup_vs_deepspeed_offload"] == 1.0
    assert doc["config"]["resolved"]["deepspeed-offload"]["engine"] == "deepspeed"
    assert "deepspeed-zenflow (" in r.output  # the row names the setting it is shown in


def test_bench_sim_skips_deepspeed(cli, tmp_path):
    out = tmp_path / "bench.json"
    r = cli("bench", *QUICK, "--rounds", "1", "--device", "sim",
            "--engines", "floor,deepspeed-offload", "--json", out)  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "deepspeed-offload skipped" in r.output
    doc = json.loads(out.read_text())
    assert list(doc["engines"]) == ["floor"] and "deepspeed-offload" in doc["skipped"]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--engines", "bogus"], ["--engines", "bogus", "deepspeed-zenflow"]),
        (["--device", "tpu"], ["--device", "tpu", "cpu, sim, cuda"]),
        (["--model", "4x100"], ["4x100", "multiple of 64"]),
        (["--config", "missing.json"], ["missing.json", "zfctl init"]),
    ],
)
def test_bench_bad_input(cli, args, fragments):
    assert_user_error(cli("bench", *args), *fragments)


def test_bench_json_onto_a_directory_is_refused_before_benchmarking(cli, tmp_path, monkeypatch):
    from zenflow.hardware import bench

    ran = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: ran.append(a))
    assert_user_error(cli("bench", "--json", tmp_path), f"--json: cannot write {tmp_path}",
                      "it is a directory")  # fmt: skip
    assert ran == [] and list(tmp_path.iterdir()) == []
