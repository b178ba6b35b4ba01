"""Column gathers on the CPU: ``index_select`` along a weight's last dimension (the copy
ZenFlow makes of each non-selected gradient column on the cpu and sim devices), bf16 against
fp32, and a plain copy of the same number of bytes for scale.

    .venv/bin/python bench/gather.py            # one thread, the simulated device's share
    .venv/bin/python bench/gather.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(50257, 512), (2048, 512), (512, 1536), (1536, 512)]  # GPT-2 4x512's 2-D weights


def _ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", type=float, default=0.9, help="share of columns gathered")
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.keep:.0%} of the columns")
    print(f"{'shape':>14} {'bf16 ms':>9} {'fp32 ms':>9} {'bf16/fp32':>10} {'copy ms':>9} "
          f"{'bf16/copy':>10}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for rows, cols in SHAPES:
        idx = torch.randperm(cols, generator=g)[: int(cols * args.keep)].sort().values
        res = {}
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, cols, generator=g).to(dt)
            out = torch.empty(rows, len(idx), dtype=dt)
            res[dt] = _ms(lambda x=x, out=out, idx=idx: torch.index_select(x, 1, idx, out=out),
                          args.repeats)  # fmt: skip
        x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        out = torch.empty(rows, len(idx), dtype=torch.bfloat16)
        copy = _ms(lambda x=x, out=out, n=len(idx): out.copy_(x[:, :n]), args.repeats)
        bf, fp = res[torch.bfloat16], res[torch.float32]
        print(f"{str((rows, cols)):>14} {bf:9.3f} {fp:9.3f} {bf / fp:10.2f} {copy:9.3f} "
              f"{bf / copy:10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
