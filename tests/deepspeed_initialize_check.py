"""Child process of tests/test_deepspeed_pin.py: deepspeed.initialize with ZenFlow on.

Run as ``python tests/deepspeed_initialize_check.py DEADLINE_S``. Exits 0 when every
parameter of the engine's module still equals the original bit for bit and the forward
output agrees; otherwise an assertion names the first weight that changed. A separate
process keeps DeepSpeed's global communication state out of the test session, and
``faulthandler`` ends a run that passes its deadline with every thread's stack printed, so
a hang shows where it is instead of stalling the suite.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch

TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "zenflow.json"


def main(deadline_s: float) -> None:
    faulthandler.dump_traceback_later(deadline_s, exit=True)
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_SIZE="1", LOCAL_RANK="0", RANK="0")
    # MASTER_ADDR/MASTER_PORT only name DeepSpeed's shared-memory segment here; the parent
    # test picks the port and removes the segment afterwards.
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.update(WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")

    import deepspeed
    import torch.distributed as dist

    from zenflow.engine.distributed import leave_process_group
    from zenflow.ops.loader import load_deepspeed_op

    # Built first under zenflow's build guard: a lock left by a killed build is cleared
    # instead of waited on forever. deepspeed.initialize then reuses the loaded modules.
    for builder in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        load_deepspeed_op(builder)
    # DeepSpeed's ZenFlow optimizer process is spawned and loads cpu_adam again from
    # TORCH_EXTENSIONS_DIR: it must find the guarded folder, not torch's shared default.
    from zenflow.ops.loader import build_root

    ext_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ""))
    assert ext_dir.parent == build_root() / "deepspeed", ext_dir
    # A single-process gloo group on an in-memory store: no TCP rendezvous to hang on.
    # DeepSpeed wraps a group that is already there.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

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
    with torch.no_grad():
        expected = model(x)

    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    # ZenFlow really is on: DeepSpeed built its ZenFlow ZeRO optimizer from the block.
    assert "ZenFlow" in type(optimizer).__name__, type(optimizer).__name__
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
    # so that a column is contiguous; the matmul then sums in another order, so the output
    # agrees to fp32 rounding (about 1e-7 here), not bit for bit.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    leave_process_group()  # a barrier first: see its docstring
    faulthandler.cancel_dump_traceback_later()
    print(f"ok: {len(original)} parameters unchanged through deepspeed.initialize")


if __name__ == "__main__":
    main(float(sys.argv[1]))
