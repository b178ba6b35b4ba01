"""Helpers shared by the trainer tests: the small config, specs on a tiny GPT-2, run readers."""

from __future__ import annotations

import torch

from zenflow.config import load_config
from zenflow.train import runs
from zenflow.train.spec import RunSpec

# Constant lr (no scheduler) so every step moves the weights; a small ZenFlow window and
# step-wise reselection so a 6-step run crosses windows, a reselection and an in-flight
# host step at the resume point.
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {
            "topk_ratio": 0.1,
            "update_interval": 2,
            "select_strategy": "step",
            "select_interval": 2,
            "overlap_step": True,
        },
    },
}


def make_spec(tiny_gpt2_dir, data_dir, root, gas: int = 1, config=None, **kw) -> RunSpec:
    base = dict(
        model=str(tiny_gpt2_dir),
        task="sst2",
        config=load_config({**(config or CONFIG), "gradient_accumulation_steps": gas}),
        data_dir=str(data_dir),
        seq_len=16,
        runs_root=root,
        max_eval_samples=8,
    )
    base.update(kw)
    return RunSpec(**base)


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in runs.read_run(run_dir)["metrics"]]


def final_model(run_dir) -> dict:
    """The model weights of the run's newest checkpoint (loaded as plain data)."""
    ckpt = runs.latest_checkpoint(run_dir)
    return torch.load(ckpt, weights_only=True)["model"]


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
