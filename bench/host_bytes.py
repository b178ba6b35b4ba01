"""Host bytes per non-selected element per step, measured with the engine's native kernels.

What ZenFlow's host does for each non-selected element, over a window of S optimizer steps
(issue 28 item 2; the model is ``zenflow.hardware.predict.zenflow_host_bytes``):

- every step, the copy engine lands the element's gradient in the step store (a DMA write
  in the link's dtype: the copy engine's, no CPU time), and the accumulator adds it into the
  window sum: ``zenflow.ops.accumulate_``, whose first add of a window only writes the sum
  (``overwrite``);
- once per window, the CPU Adam over the window sum (``adamw_step_``, exact: fp32 master and
  moments; ``adamw_q8_step_``, compact: 8-bit moments, a bf16 sum), and the return: the
  copy engine reads the fp32 master (a DMA read, no CPU time).

The CPU kernels are timed here, on ``--numel`` elements far beyond any cache, interleaved
round-robin with a plain copy (torch ``copy_`` of fp32 on the same threads: 8 bytes per
element) so that drifting load hits all alike. A kernel's **effective bytes** are its time
at that copy's rate: what it costs the host in memory traffic, whether it is bound by
bandwidth or not. The DMA's bytes (landing write, return read) cannot be timed on a CPU
box: they are counted from the model and said so. Per step:

    effective = (first add + (S - 1) adds + Adam) / S / element x copy bytes/s + DMA bytes

The arm ``staged (before)`` is the path before pieces landed in their step store: a copy
from the staging ring into the store (2 + 2 bytes, torch) before each add.

The arms ``q8`` are ``zfctl.step_store`` "q8" with clipping that bites at every step (its
upper bound, ``predict.q8_store_bytes``): the window's first write as above; its second add
keeps the piece's 8-bit copy and takes in the first's multiplier
(``accumulate_keep_i8_``'s ``prev_mul``); each later add keeps its copy and takes in the
step before's correction from that step's copy (``prev_delta``); the last step's
correction goes into the Adam as it reads the sum (``adamw_step_`` / ``adamw_q8_step_``'s
``corr_*``). ``q8 correct`` times the pass that did it before (``add_dequantized_i8_``).

The break-even tokens per step (compute = host time) for this host follow for a model
(``--model``, at ``--topk-ratio``, h100-sxm at 45%), from the measured time per element.

    python bench/host_bytes.py [--numel N] [--interval S] [--threads T] [--repeats R]
                               [--model llama-7b] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.host_accumulate import torch_threads  # noqa: E402
from zenflow import ops  # noqa: E402
from zenflow.hardware import predict  # noqa: E402
from zenflow.hardware.layout import Settings  # noqa: E402

HP = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
STATES = ("exact", "compact")


class Window:
    """One host state's buffers for ``n`` non-selected elements and its kernels."""

    def __init__(self, state: str, n: int, threads: int):
        self.state, self.threads = state, threads
        self.store = torch.randn(n).to(torch.bfloat16)  # a step's landed pieces (bf16 link)
        self.ring = torch.randn(n).to(torch.bfloat16)  # staged (before): the ring slot
        self.sum = torch.zeros(n, dtype=torch.float32 if state == "exact" else torch.bfloat16)
        self.master = torch.randn(n)
        self.step = 0
        if state == "exact":
            self.m, self.v = torch.zeros(n), torch.zeros(n)
        else:
            blocks = ops.q8_num_blocks(n)
            self.codes = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
            self.scales = [torch.zeros(blocks) for _ in range(2)]
        # "q8": the pieces' 8-bit copy (int8 codes, an fp32 scale per I8_BLOCK)
        self.copy = (torch.zeros(n, dtype=torch.int8), torch.zeros(ops.i8_num_blocks(n)))

    def add(self, first: bool) -> None:
        ops.accumulate_(self.sum, self.store, 0.5, overwrite=first, num_threads=self.threads)

    def keep_add(self, mul: float = 1.0, delta: float = 0.0) -> None:
        """A q8 add: the piece kept in 8 bits by its own pass, which first takes in the step
        before's multiplier (``mul``) or correction (``delta`` times that step's copy)."""
        kw = dict(num_threads=self.threads, prev_mul=mul, prev_delta=delta)
        ops.accumulate_keep_i8_(self.sum, self.store, 0.5, *self.copy, **kw)

    def correct(self) -> None:
        """A q8 window's last correction as a pass of its own (before it went into the
        Adam)."""
        ops.add_dequantized_i8_(self.sum, *self.copy, 0.01, num_threads=self.threads)

    def adam(self, **corr) -> None:
        self.step += 1
        kw = dict(step=self.step, num_threads=self.threads, **HP, **corr)
        if self.state == "exact":
            ops.adamw_step_(self.master, self.sum, self.m, self.v, **kw)
        else:
            (mc, uc), (ms, us) = self.codes, self.scales
            ops.adamw_q8_step_(self.master, self.sum, mc, ms, uc, us, **kw)

    def adam_folded(self) -> None:
        """The window's Adam taking a q8 window's last correction in as it reads the sum
        (one piece)."""
        starts = torch.tensor([0, self.sum.numel()], dtype=torch.int64)
        self.adam(corr_codes=self.copy[0], corr_scales=self.copy[1], corr_starts=starts,
                  corr_delta=0.01)  # fmt: skip

    def staged_add(self) -> None:
        """A later add of the path before the store: the ring slot copied in first."""
        with torch_threads(self.threads):
            self.store.copy_(self.ring)
        self.add(False)


def measure(n: int, threads: int, repeats: int) -> dict:
    """Median seconds of each kernel (and of the copy), interleaved round-robin."""
    windows = {st: Window(st, n, threads) for st in STATES}
    src, dst = torch.randn(n), torch.empty(n)

    def copy():
        with torch_threads(threads):
            dst.copy_(src)

    timed = {"copy": copy}
    for st, w in windows.items():
        timed[f"{st} first add"] = lambda w=w: w.add(True)
        timed[f"{st} add"] = lambda w=w: w.add(False)
        timed[f"{st} adam"] = w.adam
        timed[f"{st} q8 adam folded"] = w.adam_folded
        # (a multiplier near 1, so that repeats leave the sums' scale as it was)
        timed[f"{st} q8 keep mul"] = lambda w=w: w.keep_add(mul=0.999)
        timed[f"{st} q8 keep delta"] = lambda w=w: w.keep_add(delta=0.01)
        timed[f"{st} q8 correct"] = w.correct
    timed["exact staged add"] = windows["exact"].staged_add
    times = {k: [] for k in timed}
    for fn in timed.values():
        fn()  # warm-up: pages touched, the native op built
    for _ in range(repeats):
        for k, fn in timed.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def per_step(sec: dict, state: str, S: int, n: int, staged: bool = False,
             q8: bool = False) -> float:  # fmt: skip
    """CPU seconds per element per step of ``state``'s window of ``S`` steps (``q8``: with
    zfctl.step_store "q8"'s copies and corrections, clipping biting at every step)."""
    if q8:
        first, adam = sec[f"{state} first add"], sec[f"{state} adam"]
        if S == 1:  # the first write's multiplier as a pass: a correction's sum bytes
            return (first + sec[f"{state} q8 correct"] + adam) / n
        adds = sec[f"{state} q8 keep mul"] + (S - 2) * sec[f"{state} q8 keep delta"]
        # the last correction inside the window's Adam
        return (first + adds + sec[f"{state} q8 adam folded"]) / S / n
    add = sec["exact staged add"] if staged else sec[f"{state} add"]
    first = sec[f"{state} first add"] + (add - sec["exact add"] if staged else 0.0)
    return (first + (S - 1) * add + sec[f"{state} adam"]) / S / n


def dma_bytes(s: Settings) -> float:
    """The copy engine's host bytes per element per step (counted): the landing's write in
    the link's dtype, the return's read of the fp32 master once per window."""
    return s.link_bytes + predict.HOST_BYTES["return"][s.host_state] / max(1, s.update_interval)


def rows(sec: dict, S: int, n: int) -> list[dict]:
    copy_bps = 8 * n / sec["copy"]
    out = []
    arms = [("exact", "exact", False, "on"), ("compact", "compact", False, "on"),
            ("exact, staged (before)", "exact", True, "on"), ("exact, q8", "exact", False, "q8"),
            ("compact, q8", "compact", False, "q8")]  # fmt: skip
    for name, st, staged, store in arms:
        s = Settings(bf16=True, host_state=st, update_interval=S, step_store=store)
        cpu_s = per_step(sec, st, S, n, staged, q8=store == "q8")
        model = predict.zenflow_host_bytes(s) + (2 * s.link_bytes if staged else 0)
        eff = cpu_s * copy_bps + dma_bytes(s)
        out.append({"arm": name, "state": st, "cpu_ns_per_element_step": cpu_s * 1e9,
                    "effective_bytes": eff, "counted_bytes": model,
                    "effective_over_counted": eff / model})  # fmt: skip
    return out


def break_even(model: str, topk: float, S: int, cpu_s: dict, copy_bps: float) -> dict:
    """Tokens per step where compute equals the host's time, at this host's measured time
    per element (the DMA's bytes at the copy rate), h100-sxm at 45%, recomputing."""
    from zenflow.hardware.census import resolve_census

    census = resolve_census(model, head="causal-lm")
    box = predict.box_of("h100-sxm")
    out = {}
    for arm, t in cpu_s.items():  # arm: the state, or "<state>, q8"
        st, _, store = arm.partition(", ")
        s = Settings(bf16=True, host_state=st, update_interval=S, topk_ratio=topk,
                     gradient_checkpointing=True, step_store=store or "on")  # fmt: skip
        seconds = t + dma_bytes(s) / copy_bps  # per element per step
        host_bw = predict.zenflow_host_bytes(s) / seconds  # the model's bytes in that time
        out[arm] = predict.break_even_tokens(census, s, box, host_bw)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=32 * 2**20, help="elements per buffer")
    ap.add_argument("--interval", type=int, default=4, help="update_interval S")
    ap.add_argument("--threads", type=int, default=1, help="threads of every kernel")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", default="llama-7b", help="for the break-even tokens per step")
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    n, S = args.numel, args.interval
    sec = measure(n, args.threads, args.repeats)
    copy_bps = 8 * n / sec["copy"]
    table = rows(sec, S, n)
    cpu = {st: per_step(sec, st, S, n) for st in STATES}
    cpu.update({f"{st}, q8": per_step(sec, st, S, n, q8=True) for st in STATES})
    even = break_even(args.model, args.topk_ratio, S, cpu, copy_bps)
    meta = {"numel": n, "update_interval": S, "threads": args.threads, "repeats": args.repeats,
            "copy_gb_per_s": copy_bps / 1e9, "cores": os.cpu_count(), "torch": torch.__version__,
            "native": ops.native_status(), "kernel_ms": {k: v * 1e3 for k, v in sec.items()},
            "break_even_model": args.model, "topk_ratio": args.topk_ratio}  # fmt: skip
    if args.json:
        print(json.dumps({"meta": meta, "rows": table, "break_even_tokens": even}, indent=2,
                         default=str))  # fmt: skip
        return 0
    print(
        f"{n / 2**20:.0f}M elements, S = {S}, {args.threads} thread(s), median of "
        f"{args.repeats}; copy {copy_bps / 1e9:.1f} GB/s (8 B per element)"
    )
    print("kernel ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sec.items()))
    print(f"{'arm':<26}{'CPU ns/elem/step':>18}{'effective B':>13}{'counted B':>11}{'ratio':>7}")
    for r in table:
        print(
            f"{r['arm']:<26}{r['cpu_ns_per_element_step']:18.3f}{r['effective_bytes']:13.2f}"
            f"{r['counted_bytes']:11.2f}{r['effective_over_counted']:7.2f}"
        )
    print(
        f"break-even tokens per step, {args.model} at topk {args.topk_ratio}, h100-sxm at 45%, "
        f"this host: " + ", ".join(f"{k} {v:,}" for k, v in even.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
