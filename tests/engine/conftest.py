"""Shared helpers for the engine tests: configs, tiny models, AdamW baselines.

Opt-in, for these tests only: ``ZENFLOW_TEST_SIM_LAG=<seconds>`` (e.g. 0.002) runs every
simulated accelerator in strict + lag mode: each copy starts up to that many seconds late,
as on a GPU running behind the host, and copy destinations are poisoned until their copy
completes, so a missing wait shows as NaN or as the source guard's error. It applies to
every process that imports this module: pytest's (engines made with ``accelerator="sim"``,
through ``engine_kw`` or not, and ``SimAccelerator`` instances the tests make) and the
fresh processes of ``dp_worker.py`` and test_resume.py, which inherit the environment. A
sim given a lag of its own keeps it. ``ZENFLOW_TEST_SIM_LAG_SEED`` picks the random delays
(default 0). The engine itself reads neither variable. Run it on tests/engine only (in a
wider pytest run it would reach the other directories' sims too)::

    ZENFLOW_TEST_SIM_LAG=0.002 .venv/bin/python -m pytest tests/engine
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from zenflow.config import load_config  # noqa: E402
from zenflow.engine.accelerator import SimAccelerator  # noqa: E402

SIM_LAG_ENV = "ZENFLOW_TEST_SIM_LAG"
SIM_LAG_SEED_ENV = "ZENFLOW_TEST_SIM_LAG_SEED"


def _env_number(name: str, default: str, kind):
    raw = os.environ.get(name, "").strip() or default
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if not (value >= 0 and math.isfinite(value)):
        raise pytest.UsageError(f"{name}={raw!r}: give a number >= 0 (seconds for the lag)")
    return value


SIM_LAG = _env_number(SIM_LAG_ENV, "0", float)
SIM_LAG_SEED = _env_number(SIM_LAG_SEED_ENV, "0", int)


def strict_lagged_init(init, lag: float, seed: int):
    """``SimAccelerator.__init__`` made strict and lagged (a sim's own lag or seed kept)."""

    @functools.wraps(init)
    def strict_lagged(self, *args, strict=False, lag_s=0.0, lag_seed=0, **kw):
        init(self, *args, strict=True, lag_s=lag_s or lag, lag_seed=lag_seed or seed, **kw)

    return strict_lagged


if SIM_LAG > 0:  # the whole process: pytest's, and the fresh ones importing this module
    SimAccelerator.__init__ = strict_lagged_init(SimAccelerator.__init__, SIM_LAG, SIM_LAG_SEED)


LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


def make_config(zenflow: dict | None = None, clip: float = 0.0, lr: float = LR, **extra):
    raw = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    if zenflow is not None:
        zf = {"select_strategy": "step", "select_interval": 1000}
        zf.update(zenflow)
        raw["zero_optimization"]["zenflow"] = zf
    raw.update(extra)
    return load_config(raw)


class MLP(torch.nn.Module):
    """Two big Linear layers (ZenFlow weights) + biases + a LayerNorm (always important)."""

    def __init__(self, d_in=64, d_hidden=96, d_out=10):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.norm = torch.nn.LayerNorm(d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_in)
        self.head = torch.nn.Linear(d_in, d_out)

    def forward(self, x, y):
        h = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return torch.nn.functional.cross_entropy(self.head(h), y)


def mlp_batches(n, seed=1, d_in=64, d_out=10, bs=8):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(bs, d_in, generator=g), torch.randint(0, d_out, (bs,), generator=g))
        for _ in range(n)
    ]


def tiny_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=96, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).float()


def gpt2_batches(n, seed=1, vocab=96, bs=2, seq=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (bs, seq), generator=g) for _ in range(n)]


def loss_of(model, batch):
    if isinstance(batch, tuple):
        return model(*batch)
    return model(input_ids=batch, labels=batch).loss


def train_engine(engine, model, batches):
    stats = []
    for b in batches:
        with engine.autocast():
            loss = loss_of(model, b)
        loss.backward()
        stats.append(engine.step(loss))
        engine.zero_grad()
    return stats


def train_adamw(model, batches, clip=0.0, lr=LR, threads=None, fused=False):
    """torch.optim.AdamW over ``batches`` (single-tensor, or ``fused``); ``threads``: torch's
    thread count meanwhile (use the engine's training threads: GPT-2's gradients depend on
    the reduction order)."""
    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return train_adamw(model, batches, clip, lr, fused=fused)
        finally:
            torch.set_num_threads(before)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WD,
                            fused=fused or None)  # fmt: skip
    for b in batches:
        loss = loss_of(model, b)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def _native_skip_reason() -> str | None:
    """None when the native op builds and runs; a reason to skip only when this machine has
    no C++ compiler (the documented case). Any other build failure fails loudly: a broken
    native build must not turn the native engine tests into skips."""
    import shutil

    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler on this machine: the native op cannot be built"
    from zenflow.ops import adamw_step_
    from zenflow.ops.loader import load_native

    load_native()  # raises NativeBuildError with the build log on failure
    x = torch.zeros(4)
    adamw_step_(x, torch.ones(4), torch.zeros(4), torch.zeros(4), step=1, lr=0.1,
                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)  # fmt: skip
    if not bool(x.abs().sum() > 0):
        raise AssertionError("the native op ran but did not update the parameter")
    return None


NATIVE_SKIP = _native_skip_reason()
if NATIVE_SKIP:
    print(f"\nengine tests: native kernel cases skipped: {NATIVE_SKIP}")

KERNELS = [
    "reference",
    pytest.param("native", marks=pytest.mark.skipif(bool(NATIVE_SKIP), reason=str(NATIVE_SKIP))),
]
# Every engine test that takes an accelerator runs on the CPU device and on the simulated
# separate device, the latter in strict mode (copy destinations poisoned until completed;
# with ZENFLOW_TEST_SIM_LAG also lagged, see the module docstring).
ACCELERATORS = ["cpu", "sim"]


def engine_kw(accelerator: str, device_adam: str = "reference") -> dict:
    """Keyword arguments for ZenFlowEngine on ``accelerator`` (sim: strict). The device-side
    AdamW is the reference (torch's single-tensor op order) by default, so that schedule
    tests compare bit-tight with torch.optim.AdamW and the reference schedule; the fused
    kernel has its own tests (test_device_adam.py) and engine cases."""
    return {
        "accelerator": accelerator,
        "sim_strict": accelerator == "sim",
        "device_adam": device_adam,
    }


def assert_params_close(m1, m2, atol=1e-6, rtol=1e-5):
    for (n1, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters(), strict=True):
        torch.testing.assert_close(p1, p2, atol=atol, rtol=rtol, msg=lambda m, n=n1: f"{n}: {m}")


def torch_style_kernel(
    param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
    param_bf16=None, grad_scale=1.0, adamw_mode=True, num_threads=0, col_steps=None,
    col_inner=1,
):  # fmt: skip
    """A host kernel with torch.optim.AdamW's exact op order (lerp etc.): lets tests
    check the SCHEDULE bit-tight on models where Adam amplifies kernel rounding. Per-column
    counts (``col_steps``) use the device's per-column arithmetic on the [.., C, inner] view."""
    from zenflow.engine.device_adam import AdamHyper, adamw_columns_, adamw_dense_

    g = grad.float() if grad_scale == 1.0 else grad.float() * grad_scale
    hp = AdamHyper(lr, beta1, beta2, eps, weight_decay, adamw_mode)
    if col_steps is None:
        adamw_dense_(param, g, exp_avg, exp_avg_sq, step, hp)
    else:
        view = (-1, col_steps.numel(), col_inner)
        adamw_columns_(param.view(view), g.view(view), exp_avg.view(view),
                       exp_avg_sq.view(view), col_steps, 1, hp)  # fmt: skip
    if param_bf16 is not None:
        param_bf16.copy_(param)
