"""The cost of a re-selection step against a steady one, on the simulated device.

The first GPU run (docs/BENCHMARKS.md, "The first GPU run") measured 17-19 s for a
re-selection of a 1B Llama against 0.5 s for a steady step. This times the same step kinds
on ``sim`` for a stack of square Linear layers (ZenFlow weights) so that the host's share
of a re-selection (the hand-over's re-layout of every weight's compact state) can be
compared between two checkouts side by side:

    .venv/bin/python bench/reselection.py --layers 4 --width 4096 --steps 13
    PYTHONPATH=/path/to/other/checkout .venv/bin/python bench/reselection.py ...

Prints one JSON line: the median milliseconds of each step kind, the engine's stall on the
re-selection steps and the first selection, the columns moved. fp32 weights, topk 0.1,
update_interval 2, a re-selection every 4 steps (select_strategy "step", select_schedule
"fixed"); ``--warm-up-rounds 1`` times the first selection from warm-up's full-shape state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "PYTHONPATH" not in os.environ:  # this checkout, also when run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from zenflow import ZenFlowEngine, load_config  # noqa: E402


class Stack(torch.nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(width, width, bias=False) for _ in range(layers)
        )

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--topk", type=float, default=0.1)
    ap.add_argument("--warm-up-rounds", type=int, default=0,
                    help="full_warm_up_rounds: 1 makes the first selection compact the "
                         "warm-up's full-shape state (three gathers a weight), as make "
                         "gpu-check's cases do")  # fmt: skip
    ap.add_argument(
        "--reserved-cores",
        type=float,
        default=0.5,
        help="pt_reserved_cores_perc, in (0, 1): 0.01 gives the host work every core",
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    model = Stack(a.layers, a.width)
    raw = {
        "train_micro_batch_size_per_gpu": a.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {
            "topk_ratio": a.topk, "update_interval": 2, "select_strategy": "step",
            "select_interval": 4, "full_warm_up_rounds": a.warm_up_rounds,
            "pt_reserved_cores_perc": a.reserved_cores, "overlap_step": False}},
        "zfctl": {"select_schedule": "fixed"},
    }  # fmt: skip
    x = torch.randn(a.batch, a.width)
    kinds: dict[str, list[float]] = {}
    stall, moved, first_stall = [], [], None
    first = a.warm_up_rounds + 1  # the first selection's step
    with ZenFlowEngine(model, load_config(raw), mode="zenflow", accelerator="sim") as e:
        for _ in range(a.steps):
            x = x + 0.1 * torch.randn_like(x)  # a different gradient every step
            t0 = time.perf_counter()
            e.backward(model(x))
            st = e.step()
            ms = 1e3 * (time.perf_counter() - t0)
            e.zero_grad()
            kind = "re-selection" if st.selection_changed and st.step > first else (
                "first selection" if st.step == first else
                "warm-up" if st.step < first else "steady")  # fmt: skip
            kinds.setdefault(kind, []).append(ms)
            if kind == "first selection":
                first_stall = st.stall_ms
            if kind == "re-selection":
                stall.append(st.stall_ms)
                moved.append(st.selection_changed)
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "median_ms": {k: round(statistics.median(v), 1) for k, v in kinds.items()},
        "steps": {k: len(v) for k, v in kinds.items()},
        "reselection_stall_ms_median": round(statistics.median(stall), 1) if stall else None,
        "columns_moved_median": statistics.median(moved) if moved else None,
        "first_selection_stall_ms": None if first_stall is None else round(first_stall, 1),
        "torch_threads": torch.get_num_threads(),
        "host_threads": e.host_threads,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
