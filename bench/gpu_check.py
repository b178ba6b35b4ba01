"""make gpu-check's measurements, budget-aware: the host, the link, a 1B-class Llama under
three engines at two token counts, and the CUDA tier, into ONE JSON.

    python bench/gpu_check.py --out DIR [--budget 480] [--spent S] [--scale auto] \\
        [--only host,link,...] [--set KEY=VALUE ...]

Sections run in the order below, the most decisive first; each one runs only if what is
left of the budget covers what it needs (its first estimate, then what the same kind of
section took here), else it is recorded as skipped with the reason; a section that runs
past what is left is stopped and recorded as cut, with what it had measured.

1. ``environment``: GPU, driver, torch, packages, the core split (gpu_check_host.py env).
2. ``host``: memory bandwidth, the accumulate and the CPU Adam alone and together.
3. ``link``: host<->device bandwidth, pinned and pageable; the pinned allocator's rounding.
4. ``llama_<engine>_<tokens>``: zenflow and device AdamW at the large token count, then at
   the small one, then offload at both (gpu_check_case.py, one process each), each with
   ``zfctl estimate``'s bytes for the same settings beside the measured peaks (the estimate
   runs first, once per token count, and its time counts in the case's need).
5. ``pieces``: the training thread's CPU per streamed piece and per weight, and the 7B step
   it comes to (bench/piece_cost.py on the check's accelerator: CUDA's own calls on a GPU).
6. ``cuda_tier``: ``pytest -m cuda tests/cuda`` with what time is left.

Then ``verdicts``: the figures that could contradict the design, each with its threshold
(docs/GPU.md explains them). Without a CUDA device the check is a rehearsal on the
simulated device (``sim``), shapes scaled down (``SCALES``): the JSON's ``run`` says
"rehearsal (sim)" and every figure that needs CUDA says "not measured: no CUDA device".

This file imports no torch: each part runs in a child process, so a crash, an out-of-memory
or a hang costs one section. The JSON is rewritten after every section. Exit 0 unless a
section failed (skipped and cut sections are budget decisions, not failures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def _load(name: str):
    """A module of this folder by path (bench/ is not a package; sys.path stays as it is)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


verdicts = _load("gpu_check_verdicts").verdicts

NO_CUDA = "not measured: no CUDA device"
RESULT = "GPU_CHECK_RESULT "
RESERVE_S = 8  # kept back at every decision for the verdicts and the last JSON write

# Shapes. gpu: Llama 3.2 1B's shape (zenflow/config/architectures.py "llama-1b") at 4k and
# 16k tokens per optimizer step in sequences of 1024. The rehearsals scale the model and the
# tokens down (a 2-core CPU box computes about 10^4 times slower than an H100) so that the
# whole check fits its budget there; "tiny" is the test's.
SCALES = {
    "gpu": {"arch": "llama-1b", "shape": None, "tokens": (16384, 4096), "seq": 1024,
            "need": {"environment": 15, "host": 45, "link": 25, "case_first": 100,
                     "estimate": 20, "pieces": 40, "cuda_tier": 60}},
    "rehearsal": {"arch": None,
                  "shape": {"hidden_size": 256, "intermediate_size": 1024,
                            "num_hidden_layers": 4, "num_attention_heads": 4,
                            "num_key_value_heads": 1, "vocab_size": 8192,
                            "tie_word_embeddings": True, "max_position_embeddings": 1024},
                  "tokens": (1024, 256), "seq": 128,
                  "need": {"environment": 15, "host": 45, "link": 15, "case_first": 50,
                           "estimate": 20, "pieces": 45, "cuda_tier": 30}},
    "tiny": {"arch": None,
             "shape": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512,
                       "tie_word_embeddings": True, "max_position_embeddings": 256},
             "tokens": (256, 64), "seq": 32,
             "need": {"environment": 15, "host": 20, "link": 12, "case_first": 25,
                      "estimate": 15, "pieces": 30, "cuda_tier": 30}},
}  # fmt: skip
# "zenflow-q8": zenflow with zfctl.step_store "q8" at the smaller token count, where the
# host's work weighs most: what the 8-bit copies cost a step beside the store's case
CASE_ORDER = (("zenflow", 0), ("device", 0), ("zenflow", 1), ("device", 1), ("offload", 0),
              ("offload", 1), ("zenflow-q8", 1))  # fmt: skip


def case_name(mode: str, tokens: int) -> str:
    return f"llama_{mode}_{tokens // 1024}k" if tokens >= 1024 else f"llama_{mode}_{tokens}"


def case_mode(mode: str) -> tuple[str, str | None]:
    """A case's engine mode and its zfctl.step_store ("zenflow-q8": zenflow, "q8")."""
    engine, _, store = mode.partition("-")
    return engine, store or None


def section_names(scale: dict) -> list[str]:
    cases = [case_name(m, scale["tokens"][i]) for m, i in CASE_ORDER]
    return ["environment", "host", "link", *cases, "pieces", "cuda_tier"]


class Budget:
    """Seconds left of the whole check, counted from the shell's start (``spent``)."""

    def __init__(self, total: float, spent: float = 0.0, clock=time.monotonic):
        self.total = float(total)
        self.clock = clock
        self.t0 = clock() - float(spent)

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def left(self) -> float:
        return self.total - self.elapsed()

    def allows(self, need: float) -> tuple[bool, str]:
        """Whether a section that needs ``need`` seconds may start, and the note if not."""
        left = self.left() - RESERVE_S
        if left >= need:
            return True, ""
        return False, (f"skipped (budget): {max(0.0, left):.0f} s left of the {self.total:.0f} s "
                       f"budget, the section needs about {need:.0f} s")  # fmt: skip


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default action."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_part(
    cmd: list[str], timeout: float, tag: str, env: dict | None = None, grace_s: float = 0.0
) -> dict:
    """Run a child process, stream its output to ours with ``tag``, keep its last result
    line. Stopped after ``timeout`` seconds -> ``cut``: its process group is killed, or
    with ``grace_s`` first interrupted (SIGINT: pytest then writes its report of the tests
    that ran) and killed only if it has not ended ``grace_s`` later."""
    t0 = time.monotonic()
    # the child takes SIGINT's default: a check started in the background or under nohup
    # inherits SIGINT ignored, and a Python child would then never see the interrupt
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True, env=env,
                            preexec_fn=_default_sigint)  # fmt: skip
    last: list = [None]
    tail: list[str] = []

    def pump():
        for line in proc.stdout:
            if line.startswith(RESULT):
                try:
                    last[0] = json.loads(line[len(RESULT) :])
                except json.JSONDecodeError:
                    pass
                continue
            tail.append(line.rstrip())
            del tail[:-40]
            print(f"  [{tag}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    cut = False
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        cut = True
        try:
            if grace_s > 0:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass
        rc = proc.wait()
    reader.join(timeout=10)
    return {
        "rc": rc,
        "cut": cut,
        "result": last[0],
        "seconds": time.monotonic() - t0,
        "tail": tail[-15:],
    }


class Check:
    """The sections in order, their budget decisions and the one JSON."""

    def __init__(self, args):
        self.args = args
        self.budget = Budget(args.budget, args.spent)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out / "gpu-check.json"
        self.py = sys.executable
        self.doc: dict = {"check": "zfctl gpu-check", "run": "pending", "accelerator": None,
                          "budget_s": args.budget,
                          "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "setup": dict(kv.partition("=")[::2] for kv in args.set),
                          "sections": {}}  # fmt: skip
        self.seen: dict[int, float] = {}  # tokens -> seconds the last case of them took
        self.estimates: dict[int, dict] = {}
        self.estimate_s: float | None = None  # what the last estimate took here (x 1.15)

    def say(self, text: str) -> None:
        print(f"gpu-check [{self.doc['run']}] {self.budget.elapsed():5.0f}s: {text}", flush=True)

    def write(self) -> None:
        self.doc["elapsed_s"] = round(self.budget.elapsed(), 1)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str) + "\n", encoding="utf-8")
        tmp.replace(self.json_path)

    def record(self, name: str, entry: dict) -> None:
        self.doc["sections"][name] = entry
        self.say(
            f"{name}: {entry['status']}" + (f" ({entry['note']})" if entry.get("note") else "")
        )
        self.write()

    def part(
        self,
        name: str,
        need: float,
        cmd: list[str],
        env: dict | None = None,
        expect_result: bool = True,
        grace_s: float = 0.0,
    ) -> dict | None:
        """One child-process section: the budget decision, the run, the record (None when
        skipped). ``expect_result``: the child prints a result line (else its exit code
        alone says whether it passed)."""
        only = self.args.only
        asked = not only or name in only or (name.startswith("llama_") and "llama" in only)
        if not asked and name != "environment":
            self.record(name, {"status": "skipped", "note": "not asked for (--only)"})
            return None
        ok, note = self.budget.allows(need)
        if not ok:
            self.record(name, {"status": "skipped", "note": note})
            return None
        timeout = min(self.budget.left() - RESERVE_S - grace_s, max(3 * need, 120))
        self.say(f"{name}: start (needs ~{need:.0f} s, stopped after {timeout:.0f} s)")
        r = run_part(cmd, timeout, name, env, grace_s)
        entry = {"status": "measured", "seconds": round(r["seconds"], 1), "exit": r["rc"]}
        if r["cut"]:
            entry["status"] = "cut"
            entry["note"] = f"stopped after {timeout:.0f} s: the budget (what it measured is kept)"
        elif r["rc"] != 0 or (expect_result and r["result"] is None):
            entry["status"] = "failed"
            entry["note"] = f"exit {r['rc']}" + ("" if r["result"] or not expect_result
                                                 else ": no result")  # fmt: skip
            entry["output_tail"] = r["tail"]
        if isinstance(r["result"], dict):
            entry["result"] = r["result"]
            if r["result"].get("error"):
                entry["note"] = r["result"]["error"]
        if name != "cuda_tier":  # the tier adds its test results first
            self.record(name, entry)
        return entry

    # ------------------------------------------------------------------ sections
    def environment(self) -> None:
        e = self.part("environment", self.scale["need"]["environment"],
                      [self.py, str(HERE / "gpu_check_host.py"), "env"])  # fmt: skip
        self.doc["environment"] = e.pop("result", None) if e else None

    def host_parts(self) -> None:
        common = ["--accel", self.accel, "--scale", self.scale_name]
        for name in ("host", "link"):
            self.part(name, self.scale["need"][name],
                      [self.py, str(HERE / "gpu_check_host.py"), name, *common])  # fmt: skip

    def estimate(self, tokens: int) -> dict:
        """``zfctl estimate --json`` for the cases' settings at ``tokens`` (cached)."""
        if tokens in self.estimates:
            return self.estimates[tokens]
        self.say(f"zfctl estimate at {tokens} tokens per step (for the cases' peaks)")
        sc = self.scale
        model = sc["arch"]
        if model is None:  # a rehearsal shape: a config.json is all estimate reads
            d = self.out / "rehearsal-model"
            d.mkdir(exist_ok=True)
            cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **sc["shape"]}
            (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
            model = str(d)
        # the zenflow case's own config (no early phase, one warm-up round): without it
        # the estimate is the template's (an early phase), not of the runs it is set beside
        conf = self.out / f"estimate-config-{tokens}.json"
        raw = _load("gpu_check_host").case_config("zenflow", tokens // sc["seq"])
        conf.write_text(json.dumps(raw, indent=1), encoding="utf-8")
        cmd = [
            self.py,
            "-m",
            "zfctl",
            "estimate",
            model,
            "--config",
            str(conf),
            "--head",
            "causal-lm",
            "--bf16",
            "--micro-batch",
            str(tokens // sc["seq"]),
            "--seq-len",
            str(sc["seq"]),
            "--gradient-checkpointing",
            "--topk-ratio",
            "0.1",
            "--overlap-step",
            "--json",
        ]
        if self.accel != "cuda":
            cmd += ["--device-mem", "80GiB"]
        t0 = time.monotonic()
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
            try:  # a refusal (something does not fit) still prints the estimate
                est = json.loads(r.stdout)
            except json.JSONDecodeError:
                est = {"error": f"exit {r.returncode}: {r.stderr.strip()[-500:]}"}
        except (OSError, subprocess.SubprocessError, json.JSONDecodeError) as exc:
            est = {"error": f"{type(exc).__name__}: {exc}"}
        self.estimate_s = (time.monotonic() - t0) * 1.15
        self.estimates[tokens] = est
        self.doc.setdefault("estimates", {})[str(tokens)] = compact_estimate(est)
        return est

    def cases(self) -> None:
        sc = self.scale
        for mode, i in CASE_ORDER:
            tokens = sc["tokens"][i]
            name = case_name(mode, tokens)
            need = self.seen.get(tokens, sc["need"]["case_first"] * (1 if i == 0 else 0.7))
            # the case's estimate runs first (once per token count): its time counts too,
            # so that a case the budget cannot then cover does not spend it
            first = need + (0 if tokens in self.estimates
                            else self.estimate_s or sc["need"]["estimate"])  # fmt: skip
            if self.budget.allows(first)[0] and (
                not self.args.only or "llama" in self.args.only or name in self.args.only
            ):
                self.estimate(tokens)
            engine, store = case_mode(mode)
            cmd = [self.py, str(HERE / "gpu_check_case.py"), "--mode", engine, "--tokens",
                   str(tokens), "--seq", str(sc["seq"]), "--accel", self.accel,
                   "--host-kernel", self.args.host_kernel]  # fmt: skip
            cmd += ["--step-store", store] if store else []
            cmd += ["--shape", json.dumps(sc["shape"])] if sc["shape"] else ["--arch", sc["arch"]]
            entry = self.part(name, need if tokens in self.estimates else first, cmd)
            if entry is None:
                continue
            if entry["status"] == "measured":
                self.seen[tokens] = entry["seconds"] * 1.15
            res = entry.get("result")
            if isinstance(res, dict):
                res["estimate_vs_measured"] = compare(res, self.estimates.get(tokens), engine,
                                                      self.accel)  # fmt: skip
                self.write()

    def pieces(self) -> None:
        """bench/piece_cost.py on this accelerator (a small model: the per-call CPU, not the
        data work), its figures at llama-7b's weights and pieces (issue 28 item 3)."""
        # and llama-7b's stack in the 16M pieces the engine made before its 48M ones: the
        # piece size's effect on this accelerator, side by side
        cmd = [self.py, str(HERE / "piece_cost.py"), "--device", self.accel, "--warmup", "8",
               "--steps", "8", "--stack-also", str(16 << 20), "--result"]  # fmt: skip
        self.part("pieces", self.scale["need"]["pieces"], cmd)

    def cuda_tier(self) -> None:
        name = "cuda_tier"
        junit, records = self.out / "junit.xml", self.out / "records.jsonl"
        for f in (junit, records):
            f.unlink(missing_ok=True)
        cmd = [
            self.py,
            "-m",
            "pytest",
            "-m",
            "cuda",
            "tests/cuda",
            "-rA",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "-o",
            "junit_logging=system-out",
        ]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd.append("--timeout=240")  # one hung test does not take the rest of the time
        env = {**os.environ, "GPU_CHECK_RECORD": str(records)}
        rehearsed = os.environ.get("ZFCTL_CUDA_TIER_DEVICE") == "sim"
        entry = self.part(name, self.scale["need"]["cuda_tier"], cmd, env, expect_result=False,
                          grace_s=15.0)  # fmt: skip
        if entry is None:
            return
        report = _gpu_report()
        entry["tests"] = report.tests(junit)
        entry["records"] = report.records(records)
        if entry["status"] != "cut":
            entry.pop("output_tail", None)
            entry["note"] = f"pytest exit {entry['exit']}"
        if rehearsed:
            entry["note"] += "; ZFCTL_CUDA_TIER_DEVICE=sim: the tier's logic on sim, not a GPU"
        elif self.accel != "cuda" and entry["status"] != "cut":
            entry["status"] = "not measured"
            entry["note"] = (f"{NO_CUDA}: every test of the tier skips, saying why (pytest "
                             f"exit {entry['exit']})")  # fmt: skip
        self.record(name, entry)

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        asked = self.args.scale
        self.scale_name = "gpu" if asked == "auto" else asked
        self.scale = SCALES[self.scale_name]
        self.environment()
        env = self.doc.get("environment")
        cuda = bool(env.get("cuda_available")) if env else cuda_available(self.py)
        if not cuda and self.scale_name == "gpu":  # auto, or gpu asked for without a GPU
            self.scale_name = "rehearsal"
        self.scale = SCALES[self.scale_name]
        scale_name = self.scale_name
        self.accel = "cuda" if cuda else "sim"
        self.doc["run"] = "gpu" if cuda else "rehearsal (sim)"
        self.doc["accelerator"] = self.accel
        self.doc["scale"] = {"name": scale_name, "model": self.scale["arch"] or "llama-shaped "
                             "(scaled down)", "shape": self.scale["shape"],
                             "tokens_per_step": list(self.scale["tokens"]),
                             "seq": self.scale["seq"], "gradient_checkpointing": True,
                             "sections": section_names(self.scale)}  # fmt: skip
        if not cuda:
            self.doc["rehearsal_note"] = (
                "rehearsal (sim): no CUDA device, the simulated accelerator stands in and the "
                "shapes are scaled down; no figure here is a GPU figure")  # fmt: skip
        self.say(f"budget {self.budget.total:.0f} s, {self.budget.left():.0f} s left; "
                 f"scale {scale_name}, accelerator {self.accel}")  # fmt: skip
        self.host_parts()
        self.cases()
        self.pieces()
        self.cuda_tier()
        self.doc["verdicts"] = verdicts(self.doc)
        self.write()
        unmeasured = 0
        for v in self.doc["verdicts"]:
            if v["result"] == "not measured":
                unmeasured += 1
                continue
            self.say(f"verdict: {v['name']}: {v['result']} ({v.get('figure_text', '')})")
        self.say(f"verdicts: {len(self.doc['verdicts']) - unmeasured} measured, {unmeasured} "
                 "not measured (the JSON says why)")  # fmt: skip
        failed = [n for n, s in self.doc["sections"].items() if s["status"] == "failed"]
        self.say(f"done in {self.budget.elapsed():.0f} s; JSON {self.json_path}"
                 + (f"; FAILED: {', '.join(failed)}" if failed else ""))  # fmt: skip
        return 1 if failed else 0


def cuda_available(py: str) -> bool:
    """Whether ``py``'s torch sees a CUDA device (when the environment part failed)."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([py, "-c", probe], timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def compact_estimate(est: dict | None) -> dict | None:
    """What the check compares from ``zfctl estimate --json``: bytes per engine."""
    if not est or "engines" not in est:
        return est
    keep = ("params", "zenflow_params", "selected_elements", "bucket_elements")
    out = {k: est.get(k) for k in keep}
    out["engines"] = {
        name: {"device_bytes": e.get("device_bytes"), "host_bytes": e.get("host_bytes"),
               "host_peak_bytes": e.get("host_peak_bytes"),
               "host_peak_phase": e.get("host_peak_phase"),
               "host_runtime_bytes": e.get("host_runtime_bytes"),
               "pinned_bytes": e.get("pinned_bytes"),
               "activations_bytes": (e.get("holders") or {}).get("device", {}).get("activations")}
        for name, e in est["engines"].items() if name in ("device", "offload", "zenflow")
    }  # fmt: skip
    return out


def compare(res: dict, est: dict | None, mode: str, accel: str) -> dict:
    """Measured peaks against the estimate of the same engine and settings."""
    e = (compact_estimate(est) or {}).get("engines", {}).get(mode)
    if not e:
        return {"note": "no estimate: " + str((est or {}).get("error", "not run"))}
    mem = res.get("memory") or {}
    out = {"estimate_device_bytes": e["device_bytes"], "estimate_host_bytes": e["host_bytes"],
           "estimate_pinned_bytes": e["pinned_bytes"]}  # fmt: skip
    peak = res.get("device_peak_bytes")
    if accel == "cuda" and isinstance(peak, (int, float)) and e["device_bytes"]:
        out["device_peak_over_estimate"] = peak / e["device_bytes"]
    else:
        out["device_peak_over_estimate"] = NO_CUDA
    sim_peak = res.get("sim_device_allocated_peak_bytes")
    if isinstance(sim_peak, (int, float)) and e["device_bytes"]:  # the rehearsal's (CPU kernels)
        out["sim_device_peak_over_estimate"] = sim_peak / e["device_bytes"]
    if isinstance(mem.get("engine_pinned_bytes"), (int, float)) and e["pinned_bytes"]:
        out["engine_pinned_over_estimate"] = mem["engine_pinned_bytes"] / e["pinned_bytes"]
    host = mem.get("engine_host_peak_bytes") or mem.get("engine_host_bytes")
    if isinstance(host, (int, float)) and e["host_bytes"]:
        out["engine_host_over_estimate"] = host / e["host_bytes"]  # the steady state's
    if isinstance(mem.get("host_peak_rss_bytes"), (int, float)) and e["host_bytes"]:
        out["host_peak_rss_over_estimate"] = mem["host_peak_rss_bytes"] / e["host_bytes"]
    # against the whole run's peak (the engine's accounting has no runtime; the RSS has)
    peak_est, runtime = e.get("host_peak_bytes"), e.get("host_runtime_bytes") or 0
    if isinstance(peak_est, (int, float)) and peak_est > runtime:
        out["estimate_host_peak_bytes"] = peak_est
        out["estimate_host_peak_phase"] = e.get("host_peak_phase")
        if isinstance(host, (int, float)):
            out["engine_host_peak_over_estimate_peak"] = host / (peak_est - runtime)
        if isinstance(mem.get("host_peak_rss_bytes"), (int, float)):
            out["host_peak_rss_over_estimate_peak"] = mem["host_peak_rss_bytes"] / peak_est
    return out


def _gpu_report():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "tests/cuda/gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module  # tests/cuda's summary helpers: environment(), tests(), records()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-check", help="folder of gpu-check.json")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check")
    ap.add_argument("--spent", type=float, default=0.0, help="seconds already spent (setup)")
    ap.add_argument("--scale", default="auto", choices=["auto", *SCALES],
                    help="auto: gpu with CUDA, else the sim rehearsal")  # fmt: skip
    ap.add_argument("--only", default="", help="comma-separated sections (llama: every case)")
    ap.add_argument("--host-kernel", default="native", choices=["native", "reference"])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setup fact for the JSON (repeatable)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.budget <= 0:
        print(f"gpu-check: --budget must be positive seconds, not {args.budget:g}", file=sys.stderr)
        return 2
    args.only = {s.strip() for s in args.only.split(",") if s.strip()}
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
