"""zenflow.hw: probe parsers on fixture text, the pure decision logic, small real probes."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest

from zenflow import hw

# Two physical cores, two hyper-threads each: processors 0..3, core ids 0, 1, 0, 1.
CPUINFO_2x2 = "\n\n".join(
    f"""processor\t: {i}
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Test CPU @ 2.00GHz
physical id\t: 0
siblings\t: 4
core id\t\t: {i % 2}
cpu cores\t: 2
flags\t\t: fpu sse sse2 avx avx2 fma avx512f amx_tile amx_bf16"""
    for i in range(4)
)

MEMINFO = """MemTotal:       16384000 kB
MemFree:         1000000 kB
MemAvailable:    8192000 kB
Buffers:            1234 kB
"""


def test_parse_cpuinfo_counts_physical_cores_and_flags():
    info = hw.parse_cpuinfo(CPUINFO_2x2)
    assert info["model"] == "Intel(R) Xeon(R) Test CPU @ 2.00GHz"
    assert info["logical"] == 4
    assert info["physical"] == 2
    simd = hw.simd_support(info["flags"])
    assert simd == {"avx2": True, "fma": True, "avx512f": True, "avx512_bf16": False, "amx": True}


def test_parse_cpuinfo_without_core_ids_counts_logical():
    text = "processor\t: 0\nmodel name\t: X\nflags\t: avx2\n\nprocessor\t: 1\nmodel name\t: X\n"
    info = hw.parse_cpuinfo(text)
    assert (info["logical"], info["physical"]) == (2, 2)
    assert hw.simd_support(info["flags"])["avx2"] is True
    assert hw.simd_support(info["flags"])["fma"] is False


def test_parse_meminfo_bytes():
    mem = hw.parse_meminfo(MEMINFO)
    assert mem == {"total_bytes": 16384000 * 1024, "available_bytes": 8192000 * 1024}
    # Old kernels without MemAvailable: fall back to MemFree.
    assert hw.parse_meminfo("MemTotal: 10 kB\nMemFree: 4 kB\n")["available_bytes"] == 4096


def test_sysfs_topology_and_numa(tmp_path):
    cpu_root, node_root = tmp_path / "cpu", tmp_path / "node"
    for i, core in enumerate([0, 1, 0, 1]):
        topo = cpu_root / f"cpu{i}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    (cpu_root / "cpufreq").mkdir()  # not a cpuN directory
    for n in ("node0", "node1"):
        (node_root / n).mkdir(parents=True)
    (node_root / "possible").write_text("0-1\n")
    assert hw.sys_physical_cores(cpu_root) == 2
    assert hw.count_numa_nodes(node_root) == 2
    assert hw.count_numa_nodes(tmp_path / "missing") == 1

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO_2x2)
    probe = hw.probe_cpu(cpuinfo, cpu_root, node_root)
    assert (probe.logical_cores, probe.physical_cores, probe.numa_nodes) == (4, 2, 2)


def test_probe_cpu_on_this_machine():
    probe = hw.probe_cpu()
    assert probe.logical_cores >= 1
    assert 1 <= probe.physical_cores <= probe.logical_cores
    assert 1 <= probe.usable_cores <= probe.logical_cores
    assert probe.simd["avx2"] is True  # every machine of this project has AVX2
    assert probe.numa_nodes >= 1
    assert probe.model != "unknown"


def test_probe_memory_and_accelerator_on_this_machine():
    mem = hw.probe_memory(buffer_mb=8, repeats=2)
    assert 0 < mem.available_bytes <= mem.total_bytes
    assert mem.copy_gbs > 0 and mem.add_gbs > 0
    assert mem.buffer_bytes == 8 * 2**20
    acc = hw.probe_accelerator()
    import torch

    assert acc.kind == ("cuda" if torch.cuda.is_available() else "cpu")
    if acc.kind == "cpu":
        assert acc.memory_bytes is None and acc.h2d_pinned_gbs is None


# ---------------------------------------------------------------------------------------
# Decision logic


def inputs(**kw) -> hw.TuneInputs:
    """1M params of 2-D weights, topk 0.1 -> 900k offloaded. A worker rate of 9M params/s
    makes the host step 100 ms on the worker; 18M params/s on all cores makes it 50 ms."""
    base = dict(
        cores=2,
        params_total=1_010_000,
        params_2d=1_000_000,
        fb_all_ms=20.0,
        fb_split_ms=30.0,
        train_threads=1,
        adam_rate_worker=9e6,
        adam_rate_all=18e6,
        mem_available_bytes=10**12,
        topk_ratio=0.1,
    )
    base.update(kw)
    return hw.TuneInputs(**base)


def overlap_probe(s: int, on_window: float, off_window: float, **kw) -> hw.OverlapProbe:
    base = dict(
        update_interval=s,
        train_threads=1,
        worker_threads=1,
        all_threads=2,
        host_numel=900_000,
        on_window_ms=on_window,
        on_fb_ms=30.0,
        on_host_ms=100.0,
        on_wait_ms=0.0,
        off_window_ms=off_window,
        off_fb_ms=20.0,
        off_host_ms=50.0,
        repeats=3,
    )
    base.update(kw)
    return hw.OverlapProbe(**base)


def test_interval_to_hide():
    assert hw.interval_to_hide(100, 30) == 4
    assert hw.interval_to_hide(90, 30) == 3  # exactly hidden: no extra step
    assert hw.interval_to_hide(10, 30) == 1
    assert hw.interval_to_hide(0, 30) == 1
    assert hw.interval_to_hide(10_000, 1) == 64
    assert hw.interval_to_hide(5, 0) == 64


def test_update_interval_hides_host_step():
    c = hw.choose(inputs())
    assert c.update_interval == 4  # 100 ms host step, 30 ms forward+backward
    assert c.windows["host_worker_ms"] == pytest.approx(100.0)
    assert c.windows["host_all_ms"] == pytest.approx(50.0)
    assert "S=4" in c.reasons["update_interval"]


def test_update_interval_bounds():
    assert hw.choose(inputs(adam_rate_worker=1.0)).update_interval == 64
    assert "capped at 64" in hw.choose(inputs(adam_rate_worker=1.0)).reasons["update_interval"]
    assert hw.choose(inputs(adam_rate_worker=1e15)).update_interval == 1


def test_overlap_modelled_without_measurement():
    # on: max(4 x 30, 100) = 120 ms; off: 4 x 20 + 50 = 130 ms -> overlap on.
    c = hw.choose(inputs())
    assert c.overlap_step is True
    assert c.windows["on_ms"] == pytest.approx(120.0)
    assert c.windows["off_ms"] == pytest.approx(130.0)
    assert c.windows["measured"] is False
    # Faster training on all cores tips it: off = 4 x 10 + 50 = 90 ms < 120 ms.
    c = hw.choose(inputs(fb_all_ms=10.0))
    assert c.overlap_step is False
    assert c.windows["off_ms"] == pytest.approx(90.0)


def test_overlap_follows_the_measured_windows():
    on = hw.choose(inputs(overlap=overlap_probe(4, on_window=150.0, off_window=160.0)))
    assert on.overlap_step is True
    assert on.windows["measured"] is True
    assert (on.windows["on_ms"], on.windows["off_ms"]) == (150.0, 160.0)
    assert "150 ms" in on.reasons["overlap_step"] and "160 ms" in on.reasons["overlap_step"]
    off = hw.choose(inputs(overlap=overlap_probe(4, on_window=170.0, off_window=160.0)))
    assert off.overlap_step is False
    # Equal is not faster: keep the simpler schedule.
    tie = hw.choose(inputs(overlap=overlap_probe(4, on_window=160.0, off_window=160.0)))
    assert tie.overlap_step is False


def test_interval_from_concurrent_figures_and_rescaled_window():
    # Under contention forward+backward slows to 25 ms and the host step to 130 ms:
    # S = ceil(130 / 25) = 6, not the 4 the window was measured at -> model from its parts.
    ov = overlap_probe(4, 150.0, 160.0, on_fb_ms=25.0, on_host_ms=130.0)
    c = hw.choose(inputs(overlap=ov))
    assert c.update_interval == 6
    assert c.windows["measured"] is False
    assert c.windows["on_ms"] == pytest.approx(max(6 * 25.0, 130.0))
    assert c.windows["off_ms"] == pytest.approx(6 * 20.0 + 50.0)
    assert c.overlap_step is True  # 150 < 170


def test_core_split_share():
    c = hw.choose(inputs(cores=8, train_threads=6))
    assert c.pt_reserved_cores_perc == pytest.approx(0.75)
    assert 0 < hw.choose(inputs()).pt_reserved_cores_perc < 1


def test_single_core_never_overlaps():
    c = hw.choose(inputs(cores=1, train_threads=1, overlap=None))
    assert c.overlap_step is False
    assert c.pt_reserved_cores_perc == 0.5
    assert c.update_interval == 3  # 50 ms host step on all cores, 20 ms forward+backward


def test_topk_choice():
    assert hw.choose(inputs(topk_ratio=None)).topk_ratio == 0.1
    assert hw.choose(inputs(topk_ratio=None, params_2d=5 * 10**9)).topk_ratio == 0.05
    assert hw.choose(inputs(topk_ratio=None, params_2d=20 * 10**9)).topk_ratio == 0.01
    fixed = hw.choose(inputs(topk_ratio=0.3))
    assert fixed.topk_ratio == 0.3 and "--topk" in fixed.reasons["topk_ratio"]
    # Less offloaded with a larger k: host step 1M x 0.7 / 9M/s = 77.8 ms -> S = 3.
    assert fixed.update_interval == 3


def test_memory_check():
    c = hw.choose(inputs())  # overlap on -> 20 bytes/param of 2-D weights on the host
    mem = c.memory
    assert mem["bytes_per_param"] == 20
    assert mem["host_state"] == 20 * 1_000_000
    # CPU-only: fp32 weights + grads (8 B/param) + device moments for 10% of the 2-D
    # weights and all 10k 1-D params (8 B/param).
    assert mem["device_side_in_host"] == 8 * 1_010_000 + 8 * (100_000 + 10_000)
    assert mem["total"] == mem["host_state"] + mem["device_side_in_host"]
    assert mem["ok"] is True and mem["pinned_ok"] is None
    assert "host memory OK" in hw.memory_verdict(mem)

    short = hw.choose(inputs(mem_available_bytes=mem["total"] - 1)).memory
    assert short["ok"] is False
    assert "NOT OK" in hw.memory_verdict(short)
    exact = hw.choose(inputs(mem_available_bytes=mem["total"])).memory
    assert exact["ok"] is True


def test_pinned_memory_check_with_cuda():
    cuda = dict(accelerator="cuda", accelerator_memory_bytes=80 * 2**30)
    c = hw.choose(inputs(memlock_bytes=2**20, **cuda))
    assert c.memory["device_side_in_host"] == 0  # weights and grads live on the GPU
    assert c.memory["pinned_needed"] == c.memory["host_state"]
    assert c.memory["pinned_ok"] is False
    assert "pinned memory NOT OK" in hw.memory_verdict(c.memory)
    assert hw.choose(inputs(memlock_bytes=None, **cuda)).memory["pinned_ok"] is True


def test_zenflow_block_keys():
    block = hw.choose(inputs()).zenflow_block()
    assert block == {
        "topk_ratio": 0.1,
        "update_interval": 4,
        "select_strategy": "auto",
        "select_interval": "auto",
        "overlap_step": True,
        "pt_reserved_cores_perc": 0.5,
    }


# ---------------------------------------------------------------------------------------
# Measurements


def test_resolve_adam_never_falls_back_silently(monkeypatch):
    from zenflow import ops

    monkeypatch.setenv("ZENFLOW_OPS", "reference")
    fn, backend, reason = hw.resolve_adam()
    assert (fn, backend) == (ops.adamw_step_reference_, "reference")
    assert "ZENFLOW_OPS=reference" in reason

    monkeypatch.delenv("ZENFLOW_OPS")
    not_built = {"state": "not-built", "ops": "native", "cached_library": False}
    monkeypatch.setattr(ops, "native_status", lambda: not_built)
    fn, backend, reason = hw.resolve_adam(allow_build=False)
    assert backend == "reference" and "--quick does not build" in reason


def test_measure_cpu_adam_updates_and_reports():
    probe = hw.measure_cpu_adam(4097, num_threads=1, repeats=2)
    assert probe.backend in ("native", "reference")
    assert (probe.backend == "reference") == (probe.fallback_reason is not None)
    assert probe.numel == 4097 and probe.num_threads == 1
    assert probe.params_per_s == pytest.approx(4097 / (probe.ms / 1e3))


def test_measure_cpu_adam_restores_threads():
    import torch

    before = torch.get_num_threads()
    hw.measure_cpu_adam(1024, num_threads=1, repeats=1)
    assert torch.get_num_threads() == before


@pytest.fixture(scope="module")
def tiny_probe_model():
    return hw.load_probe_model("builtin:gpt2-2x128", micro_batch=2, seq_len=8)


def test_probe_model_counts(tiny_probe_model):
    pm = tiny_probe_model
    params = list(pm.model.parameters())
    assert pm.params_total == sum(p.numel() for p in params)
    assert pm.params_2d == sum(p.numel() for p in params if p.dim() == 2)
    assert pm.params_2d < pm.params_total
    assert pm.batch["input_ids"].shape == (2, 8)
    assert "random init" in pm.source


def test_measure_fwd_bwd_runs_backward_and_restores_threads(tiny_probe_model):
    import torch

    before = torch.get_num_threads()
    ms = hw.measure_fwd_bwd(tiny_probe_model, num_threads=1, repeats=2)
    assert ms > 0
    assert torch.get_num_threads() == before
    # fwd_bwd_once leaves no gradients behind (zero_grad after each step).
    assert all(p.grad is None for p in tiny_probe_model.model.parameters())


def test_measure_overlap_runs_the_whole_host_step(tiny_probe_model):
    """A counting Adam: the worker covers every offloaded param, on the right threads."""
    calls: list[tuple[int, int]] = []

    def counting_adam(param, grad, exp_avg, exp_avg_sq, *, num_threads, **_):
        calls.append((param.numel(), num_threads))
        exp_avg.add_(grad)

    host_numel, repeats, s = 2500, 2, 3
    ov = hw.measure_overlap(
        tiny_probe_model,
        update_interval=s,
        train_threads=1,
        worker_threads=1,
        all_threads=2,
        host_numel=host_numel,
        adam=(counting_adam, "reference", "test"),
        repeats=repeats,
        chunk_numel=1000,
    )
    windows = 2 * (repeats + 1)  # on and off, each with one warm-up window
    assert [n for n, _ in calls] == [1000, 1000, 500] * windows
    on_calls, off_calls = calls[: 3 * (repeats + 1)], calls[3 * (repeats + 1) :]
    assert {t for _, t in on_calls} == {1} and {t for _, t in off_calls} == {2}
    assert ov.update_interval == s and ov.host_numel == host_numel
    # Per window: the window contains the worker's host step (on) and the host step (off).
    assert ov.on_window_ms >= ov.on_host_ms > 0
    assert ov.off_window_ms >= ov.off_host_ms > 0
    assert ov.on_window_ms >= ov.on_wait_ms >= 0


# ---------------------------------------------------------------------------------------
# Files and imports


def test_write_json_atomic_keeps_mode_and_leaves_no_temp(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text("{}")
    os.chmod(path, 0o640)
    hw.write_json_atomic(path, {"a": 1, "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": 1, "b": [1, 2]}
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["cfg.json"]
    hw.write_json_atomic(tmp_path / "new" / "hw.json", {"x": 1})
    assert json.loads((tmp_path / "new" / "hw.json").read_text()) == {"x": 1}


def test_read_config_document_errors(tmp_path):
    from zenflow.config import ConfigError
    from zenflow.errors import UserInputError

    assert issubclass(ConfigError, UserInputError)  # the CLI shows one red line, exit 2
    with pytest.raises(ConfigError, match="cannot be read"):
        hw.read_config_document(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,,}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        hw.read_config_document(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 2}}}')
    with pytest.raises(ConfigError, match="topk_ratio"):
        hw.read_config_document(wrong)


def test_update_config_keeps_other_keys(tmp_path):
    from zenflow.config import load_config

    template = json.loads((Path(__file__).parents[1] / "templates" / "zenflow.json").read_text())
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(template))
    doc = hw.read_config_document(path)
    block = hw.choose(inputs(fb_all_ms=10.0)).zenflow_block()  # overlap off, S=4
    shown = hw.update_config(path, doc, block, write=False)
    assert json.loads(path.read_text()) == template  # without --write nothing changes
    assert shown["written"] is False
    assert shown["old"]["overlap_step"] is True and shown["new"]["overlap_step"] is False

    written = hw.update_config(path, doc, block, write=True)
    assert written["written"] is True
    after = json.loads(path.read_text())
    expected = copy.deepcopy(template)
    expected["zero_optimization"]["zenflow"].update(block)
    assert after == expected  # every other key kept, full_warm_up_rounds included
    cfg = load_config(path)
    assert cfg.zenflow.update_interval == 4 and cfg.zenflow.overlap_step is False
    assert cfg.zenflow.pt_reserved_cores_perc == 0.5
    again = hw.update_config(path, after, block, write=True)
    assert again["written"] is False  # already matches: the file is not rewritten


def test_choices_are_json_serialisable():
    c = hw.choose(inputs())
    json.dumps({"c": dataclasses.asdict(c)})


def test_measure_engine_times_whole_windows(tiny_probe_model):
    import torch

    before = torch.get_num_threads()
    block = hw.choose(inputs()).zenflow_block()  # S = 4
    block["update_interval"] = 2
    runs = [hw.measure_engine(tiny_probe_model, block, on, windows=1) for on in (True, False)]
    assert [r["overlap_step"] for r in runs] == [True, False]
    assert all(r["steps"] == 2 and r["update_interval"] == 2 and r["ms_per_step"] > 0 for r in runs)
    assert torch.get_num_threads() == before


def test_measure_overlap_reraises_a_worker_failure(tiny_probe_model):
    def broken_adam(*args, **kwargs):
        raise RuntimeError("adamw_step_: grad is not contiguous")

    with pytest.raises(RuntimeError, match="not contiguous"):
        hw.measure_overlap(
            tiny_probe_model,
            update_interval=1,
            train_threads=1,
            worker_threads=1,
            all_threads=2,
            host_numel=10,
            adam=(broken_adam, "reference", "test"),
            repeats=1,
        )
