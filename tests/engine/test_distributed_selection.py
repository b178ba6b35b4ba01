"""Data-parallel selection: every rank picks the same columns, from the summed scores.

ZENFLOW.md section 2: each rank scores its own gradient columns, the score vectors are
all-reduced, and every rank takes the same top-k. Two real processes in a gloo group (on a
file store, no network), the same model, different data on each rank and no gradient
averaging, so the local scores differ: both engines must still select identical columns,
equal to the top-k of the sum of the two ranks' local scores, which is not what either rank
would pick alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

WORLD = 2
RANK_SCRIPT = """
import sys
import torch
import torch.distributed as dist
from zenflow import ZenFlowEngine, load_config
from zenflow.engine.selection import column_scores

rank, world, store_path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group(
    "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
)
torch.manual_seed(0)  # the same model on every rank
model = torch.nn.Sequential(
    torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 80), torch.nn.ReLU(),
    torch.nn.Linear(80, 10),
)
config = load_config({
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {
            "topk_ratio": 0.2, "update_interval": 2, "full_warm_up_rounds": 0,
            "select_strategy": "step", "select_interval": 1000, "overlap_step": False,
        },
    },
}, world_size=world)
engine = ZenFlowEngine(model, config, min_numel=1)
gen = torch.Generator().manual_seed(100 + rank)  # different data on every rank
x, y = torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen)
loss = torch.nn.functional.cross_entropy(model(x), y)
loss.backward()
local = {w.spec.name: column_scores(w.spec.param.grad, w.cd) for w in engine.zweights}
engine.step()
selected = {w.spec.name: w.sel_dev.clone() for w in engine.zweights}
k = {w.spec.name: w.k for w in engine.zweights}
engine.close()
torch.save({"local": local, "selected": selected, "k": k}, out)
dist.destroy_process_group()
"""


def test_ranks_select_the_same_columns_from_summed_scores(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(r),
                str(WORLD),
                str(tmp_path / "store"),
                str(tmp_path / f"rank{r}.pt"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(WORLD)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * WORLD, outputs
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    names = sorted(ranks[0]["selected"])
    assert len(names) == 3  # the three Linear weights are ZenFlow weights
    alone_differs = False
    for name in names:
        k = ranks[0]["k"][name]
        summed = sum(rank["local"][name] for rank in ranks)
        expected = torch.sort(torch.topk(summed, k).indices).values
        for rank in ranks:
            assert torch.equal(rank["selected"][name], expected), name
        for rank in ranks:
            alone = torch.sort(torch.topk(rank["local"][name], k).indices).values
            alone_differs |= not torch.equal(alone, expected)
    # The data differ enough that a rank choosing from its own scores would pick otherwise.
    assert alone_differs
