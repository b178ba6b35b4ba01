"""Whole-run host memory per parameter of a ZenFlow run, measured (issue 27).

Runs ``zfctl finetune MODEL --init random --device sim`` in fp32 for gpt2 and gpt2-medium
in both host states (``zfctl.host_state`` exact and compact), each under
``/usr/bin/time -v``, with periodic checkpoints, evaluations and a re-selection within the
run, and prints per run: the process's peak RSS, the simulated device's peak (its memory
lives in the same process; summary.json's ``device_memory_peak_bytes``, its device pool at
its largest, activations and the pool's cache included; without a pool, ``ZENFLOW_SIM_POOL=
off``, the accounted ``device_peak_bytes``: weights, gradients, the selected columns' state,
buckets), the host peak = RSS peak - device peak, and the engine's own whole-run host
accounting (summary.json ``host_peak_bytes``), and the estimate's whole-run host peak for
the same settings (``zenflow.hardware.preflight``, what ``zfctl finetune``'s preflight
computes for a sim run, the runtime included) with measured / estimate; then, per host
state, the slope in bytes per parameter between the two models (the process's constant
part - Python, torch, the data - cancels). ``--set`` adds config overrides to every run
(e.g. ``--set gradient_clipping=0 --set zfctl.step_store=off``). ``--heap`` loads
``bench/heap_probe`` into each run (a sampler of its RSS and glibc's ``mallinfo2``) and
adds the C heap's free bytes at the peak RSS and the live host peak (the largest RSS less
them, less the device's peak) with its slope: where the bytes beyond the engine's are,
not a replacement for the host peak. Each run's checkpoints
and model are deleted once read (summary.json stays). Owns nothing else; must not run
the engine itself (it measures the CLI, as a user runs it; the estimate is
``zenflow.hardware``'s, which reads the model's config only).

    .venv/bin/python bench/host_memory.py [--models gpt2 gpt2-medium] [--states exact compact]
        [--steps 8] [--set KEY=VALUE ...] [--out DIR] [--heap]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZFCTL = ROOT / ".venv" / "bin" / "zfctl"
PROBE = ROOT / "bench" / "heap_probe"  # its sitecustomize.py samples RSS and the C heap

# k = 0.1, two-step windows, a re-selection every 4 steps (at the window end of step 4),
# a checkpoint every 3 steps, an evaluation every 4 (on 32 samples), fp32 on sim; without
# the template's early phase, whose ramp keeps an 8-step run in one-step windows, so that
# what a window's second step makes (zfctl.step_store "q8"'s 8-bit copies) is made and
# counted (`--set zfctl.early.steps=200` puts the phase back: a bf16 model's images)
SETTINGS = [
    "bf16.enabled=false",
    "zero_optimization.zenflow.topk_ratio=0.1",
    "zero_optimization.zenflow.update_interval=2",
    "zero_optimization.zenflow.select_strategy=step",
    "zero_optimization.zenflow.select_interval=4",
    "zero_optimization.zenflow.overlap_step=true",
    "zfctl.early.steps=0",
]


def estimated_peak(model: str, settings: list[str]) -> int:
    """The estimate's whole-run host peak of the run (zenflow, the template with
    ``settings``), as the preflight of a sim run computes it."""
    from zenflow.config import load_config, parse_set_args
    from zenflow.hardware.preflight import preflight

    cfg = load_config(ROOT / "templates" / "zenflow.json", parse_set_args(settings))
    est = preflight(model, mode="zenflow", config=cfg, micro_batch=2, seq_len=32,
                    device_mem=2**50, host_mem=2**50, separate_device=True,
                    device_kind="sim")  # fmt: skip
    return est.engines["zenflow"].host_peak_bytes


def probe_env(run_dir: Path) -> dict:
    """The environment of a run with ``heap_probe`` loaded (``--heap``)."""
    path = os.pathsep.join(p for p in (str(PROBE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "ZF_HEAP_PROBE_OUT": str(run_dir / "heap_probe.json")}


def heap_figures(run_dir: Path, device_peak: int) -> dict:
    """The probe's figures of a run: the heap's free bytes at its peak RSS, and the live
    host peak (the largest RSS less those free bytes, less the device's peak)."""
    probe = json.loads((run_dir / "heap_probe.json").read_text())
    return {"probe_rss_peak": probe["rss_peak"], "free_at_peak": probe["free_at_peak"],
            "live_host_peak": probe["live_peak"] - device_peak}  # fmt: skip


def run_one(model: str, state: str, steps: int, out: Path, extra: list[str],
            heap: bool = False) -> dict:  # fmt: skip
    """One ``zfctl finetune`` under /usr/bin/time -v -> its figures (``heap``: with
    ``heap_probe`` loaded, and its figures)."""
    run_dir = out / f"{model}-{state}"
    settings = SETTINGS + [f"zfctl.host_state={state}"] + extra
    sets = [a for s in settings for a in ("--set", s)]
    cmd = ["/usr/bin/time", "-v", str(ZFCTL), "finetune", model, "--init", "random",
           "--device", "sim", "--task", "sst2", "--max-steps", str(steps),
           "--micro-batch", "2", "--seq-len", "32", "--checkpoint-every", "3",
           "--eval-every", "4", "--max-eval-samples", "32", "--run-dir", str(run_dir),
           "--overwrite", "--no-dashboard", "--force", *sets]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if heap:
        env.update(probe_env(run_dir))
        (run_dir / "heap_probe.json").unlink(missing_ok=True)  # never an earlier run's
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    summary = json.loads((run_dir / "summary.json").read_text())
    for bulky in ("checkpoints", "model"):  # gpt2-medium's fp32 checkpoints are 5 GB each
        shutil.rmtree(run_dir / bulky, ignore_errors=True)
    params = int(summary["params"])
    accounted = int(summary.get("device_peak_bytes") or
                    summary["device_peak_bytes_per_param"] * params)  # fmt: skip
    # the device pool's peak where the run had one (what the simulated device held in the
    # RSS, activations and its cache included), else the accounted peak (no activations)
    pooled = summary.get("device_memory_peak_bytes")
    device_peak = int(pooled) if pooled is not None else accounted
    row = {
        "model": model, "state": state, "params": params, "rss_peak": rss_kb * 1024,
        "device_peak": device_peak, "device_accounted_peak": accounted,
        "device_pool": pooled is not None, "host_peak": rss_kb * 1024 - device_peak,
        # the run's own measure of the same peak (VmHWM: /usr/bin/time's figure)
        "run_rss_peak": summary.get("process_rss_peak_bytes"),
        "engine_host_peak": summary.get("host_peak_bytes"),
        "engine_host_per_param": summary.get("host_bytes_per_param"),
        "estimate": estimated_peak(model, settings),
        "command": " ".join(cmd[2:]),
    }  # fmt: skip
    return row | (heap_figures(run_dir, device_peak) if heap else {})


def slope(rows: list[dict], key: str) -> float | None:
    """Bytes per parameter between the smallest and the largest model of ``rows``."""
    if len(rows) < 2 or any(r.get(key) is None for r in rows):
        return None
    a, b = min(rows, key=lambda r: r["params"]), max(rows, key=lambda r: r["params"])
    return (b[key] - a[key]) / (b["params"] - a["params"])


def table(rows: list[dict]) -> str:
    gib = 2**30
    lines = ["| model | host state | params | RSS peak | sim device peak (pool / accounted) "
             "| host peak (RSS - device) | engine host peak | estimate | measured / estimate |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        eng = r["engine_host_peak"]
        pool = f"{r['device_peak'] / gib:.2f}" if r.get("device_pool") else "-"
        lines.append(
            f"| {r['model']} | {r['state']} | {r['params'] / 1e6:.1f}M | "
            f"{r['rss_peak'] / gib:.2f} GiB | {pool} / "
            f"{r.get('device_accounted_peak', r['device_peak']) / gib:.2f} GiB | "
            f"{r['host_peak'] / gib:.2f} GiB | "
            f"{'-' if eng is None else f'{eng / gib:.2f} GiB'} | "
            f"{r['estimate'] / gib:.2f} GiB | {r['host_peak'] / r['estimate']:.2f} |"
        )
    lines += ["", "| host state | slope of the host peak | slope of the engine's host peak | "
              "slope of the estimate |", "|---|---|---|---|"]  # fmt: skip
    for state in sorted({r["state"] for r in rows}):
        mine = [r for r in rows if r["state"] == state]
        s1, s2 = slope(mine, "host_peak"), slope(mine, "engine_host_peak")
        s3 = slope(mine, "estimate")
        fmt = lambda v: "-" if v is None else f"{v:.2f} B/param"  # noqa: E731
        lines.append(f"| {state} | {fmt(s1)} | {fmt(s2)} | {fmt(s3)} |")
    if all("free_at_peak" in r for r in rows):
        lines += ["", heap_table(rows)]
    return "\n".join(lines)


def heap_table(rows: list[dict]) -> str:
    """``--heap``: the C heap's free bytes at the peak RSS, and the live host peak with its
    slope (beside the host peak's, which stays the measurement)."""
    gib = 2**30
    lines = ["| model | host state | probe's RSS peak | heap free at it | live host peak "
             "(RSS - free heap - device) |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['model']} | {r['state']} | {r['probe_rss_peak'] / gib:.2f} GiB | "
                     f"{r['free_at_peak'] / gib:.2f} GiB | "
                     f"{r['live_host_peak'] / gib:.2f} GiB |")  # fmt: skip
    lines += ["", "| host state | slope of the live host peak |", "|---|---|"]
    for state in sorted({r["state"] for r in rows}):
        s = slope([r for r in rows if r["state"] == state], "live_host_peak")
        lines.append(f"| {state} | {'-' if s is None else f'{s:.2f} B/param'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt2-medium"])
    ap.add_argument("--states", nargs="+", default=["exact", "compact"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (repeatable)",
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/zfctl-host-memory"))
    ap.add_argument("--heap", action="store_true",
                    help="also sample each run's C heap (bench/heap_probe): its free bytes "
                    "at the peak RSS, and the live host peak")  # fmt: skip
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for state in args.states:
        for model in args.models:
            rows.append(run_one(model, state, args.steps, args.out, args.extra, args.heap))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
