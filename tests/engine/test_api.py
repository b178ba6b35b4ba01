"""Engine API surface: resolved values, errors with fixes, threads, light import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import MLP, make_config, mlp_batches, train_engine

from zenflow import ZenFlowEngine
from zenflow.engine import EngineError


def test_epoch_strategy_needs_steps_per_epoch():
    cfg = make_config({"select_strategy": "auto", "select_interval": "auto"})
    with pytest.raises(EngineError, match="steps_per_epoch"):
        ZenFlowEngine(MLP(), cfg)
    with ZenFlowEngine(MLP(), cfg, steps_per_epoch=25) as e:
        assert e.resolved["select_every_steps"] == 25
    cfg = make_config({"select_strategy": "epoch", "select_interval": 2})
    with ZenFlowEngine(MLP(), cfg, steps_per_epoch=10) as e:
        assert e.resolved["select_every_steps"] == 20


def test_non_fp32_params_rejected():
    with pytest.raises(EngineError, match="fp32"):
        ZenFlowEngine(MLP().bfloat16(), make_config({"update_interval": 2}))


def test_resolved_threads_and_restore():
    orig = torch.get_num_threads()
    cfg = make_config({"update_interval": 4, "overlap_step": True, "pt_reserved_cores_perc": 0.5})
    e = ZenFlowEngine(MLP(), cfg, grad_accum="host")
    r = e.resolved
    assert r["worker_threads"] == max(1, round(e.cores * 0.5))
    assert r["training_threads"] == max(1, e.cores - r["worker_threads"])
    assert torch.get_num_threads() == r["training_threads"]
    assert r["grad_accum"] == "host" and r["update_interval"] == 4 and r["overlap_step"]
    e.close()
    assert torch.get_num_threads() == orig
    with ZenFlowEngine(MLP(), make_config({"update_interval": "auto"})) as e:
        assert e.resolved["grad_accum"] == "device"  # CPU device: zero-copy accumulation
        assert e.resolved["update_interval"] == "auto(1..64)"


def test_stats_fields_and_lr_schedule():
    model = MLP()
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                            "warmup_num_steps": 4}}  # fmt: skip
    cfg = make_config({"update_interval": 2, "full_warm_up_rounds": 1}, scheduler=sched)
    with ZenFlowEngine(model, cfg) as e:
        stats = train_engine(e, model, mlp_batches(5))
        assert e.lr == stats[-1].lr
    assert [s.step for s in stats] == [1, 2, 3, 4, 5]
    assert stats[0].warmup and not stats[1].warmup
    assert stats[1].selection_changed > 0  # first selection
    assert [s.window_len for s in stats] == [0, 0, 2, 0, 2]
    assert stats[0].lr < stats[3].lr
    assert all(s.loss is not None and s.grad_norm > 0 and s.step_ms > 0 for s in stats)


def test_import_zenflow_is_light():
    code = (
        "import sys, zenflow; zenflow.StepStats; "
        "bad = [m for m in ('typer', 'rich', 'zfctl') if m in sys.modules]; "
        "assert not bad, bad; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr
