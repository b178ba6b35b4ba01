"""Side-by-side engine benchmark: floor (forward+backward only), device AdamW, ZeRO-Offload,
ZenFlow (overlap on / off), on the cpu, sim or cuda accelerator.

All modes run in ONE process on identical GPT-2-shaped models (random init), alternating
rounds so that machine noise hits every mode alike; each round is a whole number of
ZenFlow windows, so window-end steps are counted. Per mode it reports medians of the
iteration (forward+backward+step, on the host's clock, up to the step's wait for the
device), forward+backward (device time: the accelerator's marks, CUDA events on cuda,
read once the step's wait has passed them), engine step, device optimizer and stall
times, the mean iteration time (window-end spikes included), counted traffic per step
(absolute and as a multiple of the model's training-dtype bytes) and the device bytes per
parameter (weights, gradients and engine state, activations excluded).

The ``floor`` (forward+backward, no optimizer) waits for its device at the end of each
step, as an engine's step does (one read of the loss, counted): otherwise, on cuda, its time
would be kernel-launch time and its queued work would be charged to the next mode.

On ``--device sim`` every mode's device compute runs on the simulated device's reserved
cores (the floor too), and copies cross a modelled PCIe link (``--bandwidth``), or, with
``--sim-profile NAME`` (``zenflow.engine.accelerator.profiles``), a link scaled so that the sim's
compute:link ratio is the named GPU box's (the profile and the scaling are printed); ``--lag``
starts each copy up to that many seconds late (a GPU running behind the host). Each mode
also reports the share of its link bytes that moved while the device computed (forward and
backward; sim), its device-to-host reads and full syncs per step (the sync counter), and its
device peak, host and pinned bytes per parameter.

    .venv/bin/python bench/engine.py                      # 4 layers, width 512 (~38M)
    .venv/bin/python bench/engine.py --device sim --bf16 --batch 1 --seq 16
    .venv/bin/python bench/engine.py --layers 12 --width 768 --json
    .venv/bin/python bench/engine.py --device sim --sim-profile h100-pcie5 --head cls \
        --vocab 1024 --layers 4 --width 512 --batch 16 --seq 256
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zenflow import ZenFlowEngine, load_config  # noqa: E402

MODES = ("floor", "device", "offload", "zenflow-overlap", "zenflow-sync")


def build_model(layers: int, width: int, vocab: int, seed: int = 0, head: str = "lm"):
    """GPT-2's architecture, random init: with its LM head (``lm``: every token scores the
    whole vocabulary) or the sequence classifier fine-tuning uses (``cls``: the embedding
    matrix is only looked up, so forward+backward is far cheaper for the same parameters)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=vocab,
        n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, num_labels=2,
        pad_token_id=0,
    )  # fmt: skip
    cls = GPT2LMHeadModel if head == "lm" else GPT2ForSequenceClassification
    return cls(cfg).float()


def forward_loss(model, batch, head: str):
    if head == "lm":
        return model(input_ids=batch, labels=batch).loss
    ids = batch.clamp(min=1)  # no pad tokens: the last position is the sequence end
    labels = (batch[:, 0] % 2).long()
    return model(input_ids=ids, labels=labels).loss


def make_config(args, overlap: bool | None):
    raw = {
        "bf16": {"enabled": args.bf16},
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    if args.copy_buckets:
        raw["zfctl"] = {"copy_buckets": args.copy_buckets}
    if overlap is not None:
        raw["zero_optimization"]["zenflow"] = {
            "topk_ratio": args.topk,
            "update_interval": args.update_interval,
            "select_strategy": "step",
            "select_interval": args.select_interval,
            "overlap_step": overlap,
        }
    return load_config(raw)


def main(argv=None, make_accel=None) -> int:
    """``make_accel``: a callable returning a fresh accelerator for each mode (tests pass
    doubles); default: ``make_accelerator`` for ``--device``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per mode per round")
    ap.add_argument("--warmup", type=int, default=8, help="unmeasured steps per mode")
    ap.add_argument("--topk", type=float, default=0.1)
    ap.add_argument("--update-interval", type=int, default=4)
    ap.add_argument("--select-interval", type=int, default=1000)
    ap.add_argument("--device", default="cpu", choices=["cpu", "sim", "cuda"])
    ap.add_argument("--bf16", action="store_true", help="bf16 weights and gradients")
    ap.add_argument(
        "--head",
        default="lm",
        choices=["lm", "cls"],
        help="lm: GPT-2 LM head; cls: sequence classification (fine-tuning)",
    )
    ap.add_argument("--bandwidth", type=float, default=25e9, help="sim: bytes/s per direction")
    ap.add_argument("--sim-profile", default=None, help="sim: a named GPU box (h100-pcie5, ...)")
    ap.add_argument("--lag", type=float, default=0.0, help="sim: copies start up to S s late")
    ap.add_argument("--copy-buckets", type=int, default=None, help="zfctl.copy_buckets")
    ap.add_argument("--host-kernel", default="native", choices=["native", "reference"])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if args.steps % args.update_interval or args.warmup % args.update_interval:
        ap.error("--steps and --warmup must be multiples of --update-interval (whole windows)")

    base_threads = torch.get_num_threads()
    base = build_model(args.layers, args.width, args.vocab, head=args.head)
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen) for _ in range(8)
    ]
    if args.device == "cuda":  # made once, where the model is: no input copy is timed
        batches = [b.cuda() for b in batches]
    from zenflow.engine.accelerator import make_accelerator

    def accel():
        if make_accel is not None:
            return make_accel()
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        return make_accelerator(
            args.device, bandwidth=args.bandwidth, sim_profile=args.sim_profile,
            lag_s=args.lag, compute_threads=max(1, round(os.cpu_count() * 0.5)),
            compute_dtype=dtype,
        )  # fmt: skip

    profile = None
    if args.device == "sim" and args.sim_profile:
        probe = accel()
        profile = probe.profile
        probe.close()

    runs = {}
    for m in modes:
        model = copy.deepcopy(base)
        if args.device == "cuda":
            model = model.cuda()
        if m == "floor":  # forward+backward only, on the device's compute threads
            a = accel()  # its marks time the phases, its read is the step's wait
            threads = a.compute_threads(0.5, False)[0] if args.device == "sim" else base_threads
            if args.bf16:
                model = model.bfloat16()
            runs[m] = {"model": model, "engine": None, "accel": a, "threads": threads,
                       "rows": [], "i": 0}  # fmt: skip
            continue
        if m in ("device", "offload"):
            eng = ZenFlowEngine(
                model, make_config(args, None), mode=m, host_kernel=args.host_kernel,
                accelerator=accel(),
            )  # fmt: skip
        else:
            eng = ZenFlowEngine(
                model, make_config(args, m == "zenflow-overlap"), mode="zenflow",
                host_kernel=args.host_kernel, accelerator=accel(),
            )  # fmt: skip
        threads = eng.resolved.get("training_threads", base_threads)
        torch.set_num_threads(base_threads)  # the engine set its own split
        runs[m] = {"model": model, "engine": eng, "accel": eng.accel, "threads": threads,
                   "rows": [], "i": 0}  # fmt: skip

    def run_steps(m, n, record):
        r = runs[m]
        model, eng, acc = r["model"], r["engine"], r["accel"]
        torch.set_num_threads(r["threads"])
        for _ in range(n):
            b = batches[r["i"] % len(batches)]
            r["i"] += 1
            t0, m0 = time.perf_counter(), acc.mark()
            if eng is None:  # floor
                loss = forward_loss(model, b, args.head)
                loss.backward()
                m1, t1 = acc.mark(), time.perf_counter()
                reads = acc.syncs.reads
                acc.read([loss])  # the step's wait for the device, as an engine's step
                reads = acc.syncs.reads - reads
                model.zero_grad(set_to_none=True)
                st = None
            else:
                with eng.autocast():
                    loss = forward_loss(model, b, args.head)
                eng.backward(loss)
                m1, t1 = acc.mark(), time.perf_counter()
                acc.note_compute(t0, t1)  # the device computed (the overlap figure, sim)
                st = eng.step(loss)  # its one read: the device has passed m0 and m1 after it
                eng.zero_grad()
                reads = st.d2h_reads
            t2 = time.perf_counter()
            if record:  # fwd+bwd: device time between the marks
                r["rows"].append((t2 - t0, acc.elapsed_ms(m0, m1) / 1e3, st, reads))
        torch.set_num_threads(base_threads)

    for m in modes:
        run_steps(m, args.warmup, False)
    for _ in range(args.rounds):
        for m in modes:
            run_steps(m, args.steps, True)

    results = {}
    params = sum(p.numel() for p in base.parameters())
    for m in modes:
        r = runs[m]
        eng = r["engine"]
        rows = r["rows"]
        stats = [x[2] for x in rows if x[2] is not None]
        mb = params * (2 if args.bf16 else 4) if eng is None else eng.model_bytes
        traffic = [st.d2h_bytes + st.h2d_bytes for st in stats] or [0]

        def med(f, stats=stats):
            return statistics.median(map(f, stats)) if stats else 0.0

        results[m] = {
            "iter_ms_median": statistics.median(x[0] for x in rows) * 1e3,
            "iter_ms_mean": statistics.mean(x[0] for x in rows) * 1e3,
            "fwd_bwd_ms_median": statistics.median(x[1] for x in rows) * 1e3,
            "step_ms_median": med(lambda st: st.step_ms),
            "step_ms_mean": statistics.mean(st.step_ms for st in stats) if stats else 0.0,
            "device_opt_ms_median": med(lambda st: st.device_opt_ms),
            "stall_ms_mean": statistics.mean(st.stall_ms for st in stats) if stats else 0.0,
            "bytes_per_step": statistics.mean(traffic),
            "x_model_bytes": statistics.mean(traffic) / mb,
            "device_bytes_per_param": (
                max(st.device_bytes for st in stats) / params if stats else None
            ),
            "device_peak_bytes_per_param": (
                max(st.device_peak_bytes for st in stats) / params if stats else None
            ),
            "host_bytes_per_param": max(st.host_bytes for st in stats) / params if stats else None,
            "pinned_bytes_per_param": (
                max(st.pinned_host_bytes for st in stats) / params if stats else None
            ),
            "overlap_share": _overlap(stats),
            "d2h_reads_max": max((x[3] for x in rows), default=0),
            "full_syncs_max": max((st.full_syncs for st in stats), default=0),
            "training_threads": r["threads"],
            "resolved": {} if eng is None else dict(eng.resolved),
        }
        if eng is not None:
            eng.close()
        else:
            r["accel"].close()
    meta = {
        "layers": args.layers, "width": args.width, "vocab": args.vocab, "params": params,
        "batch": args.batch, "seq": args.seq, "rounds": args.rounds, "steps": args.steps,
        "cores": os.cpu_count(), "torch": torch.__version__, "device": args.device,
        "bf16": args.bf16, "head": args.head,
        "sim_bandwidth": args.bandwidth if args.device == "sim" else None,
        "update_interval": args.update_interval, "topk": args.topk,
        "tokens_per_step": args.batch * args.seq, "lag_s": args.lag,
        "copy_buckets": args.copy_buckets or "auto",
        "sim_profile": profile.to_dict() if profile is not None else None,
    }  # fmt: skip
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
        return 0
    print(
        f"GPT-2 shape: {args.layers} layers, width {args.width}, {meta['params'] / 1e6:.1f}M "
        f"params, micro-batch {args.batch}, seq {args.seq}, {'bf16' if args.bf16 else 'fp32'}, "
        f"device {args.device}"
        + (f" ({args.bandwidth / 1e9:g} GB/s modelled)" if args.device == "sim" else "")
        + f"; {args.rounds} rounds x {args.steps} steps per mode"
    )
    if profile is not None:
        print(f"sim profile: {profile.describe()}")
    hdr = (
        f"{'mode':<17}{'iter med':>9}{'iter mean':>10}{'fwd+bwd':>9}{'step med':>9}"
        f"{'step mean':>10}{'dev opt':>8}{'stall':>8}{'MB/step':>9}{'x model':>8}"
        f"{'dev B/p':>8}{'x floor':>8}"
    )
    print(hdr)
    for m, x in results.items():
        print(
            f"{m:<17}{x['iter_ms_median']:9.1f}{x['iter_ms_mean']:10.1f}"
            f"{x['fwd_bwd_ms_median']:9.1f}{x['step_ms_median']:9.1f}{x['step_ms_mean']:10.1f}"
            f"{x['device_opt_ms_median']:8.1f}{x['stall_ms_mean']:8.1f}"
            f"{x['bytes_per_step'] / 1e6:9.1f}{x['x_model_bytes']:8.2f}"
            + (
                f"{x['device_bytes_per_param']:8.2f}"
                if x["device_bytes_per_param"]
                else f"{'-':>8}"
            )
            + (
                f"{x['iter_ms_mean'] / results['floor']['iter_ms_mean']:8.2f}"
                if "floor" in results
                else ""
            )
        )
    print(f"{'mode':<17}{'overlap':>8}{'reads':>6}{'syncs':>6}{'peak B/p':>9}{'host B/p':>9}"
          f"{'pinned B/p':>11}")  # fmt: skip
    for m, x in results.items():
        if not x["resolved"]:
            continue
        share = "-" if x["overlap_share"] is None else f"{x['overlap_share']:.0%}"
        print(f"{m:<17}{share:>8}{x['d2h_reads_max']:6d}{x['full_syncs_max']:6d}"
              f"{x['device_peak_bytes_per_param']:9.2f}{x['host_bytes_per_param']:9.2f}"
              f"{x['pinned_bytes_per_param']:11.2f}")  # fmt: skip
    print("times in ms (stall: mean per step); traffic counted by the engine at each copy;")
    print("overlap: share of link bytes moved while the device computed; reads / syncs: the")
    print("most device-to-host reads and full syncs in one step")
    return 0


def _overlap(stats) -> float | None:
    """Link bytes moved while the device computed, over all link bytes of the steps (each
    step's share weighted by its traffic); None where no copy was timed (cpu, cuda)."""
    num = den = 0.0
    for st in stats:
        if st.overlap_share is None:
            continue
        b = st.d2h_bytes + st.h2d_bytes
        num += st.overlap_share * b
        den += b
    return num / den if den else None


if __name__ == "__main__":
    sys.exit(main())
