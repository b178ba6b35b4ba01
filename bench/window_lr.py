"""How far does a window's single host AdamW step move a column, against AdamW's S steps?

A model study of ZenFlow's host step (issue 17), not a training run. Every element gets a
gradient ``g_t = mu + sigma * noise_t`` (fixed signal ``mu``, Gaussian noise), and after
``--steps`` steps the displacement of each element is compared with torch's AdamW taking
every step:

- ``adamw``: one AdamW step per step (the reference);
- window treatments, one AdamW step per window of ``S`` steps on the window's MEAN
  gradient, bias correction counting windows (ZENFLOW.md), at the lr
  ``last`` (the step's lr: DeepSpeed's ZenFlow, zfctl.window_lr "last"),
  ``sum`` (S x lr: zfctl.window_lr "sum") and ``sqrt`` (sqrt(S) x lr, for comparison).

Per signal-to-noise ratio ``mu / sigma`` it prints each treatment's DRIFT (mean
displacement, the signal a column learns) and SPREAD (standard deviation of the
displacement over elements, the noise it takes on), both as multiples of AdamW's. The
window's mean gradient has ``sigma / sqrt(S)`` of noise, so its second moment is smaller
than a step's when noise dominates and Adam's normalised step is larger.

    .venv/bin/python bench/window_lr.py                 # S = 4, 400 steps
    .venv/bin/python bench/window_lr.py --interval 8 --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zenflow.ops import adamw_step_reference_  # noqa: E402

TREATMENTS = {"last": lambda s: 1.0, "sum": float, "sqrt": math.sqrt}
SNRS = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0)


def displacement(snr: float, interval: int, steps: int, n: int, treatment: str | None,
                 lr: float = 1e-4, seed: int = 0) -> torch.Tensor:  # fmt: skip
    """Each element's displacement after ``steps`` steps of gradient ``snr + noise`` (sigma
    1): AdamW every step (``treatment`` None) or one step per window of ``interval``."""
    gen = torch.Generator().manual_seed(seed)
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    acc = torch.zeros(n)
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    windows = 0
    for t in range(1, steps + 1):
        g = snr + torch.randn(n, generator=gen)
        if treatment is None:
            adamw_step_reference_(p, g, m, v, step=t, lr=lr, **kw)
            continue
        acc += g
        if t % interval == 0:
            windows += 1
            step_lr = lr * TREATMENTS[treatment](interval)
            adamw_step_reference_(p, acc, m, v, step=windows, lr=step_lr,
                                  grad_scale=1.0 / interval, **kw)  # fmt: skip
            acc.zero_()
    return -p  # a positive gradient moves the weight down: drift measured along the signal


def study(interval: int, steps: int, n: int, snrs=SNRS) -> list[dict]:
    rows = []
    for snr in snrs:
        ref = displacement(snr, interval, steps, n, None)
        row = {"snr": snr, "adamw_drift": float(ref.mean()), "adamw_spread": float(ref.std())}
        for name in TREATMENTS:
            d = displacement(snr, interval, steps, n, name)
            drift = float(d.mean()) / row["adamw_drift"] if snr > 0 else None
            row[name] = {"drift": drift, "spread": float(d.std()) / row["adamw_spread"]}
        rows.append(row)
    return rows


def render(rows: list[dict], interval: int, steps: int) -> str:
    head = "| mu / sigma | " + " | ".join(f"{t} drift | {t} spread" for t in TREATMENTS) + " |"
    lines = [f"S = {interval}, {steps} steps; multiples of AdamW's drift and spread", "",
             head, "|---:|" + "---:|" * (2 * len(TREATMENTS))]  # fmt: skip
    for row in rows:
        cells = [f"{row['snr']:g}"]
        for t in TREATMENTS:
            drift = row[t]["drift"]
            cells += ["-" if drift is None else f"{drift:.2f}", f"{row[t]['spread']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=int, default=4, help="steps per window (S)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--elements", type=int, default=100_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.interval < 1 or args.steps < args.interval or args.elements < 2:
        print("error: need --interval >= 1, --steps >= --interval, --elements >= 2",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = study(args.interval, args.steps, args.elements)
    if args.json:
        print(json.dumps({"interval": args.interval, "steps": args.steps, "rows": rows}))
    else:
        print(render(rows, args.interval, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
