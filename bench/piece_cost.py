"""The training thread's CPU time per streamed piece and per weight, and what it comes to
for a 7B model's step (issue 28 item 3).

On a GPU the copies, gathers and norms of a step's gradient pieces are kernels; what costs
the training thread (the one that also launches the backward) is the Python and the
launches around each piece: a bucket, its gather, its norm, its events, its copy, the
accumulator's queue. This runs ZenFlow on the simulated accelerator (the CUDA code paths:
streams, events, pinned landing) with a model whose tensors are small, so that the data work
is negligible and what is measured is that per-call cost, on this machine's CPU:

- each weight's gradient route (``ZenFlowMode.route``: its hook's work, all its pieces),
  timed with the thread's CPU clock, then fitted per weight as ``a + b x pieces``: ``b`` is
  the CPU per piece, ``a`` the rest of a weight's hook;
- the device step (``DeviceStep.update``: AdamW of the selected columns and the per-weight
  bookkeeping) per weight;
- the whole backward + optimizer step on the training thread, ZenFlow less plain device
  AdamW on the same model (the engine's extra CPU per step, all of it).

Then ``--model``'s step (default llama-7b, topk 0.1) at those rates: its weights and the
pieces the engine's bucket rule gives it (``zenflow.hardware.predict.pieces``).

    python bench/piece_cost.py [--layers 8] [--width 128] [--piece-elems N] [--steps 12]
                               [--model llama-7b] [--json]

``--piece-elems``: a smaller bucket than the engine's rule gives this small model, for more
pieces per weight (the engine's ``bucket_elems``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import engine as bench_engine  # noqa: E402  (bench/engine.py: the same model)

from zenflow import ZenFlowEngine, load_config  # noqa: E402
from zenflow.engine.accelerator import make_accelerator  # noqa: E402


def config(zenflow: bool):
    raw = {
        "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }  # fmt: skip
    if zenflow:
        raw["zero_optimization"]["zenflow"] = {
            "topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step",
            "select_interval": 1000, "overlap_step": True,
        }  # fmt: skip
    return load_config(raw)


class Timed:
    """Wraps ``obj.name`` to add each call's thread CPU time to ``self.calls`` (by key)."""

    def __init__(self, obj, name: str, key=lambda *a: None):
        self.calls: dict = {}
        self.on = False
        inner = getattr(obj, name)

        def wrapper(*args, **kw):
            t0 = time.thread_time_ns()
            try:
                return inner(*args, **kw)
            finally:
                if self.on:
                    k = key(*args)
                    self.calls.setdefault(k, []).append((time.thread_time_ns() - t0) / 1e9)

        setattr(obj, name, wrapper)


def run(mode: str, args) -> dict:
    """Steady steps of ``mode`` (after warm-up and the first selection): the training
    thread's CPU per step, and for ZenFlow per weight route and per device step."""
    model = bench_engine.build_model(args.layers, args.width, args.vocab, head="cls")
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(1, args.vocab, (1, args.seq), generator=gen)
    cfg = config(mode == "zenflow")
    accel = make_accelerator("sim")
    kw = {"bucket_elems": args.piece_elems} if args.piece_elems else {}
    with ZenFlowEngine(model, cfg, mode=mode, accelerator=accel, **kw) as eng:
        torch.set_num_threads(1)
        route = dev = None
        if mode == "zenflow":
            route = Timed(eng.impl, "route", key=lambda spec, *a: spec.name)
            dev = Timed(eng.impl.device_step, "update")

        def step() -> float:
            with eng.autocast():
                loss = bench_engine.forward_loss(model, batch, "cls")
            t0 = time.thread_time_ns()
            eng.backward(loss)
            eng.step(loss)
            dt = (time.thread_time_ns() - t0) / 1e9
            eng.zero_grad()
            return dt

        for _ in range(args.warmup):
            step()
        for t in (route, dev):
            if t is not None:
                t.on = True
        steps = [step() for _ in range(args.steps)]
        out = {"step_cpu_s": statistics.median(steps)}
        if mode == "zenflow":
            pieces = {w.spec.name: len(w.pieces) for w in eng.impl.zweights}
            out["weights"] = [
                {"pieces": pieces[k], "cpu_s": statistics.median(v)} for k, v in route.calls.items()
            ]  # fmt: skip
            out["device_step_s"] = statistics.median(dev.calls[None])
            out["weight_count"] = len(pieces)
    return out


def fit(weights: list[dict]) -> tuple[float, float]:
    """Least squares ``cpu = a + b x pieces`` over the weights: (a, b)."""
    xs = [w["pieces"] for w in weights]
    ys = [w["cpu_s"] for w in weights]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def at_scale(model: str, topk: float, per_weight: float, per_piece: float) -> dict:
    """``model``'s weights and pieces per step (the engine's rule) and its CPU at these
    rates (per weight: its route's rest and its device step's share)."""
    from zenflow.hardware.census import resolve_census
    from zenflow.hardware.layout import Settings
    from zenflow.hardware.predict import pieces

    census = resolve_census(model, head="causal-lm")
    n_pieces = pieces(census, Settings(bf16=True, topk_ratio=topk))
    n_weights = len(census.zenflow_weights)
    return {"model": model, "topk_ratio": topk, "weights": n_weights, "pieces": n_pieces,
            "bucket_elements": census.bucket_elements,
            "cpu_ms": (per_weight * n_weights + per_piece * n_pieces) * 1e3}  # fmt: skip


def measure(args) -> dict:
    device = run("device", args)
    zen = run("zenflow", args)
    a, b = fit(zen["weights"])
    n_w = zen["weight_count"]
    dev_per_weight = zen["device_step_s"] / n_w
    per_step = sum(w["cpu_s"] for w in zen["weights"])
    pieces = sum(w["pieces"] for w in zen["weights"])
    return {
        "shape": {
            "layers": args.layers,
            "width": args.width,
            "vocab": args.vocab,
            "seq": args.seq,
            "piece_elems": args.piece_elems,
        },  # fmt: skip
        "weights": n_w,
        "pieces_per_step": pieces,
        "route_cpu_ms_per_step": per_step * 1e3,
        "per_piece_us": b * 1e6,
        "per_weight_route_us": a * 1e6,
        "per_weight_device_step_us": dev_per_weight * 1e6,
        "step_cpu_ms": {"zenflow": zen["step_cpu_s"] * 1e3, "device": device["step_cpu_s"] * 1e3},
        "extra_cpu_ms_per_step": (zen["step_cpu_s"] - device["step_cpu_s"]) * 1e3,
        "at_scale": at_scale(args.model, args.topk_ratio, a + dev_per_weight, b),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--piece-elems", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = measure(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    s = out["at_scale"]
    print(f"{out['weights']} weights, {out['pieces_per_step']} pieces a step (sim, bf16)")
    print(
        f"per piece {out['per_piece_us']:.0f} us, per weight {out['per_weight_route_us']:.0f}"
        f" us in its hook + {out['per_weight_device_step_us']:.0f} us in the device step"
    )
    print(
        f"training thread per step: zenflow {out['step_cpu_ms']['zenflow']:.1f} ms, device "
        f"AdamW {out['step_cpu_ms']['device']:.1f} ms: {out['extra_cpu_ms_per_step']:.1f} ms more"
    )
    print(
        f"{s['model']} at topk {s['topk_ratio']}: {s['weights']} weights, {s['pieces']} pieces "
        f"(buckets of {s['bucket_elements']:,} elements): {s['cpu_ms']:.0f} ms a step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
