"""zenflow.hardware.bench: the plan (alternation, whole windows), the summary arithmetic and
the orchestration, with a recording runner in place of the child processes (the real
children run in tests/cli/test_bench.py)."""

from __future__ import annotations

import json

import pytest

from zenflow.errors import UserInputError
from zenflow.hardware import bench
from zenflow.hardware.bench_worker import preset_shape


def test_plan_alternates_every_round_in_the_same_order():
    engines = ("floor", "offload", "zenflow-sync")
    order = [c for _, c in bench.plan(engines, 3)]
    assert order == ["floor", "offload", "zenflow-sync"] * 3  # A B C A B C A B C
    assert [r for r, _ in bench.plan(engines, 3)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_deepspeed_zenflow_runs_in_both_overlap_settings():
    assert bench.contenders(("deepspeed-offload", "deepspeed-zenflow")) == [
        "deepspeed-offload",
        "deepspeed-zenflow[overlap_step=false]",
        "deepspeed-zenflow[overlap_step=true]",
    ]


def test_parse_engines():
    assert bench.parse_engines("zenflow-sync, floor") == ("floor", "zenflow-sync")
    for bad in ("bogus", "floor,bogus", ","):
        with pytest.raises(UserInputError, match="choose from floor, device"):
            bench.parse_engines(bad)


@pytest.mark.parametrize(
    "steps, warmup_windows, fwr, expected",
    [(8, 2, 0, (8, 8)), (5, 2, 0, (8, 8)), (1, 0, 0, (0, 4)), (4, 1, 3, (7, 4))],
)
def test_whole_windows(steps, warmup_windows, fwr, expected):
    block = {**bench.DEFAULT_BLOCK, "full_warm_up_rounds": fwr}
    spec = bench.BenchSpec(steps=steps, warmup_windows=warmup_windows, zenflow=block)
    assert bench.window_steps(spec) == expected


def test_ds_config_per_contender():
    spec = bench.BenchSpec(micro_batch=3)
    assert "zenflow" not in bench.ds_config(spec, "offload")["zero_optimization"]
    assert "zenflow" not in bench.ds_config(spec, "deepspeed-offload")["zero_optimization"]
    for contender, overlap in [("zenflow-sync", False), ("zenflow-overlap", True),
                               ("deepspeed-zenflow[overlap_step=false]", False),
                               ("deepspeed-zenflow[overlap_step=true]", True)]:  # fmt: skip
        block = bench.ds_config(spec, contender)["zero_optimization"]["zenflow"]
        assert block == {**bench.DEFAULT_BLOCK, "overlap_step": overlap}
    assert bench.ds_config(spec, "device")["train_micro_batch_size_per_gpu"] == 3


def test_zenflow_block_from_a_config(tmp_path):
    path = tmp_path / "ds.json"
    zf = {"topk_ratio": 0.2, "update_interval": 2, "select_strategy": "step",
          "select_interval": 6, "overlap_step": True}  # fmt: skip
    offload = {"device": "cpu"}
    path.write_text(
        json.dumps({"zero_optimization": {"stage": 2, "zenflow": zf, "offload_optimizer": offload}})
    )
    block = bench.zenflow_block(path)
    assert (block["topk_ratio"], block["update_interval"], block["select_interval"]) == (0.2, 2, 6)
    assert "overlap_step" not in block  # each engine sets its own
    zf.update(update_interval="auto", select_strategy="auto", select_interval="auto")
    path.write_text(
        json.dumps({"zero_optimization": {"stage": 2, "zenflow": zf, "offload_optimizer": offload}})
    )
    with pytest.raises(UserInputError, match="integer update_interval"):
        bench.zenflow_block(path)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(UserInputError, match="no zero_optimization.zenflow block"):
        bench.zenflow_block(path)


def test_presets():
    assert preset_shape("gpt2") == (12, 768)
    assert preset_shape("4x512") == (4, 512)
    assert preset_shape("2x64") == (2, 64)
    assert preset_shape("openai-community/gpt2") is None
    with pytest.raises(UserInputError, match="multiple of 64"):
        preset_shape("4x100")


def _run(ms, stall=0.0, traffic=0, device=None, windows=()):
    return {"records": [{"ms": m, "stall_ms": stall, "bytes": traffic, "device_bytes": device,
                         "host_update": i in windows, "window_len": 4 if i in windows else 0}
                        for i, m in enumerate(ms)]}  # fmt: skip


def test_summary_arithmetic():
    mb, params = 1000, 250
    results = {
        "floor": [_run([100, 100]), _run([100, 100])],
        "offload": [_run([400, 400], stall=50, traffic=2000), _run([300, 500], stall=50,
                                                                   traffic=2000)],
        "zenflow-sync": [_run([100, 100, 100, 300], stall=20, traffic=500, device=1300,
                              windows={3})],
        "deepspeed-offload": [_run([800, 800], stall=None, traffic=None)],
        "deepspeed-zenflow[overlap_step=false]": [_run([600, 600], stall=None, traffic=None)],
        "deepspeed-zenflow[overlap_step=true]": [_run([900, 700], stall=None, traffic=None)],
    }  # fmt: skip
    s = bench.summarize(results, mb, params)
    assert list(s) == ["floor", "offload", "zenflow-sync", "deepspeed-offload",
                       "deepspeed-zenflow"]  # fmt: skip
    assert s["offload"]["step_ms"] == 400 and s["offload"]["step_ms_median"] == 400
    assert s["offload"]["round_step_ms"] == [400, 400]
    assert s["offload"]["bytes_per_step_over_model"] == 2.0 and s["offload"]["stall_ms"] == 50
    zs = s["zenflow-sync"]
    assert zs["step_ms"] == 150 and zs["step_ms_median"] == 100  # the window end counts
    assert zs["windows"] == 1 and zs["steps"] == 4
    assert zs["device_bytes_per_param"] == 1300 / 250
    assert s["floor"]["device_bytes_per_param"] is None
    assert s["deepspeed-offload"]["stall_ms"] is None  # not reported, not zero
    assert s["deepspeed-offload"]["bytes_per_step_over_model"] is None
    ds = s["deepspeed-zenflow"]
    assert ds["variant"] == "overlap_step=false" and ds["step_ms"] == 600  # the better one
    assert ds["variants"]["overlap_step=true"]["step_ms"] == 800
    assert zs["speedup_vs_deepspeed_offload"] == 800 / 150
    assert zs["ratio_to_floor"] == 1.5
    assert s["floor"]["ratio_to_floor"] == 1.0


def _fake_runner(calls):
    def runner(job):
        calls.append(job)
        if job["engine"] == "prepare-deepspeed":
            return {"ok": True}
        n = job["measured"]
        records = _run([10.0] * n)["records"]
        return {"ok": True, "records": records, "params": 5, "model_bytes": 20,
                "model_source": "fake", "threads": 2, "resolved": {}}  # fmt: skip

    return runner


def test_run_bench_orchestration():
    calls: list[dict] = []
    events: list[dict] = []
    spec = bench.BenchSpec(model="2x64", steps=3, rounds=2,
                           engines=("floor", "zenflow-overlap", "deepspeed-zenflow"))  # fmt: skip
    out = bench.run_bench(spec, on_progress=events.append, runner=_fake_runner(calls))
    assert calls[0]["engine"] == "prepare-deepspeed"  # DeepSpeed's ops built before timing
    runs = [(j["round"], j["engine"]) for j in calls[1:]]
    one_round = ["floor", "zenflow-overlap", "deepspeed-zenflow[overlap_step=false]",
                 "deepspeed-zenflow[overlap_step=true]"]  # fmt: skip
    assert runs == [(0, c) for c in one_round] + [(1, c) for c in one_round]
    assert out["config"]["order"] == one_round * 2
    assert all(j["warmup"] == 8 and j["measured"] == 4 for j in calls[1:])
    ds_ports = [j["env"]["MASTER_PORT"] for j in calls[1:] if "deepspeed" in j["engine"]]
    assert len(set(ds_ports)) == 4  # every DeepSpeed child has its own shm segment name
    assert "env" not in calls[1]  # ours need none
    assert out["engines"]["deepspeed-zenflow"]["steps"] == 8
    assert any("rounded up to 4" in n for n in out["notes"])
    assert events[0] == {"event": "start", "total": 9}
    assert sum(e["event"] == "done" for e in events) == 9
    json.dumps(out, allow_nan=False)  # strict JSON


def test_sim_skips_deepspeed_with_a_note():
    calls: list[dict] = []
    spec = bench.BenchSpec(model="2x64", steps=4, rounds=1, device="sim",
                           engines=("floor", "deepspeed-offload"))  # fmt: skip
    out = bench.run_bench(spec, runner=_fake_runner(calls))
    assert [j["engine"] for j in calls] == ["floor"]
    assert "cpu or cuda only" in out["skipped"]["deepspeed-offload"]
    assert list(out["engines"]) == ["floor"] and out["device"] == "sim"
    spec = bench.BenchSpec(model="2x64", device="sim", engines=("deepspeed-offload",))
    with pytest.raises(UserInputError, match="No engine left"):
        bench.run_bench(spec, runner=_fake_runner([]))


def test_bad_inputs_fail_before_any_child():
    calls: list[dict] = []
    with pytest.raises(UserInputError, match="--device 'tpu'"):
        bench.run_bench(bench.BenchSpec(device="tpu"), runner=_fake_runner(calls))
    with pytest.raises(UserInputError, match="multiple of 64"):
        bench.run_bench(bench.BenchSpec(model="3x99"), runner=_fake_runner(calls))
    assert calls == []


def test_a_child_past_its_deadline_is_stopped_and_named(tmp_path):
    """The child's faulthandler ends it at its deadline with every thread's stack in its log;
    the parent reports which engine and round, and where the log is, instead of waiting."""
    spec = bench.BenchSpec(model="2x64", micro_batch=1, seq_len=4)
    log = tmp_path / "r0-floor.log"
    job = {"model": spec.model, "micro_batch": 1, "seq_len": 4, "device": "cpu", "seed": 0,
           "deadline_s": 1.0, "warmup": 10**9, "measured": 1, "engine": "floor", "round": 0,
           "ds_config": bench.ds_config(spec, "floor"), "log": str(log)}  # fmt: skip
    with pytest.raises(bench.BenchError) as info:
        bench.run_child(job)
    assert "floor (round 1)" in str(info.value) and str(log) in str(info.value)
    assert "Timeout" in log.read_text()  # faulthandler's stack dump
