"""The deepspeed==0.19.6 pin: ZenFlow's deepspeed.initialize must leave the weights alone.

DeepSpeed 0.19.7 and 0.19.8 corrupt every 2-D weight at ``deepspeed.initialize`` when a
zenflow block is on, so the project pins 0.19.6 (pyproject.toml). A version check alone
would not catch a reinstalled or patched DeepSpeed, so this test runs the real thing: a
small model goes through ``deepspeed.initialize`` with the shipped ZenFlow template (ZeRO
stage 2, optimizer offloaded to the CPU) in a single-process gloo group on DeepSpeed's CPU
accelerator, and every parameter of the engine's module must still equal the original,
bit for bit, and give the same forward output.

The first run JIT-builds DeepSpeed's cpu_adam (and its shm comm op) into
~/.cache/torch_extensions: 1-3 minutes on 2 cores; later runs take seconds.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "zenflow.json"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _teardown_distributed() -> None:
    import deepspeed.comm.comm as ds_comm

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # DeepSpeed caches its comm backend in a module global; clear it so a later
    # deepspeed.initialize in the same interpreter sets up a fresh group.
    ds_comm.cdb = None


def test_deepspeed_version_is_the_pinned_one():
    assert deepspeed.__version__ == "0.19.6", (
        "pyproject.toml pins deepspeed==0.19.6; 0.19.7 and 0.19.8 corrupt 2-D weights at "
        "deepspeed.initialize with ZenFlow on. Reinstall with scripts/setup.sh."
    )


def test_zenflow_initialize_keeps_every_weight(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_SIZE", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")

    config = json.loads(TEMPLATE.read_text())
    assert "zenflow" in config["zero_optimization"], "the template lost its zenflow block"
    config["train_micro_batch_size_per_gpu"] = 4
    config["gradient_accumulation_steps"] = 1

    torch.manual_seed(0)
    # Odd sizes: a flattening or partitioning mix-up cannot line up by chance.
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 12), torch.nn.Linear(12, 7)
    )
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert sum(p.dim() == 2 for p in original.values()) == 3
    x = torch.randn(5, 24)
    threads = torch.get_num_threads()
    with torch.no_grad():
        expected = model(x)

    try:
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        # ZenFlow really is on: DeepSpeed built its ZenFlow ZeRO optimizer from the block.
        assert "ZenFlow" in type(optimizer).__name__
        assert engine.zero_optimization_stage() == 2

        after = dict(engine.module.named_parameters())
        assert set(after) == set(original)
        for name, before in original.items():
            now = after[name].detach()
            assert now.dtype == before.dtype and now.shape == before.shape, name
            assert torch.equal(now, before), (
                f"{name} {tuple(before.shape)} changed at deepspeed.initialize: "
                f"max |diff| {(now.float() - before.float()).abs().max().item():.3e}"
            )
        with torch.no_grad():
            got = engine.module(x)
        # Same values, but ZenFlow re-lays each 2-D weight out column-major (strides (1, in))
        # so that a column is contiguous; the matmul then sums in another order, so the
        # output agrees to fp32 rounding (about 1e-7 here), not bit for bit.
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    finally:
        _teardown_distributed()
        torch.set_num_threads(threads)
