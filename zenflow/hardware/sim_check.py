"""The step-time prediction (``zenflow.hardware.predict``) checked against measured steps on the
simulated device: ``python -m zenflow.hardware.sim_check BENCH.json``.

BENCH.json is ``bench/engine.py --device sim [--sim-profile NAME] --json``'s output. The sim
computes on this CPU's training share of the cores, its link runs at the modelled (or
profile-scaled) bandwidth and its host at this machine's memory bandwidth, so the GPU box
of the prediction is replaced by the sim's own rates at matching ratios: compute from the
measured forward+backward of the bench's ``floor`` mode (its achieved rate: 6 P T / time),
the link from the bench's modelled bandwidth, device memory from the sim core's copy rate,
and the host bandwidth measured here with the engine's host threads. Each engine's mean
step (window ends included) is printed beside its prediction, with the ratio.

Must not run the engine (bench/engine.py does) nor hold a formula (``predict`` does).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zenflow.hardware.census import census_of
from zenflow.hardware.layout import Settings
from zenflow.hardware.predict import Box, predict_engine

BENCH_MODES = {"device": "device", "offload": "offload", "zenflow-overlap": "zenflow",
               "zenflow-sync": "zenflow"}  # fmt: skip


def bench_census(meta: dict):
    """The bench's GPT-2 shape (bench/engine.py ``build_model``), counted on the meta device."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=meta["layers"], n_embd=meta["width"],
                     n_head=max(1, meta["width"] // 64), vocab_size=meta["vocab"],
                     n_positions=1024, num_labels=2, pad_token_id=0)  # fmt: skip
    cls = GPT2LMHeadModel if meta["head"] == "lm" else GPT2ForSequenceClassification
    with torch.device("meta"):
        model = cls(cfg)
    return census_of(model, name="bench", source="bench/engine.py")


def host_bandwidth(threads: int, mb: int = 256) -> float:
    """This machine's memory bandwidth (bytes read + written per second, a large fp32 copy)
    on ``threads`` threads: what the engine's host work gets."""
    import torch

    from zenflow.hardware.probes import median_seconds

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        n = mb * 2**20 // 4
        a, b = torch.rand(n), torch.empty(n)
        b.copy_(a)
        return 2 * n * 4 / median_seconds(lambda: b.copy_(a), 5)
    finally:
        torch.set_num_threads(before)


def sim_box(meta: dict, results: dict) -> Box:
    """The sim as a GPU box: the floor's achieved compute rate, the modelled link, the sim
    core's copy rate for its elementwise work."""
    census = bench_census(meta)
    tokens = meta["batch"] * meta["seq"]
    fb_s = results["floor"]["fwd_bwd_ms_median"] / 1e3
    from zenflow.engine.accelerator import SIM_LATENCY_S

    prof = meta.get("sim_profile") or {}
    link = prof["sim_link_mbs"] * 1e6 if prof else meta["sim_bandwidth"]
    hbm = prof["sim_copy_gbs"] * 1e9 if prof else 10e9
    latency = prof["sim_latency_ms"] / 1e3 if prof else SIM_LATENCY_S
    flops = 6 * census.params * tokens / fb_s
    return Box("sim", "the simulated device", flops, 1.0, link, hbm, latency)


def check(bench: dict, host_bw: float | None = None) -> list[dict]:
    """Predicted vs measured mean step (ms) of each bench mode, with the bound."""
    meta, results = bench["meta"], bench["results"]
    census = bench_census(meta)
    box = sim_box(meta, results)
    rows = []
    for mode, engine in BENCH_MODES.items():
        if mode not in results:
            continue
        res = results[mode]
        threads = res["resolved"].get("host_threads") or 1
        bw = host_bw or host_bandwidth(threads)
        s = Settings(bf16=meta["bf16"], micro_batch=meta["batch"], seq_len=meta["seq"],
                     topk_ratio=meta["topk"], update_interval=meta["update_interval"],
                     overlap_step=mode == "zenflow-overlap")  # fmt: skip
        p = predict_engine(census, engine, s, box, bw, mode)
        measured = res["iter_ms_mean"]
        rows.append({"mode": mode, "predicted_ms": p.step_s * 1e3, "measured_ms": measured,
                     "ratio": p.step_s * 1e3 / measured, "bound": p.bound,
                     "terms_ms": {k: v * 1e3 for k, v in p.terms.items()},
                     "host_gbs": bw / 1e9})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json", type=Path, help="bench/engine.py --device sim --json output")
    ap.add_argument("--host-bw", type=float, default=None, help="GB/s (default: measured)")
    args = ap.parse_args(argv)
    bench = json.loads(args.bench_json.read_text())
    meta = bench["meta"]
    rows = check(bench, args.host_bw * 1e9 if args.host_bw else None)
    print(f"{meta['layers']}x{meta['width']} {meta['head']}, {meta['batch']}x{meta['seq']} "
          f"tokens, {'bf16' if meta['bf16'] else 'fp32'}, topk {meta['topk']}, S "
          f"{meta['update_interval']}, profile "
          f"{(meta.get('sim_profile') or {}).get('profile', 'none')}")  # fmt: skip
    for r in rows:
        terms = ", ".join(f"{k} {v:.1f}" for k, v in r["terms_ms"].items())
        print(f"  {r['mode']:<16} predicted {r['predicted_ms']:8.1f} ms  measured "
              f"{r['measured_ms']:8.1f} ms  ratio {r['ratio']:.2f}  bound {r['bound']:<15} "
              f"({terms}; host {r['host_gbs']:.1f} GB/s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
