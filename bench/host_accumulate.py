"""Host accumulation throughput: how fast the host sums streamed gradient pieces into fp32.

Every step, ZenFlow's host accumulator adds the non-selected share of the gradient (the
pieces the copy engine landed in pinned staging, in the training dtype) into the window's
fp32 sum, scaled by the step's clipping coefficient: ``dst += scale * src``. The host has
to keep pace with the link (issue 15, item 2): at 7B and topk 0.1 that is about 6G elements
per step. Contenders, interleaved round-robin so that drifting load hits all alike:

- ``native``: ``zenflow.ops.accumulate_`` (the engine's op: contiguous, SIMD, OpenMP over
  fixed-size blocks) at each thread count of ``--threads``;
- ``torch add_``: ``dst.add_(src, alpha=scale)`` (torch's own elementwise kernel; bf16 is
  widened on the fly) at the same thread counts;
- ``index_add_``: the layout the engine had before the compact window sums (a strided
  column gather, ``dst.index_add_(1, cols, src)`` into a full-shape sum), one thread, for
  reference;
- ``via store``: the path before a piece landed in its step store: the piece copied from
  the staging ring into the store (``store.copy_(src)``, torch, the same threads), then
  ``accumulate_`` from the store (each piece read twice more and written once more);
- ``q8 keep``: ``zfctl.step_store`` "q8"'s add, ``accumulate_keep_i8_`` (the same add and,
  in its pass, the piece's 8-bit copy: 1 byte an element more), ``q8 keep+fold``: the same
  with the previous step's correction folded in from the copy it replaces (``prev_delta``:
  the copy read too), and ``q8 correct``: the correction as a pass of its own,
  ``add_dequantized_i8_`` (read the copy, read and write the sum: 9 bytes an element), what
  a window's last step takes.

Bytes per element: read src (2 bf16 / 4 fp32), read and write dst (8): 10 or 12 (via
store: 14 or 20). The table gives elements/s, GB/s at those bytes, and each thread count's
speed-up over one thread.

    python bench/host_accumulate.py [--numel N] [--threads 1,2] [--fp32] [--repeats R] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zenflow import ops  # noqa: E402


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's own ops on ``n`` threads inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=64 * 2**20, help="elements per pass")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma separated")
    ap.add_argument("--fp32", action="store_true", help="fp32 pieces (default bf16)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    src_dtype = torch.float32 if args.fp32 else torch.bfloat16
    n = args.numel
    src = torch.randn(n).to(src_dtype)
    dst = torch.zeros(n)
    # the old layout: a [rows, cols] full-shape sum, pieces added into strided columns
    cols_n = 4096
    rows = n // cols_n
    cols = torch.arange(0, cols_n, 1, dtype=torch.long)
    full = torch.zeros(rows, cols_n)
    piece = src[: rows * cols_n].view(rows, cols_n)

    def native(t):
        return lambda: ops.accumulate_(dst, src, 0.5, num_threads=t)

    def torch_add(t):
        def run():
            with torch_threads(t):
                dst.add_(src, alpha=0.5)

        return run

    store = torch.empty_like(src)

    def via_store(t):
        def run():
            with torch_threads(t):
                store.copy_(src)
            ops.accumulate_(dst, store, 0.5, num_threads=t)

        return run

    codes = torch.empty(n, dtype=torch.int8)
    scales = torch.empty(ops.i8_num_blocks(n))

    def q8_keep(t):
        return lambda: ops.accumulate_keep_i8_(dst, src, 0.5, codes, scales, num_threads=t)

    def q8_keep_fold(t):
        return lambda: ops.accumulate_keep_i8_(dst, src, 0.5, codes, scales, num_threads=t,
                                               prev_delta=-0.1)  # fmt: skip

    def q8_correct(t):
        return lambda: ops.add_dequantized_i8_(dst, codes, scales, -0.1, num_threads=t)

    def index_add():
        with torch_threads(1):
            full.index_add_(1, cols, piece.float(), alpha=0.5)

    contenders = {}
    for t in threads:
        contenders[f"native, {t} thread{'s' * (t > 1)}"] = (native(t), t, n)
    for t in threads:
        contenders[f"torch add_, {t} thread{'s' * (t > 1)}"] = (torch_add(t), t, n)
    contenders["index_add_ (old layout), 1 thread"] = (index_add, 1, rows * cols_n)
    for t in threads:
        contenders[f"via store, {t} thread{'s' * (t > 1)}"] = (via_store(t), t, n)
    for t in threads:
        contenders[f"q8 keep, {t} thread{'s' * (t > 1)}"] = (q8_keep(t), t, n)
    for t in threads:
        contenders[f"q8 keep+fold, {t} thread{'s' * (t > 1)}"] = (q8_keep_fold(t), t, n)
    for t in threads:
        contenders[f"q8 correct, {t} thread{'s' * (t > 1)}"] = (q8_correct(t), t, n)
    times = {name: [] for name in contenders}
    for fn, _, _ in contenders.values():
        fn()  # warm-up (and the native build)
    for _ in range(args.repeats):
        for name, (fn, _, _) in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    per = 2 if src_dtype == torch.bfloat16 else 4
    bytes_per = per + 8
    out = {}
    for name, (_, t, numel) in contenders.items():
        s = statistics.median(times[name])
        moved = {"via store": bytes_per + 2 * per, "q8 keep": bytes_per + 1 + 4 / 256,
                 "q8 keep+fold": bytes_per + 2 + 8 / 256,
                 "q8 correct": 9 + 4 / 256}.get(name.split(",")[0], bytes_per)  # fmt: skip
        out[name] = {"threads": t, "numel": numel, "ms": s * 1e3, "elements_per_s": numel / s,
                     "bytes_per_element": moved, "gb_per_s": numel * moved / s / 1e9}  # fmt: skip
    for kind in ("native", "torch add_", "via store", "q8 keep", "q8 keep+fold", "q8 correct"):
        one = out.get(f"{kind}, 1 thread")
        for name, r in out.items():
            if one and name.startswith(kind):
                r["speedup_vs_1_thread"] = r["elements_per_s"] / one["elements_per_s"]
    meta = {"numel": n, "src_dtype": str(src_dtype).replace("torch.", ""),
            "bytes_per_element": bytes_per, "cores": os.cpu_count(), "repeats": args.repeats,
            "native": ops.native_status(), "torch": torch.__version__}  # fmt: skip
    if args.json:
        print(json.dumps({"meta": meta, "results": out}, indent=2, default=str))
        return 0
    print(f"dst (fp32) += 0.5 * src ({meta['src_dtype']}), {n / 2**20:.0f}M elements, "
          f"{bytes_per} bytes/element, median of {args.repeats}")  # fmt: skip
    print(f"{'contender':<36}{'ms':>9}{'G elem/s':>10}{'GB/s':>8}{'x 1 thread':>11}")
    for name, r in out.items():
        sp = r.get("speedup_vs_1_thread")
        print(f"{name:<36}{r['ms']:9.1f}{r['elements_per_s'] / 1e9:10.3f}{r['gb_per_s']:8.2f}"
              + (f"{sp:11.2f}" if sp else f"{'-':>11}"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
