"""Every shipped DeepSpeed template is accepted by zenflow.config and by DeepSpeed itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zenflow.config import load_config

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
TEMPLATES = sorted(TEMPLATES_DIR.glob("*.json"))


def test_templates_exist():
    assert {p.name for p in TEMPLATES} >= {"zenflow.json", "offload.json"}


@pytest.fixture(scope="module")
def ds_config_cls():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_accepted_by_load_config(path):
    cfg = load_config(path)
    assert cfg.ignored == (), "templates use only keys the engine honours"
    assert cfg.zero_stage == 2 and cfg.offload_device == "cpu" and cfg.pin_memory is True
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.weight_decay == 0.01
    assert cfg.optimizer.lr == 2e-5
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params["warmup_max_lr"] == cfg.optimizer.lr
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 1)
    # bf16 "auto": on for a CUDA GPU with bf16 and for sim, off on the CPU (resolve_bf16)
    assert cfg.gradient_clipping == 1.0 and cfg.bf16 == "auto" and cfg.steps_per_print == 10
    # written back, the template keeps its meaning
    assert load_config(cfg.to_json_dict()) == cfg


def test_zenflow_template_block():
    cfg = load_config(TEMPLATES_DIR / "zenflow.json")
    z = cfg.zenflow
    assert z is not None
    assert (z.topk_ratio, z.update_interval, z.select_strategy, z.select_interval) == (
        0.1,
        4,
        "auto",
        "auto",
    )
    assert (z.full_warm_up_rounds, z.overlap_step) == (0, True)


def test_offload_template_has_no_zenflow():
    assert load_config(TEMPLATES_DIR / "offload.json").zenflow is None


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_accepted_by_deepspeed(path, ds_config_cls):
    ours = load_config(path)
    # Without torch.distributed initialised DeepSpeedConfig takes world size 1 (rank 0).
    ds = ds_config_cls(str(path))
    assert ds.world_size == 1
    assert ds.zero_optimization_stage == 2
    assert ds.zero_config.offload_optimizer.device == "cpu"
    assert ds.zero_config.offload_optimizer.pin_memory is True
    assert ds.train_micro_batch_size_per_gpu == ours.train_micro_batch_size_per_gpu
    assert ds.gradient_accumulation_steps == ours.gradient_accumulation_steps
    assert ds.train_batch_size == ours.train_batch_size
    assert ds.gradient_clipping == ours.gradient_clipping
    assert ds.optimizer_name == ours.optimizer.type.lower()
    assert ds.optimizer_params["lr"] == ours.optimizer.lr
    assert ds.scheduler_name == ours.scheduler.type
    # "auto" is HF's convention: DeepSpeed 0.19.6 reads it without an error (as off); zfctl
    # hands DeepSpeed the value resolved for the device (deepspeed_engine.deepspeed_config)
    assert ours.bf16 == "auto" and ds.bfloat16_config.enabled in (True, False)
    zf = ds.zero_config.zenflow
    if ours.zenflow is None:
        assert zf is None
    else:
        assert zf is not None, "DeepSpeed did not parse the zenflow block"
        for key in ("topk_ratio", "select_strategy", "select_interval", "update_interval"):
            assert getattr(zf, key) == getattr(ours.zenflow, key), key
        assert zf.full_warm_up_rounds == ours.zenflow.full_warm_up_rounds
        assert zf.overlap_step == ours.zenflow.overlap_step


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_to_json_dict_of_template_accepted_by_deepspeed(path, ds_config_cls):
    """What `zfctl init` writes (the template after overrides, resolved) DeepSpeed reads."""
    ours = load_config(path, {"optimizer.params.lr": 1e-4, "train_micro_batch_size_per_gpu": 4})
    out = ours.to_json_dict(resolved={"update_interval": 2, "bf16": True})
    assert out["bf16"]["enabled"] is True  # "auto" resolved, as a run saves it
    ds = ds_config_cls(json.loads(json.dumps(out)))
    assert ds.bfloat16_config.enabled is True
    assert ds.optimizer_params["lr"] == 1e-4
    assert ds.train_micro_batch_size_per_gpu == 4
    assert ds.scheduler_params == dict(ours.scheduler.params)
    if ours.zenflow is not None:
        assert ds.zero_config.zenflow.topk_ratio == ours.zenflow.topk_ratio
        assert ds.zero_config.zenflow.auto_ratio == ours.zenflow.auto_ratio
        assert ds.zero_config.zenflow.pt_reserved_cores_perc == ours.zenflow.pt_reserved_cores_perc
