"""One rank of a data-parallel engine run on CUDA (used by test_cuda_data_parallel.py).

    python dp_cuda_worker.py RANK WORLD STORE OUT SPEC_JSON

SPEC: backend ("nccl": rank r on cuda:r; "gloo": every rank on the current GPU, the
one-GPU case), mode, zenflow block (or null), steps, stream_grads. Every rank builds the same
MLP and trains on its slice of the same global batches (WORLD=1: the whole batch, no process
group), clipping at 1.0, and writes its parameters, selected columns after every step and
window lengths to OUT. A rehearsal (``ZFCTL_CUDA_TIER_DEVICE=sim``) runs on the simulated
device over gloo.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cudahelp import ACCEL, MLP, engine_kw, make_config  # noqa: E402

from zenflow import ZenFlowEngine  # noqa: E402
from zenflow.engine.distributed import leave_process_group  # noqa: E402

GLOBAL_BATCH = 8


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    spec = json.loads(sys.argv[5])
    if ACCEL == "cuda":
        gpu = rank if spec["backend"] == "nccl" else torch.cuda.current_device()
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    else:
        device = torch.device("cpu")
    if world > 1:
        dist.init_process_group(
            spec["backend"], store=dist.FileStore(store, world), rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )  # fmt: skip
    torch.manual_seed(0)  # the same model on every rank
    model = MLP().to(device)
    cfg = make_config(spec["zenflow"], clip=1.0, zfctl={"stream_grads": spec["stream_grads"]})
    engine = ZenFlowEngine(model, cfg, mode=spec["mode"], **engine_kw(min_numel=1000))
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(GLOBAL_BATCH, 64, generator=g),
         torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
        for _ in range(spec["steps"])
    ]  # fmt: skip
    per_rank = GLOBAL_BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    selected = []
    for x, y in batches:
        loss = model(x[rows].to(device), y[rows].to(device))
        engine.backward(loss)
        engine.step(loss)
        engine.zero_grad()
        selected.append({w.spec.name: w.sel_host.tolist() for w in engine.zweights
                         if w.sel_host is not None})  # fmt: skip
    result = {
        "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
        "selected": selected,
        "window_lengths": list(engine.window_lengths),
        "world_size": engine.dp.world,
        "backend": engine.dp.backend,
        "device": str(engine.device),
    }
    engine.close()
    torch.save(result, out)
    leave_process_group()  # a barrier first: see its docstring


if __name__ == "__main__":
    main()
