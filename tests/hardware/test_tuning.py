"""zenflow.hardware.tuning: the pure decision rules on synthetic figures, and the config update."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from zenflow.hardware import measure, tuning


def inputs(**kw) -> tuning.TuneInputs:
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
    return tuning.TuneInputs(**base)


def overlap_probe(s: int, on_window: float, off_window: float, **kw) -> measure.OverlapProbe:
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
    return measure.OverlapProbe(**base)


def test_interval_to_hide():
    assert tuning.interval_to_hide(100, 30) == 4
    assert tuning.interval_to_hide(90, 30) == 3  # exactly hidden: no extra step
    assert tuning.interval_to_hide(10, 30) == 1
    assert tuning.interval_to_hide(0, 30) == 1
    assert tuning.interval_to_hide(10_000, 1) == 64
    assert tuning.interval_to_hide(5, 0) == 64


def test_update_interval_hides_host_step():
    c = tuning.choose(inputs())
    assert c.update_interval == 4  # 100 ms host step, 30 ms forward+backward
    assert c.windows["host_worker_ms"] == pytest.approx(100.0)
    assert c.windows["host_all_ms"] == pytest.approx(50.0)
    assert "S=4" in c.reasons["update_interval"]


def test_update_interval_bounds():
    assert tuning.choose(inputs(adam_rate_worker=1.0)).update_interval == 64
    assert "capped at 64" in tuning.choose(inputs(adam_rate_worker=1.0)).reasons["update_interval"]
    assert tuning.choose(inputs(adam_rate_worker=1e15)).update_interval == 1


def test_overlap_modelled_without_measurement():
    # on: max(4 x 30, 100) = 120 ms; off: 4 x 20 + 50 = 130 ms -> overlap on.
    c = tuning.choose(inputs())
    assert c.overlap_step is True
    assert c.windows["on_ms"] == pytest.approx(120.0)
    assert c.windows["off_ms"] == pytest.approx(130.0)
    assert c.windows["measured"] is False
    # Faster training on all cores tips it: off = 4 x 10 + 50 = 90 ms < 120 ms.
    c = tuning.choose(inputs(fb_all_ms=10.0))
    assert c.overlap_step is False
    assert c.windows["off_ms"] == pytest.approx(90.0)


def test_overlap_follows_the_measured_windows():
    on = tuning.choose(inputs(overlap=overlap_probe(4, on_window=150.0, off_window=160.0)))
    assert on.overlap_step is True
    assert on.windows["measured"] is True
    assert (on.windows["on_ms"], on.windows["off_ms"]) == (150.0, 160.0)
    assert "150 ms" in on.reasons["overlap_step"] and "160 ms" in on.reasons["overlap_step"]
    off = tuning.choose(inputs(overlap=overlap_probe(4, on_window=170.0, off_window=160.0)))
    assert off.overlap_step is False
    # Equal is not faster: keep the simpler schedule.
    tie = tuning.choose(inputs(overlap=overlap_probe(4, on_window=160.0, off_window=160.0)))
    assert tie.overlap_step is False


def test_interval_from_concurrent_figures_and_rescaled_window():
    # Under contention forward+backward slows to 25 ms and the host step to 130 ms:
    # S = ceil(130 / 25) = 6, not the 4 the window was measured at -> model from its parts.
    ov = overlap_probe(4, 150.0, 160.0, on_fb_ms=25.0, on_host_ms=130.0)
    c = tuning.choose(inputs(overlap=ov))
    assert c.update_interval == 6
    assert c.windows["measured"] is False
    assert c.windows["on_ms"] == pytest.approx(max(6 * 25.0, 130.0))
    assert c.windows["off_ms"] == pytest.approx(6 * 20.0 + 50.0)
    assert c.overlap_step is True  # 150 < 170


def test_core_split_share():
    c = tuning.choose(inputs(cores=8, train_threads=6))
    assert c.pt_reserved_cores_perc == pytest.approx(0.75)
    assert 0 < tuning.choose(inputs()).pt_reserved_cores_perc < 1


def test_single_core_never_overlaps():
    c = tuning.choose(inputs(cores=1, train_threads=1, overlap=None))
    assert c.overlap_step is False
    assert c.pt_reserved_cores_perc == 0.5
    assert c.update_interval == 3  # 50 ms host step on all cores, 20 ms forward+backward


def test_topk_choice():
    assert tuning.choose(inputs(topk_ratio=None)).topk_ratio == 0.1
    assert tuning.choose(inputs(topk_ratio=None, params_2d=5 * 10**9)).topk_ratio == 0.05
    assert tuning.choose(inputs(topk_ratio=None, params_2d=20 * 10**9)).topk_ratio == 0.01
    fixed = tuning.choose(inputs(topk_ratio=0.3))
    assert fixed.topk_ratio == 0.3 and "--topk" in fixed.reasons["topk_ratio"]
    # Less offloaded with a larger k: host step 1M x 0.7 / 9M/s = 77.8 ms -> S = 3.
    assert fixed.update_interval == 3


def test_memory_check():
    c = tuning.choose(inputs())  # overlap on -> 20 bytes/param of 2-D weights on the host
    mem = c.memory
    assert mem["bytes_per_param"] == 20
    assert mem["host_state"] == 20 * 1_000_000
    # CPU-only: fp32 weights + grads (8 B/param) + device moments for 10% of the 2-D
    # weights and all 10k 1-D params (8 B/param).
    assert mem["device_side_in_host"] == 8 * 1_010_000 + 8 * (100_000 + 10_000)
    assert mem["total"] == mem["host_state"] + mem["device_side_in_host"]
    assert mem["ok"] is True and mem["pinned_ok"] is None
    assert "host memory OK" in tuning.memory_verdict(mem)

    short = tuning.choose(inputs(mem_available_bytes=mem["total"] - 1)).memory
    assert short["ok"] is False
    assert "NOT OK" in tuning.memory_verdict(short)
    exact = tuning.choose(inputs(mem_available_bytes=mem["total"])).memory
    assert exact["ok"] is True


def test_pinned_memory_check_with_cuda():
    cuda = dict(accelerator="cuda", accelerator_memory_bytes=80 * 2**30)
    c = tuning.choose(inputs(memlock_bytes=2**20, **cuda))
    assert c.memory["device_side_in_host"] == 0  # weights and grads live on the GPU
    assert c.memory["pinned_needed"] == c.memory["host_state"]
    assert c.memory["pinned_ok"] is False
    assert "pinned memory NOT OK" in tuning.memory_verdict(c.memory)
    assert tuning.choose(inputs(memlock_bytes=None, **cuda)).memory["pinned_ok"] is True


def test_zenflow_block_keys():
    block = tuning.choose(inputs()).zenflow_block()
    assert block == {
        "topk_ratio": 0.1,
        "update_interval": 4,
        "select_strategy": "auto",
        "select_interval": "auto",
        "overlap_step": True,
        "pt_reserved_cores_perc": 0.5,
    }


def test_read_config_document_errors(tmp_path):
    from zenflow.config import ConfigError
    from zenflow.errors import UserInputError

    assert issubclass(ConfigError, UserInputError)  # the CLI shows one red line, exit 2
    with pytest.raises(ConfigError, match="cannot be read"):
        tuning.read_config_document(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,,}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        tuning.read_config_document(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 2}}}')
    with pytest.raises(ConfigError, match="topk_ratio"):
        tuning.read_config_document(wrong)


def test_update_config_keeps_other_keys(tmp_path):
    from zenflow.config import load_config

    template = json.loads((Path(__file__).parents[2] / "templates" / "zenflow.json").read_text())
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(template))
    doc = tuning.read_config_document(path)
    block = tuning.choose(inputs(fb_all_ms=10.0)).zenflow_block()  # overlap off, S=4
    shown = tuning.update_config(path, doc, block, write=False)
    assert json.loads(path.read_text()) == template  # without --write nothing changes
    assert shown["written"] is False
    assert shown["old"]["overlap_step"] is True and shown["new"]["overlap_step"] is False

    written = tuning.update_config(path, doc, block, write=True)
    assert written["written"] is True
    after = json.loads(path.read_text())
    expected = copy.deepcopy(template)
    expected["zero_optimization"]["zenflow"].update(block)
    assert after == expected  # every other key kept, full_warm_up_rounds included
    cfg = load_config(path)
    assert cfg.zenflow.update_interval == 4 and cfg.zenflow.overlap_step is False
    assert cfg.zenflow.pt_reserved_cores_perc == 0.5
    again = tuning.update_config(path, after, block, write=True)
    assert again["written"] is False  # already matches: the file is not rewritten


def test_choices_are_json_serialisable():
    c = tuning.choose(inputs())
    json.dumps({"c": dataclasses.asdict(c)})
