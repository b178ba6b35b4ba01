"""zenflow.config.lr_schedule.lr_at against DeepSpeed 0.19.6's own scheduler classes."""

from __future__ import annotations

import math

import pytest
import torch

from zenflow.config import load_config
from zenflow.config.lr_schedule import lr_at

lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")

LR = 3e-4


def make_config(sched_type: str | None, **params):
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    if sched_type is not None:
        raw["scheduler"] = {"type": sched_type, "params": params}
    return load_config(raw)


def deepspeed_lrs(cfg, steps: int) -> list[float]:
    """The lr DeepSpeed's engine uses for optimizer steps 1..steps.

    The engine builds the scheduler (which writes an lr into the optimizer) and calls
    ``scheduler.step()`` after every optimizer step; the lr in effect for step s is the one
    in the param group just before that step.
    """
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=cfg.optimizer.lr)
    cls = getattr(lr_schedules, cfg.scheduler.type)
    scheduler = cls(optimizer, **dict(cfg.scheduler.params))
    out = []
    for _ in range(steps):
        lr = optimizer.param_groups[0]["lr"]
        out.append(float(lr))
        optimizer.step()
        scheduler.step()
    return out


CASES = [
    ("WarmupLR", {}),
    ("WarmupLR", {"warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_num_steps": 10, "warmup_type": "linear", "warmup_min_lr": 1e-5}),
    ("WarmupLR", {"warmup_num_steps": 1, "warmup_max_lr": 1e-3}),
    ("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_num_steps": 8}),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 30,
            "warmup_num_steps": 5,
            "warmup_type": "linear",
            "warmup_min_lr": 1e-6,
        },
    ),
    ("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 10}),  # total < warm-up
    ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 8}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 35,
            "warmup_num_steps": 6,
            "warmup_type": "linear",
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
        },
    ),
    ("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 10}),  # total < warm-up
]


@pytest.mark.parametrize(("sched_type", "params"), CASES)
def test_matches_deepspeed_for_50_steps(sched_type, params):
    cfg = make_config(sched_type, **params)
    expected = deepspeed_lrs(cfg, 50)
    got = [lr_at(cfg, s) for s in range(1, 51)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # the schedule must actually move, or the comparison proves little
    assert len({round(v, 15) for v in expected}) >= 2


def test_warmup_lr_values_by_hand():
    cfg = make_config("WarmupLR", warmup_num_steps=4, warmup_type="linear", warmup_min_lr=0.0)
    # step 1: scheduler iteration -1 -> min; then iteration s-2 -> (s-2)/4 of the way; capped
    assert [lr_at(cfg, s) for s in range(1, 8)] == pytest.approx(
        [0.0, 0.0, LR / 4, LR / 2, 3 * LR / 4, LR, LR]
    )
    log_cfg = make_config("WarmupLR", warmup_num_steps=4)
    assert lr_at(log_cfg, 4) == pytest.approx(LR * math.log(3) / math.log(4))


def test_warmup_max_lr_defaults_to_optimizer_lr():
    cfg = make_config("WarmupDecayLR", total_num_steps=20, warmup_num_steps=2)
    assert lr_at(cfg, 4) == pytest.approx(LR)  # iteration 2: decay starts at the max


def test_decay_reaches_zero_and_cosine_reaches_floor():
    decay = make_config("WarmupDecayLR", total_num_steps=20, warmup_num_steps=5)
    assert lr_at(decay, 22) == 0.0 and lr_at(decay, 100) == 0.0
    cosine = make_config(
        "WarmupCosineLR", total_num_steps=20, warmup_num_steps=5, cos_min_ratio=0.1
    )
    assert lr_at(cosine, 30) == pytest.approx(0.1 * LR)
    assert lr_at(cosine, 1) == 0.0  # DeepSpeed's first step, before any scheduler.step()


def test_no_scheduler_is_constant():
    cfg = make_config(None)
    assert [lr_at(cfg, s) for s in (1, 2, 1000)] == [LR, LR, LR]


def test_step_is_one_based():
    with pytest.raises(ValueError, match="1-based"):
        lr_at(make_config("WarmupLR"), 0)
