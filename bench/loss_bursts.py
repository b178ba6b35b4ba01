"""Why does ZenFlow's loss burst on a randomly initialised GPT-2? (issue 11, section 1)

Trains a random-init GPT-2-architecture classifier on SST-2 with several engine variants,
each from the same initial weights, the same data order and the same dropout masks as
``zfctl finetune gpt2 --task sst2 --init random`` (seed 42, micro-batch 8, sequence 32,
templates/zenflow.json), and records per step:

- the training loss (the batch's mean, before the step) and the global gradient norm;
- the loss of a fixed, balanced probe set of dev rows after the step (eval mode, no dropout:
  a clean function of the weights, without the batch-to-batch noise of an 8-row loss);
- the mean and spread over the probe of the logit margin ``logit[1] - logit[0]``;
- how far each step moved the weights: the L2 norm of the update of the ZenFlow weights'
  selected columns, their non-selected columns and the always-important params (the
  column split is the top-k of the first step's gradient for EVERY engine, so AdamW's update
  is split the same way), and every 4 steps the distance from the initial weights;
- the share of the step's squared gradient norm (2-D weights) in those columns, and in the
  step's own top-k (ZenFlow's premise: a few columns carry most of the gradient).

``--report`` prints the summary table (mean/max loss, probe extremes, the margin change at
host landings, whether landings corrected the past or the present margin) of earlier
``--json`` files; ``--check-first-step`` checks the first host step's bias correction and
the per-column counts on a tiny model. Results and reading: docs/BENCHMARKS.md, "ZenFlow
loss bursts on a randomly initialised GPT-2".

Variants are ``NAME=ENGINE[:key=value,...]`` with keys
``topk`` ``interval`` ``overlap`` (0/1) ``warmup`` (full_warm_up_rounds) ``clip``
``lr`` ``sched`` (``warmup`` = the template's WarmupLR, ``none`` = constant lr)
``dense_emb`` (1: wte/wpe updated fully on the device, not as ZenFlow weights)
``dropout`` (0: no dropout). Examples::

    .venv/bin/python bench/loss_bursts.py --suite exact             # 4 layers x 256
    .venv/bin/python bench/loss_bursts.py --layers 12 --width 768 --heads 12 --suite demo
    .venv/bin/python bench/loss_bursts.py --model minilm --init random --suite demo
    .venv/bin/python bench/loss_bursts.py --variant adamw=device \\
        --variant zf=zenflow --variant s1=zenflow:interval=1,overlap=0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zenflow import ZenFlowEngine, load_config  # noqa: E402
from zenflow.engine import schedule as schedule_mod  # noqa: E402
from zenflow.engine.selection import (  # noqa: E402
    DEFAULT_MIN_NUMEL,
    ParamSpec,
    classify_params,
    column_scores,
    select_topk,
)
from zenflow.train.data import batches, encode, get_task, load_task  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITES = {
    # the demo's engines: AdamW, ZenFlow as templates/zenflow.json has it, and overlap off
    "demo": ["adamw=device", "zf=zenflow", "zf-sync=zenflow:overlap=0"],
    # one change at a time against "zf" (same seed, data order, initial weights)
    "ablate": [
        "s1=zenflow:interval=1",
        "s2=zenflow:interval=2",
        "topk.5=zenflow:topk=0.5",
        "lr1e-5=zenflow:lr=1e-5",
        "adamw-lr1e-5=device:lr=1e-5",
        "dense-emb=zenflow:dense_emb=1",
        "warmup4=zenflow:warmup=4",
    ],
    # exactness: offload and one-step windows without overlap must reproduce AdamW
    "exact": [
        "adamw=device",
        "offload=offload",
        "s1-sync=zenflow:interval=1,overlap=0",
        "s1=zenflow:interval=1",
    ],
}

VARIANT_KEYS = ("topk", "interval", "overlap", "warmup", "clip", "lr", "sched", "dense_emb",
                "dropout")  # fmt: skip


def parse_variant(text: str) -> dict:
    name, _, rest = text.partition("=")
    engine, _, opts = rest.partition(":")
    if engine not in ("device", "offload", "zenflow"):
        raise SystemExit(f"variant {text!r}: engine must be device, offload or zenflow")
    v = {"name": name, "engine": engine}
    for kv in filter(None, opts.split(",")):
        k, _, val = kv.partition("=")
        if k not in VARIANT_KEYS:
            raise SystemExit(f"variant {text!r}: unknown key {k!r} (use {', '.join(VARIANT_KEYS)})")
        v[k] = val
    return v


def make_config(base: str, v: dict):
    ov = {}
    if "topk" in v:
        ov["zero_optimization.zenflow.topk_ratio"] = float(v["topk"])
    if "interval" in v:
        iv = v["interval"]
        ov["zero_optimization.zenflow.update_interval"] = iv if iv == "auto" else int(iv)
    if "overlap" in v:
        ov["zero_optimization.zenflow.overlap_step"] = bool(int(v["overlap"]))
    if "warmup" in v:
        ov["zero_optimization.zenflow.full_warm_up_rounds"] = int(v["warmup"])
    if "clip" in v:
        ov["gradient_clipping"] = float(v["clip"])
    if "lr" in v:
        ov["optimizer.params.lr"] = float(v["lr"])
        ov["scheduler.params.warmup_max_lr"] = float(v["lr"])
    raw = json.load(open(base))
    if v.get("sched") == "none":
        raw.pop("scheduler", None)
    return load_config(raw, overrides=ov)


def build_model(layers, width, heads, seed, dropout: bool):
    from transformers import AutoModelForSequenceClassification, GPT2Config

    from zenflow.train.models import GPT2_EOS_ID, GPT2_VOCAB_SIZE

    kw = {} if dropout else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=GPT2_VOCAB_SIZE,
                     n_positions=1024, bos_token_id=GPT2_EOS_ID, eos_token_id=GPT2_EOS_ID,
                     **kw)  # fmt: skip
    cfg.num_labels = 2
    torch.manual_seed(seed)  # as zenflow.train.models.resolve_model does
    model = AutoModelForSequenceClassification.from_config(cfg)
    return model


def dense_embeddings_patch(enabled: bool):
    """Make wte/wpe always-important (updated fully on the device) when ``enabled``."""
    orig = classify_params

    def patched(model, min_numel=DEFAULT_MIN_NUMEL):
        specs = orig(model, min_numel)
        if not enabled:
            return specs
        return [ParamSpec(s.name, s.param, None) if s.name.endswith(("wte.weight", "wpe.weight"))
                else s for s in specs]  # fmt: skip

    schedule_mod.classify_params = patched


def probe_set(dev, n: int):
    """The first n/2 negative and n/2 positive dev rows (balanced: loss ln 2 at margin 0)."""
    neg = [i for i, r in enumerate(dev.rows) if r.label == 0][: n // 2]
    pos = [i for i, r in enumerate(dev.rows) if r.label == 1][: n // 2]
    return dev.take(neg + pos)


@torch.no_grad()
def probe(model, batch):
    was = model.training
    model.eval()
    out = model(**batch)
    model.train(was)
    logits = out.logits.float()
    margin = logits[:, 1] - logits[:, 0]
    acc = float((logits.argmax(-1) == batch["labels"]).float().mean())
    return float(out.loss), float(margin.mean()), float(margin.std()), acc


def split_sq(params, ref, sel_mask):
    """Squared L2 norm of ``params - ref`` over the selected columns, the non-selected
    columns and the rest; and per weight (selected or whole, non-selected) norms."""
    sq = {"sel": 0.0, "nonsel": 0.0, "dense": 0.0}
    per_weight = {}
    for n, p in params.items():
        d = p.detach() - ref[n]
        if n in sel_mask:
            m, cd = sel_mask[n]
            col = (d * d).sum(dim=1 - cd)
            a, b = float(col[m].sum()), float(col[~m].sum())
            sq["sel"] += a
            sq["nonsel"] += b
        else:
            a, b = float((d * d).sum()), 0.0
            sq["dense"] += a
        per_weight[n] = (math.sqrt(a), math.sqrt(b))
    return sq, per_weight


def run_variant(args, v, encoded, probe_batch, tok_pad_id):
    dense_embeddings_patch(bool(int(v.get("dense_emb", "0"))))
    dropout = bool(int(v.get("dropout", "1"))) and not args.no_dropout
    if args.model:  # a named model through zfctl's own resolution (e.g. minilm)
        from zenflow.train.models import resolve_model

        model = resolve_model(args.model, task_num_labels=2, init=args.init, seed=args.seed).model
        if not dropout:
            for mod in model.modules():
                if isinstance(mod, torch.nn.Dropout):
                    mod.p = 0.0
    else:
        model = build_model(args.layers, args.width, args.heads, args.seed, dropout)
        model.config.pad_token_id = tok_pad_id
    model.float().train()
    config = make_config(args.config, v)
    spe = len(encoded.train) // args.micro_batch
    engine = ZenFlowEngine(model, config, mode=v["engine"], steps_per_epoch=spe,
                           accelerator="cpu")  # fmt: skip
    torch.set_num_threads(engine.training_threads)
    names = {id(s.param): s.name for s in engine.specs}
    params = {s.name: s.param for s in engine.specs}
    # the column split used to report every engine's update: the 2-D weights ZenFlow would
    # treat (with the default classification), top-k of the first step's gradient
    split_specs = [s for s in classify_params(model) if s.is_zenflow]
    topk = float(v.get("topk", config.zenflow.topk_ratio if config.zenflow else 0.1))
    init = {n: p.detach().clone() for n, p in params.items()}
    sel_mask = {}
    torch.manual_seed(args.seed)  # as the trainer does before its loop
    it = batches(encoded.train, args.micro_batch, args.seed, 0, 0)
    rows = []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        _, batch = next(it)
        out = model(**batch)
        loss = out.loss.float()
        engine.backward(loss)
        if step == 1:
            from zenflow.engine.selection import num_selected

            for s in split_specs:
                k = num_selected(s.n_cols, topk)
                sel = select_topk(column_scores(s.param.grad, s.column_dim), k)
                m = torch.zeros(s.n_cols, dtype=torch.bool)
                m[sel] = True
                sel_mask[s.name] = (m, s.column_dim)
        # ZenFlow's premise, measured: the share of this step's squared gradient norm (of the
        # 2-D weights) in the first step's selected columns, and in this step's own top-k
        mass_sel = mass_best = mass_all = 0.0
        for s in split_specs:
            if s.param.grad is None:
                continue
            sc = column_scores(s.param.grad, s.column_dim)
            m, _ = sel_mask[s.name]
            mass_all += float(sc.sum())
            mass_sel += float(sc[m].sum())
            mass_best += float(sc.topk(int(m.sum())).values.sum())
        before = {n: p.detach().clone() for n, p in params.items()}
        stats = engine.step(loss)
        engine.zero_grad()
        sq, per_weight = split_sq(params, before, sel_mask)
        drift = split_sq(params, init, sel_mask)[0] if step % 4 == 0 else None
        pl, pm, ps, pa = probe(model, probe_batch) if probe_batch is not None else (None,) * 4
        rows.append({
            "step": step, "loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr,
            "host_update": stats.host_update, "window_ended": stats.window_len,
            "moved_columns": stats.selection_changed,
            "labels_pos": int(batch["labels"].sum()),
            "train_margin_mean": float((out.logits[:, 1] - out.logits[:, 0]).detach().mean()),
            "sel_grad_share": mass_sel / mass_all if mass_all else None,
            "topk_grad_share": mass_best / mass_all if mass_all else None,
            "probe_loss": pl, "probe_margin": pm, "probe_margin_std": ps, "probe_acc": pa,
            "upd": {k: math.sqrt(x) for k, x in sq.items()},
            "drift": drift and {k: math.sqrt(x) for k, x in drift.items()},
            "per_weight": per_weight,
        })  # fmt: skip
        if args.verbose:
            r = rows[-1]
            print(f"  {v['name']:>10} {step:3d} loss {r['loss']:.3f} probe {pl:.3f} "
                  f"margin {pm:+.3f}±{ps:.3f} upd sel {r['upd']['sel']:.2e} "
                  f"non {r['upd']['nonsel']:.2e} dense {r['upd']['dense']:.2e} "
                  f"gshare {r['sel_grad_share']:.2f}/{r['topk_grad_share']:.2f}"
                  f"{' H' if stats.host_update else ''}", flush=True)  # fmt: skip
    counts = {}
    for w in engine.zweights:  # per-column Adam counts: device = steps, host = windows
        dev, host = w.steps_dev.counts, w.host.steps.counts
        counts[w.spec.name] = [int(dev.min()), int(dev.max()), int(host.min()), int(host.max())]
    engine.close()
    return {"counts": counts, "variant": v, "rows": rows, "wall_s": time.perf_counter() - t_start,
            "resolved": {k: str(x) for k, x in engine.resolved.items()},
            "param_names": list(names.values())}  # fmt: skip


def summary_table(results, key="loss"):
    lines = []
    steps = len(results[0]["rows"])
    head = f"{'step':>6}" + "".join(f"{r['variant']['name']:>10}" for r in results)
    lines.append(head)
    for i in range(steps):
        cells = []
        for r in results:
            row = r["rows"][i]
            val = row[key]
            mark = "*" if row["host_update"] else " "
            cells.append(f"{val:9.3f}{mark}" if val is not None else f"{'-':>10}")
        lines.append(f"{i + 1:6d}" + "".join(cells))
    lines.append("")
    for label, fn in (
        ("mean", lambda xs: sum(xs) / len(xs)),
        ("max", max),
        ("last10", lambda xs: sum(xs[-10:]) / len(xs[-10:])),
    ):
        cells = []
        for r in results:
            xs = [row[key] for row in r["rows"] if row[key] is not None]
            cells.append(f"{fn(xs):9.3f} " if xs else f"{'-':>10}")
        lines.append(f"{label:>6}" + "".join(cells))
    return "\n".join(lines)


def landing_feedback(r) -> str | None:
    """For the landings of a ZenFlow run at lr > 0: ``then/now/n``, how many pushed the probe
    margin against the sign it had while the landing's gradients were taken (correcting
    the past) and against the sign it has when the result lands (correcting the present)."""
    v = r["variant"]
    if v["engine"] != "zenflow" or v.get("interval") == "auto":
        return None
    S = int(v.get("interval", 4))
    overlap = v.get("overlap", "1") == "1"
    warm = int(v.get("warmup", 0))
    rows = r["rows"]
    margin = {x["step"]: x["probe_margin"] for x in rows}  # after each step
    margin[0] = margin[1]  # the lr is 0 at step 1: the weights do not move
    then = now = n = 0
    for x in rows:
        land = x["step"]
        if not x["host_update"] or x["lr"] == 0 or land <= warm:
            continue
        end = land - S if overlap else land  # the window whose host step lands here
        start = end - S + 1
        if start < warm + 1:
            continue
        d = margin[land] - margin[land - 1]
        seen = sum(margin[t - 1] for t in range(start, end + 1)) / S
        n += 1
        then += d * seen < 0
        now += d * margin[land - 1] < 0
    return f"{then}/{now}/{n}"


def summarize(results) -> str:
    """One line per variant: the statistics the BENCHMARKS.md tables quote."""
    head = (
        f"{'variant':>14} {'mean':>6} {'max':>6} {'last10':>6} {'probe':>6} {'|marg|':>6} "
        f"{'dM@H':>6} {'dM':>6} {'|dW_ns|':>7} {'gsel':>5} {'gtop':>5} {'then/now':>9} "
        f"{'vs first':>8}"
    )
    lines = [head]
    loss0 = [x["loss"] for x in results[0]["rows"]]
    for r in results:
        rows = r["rows"]
        loss = [x["loss"] for x in rows]
        probe_l = [x["probe_loss"] for x in rows if x["probe_loss"] is not None]
        marg = [x["probe_margin"] for x in rows if x["probe_margin"] is not None]
        # |change of the probe margin| at steps where a host result landed, and elsewhere
        dm_h, dm_o = [], []
        for a, b in zip(rows, rows[1:], strict=False):
            if a["probe_margin"] is None or b["lr"] == 0.0:
                continue
            landing = b["host_update"] and r["variant"]["engine"] == "zenflow"
            (dm_h if landing else dm_o).append(abs(b["probe_margin"] - a["probe_margin"]))
        # non-selected columns' update norm per landing (zenflow) or per step (device,
        # offload), once the lr has reached its peak
        peak = max(x["lr"] for x in rows)
        landed = [
            x["upd"]["nonsel"]
            for x in rows
            if x["lr"] == peak and (x["host_update"] or r["variant"]["engine"] != "zenflow")
        ]
        fb = landing_feedback(r)
        diff0 = max(abs(a - b) for a, b in zip(loss, loss0, strict=False))
        share = [x["sel_grad_share"] for x in rows[1:] if x.get("sel_grad_share") is not None]
        best = [x["topk_grad_share"] for x in rows[1:] if x.get("topk_grad_share") is not None]

        def mean(xs):
            return sum(xs) / len(xs) if xs else float("nan")

        lines.append(
            f"{r['variant']['name']:>14} {mean(loss):6.3f} {max(loss):6.3f} "
            f"{mean(loss[-10:]):6.3f} {max(probe_l) if probe_l else float('nan'):6.3f} "
            f"{max(map(abs, marg)) if marg else float('nan'):6.2f} {mean(dm_h):6.2f} "
            f"{mean(dm_o):6.2f} {mean(landed):7.3f} {mean(share):5.2f} {mean(best):5.2f} "
            f"{fb if fb else '-':>9} {diff0:8.1e}"
        )
    return "\n".join(lines)


LEGEND = (
    "mean/max/last10: training loss; probe: max probe loss; |marg|: max |probe margin|; "
    "dM@H / dM: mean |change of the probe margin| at steps where a host result landed / "
    "at the other steps (lr > 0); |dW_ns|: L2 norm of the non-selected columns' update "
    "per host landing (zenflow) or per step (device), at peak lr; gsel / gtop: share of "
    "the 2-D weights' squared gradient norm in the first step's top-k columns / in the "
    "step's own top-k (steps 2..N); "
    "then/now: host landings (lr > 0) that pushed the probe margin against the sign it had "
    "while their gradients were taken / against the sign it had when they landed, of n; "
    "vs first: max |training loss - the first variant's| over the steps"
)


def check_first_host_step(args) -> None:
    """The bias correction of the first host step and the counts, on a tiny GPT-2.

    After the first window (S = 4, no overlap) every non-selected element whose window-mean
    gradient is well above eps must have moved by exactly ``lr(4) * sign(g)`` plus the decay
    term (Adam's count-1 step); a host count of 4 (steps instead of windows) would give 0.58
    lr. After 12 steps the device counts must be 12 and the host counts 3 (windows).
    """
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from zenflow.config import lr_at

    torch.manual_seed(0)
    cfg_m = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
                       bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2ForSequenceClassification(cfg_m)
    config = make_config(args.config, {"overlap": "0"})
    engine = ZenFlowEngine(model, config, steps_per_epoch=1000, accelerator="cpu")
    wd = config.optimizer.weight_decay
    for w in engine.zweights:
        p0 = w.spec.param.detach().clone()
        w.grad_sum = torch.zeros_like(p0)
        w.p0 = p0
    for t in range(1, 13):
        ids = torch.randint(1, 1000, (8, 16))
        out = model(input_ids=ids, labels=torch.randint(0, 2, (8,)))
        engine.backward(out.loss)
        if t <= 4:  # the clipped gradient, as the engine will see it
            norm = math.sqrt(sum(float((q.grad.float() ** 2).sum()) for q in model.parameters()
                                 if q.grad is not None))  # fmt: skip
            coef = min(1.0, config.gradient_clipping / (norm + 1e-6))
            for w in engine.zweights:
                w.grad_sum += w.spec.param.grad * coef
        engine.step(out.loss)
        engine.zero_grad()
        if t == 4:
            lr = lr_at(config, 4)
            worst, ratio = 0.0, []
            for w in engine.zweights:
                ns = w.nonsel_dev
                d = (w.spec.param.detach() - w.p0).index_select(w.cd, ns)
                g = w.grad_sum.index_select(w.cd, ns) / 4
                pred = -lr * torch.sign(g) - lr * wd * w.p0.index_select(w.cd, ns)
                big = g.abs() > 100 * config.optimizer.eps
                worst = max(worst, float((d - pred)[big].abs().max()))
                ratio.append(float((d[big] + lr * wd * w.p0.index_select(w.cd, ns)[big]).abs()
                                   .mean() / lr))  # fmt: skip
            print(f"first host step (step 4, lr {lr:.3g}): max |update - (-lr sign(g) - lr wd p)| "
                  f"= {worst:.3g} ({worst / lr:.2%} of lr); mean |update|/lr per weight "
                  f"{min(ratio):.4f}..{max(ratio):.4f}")  # fmt: skip
    dev = sorted({c for w in engine.zweights for c in w.steps_dev.counts.tolist()})
    host = sorted({c for w in engine.zweights for c in w.host.steps.counts.tolist()})
    print(f"after 12 steps: device counts {dev}, host counts {host}, windows "
          f"{engine.window_lengths}")  # fmt: skip
    engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument(
        "--model",
        help="a model name zfctl resolves (e.g. minilm) instead of "
        "the GPT-2 shape given by --layers/--width/--heads",
    )
    ap.add_argument(
        "--init",
        choices=("pretrained", "random"),
        default="pretrained",
        help="with --model: its pretrained weights or random ones",
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--probe", type=int, default=64, help="balanced dev rows (0: none)")
    ap.add_argument("--config", default=os.path.join(ROOT, "templates", "zenflow.json"))
    ap.add_argument("--glue-dir", default=os.environ.get("GLUE_DIR", "/work/shared/data/glue"))
    ap.add_argument("--suite", choices=sorted(SUITES))
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--no-dropout", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: engine's)")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument(
        "--report",
        nargs="+",
        metavar="JSON",
        help="print the summary of earlier --json files and exit",
    )
    ap.add_argument(
        "--check-first-step",
        action="store_true",
        help="check the first host step's bias correction and the counts, exit",
    )
    args = ap.parse_args()
    if args.check_first_step:
        check_first_host_step(args)
        return
    if args.report:
        for path in args.report:
            data = json.load(open(path))
            a = data["meta"]["args"]
            shape = a.get("model") or f"GPT-2 {a['layers']}x{a['width']}"
            init = a.get("init", "random") if a.get("model") else "random"
            print(
                f"## {path}: {shape} (init {init}), seed {a['seed']}, "
                f"{a['steps']} steps, {data['meta']['date']}"
            )
            print(summarize(data["results"]))
        print(LEGEND)
        return
    variants = [parse_variant(t) for t in (SUITES.get(args.suite, []) + args.variant)]
    if not variants:
        raise SystemExit("give --suite or --variant")
    if args.model:
        from zenflow.train.models import resolve_model

        tok = resolve_model(args.model, task_num_labels=2, init=args.init, seed=args.seed).tokenizer
    else:
        from zenflow.train.models import packaged_gpt2_tokenizer

        tok = packaged_gpt2_tokenizer()
        tok.pad_token = tok.eos_token
    encoded = encode(load_task(get_task("sst2"), args.glue_dir), tok, args.seq_len)
    probe_batch = probe_set(encoded.dev, args.probe) if args.probe else None
    results = []
    for v in variants:
        t0 = time.perf_counter()
        res = run_variant(args, v, encoded, probe_batch, tok.pad_token_id)
        results.append(res)
        r = res["rows"]
        print(f"# {v['name']}: {v} mean loss {sum(x['loss'] for x in r) / len(r):.3f} max "
              f"{max(x['loss'] for x in r):.3f} probe last {r[-1]['probe_loss']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    print("\ntraining loss per step (* = a host result reached the weights at that step)")
    print(summary_table(results, "loss"))
    if probe_batch is not None:
        print("\nprobe loss after each step (balanced dev rows, eval mode)")
        print(summary_table(results, "probe_loss"))
        print("\nprobe margin logit[1]-logit[0], mean over the probe")
        print(summary_table(results, "probe_margin"))
    print()
    print(summarize(results))
    print(LEGEND)
    if args.json:
        meta = {"args": vars(args), "nproc": os.cpu_count(), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f)


if __name__ == "__main__":
    main()
