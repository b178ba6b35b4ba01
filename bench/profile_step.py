"""Where one engine's step time goes: torch.profiler over a few ZenFlow steps of the
``bench/engine.py`` model, ops sorted by their own CPU time (all threads: the training
thread, the host worker and the simulated copy engines).

    .venv/bin/python bench/profile_step.py --device sim --bf16 --head cls --batch 1 --seq 16
    .venv/bin/python bench/profile_step.py --device cpu --batch 4 --seq 32 --sync
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine as bench_engine  # noqa: E402  (bench/engine.py: same model and config)

from zenflow import ZenFlowEngine  # noqa: E402
from zenflow.engine.accelerator import make_accelerator  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--device", default="sim", choices=["cpu", "sim"])
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--head", default="cls", choices=["lm", "cls"])
    ap.add_argument("--sync", action="store_true", help="overlap_step off")
    ap.add_argument("--steps", type=int, default=8, help="profiled steps (whole windows)")
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args()
    cfg_args = argparse.Namespace(batch=args.batch, topk=0.1, update_interval=4,
                                  select_interval=1000, bf16=args.bf16)  # fmt: skip
    model = bench_engine.build_model(args.layers, args.width, args.vocab, head=args.head)
    cfg = bench_engine.make_config(cfg_args, not args.sync)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
               for _ in range(8)]  # fmt: skip
    with ZenFlowEngine(model, cfg, accelerator=make_accelerator(args.device)) as eng:
        torch.set_num_threads(eng.resolved.get("training_threads", 1))

        def step(i: int) -> None:
            with eng.autocast():
                loss = bench_engine.forward_loss(model, batches[i % len(batches)], args.head)
            eng.backward(loss)
            eng.step(loss)
            eng.zero_grad()

        for i in range(8):  # warm-up: selection, first windows
            step(i)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(args.steps):
                step(i)
    print(
        f"{args.steps} steps, {args.device}, {'bf16' if args.bf16 else 'fp32'}, "
        f"{args.head} head, overlap {'off' if args.sync else 'on'}"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                    max_name_column_width=40))  # fmt: skip


if __name__ == "__main__":
    main()
