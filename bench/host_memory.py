"""Whole-run host memory per parameter of a ZenFlow run, measured (issue 27).

Runs ``zfctl finetune MODEL --init random --device sim`` in fp32 for gpt2 and gpt2-medium
in both host states (``zfctl.host_state`` exact and compact), each under
``/usr/bin/time -v``, with periodic checkpoints, evaluations and a re-selection within the
run, and prints per run: the process's peak RSS, the simulated device's peak (its memory
lives in the same process: weights, gradients, the selected columns' state, buckets, from
summary.json), the host peak = RSS peak - device peak, and the engine's own whole-run host
accounting (summary.json ``host_peak_bytes``), and the estimate's whole-run host peak for
the same settings (``zenflow.hardware.preflight``, what ``zfctl finetune``'s preflight
computes for a sim run, the runtime included) with measured / estimate; then, per host
state, the slope in bytes per parameter between the two models (the process's constant
part - Python, torch, the data - cancels). ``--set`` adds config overrides to every run
(e.g. ``--set gradient_clipping=0 --set zfctl.step_store=off``). Each run's checkpoints
and model are deleted once read (summary.json stays). Owns nothing else; must not run
the engine itself (it measures the CLI, as a user runs it; the estimate is
``zenflow.hardware``'s, which reads the model's config only).

    .venv/bin/python bench/host_memory.py [--models gpt2 gpt2-medium] [--states exact compact]
        [--steps 8] [--set KEY=VALUE ...] [--out DIR]
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

# k = 0.1, two-step windows, a re-selection every 4 steps (at the window end of step 4),
# a checkpoint every 3 steps, an evaluation every 4 (on 32 samples), fp32 on sim
SETTINGS = [
    "bf16.enabled=false",
    "zero_optimization.zenflow.topk_ratio=0.1",
    "zero_optimization.zenflow.update_interval=2",
    "zero_optimization.zenflow.select_strategy=step",
    "zero_optimization.zenflow.select_interval=4",
    "zero_optimization.zenflow.overlap_step=true",
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


def run_one(model: str, state: str, steps: int, out: Path, extra: list[str]) -> dict:
    """One ``zfctl finetune`` under /usr/bin/time -v -> its figures."""
    run_dir = out / f"{model}-{state}"
    settings = SETTINGS + [f"zfctl.host_state={state}"] + extra
    sets = [a for s in settings for a in ("--set", s)]
    cmd = ["/usr/bin/time", "-v", str(ZFCTL), "finetune", model, "--init", "random",
           "--device", "sim", "--task", "sst2", "--max-steps", str(steps),
           "--micro-batch", "2", "--seq-len", "32", "--checkpoint-every", "3",
           "--eval-every", "4", "--max-eval-samples", "32", "--run-dir", str(run_dir),
           "--overwrite", "--no-dashboard", "--force", *sets]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    summary = json.loads((run_dir / "summary.json").read_text())
    for bulky in ("checkpoints", "model"):  # gpt2-medium's fp32 checkpoints are 5 GB each
        shutil.rmtree(run_dir / bulky, ignore_errors=True)
    params = int(summary["params"])
    device_peak = int(summary.get("device_peak_bytes") or
                      summary["device_peak_bytes_per_param"] * params)  # fmt: skip
    return {
        "model": model, "state": state, "params": params, "rss_peak": rss_kb * 1024,
        "device_peak": device_peak, "host_peak": rss_kb * 1024 - device_peak,
        "engine_host_peak": summary.get("host_peak_bytes"),
        "engine_host_per_param": summary.get("host_bytes_per_param"),
        "estimate": estimated_peak(model, settings),
        "command": " ".join(cmd[2:]),
    }  # fmt: skip


def slope(rows: list[dict], key: str) -> float | None:
    """Bytes per parameter between the smallest and the largest model of ``rows``."""
    if len(rows) < 2 or any(r.get(key) is None for r in rows):
        return None
    a, b = min(rows, key=lambda r: r["params"]), max(rows, key=lambda r: r["params"])
    return (b[key] - a[key]) / (b["params"] - a["params"])


def table(rows: list[dict]) -> str:
    gib = 2**30
    lines = ["| model | host state | params | RSS peak | sim device peak | host peak "
             "(RSS - device) | engine host peak | estimate | measured / estimate |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        eng = r["engine_host_peak"]
        lines.append(
            f"| {r['model']} | {r['state']} | {r['params'] / 1e6:.1f}M | "
            f"{r['rss_peak'] / gib:.2f} GiB | {r['device_peak'] / gib:.2f} GiB | "
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
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for state in args.states:
        for model in args.models:
            rows.append(run_one(model, state, args.steps, args.out, args.extra))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
