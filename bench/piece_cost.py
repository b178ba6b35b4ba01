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
  AdamW on the same model (the engine's extra CPU per step, all of it);
- each of those less the accelerator's own calls (copies, events, stream waits: on a GPU
  CUDA API calls, on sim the simulator's Python), counted per piece: the engine's part;
- the device step again after re-selections, when the selected columns carry their own
  step counts (the per-column update, batched by the device step's scratch).

Each figure twice: for a steady step (medians over the steps), and as the mean step over
whole windows (``window``), where a window-end step's extra work (the previous host step's
result returned piece by piece in the hooks) is spread over the S steps it serves.

Then ``--model``'s step (default llama-7b, topk 0.1) at those rates: its weights and the
pieces the engine's bucket rule gives it (``zenflow.hardware.predict.pieces``).

And ``--model``'s own layer stack measured directly (``stack``; llama and qwen2 shapes):
every dimension divided so that its hidden size is ``--stack-width`` (64), the bucket by
that factor squared, so that it has the model's weights and, the divisions allowing, its
pieces (both counts are given beside the model's), each tiny: the hooks' and the device
step's CPU a step, as the mean over whole windows, with no fit and no extrapolation.
``--stack-also N``: the same stack again with the model's pieces in buckets of N elements
(``stack_also``: what another piece size would cost, measured side by side).

    python bench/piece_cost.py [--layers 8] [--width 128] [--piece-elems N] [--steps 12]
                               [--model llama-7b] [--stack-width 64] [--stack-also N]
                               [--device sim|cuda]
                               [--json] [--result]

``--device cuda`` measures the same on a GPU, where the accelerator's calls are CUDA's
(``make gpu-check``'s ``pieces`` section runs it so).

``--piece-elems``: a smaller bucket than the engine's rule gives this small model, for more
pieces per weight (the engine's ``bucket_elems``).
"""

from __future__ import annotations

import argparse
import gc
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
from zenflow.engine.selection import DEFAULT_MIN_NUMEL  # noqa: E402


def config(zenflow: bool, select_interval: int = 1000):
    raw = {
        "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }  # fmt: skip
    if zenflow:
        raw["zero_optimization"]["zenflow"] = {
            "topk_ratio": TOPK, "update_interval": UPDATE_INTERVAL, "select_strategy": "step",
            "select_interval": select_interval, "overlap_step": True,
        }  # fmt: skip
    return load_config(raw)


# The accelerator's calls on the training thread: on a GPU these are CUDA API calls (an
# event, a stream switch, cudaMemcpyAsync, a stream wait), on sim the simulator's Python
# (its copy engine's queue, its threading events). Their CPU is counted apart.
ACCEL_CALLS = ("copy_d2h", "copy_h2d", "compute_wait", "record_compute")
UPDATE_INTERVAL = 4  # the config's S: the means cover whole windows
TOPK = 0.1  # the config's topk_ratio (--topk-ratio sets the fitted at-scale figures' only)


class AccelMeter:
    """Wraps the accelerator's calls to add their thread CPU time to ``cpu_ns`` and count
    them in ``calls`` (by name); ``wrap`` False: leaves them untimed (both stay 0)."""

    def __init__(self, accel, wrap: bool = True):
        self.cpu_ns = 0
        self.calls: dict[str, int] = dict.fromkeys(ACCEL_CALLS, 0)
        for name in ACCEL_CALLS if wrap else ():
            setattr(accel, name, self._wrap(name, getattr(accel, name)))

    def _wrap(self, name, inner):
        def wrapper(*args, **kw):
            t0 = time.thread_time_ns()
            try:
                return inner(*args, **kw)
            finally:
                self.cpu_ns += time.thread_time_ns() - t0
                self.calls[name] += 1

        return wrapper


class Timed:
    """Wraps ``obj.name`` to add each call's thread CPU time to ``self.calls`` (by key), as
    (all of it, the part in the accelerator's calls: ``meter``)."""

    def __init__(self, obj, name: str, meter: AccelMeter, key=lambda *a: None):
        self.calls: dict = {}
        self.on = False
        inner = getattr(obj, name)

        def wrapper(*args, **kw):
            t0, a0 = time.thread_time_ns(), meter.cpu_ns
            try:
                return inner(*args, **kw)
            finally:
                if self.on:
                    k = key(*args)
                    cpu = ((time.thread_time_ns() - t0) / 1e9, (meter.cpu_ns - a0) / 1e9)
                    self.calls.setdefault(k, []).append(cpu)

        setattr(obj, name, wrapper)


def median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """The median of each part of (all, accelerator) pairs: a steady step's."""
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def mean_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """The mean of each part of (all, accelerator) pairs: over whole windows, so a
    window-end step's extra work (its image return in the hooks) is spread over the S
    steps it serves, as the run pays it."""
    return statistics.fmean(p[0] for p in pairs), statistics.fmean(p[1] for p in pairs)


class Stack:
    """``model``'s layer stack at ``width`` (a llama- or qwen2-family architecture): every
    dimension divided by ``hidden / width`` (hidden, MLP, vocabulary; 4 attention heads,
    the key/value heads in the same proportion), and the engine's bucket divided by that
    factor squared. Its weights are the model's, one for one, and so (when the divisions
    are exact enough) are their pieces; its tensors are so small that what a step costs
    the training thread is the per-call work, measured directly rather than fitted."""

    def __init__(self, name: str, width: int, model_bucket: int | None = None):
        from zenflow.config.architectures import architecture
        from zenflow.hardware.census import resolve_census

        arch = architecture(name)
        if arch is None or arch.model_type not in ("llama", "qwen2"):
            raise ValueError(f"{name}: the scaled stack is built for llama and qwen2 shapes")
        self.cfg = cfg = arch.config()
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        self.factor = f = cfg.hidden_size // width
        cfg.hidden_size, cfg.intermediate_size = width, cfg.intermediate_size // f
        cfg.vocab_size = cfg.vocab_size // f
        cfg.num_attention_heads, cfg.num_key_value_heads = 4, max(1, 4 * kv // heads)
        cfg.head_dim = width // 4
        census = resolve_census(name, head="causal-lm")
        # the model's bucket (the engine's rule, or ``model_bucket`` elements), scaled
        self.model_bucket = model_bucket or census.bucket_elements
        self.bucket_elems = max(1, self.model_bucket // (f * f))
        # the engine's smallest ZenFlow weight, scaled too (a key/value projection with
        # few heads stays a ZenFlow weight, as it is in the model)
        self.min_numel = max(1, DEFAULT_MIN_NUMEL // (f * f))
        self.census = census

    def build(self):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(self.cfg).float()

    @staticmethod
    def loss(model, batch):
        return model(input_ids=batch, labels=batch).loss


def run(
    mode: str, args, reselect: bool = False, stack: Stack | None = None, metered: bool = True
) -> dict:
    """Steady steps of ``mode`` (after warm-up and the first selection; ``reselect``: after
    re-selections too, so that selected columns carry their own step counts): the training
    thread's CPU per step, and for ZenFlow per weight route and per device step, each as
    (all, in the accelerator's calls). ``stack``: on that scaled layer stack (its LM head),
    else on the GPT-2 of ``--layers`` x ``--width`` (a classifier). ``metered`` False: the
    accelerator's calls and the routes are not timed (each timer is two reads of the
    thread's CPU clock, a system call: 0.4 us here, a few ms a 7B step in all), so the step,
    the hooks and the device step are timed with nothing else inside them; the accelerator's
    part reads 0 and there are no per-weight routes."""
    kw = {}
    if stack is None:
        model = bench_engine.build_model(args.layers, args.width, args.vocab, head="cls")
        vocab, piece_elems = args.vocab, args.piece_elems
        loss_of = lambda m, b: bench_engine.forward_loss(m, b, "cls")  # noqa: E731
    else:
        model, vocab, piece_elems = stack.build(), stack.cfg.vocab_size, stack.bucket_elems
        loss_of, kw["min_numel"] = stack.loss, stack.min_numel
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(1, vocab, (1, args.seq), generator=gen) for _ in range(4)]
    if args.device == "cuda":  # the model and its inputs where they run: no input copy
        model = model.cuda()
        batches = [b.cuda() for b in batches]
    cfg = config(mode == "zenflow", max(2, args.warmup // 3) if reselect else 1000)
    accel = make_accelerator(args.device)
    meter = AccelMeter(accel, wrap=metered)
    if piece_elems:
        kw["bucket_elems"] = piece_elems
    with ZenFlowEngine(model, cfg, mode=mode, accelerator=accel, **kw) as eng:
        torch.set_num_threads(1)
        route = dev = hook = None
        if mode == "zenflow":
            if metered:
                route = Timed(eng.impl, "route", meter, key=lambda spec, *a: spec.name)
            dev = Timed(eng.impl.device_step, "update", meter)
        if mode == "zenflow" and stack is not None:
            # every gradient hook whole (the route, and around it the gradient's device
            # accounting and bookkeeping; the weights ZenFlow does not route too)
            hook = Timed(eng.stream, "_on_grad", meter)

        def step(i: int) -> tuple[float, float]:
            with eng.autocast():
                loss = loss_of(model, batches[i % len(batches)])
            t0, a0 = time.thread_time_ns(), meter.cpu_ns
            eng.backward(loss)
            eng.step(loss)
            cpu = ((time.thread_time_ns() - t0) / 1e9, (meter.cpu_ns - a0) / 1e9)
            eng.zero_grad()
            return cpu

        for i in range(args.warmup):
            step(i)
        # a full collection now, not one due mid-measurement: set-up leaves hundreds of
        # thousands of objects (transformers, the model) whose first full collection after
        # it takes 0.2 s on this CPU, once; a run's steady steps see none (docs/BENCHMARKS.md)
        gc.collect()
        for t in (route, dev, hook):
            if t is not None:
                t.on = True
        calls0 = dict(meter.calls)
        steps = [step(i) for i in range(args.steps)]
        out = {"step_cpu_s": median_pair(steps), "step_cpu_mean_s": mean_pair(steps),
               "accel_calls_per_step": {k: (meter.calls[k] - calls0[k]) / args.steps
                                        for k in ACCEL_CALLS}}  # fmt: skip
        if mode == "zenflow":
            pieces = {w.spec.name: len(w.pieces) for w in eng.impl.zweights}
            out["weights"] = []
            for k, v in (route.calls if route is not None else {}).items():
                (cpu, accel_s), (cpu_m, accel_m) = median_pair(v), mean_pair(v)
                out["weights"].append({"pieces": pieces[k], "cpu_s": cpu, "accel_s": accel_s,
                                       "mean": {"cpu_s": cpu_m, "accel_s": accel_m}})  # fmt: skip
            if hook is not None:
                calls = hook.calls.get(None, [])
                out["hooks_step_mean_s"] = (sum(c[0] for c in calls) / args.steps,
                                            sum(c[1] for c in calls) / args.steps)  # fmt: skip
            out["device_step_s"] = median_pair(dev.calls[None])
            out["device_step_mean_s"] = mean_pair(dev.calls[None])
            out["weight_count"] = len(pieces)
            out["per_column_weights"] = sum(
                w.steps_dev.uniform is None for w in eng.impl.zweights
            )  # fmt: skip
    return out


def fit(weights: list[dict], part: str = "cpu_s") -> tuple[float, float]:
    """Least squares ``cpu = a + b x pieces`` over the weights: (a, b); ``part``: "cpu_s"
    (all of a route's CPU) or "engine_s" (less its accelerator calls)."""
    xs = [w["pieces"] for w in weights]
    ys = [w["cpu_s"] - (w["accel_s"] if part == "engine_s" else 0.0) for w in weights]
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


def rates(zen: dict, stat: str) -> dict:
    """ZenFlow's per-piece and per-weight CPU (all of it, and the engine's part) from the
    steady steps' medians (``stat`` "median") or the means over whole windows ("mean")."""
    n_w = zen["weight_count"]
    ws = zen["weights"] if stat == "median" else [{"pieces": w["pieces"], **w["mean"]}
                                                  for w in zen["weights"]]  # fmt: skip
    dev = zen["device_step_s"] if stat == "median" else zen["device_step_mean_s"]
    a, b = fit(ws)
    a_e, b_e = fit(ws, "engine_s")
    dev_all, dev_accel = (t / n_w for t in dev)
    return {"per_piece": b, "per_weight_route": a, "per_weight_device_step": dev_all,
            "engine_per_piece": b_e, "engine_per_weight_route": a_e,
            "engine_per_weight_device_step": dev_all - dev_accel}  # fmt: skip


def measure_stack(args, model_bucket: int | None = None, device: bool = True) -> dict | None:
    """ZenFlow (and, with ``device``, device AdamW) on ``--model``'s layer stack at
    ``--stack-width`` (``Stack``; ``model_bucket``: the model's bucket in elements, default
    the engine's rule): the training thread's CPU a step in the gradient hooks (whole:
    the route, the gradient's accounting and bookkeeping) and the device step, all of it
    and the engine's own, as the mean over whole windows, measured on the model's own
    weights and pieces (no fit). Two runs: one that times only the step, the hooks and the
    device step (the figures), and a metered one for the accelerator's part (the engine's
    own is the first run's less it) and the routes alone (``metered``: its own figures,
    each with its timers' cost inside). None with ``--stack-width 0``."""
    if not args.stack_width:
        return None
    try:
        stack = Stack(args.model, args.stack_width, model_bucket)
    except ValueError as e:
        return {"model": args.model, "skipped": str(e)}
    from zenflow.hardware.layout import Settings
    from zenflow.hardware.predict import pieces

    zen = run("zenflow", args, stack=stack, metered=False)  # the figures: nothing else timed
    split = run("zenflow", args, stack=stack)  # the accelerator's part and the routes
    hooks, dev = zen["hooks_step_mean_s"][0], zen["device_step_mean_s"][0]
    accel = split["hooks_step_mean_s"][1] + split["device_step_mean_s"][1]
    ms = lambda s: s * 1e3  # noqa: E731
    B = stack.model_bucket
    out = {
        "model": args.model, "width": args.stack_width, "factor": stack.factor,
        "model_bucket_elements": B, "bucket_elements": stack.bucket_elems,
        "weights": zen["weight_count"], "pieces": sum(w["pieces"] for w in split["weights"]),
        "model_weights": len(stack.census.zenflow_weights),
        "model_pieces": pieces(stack.census, Settings(bf16=True, topk_ratio=TOPK), B),
        "hooks_ms": ms(hooks), "device_step_ms": ms(dev), "cpu_ms": ms(hooks + dev),
        # less the accelerator's calls, timed in the metered run (each with about one read
        # of the clock inside it: the engine's own is, if anything, understated by that)
        "engine_cpu_ms": ms(hooks + dev - accel),
        "step_cpu_ms": {"zenflow": ms(zen["step_cpu_mean_s"][0])},
        # the metered run's own figures: every accelerator call and route timed too
        "metered": {
            "route_ms": ms(sum(w["mean"]["cpu_s"] for w in split["weights"])),
            "hooks_ms": ms(split["hooks_step_mean_s"][0]), "accel_ms": ms(accel),
            "cpu_ms": ms(split["hooks_step_mean_s"][0] + split["device_step_mean_s"][0]),
        },
    }  # fmt: skip
    if device:
        dev_run = run("device", args, stack=stack, metered=False)
        out["step_cpu_ms"]["device"] = ms(dev_run["step_cpu_mean_s"][0])
    return out


def measure(args) -> dict:
    """The three runs (device AdamW; ZenFlow steady; ZenFlow after re-selections) and the
    figures: per piece and per weight, all of the thread's CPU and the engine's part (less
    the accelerator's calls), and ``--model``'s step at each; for a steady step (medians)
    and for the mean step over whole windows (``window``: the window end's return
    included)."""
    device = run("device", args)
    zen = run("zenflow", args)
    resel = run("zenflow", args, reselect=True)
    n_w = zen["weight_count"]
    r, rm = rates(zen, "median"), rates(zen, "mean")
    dev_cols = resel["device_step_s"][0] / n_w
    pieces = sum(w["pieces"] for w in zen["weights"])
    calls = zen["accel_calls_per_step"]
    scale = lambda per_weight, per_piece: at_scale(  # noqa: E731
        args.model, args.topk_ratio, per_weight, per_piece
    )
    out = {
        "shape": {
            "layers": args.layers,
            "width": args.width,
            "vocab": args.vocab,
            "seq": args.seq,
            "piece_elems": args.piece_elems,
        },  # fmt: skip
        "weights": n_w,
        "pieces_per_step": pieces,
        "route_cpu_ms_per_step": sum(w["cpu_s"] for w in zen["weights"]) * 1e3,
        **{f"{k}_us": v * 1e6 for k, v in r.items()},
        "accel_calls_per_piece": {k: v / max(1, pieces) for k, v in calls.items()},
        "per_column": {
            "weights": resel["per_column_weights"],
            "per_weight_device_step_us": dev_cols * 1e6,
        },  # fmt: skip
        "step_cpu_ms": {
            "zenflow": zen["step_cpu_s"][0] * 1e3,
            "device": device["step_cpu_s"][0] * 1e3,
        },  # fmt: skip
        "extra_cpu_ms_per_step": (zen["step_cpu_s"][0] - device["step_cpu_s"][0]) * 1e3,
        "at_scale": scale(r["per_weight_route"] + r["per_weight_device_step"], r["per_piece"]),
        "at_scale_engine": scale(
            r["engine_per_weight_route"] + r["engine_per_weight_device_step"],
            r["engine_per_piece"],
        ),
        "at_scale_per_column": scale(r["per_weight_route"] + dev_cols, r["per_piece"]),
        "window": {
            **{f"{k}_us": v * 1e6 for k, v in rm.items()},
            "step_cpu_ms": {
                "zenflow": zen["step_cpu_mean_s"][0] * 1e3,
                "device": device["step_cpu_mean_s"][0] * 1e3,
            },  # fmt: skip
            "at_scale": scale(
                rm["per_weight_route"] + rm["per_weight_device_step"], rm["per_piece"]
            ),  # fmt: skip
            "at_scale_engine": scale(
                rm["engine_per_weight_route"] + rm["engine_per_weight_device_step"],
                rm["engine_per_piece"],
            ),
        },
    }
    out["stack"] = measure_stack(args)
    if args.stack_also and out["stack"] and "skipped" not in out["stack"]:
        out["stack_also"] = measure_stack(args, args.stack_also, device=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--piece-elems", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12, help="a multiple of 4 (whole windows)")
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--stack-width", type=int, default=64,
                    help="also measure --model's own layer stack at this width (llama and "
                    "qwen2 shapes; 0: not)")  # fmt: skip
    ap.add_argument("--stack-also", type=int, default=None, metavar="ELEMENTS",
                    help="the stack again with the model's pieces in buckets of this many "
                    "elements (stack_also: e.g. 16777216, the engine's earlier size)")  # fmt: skip
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--device", default="sim", choices=["sim", "cuda"],
                    help="sim (CUDA's code paths, the simulator's calls) or a GPU")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--result", action="store_true",
                    help="the JSON as one GPU_CHECK_RESULT line (make gpu-check)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.steps % UPDATE_INTERVAL:
        ap.error(f"--steps {args.steps}: give a multiple of the update interval, "
                 f"{UPDATE_INTERVAL}, so that the means cover whole windows")  # fmt: skip
    out = measure(args)
    out["device"] = args.device
    if args.result:
        print("GPU_CHECK_RESULT " + json.dumps(out), flush=True)
        return 0
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    s = out["at_scale"]
    print(f"{out['weights']} weights, {out['pieces_per_step']} pieces a step ({args.device}, bf16)")
    print(
        f"per piece {out['per_piece_us']:.0f} us, per weight {out['per_weight_route_us']:.0f}"
        f" us in its hook + {out['per_weight_device_step_us']:.0f} us in the device step"
    )
    print(
        f"  of which the engine's own (less the accelerator's calls): per piece "
        f"{out['engine_per_piece_us']:.0f} us, per weight {out['engine_per_weight_route_us']:.0f}"
        f" + {out['engine_per_weight_device_step_us']:.0f} us"
    )
    calls = ", ".join(f"{k} {v:.2f}" for k, v in out["accel_calls_per_piece"].items() if v)
    print(f"  accelerator calls per piece: {calls}")
    pc = out["per_column"]
    print(
        f"after re-selections ({pc['weights']} of {out['weights']} weights with per-column "
        f"counts): {pc['per_weight_device_step_us']:.0f} us per weight in the device step"
    )
    print(
        f"training thread per step: zenflow {out['step_cpu_ms']['zenflow']:.1f} ms, device "
        f"AdamW {out['step_cpu_ms']['device']:.1f} ms: {out['extra_cpu_ms_per_step']:.1f} ms more"
    )
    print(
        f"{s['model']} at topk {s['topk_ratio']}: {s['weights']} weights, {s['pieces']} pieces "
        f"(buckets of {s['bucket_elements']:,} elements): {s['cpu_ms']:.0f} ms a steady step; "
        f"the engine's own {out['at_scale_engine']['cpu_ms']:.0f} ms; after re-selections "
        f"{out['at_scale_per_column']['cpu_ms']:.0f} ms"
    )
    win = out["window"]
    print(
        f"mean over whole windows (the window end's return in the hooks included): per piece "
        f"{win['per_piece_us']:.0f} us, per weight {win['per_weight_route_us']:.0f} + "
        f"{win['per_weight_device_step_us']:.0f} us; training thread "
        f"{win['step_cpu_ms']['zenflow']:.1f} ms a step (device AdamW "
        f"{win['step_cpu_ms']['device']:.1f}); {s['model']}: "
        f"{win['at_scale']['cpu_ms']:.0f} ms a step, the engine's own "
        f"{win['at_scale_engine']['cpu_ms']:.0f} ms"
    )
    st = out["stack"]
    if st and "skipped" in st:
        print(f"{st['model']}'s own stack: not measured ({st['skipped']})")
    elif st:
        print(
            f"{st['model']}'s own stack at width {st['width']} ({st['weights']} weights, "
            f"{st['pieces']} pieces; the model has {st['model_weights']} and "
            f"{st['model_pieces']}), measured over whole windows: {st['cpu_ms']:.0f} ms a step "
            f"(hooks {st['hooks_ms']:.0f}, device step {st['device_step_ms']:.0f}), the "
            f"engine's own {st['engine_cpu_ms']:.0f} ms; training thread "
            f"{st['step_cpu_ms']['zenflow']:.0f} ms (device AdamW "
            f"{st['step_cpu_ms']['device']:.0f})"
        )
    also = out.get("stack_also")
    if also:
        print(
            f"  the same stack in the model's buckets of {also['model_bucket_elements']:,} "
            f"elements ({also['pieces']} pieces): {also['cpu_ms']:.0f} ms a step, the engine's "
            f"own {also['engine_cpu_ms']:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
