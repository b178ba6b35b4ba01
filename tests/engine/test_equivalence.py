"""The engine equals torch.optim.AdamW where the algorithm says it must (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    ACCELERATORS,
    KERNELS,
    LR,
    MLP,
    assert_params_close,
    engine_kw,
    gpt2_batches,
    make_config,
    mlp_batches,
    tiny_gpt2,
    torch_style_kernel,
    train_adamw,
    train_engine,
)

from zenflow import ZenFlowEngine

STEPS = 20


def _models(kind):
    if kind == "mlp":
        torch.manual_seed(0)
        return MLP(), mlp_batches(STEPS)
    return tiny_gpt2(), gpt2_batches(STEPS)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
@pytest.mark.parametrize("kernel", [*KERNELS, "torch_style"])
@pytest.mark.parametrize(
    "zf",
    [
        {"topk_ratio": 1.0, "update_interval": 3},
        {"topk_ratio": 0.1, "update_interval": 2, "full_warm_up_rounds": STEPS},
    ],
    ids=["topk1", "warmup"],
)
def test_equals_adamw(kind, kernel, zf, accelerator):
    model, batches = _models(kind)
    ref = copy.deepcopy(model)
    # Adam turns rounding differences of near-zero gradients into O(lr) steps (m/sqrt(v) ~
    # +-1), and GPT-2 has many: a host kernel with a different (valid) op order drifts from
    # torch by ~1e-4 at lr 1e-2 after a few steps (plain offload mode shows the same). So
    # GPT-2 with the real kernels runs at lr 1e-3 with atol 1e-4; the torch-op-order kernel
    # checks the schedule itself tightly.
    loose = kind == "gpt2" and kernel != "torch_style"
    lr, atol = (1e-3, 1e-4) if loose else (LR, 2e-6)
    kern = torch_style_kernel if kernel == "torch_style" else kernel
    cfg = make_config(zf, lr=lr)
    with ZenFlowEngine(model, cfg, host_kernel=kern, **engine_kw(accelerator)) as engine:
        assert engine.zweights, "the test model must have ZenFlow weights"
        stats = train_engine(engine, model, batches)
    train_adamw(ref, batches, lr=lr, threads=engine.training_threads)
    assert all(s.warmup for s in stats) == (zf.get("full_warm_up_rounds", 0) >= STEPS)
    assert_params_close(model, ref, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_topk1_with_the_compact_host_state_equals_adamw(accelerator):
    """zfctl.host_state "compact" changes only the host's state of the non-selected
    columns: with every column selected there is none, and the run is AdamW (the compact
    arithmetic itself is checked against the reference schedule's)."""
    model, batches = _models("mlp")
    ref = copy.deepcopy(model)
    cfg = make_config({"topk_ratio": 1.0, "update_interval": 3}, zfctl={"host_state": "compact"})
    with ZenFlowEngine(model, cfg, host_kernel="reference", **engine_kw(accelerator)) as e:
        assert e.resolved["host_state"] == "compact"
        train_engine(e, model, batches)
    train_adamw(ref, batches, threads=e.training_threads)
    assert_params_close(model, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
@pytest.mark.parametrize("topk", [0.1, 0.5])
def test_one_step_windows_without_overlap_equal_adamw(kind, topk, accelerator):
    """S=1 and no overlap: every column gets one exact AdamW step per step, on one side.

    An identity of the algorithm that does not go through our reference schedule: each
    step the selected columns take a device AdamW step and the others a host AdamW step on
    a one-step window (its mean is the gradient itself), both at step count t. Re-selection
    every 3 steps moves columns between the sides with their moments, which keeps the
    identity; restarting moments, a wrong step count or a stale column would break it.
    """
    model, batches = _models(kind)
    ref = copy.deepcopy(model)
    zf = {
        "topk_ratio": topk,
        "update_interval": 1,
        "overlap_step": False,
        "select_strategy": "step",
        "select_interval": 3,
    }
    lr = 1e-3 if kind == "gpt2" else LR  # see test_equals_adamw on GPT-2's near-zero grads
    kw = engine_kw(accelerator)
    with ZenFlowEngine(model, make_config(zf, lr=lr), host_kernel=torch_style_kernel, **kw) as e:
        assert e.zweights, "the test model must have ZenFlow weights"
        stats = train_engine(e, model, batches)
    train_adamw(ref, batches, lr=lr, threads=e.training_threads)
    assert all(s.host_update for s in stats)
    assert sum(s.selection_changed for s in stats[1:]) > 0  # columns really moved
    assert_params_close(model, ref, atol=2e-6, rtol=1e-5)


# The zfctl block's opt-in algorithm options, each with the cases where ZenFlow must still
# equal AdamW and the selection steps expected there (STEPS = 20):
# - window_lr "sum" and "sqrt" change only what a window of several steps does: with every column
#   selected (topk 1.0) or one-step windows without overlap (the lr sum of one step is its
#   lr, and sqrt(1) = 1) nothing changes; longer windows are checked against the reference schedule
#   (test_reference_schedule.py);
# - select_schedule "doubling" changes only when columns are re-selected: with topk 1.0, or
#   one-step windows without overlap (each column takes one exact AdamW step per step on
#   whichever side owns it, moments and counts carried when it moves), through
#   re-selections 1, 2, 4, 8, 16 steps apart.
# - early (zfctl.early) changes only when windows end and whether they overlap: with topk
#   1.0, or over a phase of one-step windows applied at their own ends.
ALGORITHM_OPTION_CASES = {
    **{case: ({"window_lr": lr_mode}, zenflow, selected)
       for lr_mode in ("sum", "sqrt")
       for case, zenflow, selected in [
           (f"window_lr-{lr_mode}-topk1", {"topk_ratio": 1.0, "update_interval": 3}, [1]),
           (f"window_lr-{lr_mode}-S1",
            {"topk_ratio": 0.1, "update_interval": 1, "overlap_step": False,
             "select_strategy": "step", "select_interval": 3},
            [1, 4, 7, 10, 13, 16, 19]),
       ]},
    "doubling-topk1": ({"select_schedule": "doubling"},
                       {"topk_ratio": 1.0, "update_interval": 2, "overlap_step": True},
                       [1, 4, 8, 16]),
    "doubling-S1": ({"select_schedule": "doubling"},
                    {"topk_ratio": 0.1, "update_interval": 1, "overlap_step": False},
                    [1, 2, 4, 8, 16]),
    # early "ramp" with overlap off: the template's S = 4 with overlap, but over a 48-step
    # phase every window of the 20 steps is one step long (4 e // 48 < 2 for e <= 23) and
    # applied at its own end, so each column takes one exact AdamW step per step
    "early-ramp-sync": ({"early": {"steps": 48, "windows": "ramp", "overlap": False}},
                        {"topk_ratio": 0.1, "update_interval": 4, "overlap_step": True,
                         "select_strategy": "step", "select_interval": 3},
                        [1, 4, 7, 10, 13, 16, 19]),
    "early-ramp-topk1": ({"early": {"steps": 8, "windows": "ramp", "overlap": True}},
                         {"topk_ratio": 1.0, "update_interval": 4, "overlap_step": True}, [1]),
}  # fmt: skip


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("case", list(ALGORITHM_OPTION_CASES))
def test_algorithm_options_equal_adamw_where_they_must(case, accelerator):
    option, zf, selections = ALGORITHM_OPTION_CASES[case]
    model, batches = _models("mlp")
    ref = copy.deepcopy(model)
    cfg = make_config(zf, zfctl=option)
    kw = engine_kw(accelerator)
    with ZenFlowEngine(model, cfg, host_kernel=torch_style_kernel, **kw) as e:
        assert all(e.resolved[k] == v for k, v in option.items())
        stats = train_engine(e, model, batches)
        assert e.selection_steps == selections
    train_adamw(ref, batches, threads=e.training_threads)
    if zf["topk_ratio"] < 1.0:
        assert all(s.host_update for s in stats)
        assert sum(s.selection_changed for s in stats[1:]) > 0  # columns really moved
    assert_params_close(model, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("device_adam", ["fused", "reference"])
def test_topk1_device_path_bit_exact(device_adam, accelerator):
    """topk=1.0 never touches the host: the device AdamW is torch's, bit for bit. The fused
    update (the engine's default) reproduces torch.optim.AdamW(fused=True), the reference
    torch's single-tensor AdamW."""
    model, batches = _models("mlp")
    ref = copy.deepcopy(model)
    init = copy.deepcopy(model)
    cfg = make_config({"topk_ratio": 1.0, "update_interval": 2})
    with ZenFlowEngine(model, cfg, **engine_kw(accelerator, device_adam)) as e:
        assert e.resolved["device_update"].startswith(device_adam)
        train_engine(e, model, batches)
    train_adamw(ref, batches, threads=e.training_threads, fused=device_adam == "fused")
    for p, q, p0 in zip(model.parameters(), ref.parameters(), init.parameters(), strict=True):
        assert torch.equal(p, q)
        assert not torch.equal(p, p0)  # training moved every parameter


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("mode", ["offload", "device"])
def test_plain_modes_equal_adamw(mode, accelerator):
    model, batches = _models("mlp")
    ref = copy.deepcopy(model)
    kw = engine_kw(accelerator)
    with ZenFlowEngine(model, make_config(None), mode=mode, host_kernel="reference", **kw) as e:
        stats = train_engine(e, model, batches)
    train_adamw(ref, batches, threads=e.training_threads)
    assert_params_close(model, ref, atol=2e-6, rtol=1e-5)
    assert all(s.mode == mode for s in stats)


def test_clipping_equals_clip_grad_norm():
    model, batches = _models("mlp")
    ref = copy.deepcopy(model)
    cfg = make_config({"topk_ratio": 1.0, "update_interval": 2}, clip=0.05)
    with ZenFlowEngine(model, cfg) as e:
        stats = train_engine(e, model, batches)
    train_adamw(ref, batches, clip=0.05)
    assert all(s.grad_norm > 0.05 for s in stats)  # clipping really was active
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=1e-6)
