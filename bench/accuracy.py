"""Does ZenFlow learn as fast as AdamW? Engines x seeds x settings on one task (issue 17).

Each arm is a ``zfctl finetune`` command line: an engine and ``--set`` overrides of the
template. Every arm runs every seed with the same model, task, steps, batch, sequence
length, learning rate and evaluation cadence, so the arms of one seed start from the same
weights and see the same batches: the table compares them seed by seed (a paired gap with
its 95% interval, ``zenflow.train.learning``).

    .venv/bin/python bench/accuracy.py run runs/accuracy/main --seeds 1-5 --steps 1000 \\
        --arm adamw=device --arm zenflow=zenflow
    .venv/bin/python bench/accuracy.py run runs/accuracy/warmup --seeds 1-3 --steps 300 \\
        --arm adamw=device --arm w0=zenflow --arm w20=zenflow:warmup=20 --jobs 2
    .venv/bin/python bench/accuracy.py table runs/accuracy/main --at 100,300,1000

Arms are ``NAME=ENGINE[:key=value,...]``, ENGINE one of zenflow, offload, device (full
fine-tuning with AdamW on the device) and lora (LoRA adapters, ``zfctl finetune --engine
lora``). Keys are ``--set`` paths of the config (``zero_optimization.zenflow.topk_ratio=0.2``)
or these short names: ``topk``, ``interval`` (update_interval), ``overlap``
(overlap_step), ``warmup`` (full_warm_up_rounds), ``strategy`` (select_strategy),
``select`` (select_interval), ``window_lr`` (zfctl.window_lr), ``schedule``
(zfctl.select_schedule), ``rank`` / ``alpha`` / ``dropout`` (zfctl.lora.*), ``early`` /
``early_windows`` / ``early_overlap`` (zfctl.early.steps / windows / overlap); and ``lr``,
the arm's own peak learning rate instead of the sweep's ``--lr`` (LoRA is usually trained at
a higher one: ``lora5=lora:lr=5e-4``).

The table gives, per arm: the metric at each evaluated step (mean ± sd over seeds) and its
paired gap to the reference arm (the device arm by default) with a 95% interval; the eval
loss at the last step; the time per step (mean wall ms, and as a ratio to the reference's);
the stall share; the device bytes per parameter (the device peak during a step over the
base model's parameters, summary.json's ``device_peak_bytes_per_param``).

The arms start from one DeepSpeed config (``--config``, default the template), copied into
``ROOT/base_config.json`` when the sweep is made: an arm without settings is that config,
whatever the template says later. Resumable: a sweep's settings are kept in
``ROOT/sweep.json``, each run in
``ROOT/ARM/sSEED``. ``accuracy.py run ROOT`` on an existing sweep (the settings it leaves out
are the sweep's; the seeds are all of the sweep's) skips finished runs, resumes a run
stopped midway from its newest checkpoint (exact: ``zfctl finetune --resume``), and starts
the rest; arms and seeds may be added to a sweep later, its common settings may not change.
A finished run keeps its metrics and summary; its checkpoints and model are deleted
(``--keep-files`` keeps them) because a sweep of 50 runs would otherwise hold 20 GB.

Runs go one at a time by default; ``--jobs 2`` runs two side by side. The table's
accuracy does not depend on that; its ms/step do (a side-by-side speed comparison is
``zfctl bench``'s job), so the table says how many jobs ran them.

Ctrl-C (or SIGTERM) stops the sweep: each running ``zfctl finetune`` (in a process group of
its own) gets the signal once, writes its checkpoint and stops; the sweep then says how to
go on (``accuracy.py run ROOT``) and exits 130 (143). ROOT must be a sweep folder, a new one
or an empty one: a folder of other files is refused (exit 2), as is a file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zenflow.train import runs  # noqa: E402
from zenflow.train.learning import describe, eval_curve, paired_gap  # noqa: E402

SWEEP_FILE = "sweep.json"
BASE_CONFIG = "base_config.json"  # the sweep's DeepSpeed config, frozen when it was made
TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "zenflow.json"
SHORT_KEYS = {
    "topk": "zero_optimization.zenflow.topk_ratio",
    "interval": "zero_optimization.zenflow.update_interval",
    "overlap": "zero_optimization.zenflow.overlap_step",
    "warmup": "zero_optimization.zenflow.full_warm_up_rounds",
    "strategy": "zero_optimization.zenflow.select_strategy",
    "select": "zero_optimization.zenflow.select_interval",
    "window_lr": "zfctl.window_lr",
    "schedule": "zfctl.select_schedule",
    "rank": "zfctl.lora.rank",
    "alpha": "zfctl.lora.alpha",
    "dropout": "zfctl.lora.dropout",
    "early": "zfctl.early.steps",
    "early_windows": "zfctl.early.windows",
    "early_overlap": "zfctl.early.overlap",
}
ENGINES = ("zenflow", "offload", "device", "lora")
RESUME_HINT = "resume the sweep with: .venv/bin/python bench/accuracy.py run {root}"
# The demo's settings (README): pretrained MiniLM-L6 on SST-2, 16 x 48 tokens, lr 5e-5.
DEFAULTS = {"model": "minilm", "task": "sst2", "steps": 300, "micro_batch": 16, "seq_len": 48,
            "lr": 5e-5, "eval_every": 100, "extra": []}  # fmt: skip
DEFAULT_SEEDS = "1-5"  # a new sweep's


class SweepError(Exception):
    """A bad arm, seed list or sweep folder: one sentence for the user."""


class Stopped(Exception):  # noqa: N818 - a stop, not an error
    """SIGTERM to the sweep (Ctrl-C is KeyboardInterrupt): stop as for Ctrl-C, exit 143."""


def _raise_stopped(signum, frame) -> None:
    raise Stopped


def parse_arm(text: str) -> tuple[str, dict]:
    """``NAME=ENGINE[:key=value,...]`` -> (name, {"engine": ..., "set": ["path=value", ...]},
    and "lr" when the arm has its own)."""
    name, eq, rest = text.partition("=")
    if not eq or not name or "/" in name or name.startswith("."):
        raise SweepError(f"--arm {text!r}: write NAME=ENGINE[:key=value,...], e.g. "
                         "zf20=zenflow:topk=0.2")  # fmt: skip
    engine, _, settings = rest.partition(":")
    if engine not in ENGINES:
        raise SweepError(f"--arm {text!r}: engine {engine!r} is not one of {', '.join(ENGINES)}")
    sets, lr = [], None
    for item in filter(None, settings.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise SweepError(f"--arm {text!r}: {item!r} is not key=value")
        if key == "lr":
            try:
                lr = float(value)
            except ValueError:
                lr = -1.0
            if not 0 < lr < float("inf"):
                raise SweepError(f"--arm {text!r}: lr={value} is not a positive number")
            continue
        path = SHORT_KEYS.get(key, key)
        if "." not in path:
            raise SweepError(f"--arm {text!r}: unknown key {key!r}; use a dotted config path "
                             f"or one of {', '.join(SHORT_KEYS)}")  # fmt: skip
        sets.append(f"{path}={value}")
    arm = {"engine": engine, "set": sets}
    if lr is not None:  # only then: an arm without it equals one of an older sweep
        arm["lr"] = lr
    return name, arm


def parse_seeds(text: str) -> list[int]:
    """``1-5`` or ``1,2,7`` (or a mix) -> sorted unique seeds."""
    seeds: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            lo, dash, hi = part.partition("-")
            seeds.update(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    except ValueError:
        raise SweepError(f"--seeds {text!r}: write 1-5 or 1,2,7") from None
    if not seeds:
        raise SweepError(f"--seeds {text!r}: no seeds")
    return sorted(seeds)


def given_settings(args, new: bool) -> dict:
    """The common settings this command states: every one for a new sweep (defaults filled
    in), only those given on the command line when resuming one (the rest are the sweep's;
    a given one must match it, ``merge_sweep``)."""
    given = {"model": args.model, "task": args.task, "steps": args.steps,
             "micro_batch": args.micro_batch, "seq_len": args.seq_len, "lr": args.lr,
             "eval_every": args.eval_every, "extra": args.extra}  # fmt: skip
    config = args.config if args.config is not None else (TEMPLATE if new else None)
    if new:
        given = {k: DEFAULTS[k] if v is None else v for k, v in given.items()}
    else:
        given = {k: v for k, v in given.items() if v is not None}
    if config is not None:
        try:
            given["config"] = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SweepError(f"--config {config}: {exc}") from None
    return given


def check_root(root: Path, new_ok: bool) -> None:
    """ROOT is a folder: a sweep's, or (``new_ok``: ``run`` makes a sweep there) a new or
    empty one. Refused: a file, and a folder of other files (a sweep never writes among
    someone else's files)."""
    if root.exists() and not root.is_dir():
        raise SweepError(f"{root} is a file, not a sweep folder; pass a folder (a new one is "
                         "created)")  # fmt: skip
    if not root.is_dir() or (root / SWEEP_FILE).is_file():
        if not new_ok and not root.is_dir():
            raise SweepError(f"{root}: no such sweep folder; make one with `accuracy.py run "
                             f"{root} --arm ...`")  # fmt: skip
        return
    if not new_ok:
        raise SweepError(f"{root} holds no {SWEEP_FILE}: not a sweep folder")
    others = sorted(p.name for p in root.iterdir())
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise SweepError(f"{root} is not empty ({shown}) and holds no {SWEEP_FILE}: it is not "
                         "a sweep folder, and a sweep does not write among other files; pass "
                         "a new or empty folder")  # fmt: skip


def load_sweep(root: Path) -> dict | None:
    path = root / SWEEP_FILE
    if not path.is_file():
        return None
    try:
        sweep = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SweepError(f"{path} cannot be read ({exc}); restore it, or make a new sweep in "
                         "another folder") from None  # fmt: skip
    if not isinstance(sweep, dict) or not {"common", "arms", "seeds"} <= set(sweep):
        raise SweepError(f"{path} is not a sweep's settings (common, arms, seeds)")
    return sweep


def merge_sweep(old: dict | None, common: dict, arms: dict, seeds: list[int]) -> dict:
    """The sweep after this command: ``old`` plus new arms and seeds. Changing a common
    setting (the config included) or an arm's definition would mix two experiments in one
    table: refused."""
    if old is None:
        return {"common": common, "arms": arms, "seeds": seeds}
    for key, value in common.items():
        if old["common"].get(key) != value:
            was = "another config" if key == "config" else repr(old["common"].get(key))
            now = "this one" if key == "config" else repr(value)
            raise SweepError(f"this sweep was run with {key}={was}, not {now}: use another "
                             "folder for other settings")  # fmt: skip
    merged = dict(old["arms"])
    for name, arm in arms.items():
        if name in merged and merged[name] != arm:
            raise SweepError(f"arm {name!r} is {merged[name]} in this sweep, not {arm}: "
                             "give the new arm another name")  # fmt: skip
        merged[name] = arm
    seeds = sorted(set(old["seeds"]) | set(seeds))
    return {"common": old["common"], "arms": merged, "seeds": seeds}


def run_state(run_dir: Path) -> str:
    """One of "finished", "resume" (a run with a checkpoint), "restart" (a run without one) or
    "new"."""
    summary = runs.read_json(run_dir / runs.SUMMARY_FILE) if run_dir.is_dir() else None
    if summary and summary.get("status") == "finished":
        return "finished"
    if not runs.holds_run(run_dir):
        return "new"
    return "resume" if runs.latest_checkpoint(run_dir) else "restart"


def finetune_command(sweep: dict, arm: dict, seed: int, run_dir: Path, state: str) -> list[str]:
    c = sweep["common"]
    zfctl = Path(sys.executable).with_name("zfctl")
    cmd = [str(zfctl) if zfctl.exists() else "zfctl", "finetune", c["model"], "--task", c["task"],
           "--engine", arm["engine"], "--seed", str(seed), "--max-steps", str(c["steps"]),
           "--micro-batch", str(c["micro_batch"]), "--seq-len", str(c["seq_len"]),
           "--lr", str(arm.get("lr", c["lr"])), "--eval-every", str(c["eval_every"]),
           "--checkpoint-every", str(c["eval_every"]), "--run-dir", str(run_dir),
           "--no-dashboard", *c["extra"]]  # fmt: skip
    if "config" in c:  # every arm starts from the config frozen with the sweep
        cmd += ["--config", str(run_dir.parent.parent / BASE_CONFIG)]
    for s in arm["set"]:
        cmd += ["--set", s]
    if state == "resume":
        cmd += ["--resume", str(run_dir)]
    elif state == "restart":
        cmd += ["--overwrite"]
    return cmd


def run_sweep(root: Path, sweep: dict, jobs: int, keep_files: bool,
              seeds: list[int] | None = None, only: list[str] | None = None) -> int:  # fmt: skip
    """Run every (seed, arm) not finished yet (of ``seeds`` and the arms ``only`` names, or
    all), seed by seed so that a sweep stopped early still has whole seeds. Returns the
    number of failed runs. Ctrl-C (KeyboardInterrupt) or SIGTERM (``Stopped``): the running
    runs get that signal once, write their checkpoints and stop; then it is raised again."""
    todo = []
    for seed in seeds or sweep["seeds"]:
        for name, arm in sweep["arms"].items():
            if only and name not in only:
                continue
            run_dir = root / name / f"s{seed}"
            state = run_state(run_dir)
            if state != "finished":
                todo.append((name, arm, seed, run_dir, state))
    total = len(todo)
    n_arms = len(only) if only else len(sweep["arms"])
    print(f"{root}: {n_arms} arms x {len(seeds or sweep['seeds'])} seeds, {total} runs to "
          f"do, {jobs} at a time", flush=True)  # fmt: skip
    running: list[tuple] = []
    counts = {"failed": 0, "done": 0, "total": total}
    try:
        while todo or running:
            while todo and len(running) < jobs:
                running.append(_start(sweep, *todo.pop(0)))
            time.sleep(1.0)
            for item in list(running):
                if item[0].poll() is not None:
                    running.remove(item)
                    _finished(item, counts, todo, keep_files)
    except KeyboardInterrupt:
        _stop_runs(running, signal.SIGINT)
        raise
    except Stopped:
        _stop_runs(running, signal.SIGTERM)
        raise
    return counts["failed"]


def _start(sweep: dict, name: str, arm: dict, seed: int, run_dir: Path, state: str) -> tuple:
    """Start one ``zfctl finetune``, logging into ``ARM/sSEED.log``. It runs in a session of
    its own: a terminal's Ctrl-C reaches the sweep alone, which passes it on once."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"s{seed}.log", "a")
    cmd = finetune_command(sweep, arm, seed, run_dir, state)
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip
    print(f"  start {name} seed {seed} ({state})", flush=True)
    return proc, log, name, seed, run_dir, time.monotonic()


def _finished(item: tuple, counts: dict, todo: list, keep_files: bool) -> None:
    """One run ended: say how (its accuracy, or that it failed); a refused input (exit 2)
    stops the sweep, since every run would repeat it."""
    proc, log, name, seed, run_dir, t0 = item
    log.close()
    counts["done"] += 1
    where = f"[{counts['done']}/{counts['total']}] {name} seed {seed}"
    if proc.returncode != 0 or run_state(run_dir) != "finished":
        counts["failed"] += 1
        print(f"  {where}: FAILED (exit {proc.returncode}), see "
              f"{run_dir.parent / f's{seed}.log'}", flush=True)  # fmt: skip
        if proc.returncode == 2 and todo:  # bad input: every run would repeat it
            print(f"  stopping: exit 2 is zfctl refusing its input (the log's last line says "
                  f"why); the {len(todo)} runs not started would repeat it. Fix it and run "
                  "the same command again.", flush=True)  # fmt: skip
            counts["failed"] += len(todo)
            todo.clear()
        return
    if not keep_files:
        for sub in (runs.CHECKPOINT_DIR, runs.MODEL_DIR):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
    curve = eval_curve(runs.read_run(run_dir)["evals"])
    last = max(curve) if curve else None
    acc = f"accuracy {curve[last]:.4f} at step {last}" if last else "no evaluation"
    took = time.monotonic() - t0
    print(f"  {where}: {acc} ({took / 60:.1f} min)", flush=True)


def _stop_runs(running: list[tuple], signum: int) -> None:
    """Pass the stop on to each running run once and wait while it writes its checkpoint
    (a second Ctrl-C stops the waiting; the runs still finish their checkpoints)."""
    for proc, *_ in running:
        if proc.poll() is None:
            proc.send_signal(signum)
    if running:
        print(f"  stopping {len(running)} run(s): each writes its checkpoint first", flush=True)
    for proc, log, name, seed, run_dir, _t0 in running:
        try:
            proc.wait()
        except KeyboardInterrupt:
            print(f"  not waiting any longer: {name} seed {seed} (PID {proc.pid}) finishes its "
                  "checkpoint on its own", flush=True)  # fmt: skip
            continue
        finally:
            log.close()
        ckpt = runs.latest_checkpoint(run_dir) if run_dir.is_dir() else None
        at = f"checkpoint {ckpt.name}" if ckpt else "no checkpoint yet: it starts over"
        print(f"  {name} seed {seed}: stopped ({at})", flush=True)


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------


def collect(root: Path, sweep: dict, metric: str) -> dict:
    """Per arm: ``{"curves": {seed: {step: value}}, "loss": {seed: {step: eval_loss}},
    "summaries": {seed: summary}}`` of its finished runs."""
    out = {}
    for name in sweep["arms"]:
        arm = {"curves": {}, "loss": {}, "summaries": {}}
        for seed in sweep["seeds"]:
            run_dir = root / name / f"s{seed}"
            if run_state(run_dir) != "finished":
                continue
            run = runs.read_run(run_dir)
            arm["curves"][seed] = eval_curve(run["evals"], metric)
            arm["loss"][seed] = eval_curve(run["evals"], "eval_loss")
            arm["summaries"][seed] = run["summary"]
        out[name] = arm
    return out


def _at(per_seed: dict, step: int) -> dict:
    return {s: c[step] for s, c in per_seed.items() if step in c}


def table(root: Path, sweep: dict, reference: str | None, at: list[int] | None,
          metric: str = "accuracy") -> dict:  # fmt: skip
    """The sweep's table as plain data: per arm and step, the metric's mean/sd/min/max over
    seeds and the paired gap to ``reference`` with its 95% interval; per arm the eval loss
    at the last step, mean wall ms/step (and its ratio to the reference's), the stall share
    and the device bytes per parameter (the device peak during a step; older summaries
    without it: the device bytes at the step's end)."""
    data = collect(root, sweep, metric)
    if reference is None:
        reference = next((n for n, a in sweep["arms"].items() if a["engine"] == "device"), None)
    if reference is not None and reference not in data:
        raise SweepError(f"--reference {reference!r} is not an arm of this sweep "
                         f"({', '.join(data)})")  # fmt: skip
    steps = at or sorted({s for a in data.values() for c in a["curves"].values() for s in c})
    ref = data.get(reference) if reference else None
    rows = []
    for name, arm in data.items():
        row = {"arm": name, **sweep["arms"][name], "seeds": sorted(arm["curves"]), "at": {}}
        for step in steps:
            vals = _at(arm["curves"], step)
            gap = paired_gap(vals, _at(ref["curves"], step)) if ref and name != reference else None
            row["at"][step] = {"stats": describe(vals.values()), "gap": gap}
        last = max(steps) if steps else None
        row["eval_loss"] = describe(_at(arm["loss"], last).values()) if last else None
        sums = list(arm["summaries"].values())
        wall = [((s.get("timing_ms_mean") or {}).get("wall_ms")) for s in sums]
        stall = [s.get("stall_fraction") for s in sums]
        row["wall_ms"] = describe(v for v in wall if v is not None)
        row["stall_fraction"] = describe(v for v in stall if v is not None)
        peak = (s.get("device_peak_bytes_per_param") or s.get("device_bytes_per_param")
                for s in sums)  # fmt: skip
        row["device_bytes_per_param"] = describe(v for v in peak if v is not None)
        rows.append(row)
    ref_row = next((r for r in rows if r["arm"] == reference), None)
    for row in rows:  # time per step as a ratio to the reference's, measured in this sweep
        ref_wall = ref_row["wall_ms"] if ref_row else None
        row["wall_vs_reference"] = (row["wall_ms"]["mean"] / ref_wall["mean"]
                                    if row["wall_ms"] and ref_wall else None)  # fmt: skip
    return {"root": str(root), "metric": metric, "reference": reference, "steps": steps,
            "common": sweep["common"], "rows": rows}  # fmt: skip


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.2f}" if signed else f"{100 * x:.2f}"


def render_markdown(doc: dict) -> str:
    """The table in Markdown: metric in percent, mean +- sd (n), gap to the reference with
    its 95% interval in points."""
    steps, metric = doc["steps"], doc["metric"]
    head = ["arm", "settings"]
    for s in steps:
        head += [f"{metric} @{s}", f"gap @{s} [95% CI]"]
    head += ["eval loss", "ms/step", "time vs ref", "stall %", "device B/param"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for row in doc["rows"]:
        settings = row["engine"] + ("" if not row["set"] else " " + " ".join(
            s.replace("zero_optimization.zenflow.", "") for s in row["set"]))  # fmt: skip
        if "lr" in row:
            settings += f" lr={row['lr']:g}"
        cells = [row["arm"], settings]
        for s in steps:
            st, gap = row["at"][s]["stats"], row["at"][s]["gap"]
            cells.append("-" if st is None else
                         f"{_pct(st['mean'])} ± {_pct(st['sd'])} ({st['n']})")  # fmt: skip
            if gap is None:
                cells.append("ref" if row["arm"] == doc["reference"] else "-")
            else:
                cells.append(f"{_pct(gap['mean'], True)} [{_pct(gap['lo'], True)}, "
                             f"{_pct(gap['hi'], True)}]")  # fmt: skip
        loss, wall, stall = row["eval_loss"], row["wall_ms"], row["stall_fraction"]
        cells.append("-" if loss is None else f"{loss['mean']:.4f}")
        cells.append("-" if wall is None else f"{wall['mean']:.0f}")
        ratio = row.get("wall_vs_reference")
        cells.append("-" if ratio is None else f"{ratio:.2f}x")
        cells.append("-" if stall is None else f"{100 * stall['mean']:.1f}")
        mem = row["device_bytes_per_param"]
        cells.append("-" if mem is None else f"{mem['mean']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "run",
        help="run (or resume) a sweep, then print its table; "
        "arguments after -- go to every zfctl finetune",
    )
    r.add_argument("root", type=Path)
    r.add_argument("--arm", action="append", default=[], help="NAME=ENGINE[:key=value,...]")
    r.add_argument("--seeds", help="seeds to run now, added to the sweep's (default: "
                   f"{DEFAULT_SEEDS} for a new sweep, the sweep's own when resuming)")  # fmt: skip
    r.add_argument("--only", help="run only these arms now, e.g. adamw,zf (default: all)")
    # Left out: the defaults for a new sweep, the sweep's own when resuming one.
    r.add_argument("--model", help=f"default {DEFAULTS['model']}")
    r.add_argument("--task", help=f"default {DEFAULTS['task']}")
    r.add_argument("--steps", type=int, help=f"default {DEFAULTS['steps']}")
    r.add_argument("--micro-batch", type=int, help=f"default {DEFAULTS['micro_batch']}")
    r.add_argument("--seq-len", type=int, help=f"default {DEFAULTS['seq_len']}")
    r.add_argument("--lr", type=float, help=f"default {DEFAULTS['lr']}")
    r.add_argument("--eval-every", type=int, help=f"default {DEFAULTS['eval_every']}")
    r.add_argument("--config", type=Path,
                   help="the DeepSpeed config every arm starts from (default: the template); "
                   "a copy is kept with the sweep, so a later change of the template does not "
                   "change the sweep's arms")  # fmt: skip
    r.add_argument("--jobs", type=int, default=1)
    r.add_argument("--keep-files", action="store_true")
    t = sub.add_parser("table", help="print a sweep's table")
    t.add_argument("root", type=Path)
    for p in (r, t):
        p.add_argument("--reference", help="arm the gaps are taken to (default: the device arm)")
        p.add_argument("--at", help="steps to show, e.g. 100,300,1000 (default: every eval)")
        p.add_argument("--arms", help="only these arms, e.g. adamw,zf,w20")
        p.add_argument("--json", type=Path, help="also write the table as JSON here")
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # more finetune arguments
    args = ap.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    args.extra = extra if "--" in argv else None
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    # Ctrl-C as KeyboardInterrupt even where the sweep was started with SIGINT ignored (a
    # shell's background job, nohup): `kill -INT` then stops it as Ctrl-C would.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        doc, failed = _command(args)
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the folder cannot be made or written: the user's to fix
        where = f" {exc.filename}" if exc.filename else ""
        print(f"error: cannot write{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped) as exc:
        why = "stopped by SIGTERM" if isinstance(exc, Stopped) else "interrupted"
        print(f"\n{why}", file=sys.stderr)
        if args.cmd == "run" and (args.root / SWEEP_FILE).is_file():
            print(RESUME_HINT.format(root=args.root) + " (finished runs are kept; stopped "
                  "ones go on from their checkpoints)", file=sys.stderr)  # fmt: skip
        return 143 if isinstance(exc, Stopped) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    print(f"\n{_table_title(doc)}\n")
    print(render_markdown(doc))
    if args.json:
        runs.write_json_atomic(args.json, doc)
    return 1 if failed else 0


def _command(args) -> tuple[dict, int]:
    """``run`` (make or grow the sweep, run what is not finished) or ``table``: the table's
    data and the number of failed runs."""
    root = args.root
    check_root(root, new_ok=args.cmd == "run")
    old = load_sweep(root)
    failed = 0
    if args.cmd == "run":
        sweep, seeds, only = _sweep_to_run(args, old)
        root.mkdir(parents=True, exist_ok=True)
        runs.write_json_atomic(root / SWEEP_FILE, sweep)
        if "config" in sweep["common"]:
            runs.write_json_atomic(root / BASE_CONFIG, sweep["common"]["config"])
        failed = run_sweep(root, sweep, max(1, args.jobs), args.keep_files, seeds, only)
    else:
        sweep = old
    if args.arms:
        keep = args.arms.split(",")
        unknown = [a for a in keep if a not in sweep["arms"]]
        if unknown:
            raise SweepError(f"--arms: {', '.join(unknown)} not in this sweep")
        sweep = {**sweep, "arms": {a: sweep["arms"][a] for a in keep}}
    try:
        at = [int(s) for s in args.at.split(",")] if args.at else None
    except ValueError:
        raise SweepError(f"--at {args.at!r}: write steps like 100,300,1000") from None
    return table(root, sweep, args.reference, at), failed


def _sweep_to_run(args, old: dict | None) -> tuple[dict, list[int], list[str] | None]:
    """The sweep after ``run``'s arms, seeds and settings, the seeds to run now and the arms
    ``--only`` names."""
    arms = dict(parse_arm(a) for a in args.arm)
    if old is None and not arms:
        raise SweepError("a new sweep needs at least one --arm")
    common = given_settings(args, new=old is None)
    if old is not None and "config" not in old["common"]:
        common.pop("config", None)  # a sweep made before configs were frozen: as it was
        print(f"note: {args.root} keeps no frozen config: its arms use the template as it "
              "is when each run starts", file=sys.stderr)  # fmt: skip
    if args.seeds is not None:
        seeds = parse_seeds(args.seeds)
    else:
        seeds = parse_seeds(DEFAULT_SEEDS) if old is None else list(old["seeds"])
    only = args.only.split(",") if args.only else None
    sweep = merge_sweep(old, common, arms, seeds)
    unknown = [a for a in only or [] if a not in sweep["arms"]]
    if unknown:
        raise SweepError(f"--only: {', '.join(unknown)} not an arm of this sweep")
    return sweep, seeds, only


def _table_title(doc: dict) -> str:
    """What the table shows; without a reference arm, that there is nothing to take gaps to."""
    c = doc["common"]
    if doc["reference"] is None:
        gaps = ("no gaps: this sweep has no device arm to compare with (add one, e.g. --arm "
                "adamw=device, or name another arm with --reference)")  # fmt: skip
    else:
        gaps = f"gap = arm - {doc['reference']}, paired by seed, in points"
    return (f"{c['model']} on {c['task']}, {c['steps']} steps of {c['micro_batch']} x "
            f"{c['seq_len']} tokens, lr {c['lr']} (an arm's own lr is in its settings); "
            f"{doc['metric']} in %, mean ± sd (seeds); {gaps}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
