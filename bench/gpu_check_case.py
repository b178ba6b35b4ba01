"""gpu-check's engine case: one Llama-shaped model, one engine, one number of tokens per
optimizer step, in a process of its own (its peaks are its own).

    python bench/gpu_check_case.py --mode zenflow --tokens 16384 --seq 1024 --accel cuda \\
        --arch llama-1b [--shape JSON] [--no-ckpt] [--host-kernel native]

Random init, bf16 (the engine casts the fp32 model and keeps fp32 masters), gradient
checkpointing (recomputation: a 1B at 16k tokens in one micro-batch does not fit 80 GB with
device AdamW otherwise), gradient clipping 1.0, AdamW; zenflow: topk 0.1, windows of 4 with
overlap, one warm-up round, the first selection at step 2 and a re-selection inside the
sync phase. Phases, each printing the result so far (a budget cut keeps what was done):

1. ``build``: model and engine, their seconds, the engine's resolved settings.
2. ``warm``: the first steps (warm-up, first selection), each with its syncs; the first
   selection's host functions by own time (cProfile, ``host_profile``).
3. ``timed``: steady steps. Per step: forward, backward and optimizer from the accelerator's
   marks (CUDA events on cuda, read after one synchronize at the phase's end), the step on
   the device's timeline (one step's first mark to the next's) and on the host's clock; the
   engine's own counters (stall, reads, full syncs, bytes). Device peak: the largest of
   the steps' own peaks (each step's ``torch.cuda.max_memory_allocated``, its forward and
   backward included, as the engine reads it before it restarts the counter for the next
   step; read after the phase, the counter would hold only what followed the last step's
   restart). On sim: the simulated device's pool at its most in use (activations
   included, on the CPU's kernels) and the engine's accounted peak.
4. ``sync``: more steps (a re-selection among them) with ``torch.cuda.set_sync_debug_mode
   ("warn")``: the synchronizing calls per step, split forward / backward / step, with the
   places that made them; the re-selection's host functions by own time (cProfile).
5. ``profile``: steps under torch.profiler (CPU and CUDA activity): the share of host<->device copy
   time under kernels, the GPU's busy share.
6. ``memory``: host peak RSS (the kernel's VmHWM, ``zenflow.hardware.probes.process_rss_peak``:
   ru_maxrss would keep gpu_check's own peak from before this process's exec), pinned bytes
   as the engine accounts them and as CUDA's caching pinned allocator holds them,
   /proc/self/status VmLck and VmPin.

On ``--accel sim`` (a rehearsal) the same phases run on the simulated device; what needs
CUDA says "not measured: no CUDA device", and sim's own figures (the engine-counted syncs,
the modelled copy overlap) are labelled as such. Output: ``GPU_CHECK_RESULT {json}`` lines,
the last one complete. Must not change the engine: it drives its public API only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from gpu_check_host import (  # noqa: E402
    NO_CUDA,
    PHASES,
    _pinned_allocated,
    case_config,
    emit,
)

from zenflow.hardware.probes import proc_status_bytes, process_rss_peak  # noqa: E402

HOST_PROFILE_TOP = 15  # functions kept per selection step, by own time


def engine_config(mode: str, micro_batch: int, step_store: str | None = None):
    from zenflow import load_config

    return load_config(case_config(mode, micro_batch, step_store))


def build_model(args, dev: torch.device):
    """The Llama shape, random init, fp32 on the device (the engine casts it to bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.shape:
        cfg = LlamaConfig(**json.loads(args.shape))
    else:
        from zenflow.config.architectures import architecture

        cfg = architecture(args.arch).config()
    cfg.use_cache = False
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).float()
    model.train()
    if args.ckpt:  # as zfctl finetune --gradient-checkpointing (zenflow/train/setup.py)
        with warnings.catch_warnings():  # transformers 5.24 renamed it: a FutureWarning
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    return model, cfg


class SyncCounter:
    """Synchronizing CUDA calls, by torch's own sync debug mode (``warn``), per phase."""

    def __init__(self, on: bool):
        self.on = on
        self.places: dict[str, int] = {}

    def run(self, fn):
        """(fn(), the number of sync warnings it raised); None for the count when off."""
        if not self.on:
            return fn(), None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        n = 0
        for w in caught:
            text = str(w.message)
            if "synchroniz" not in text.lower():
                continue
            n += 1
            where = f"{os.path.relpath(w.filename, ROOT) if w.filename else '?'}:{w.lineno}"
            self.places[where] = self.places.get(where, 0) + 1
        return out, n


class Case:
    """One engine on one model: the steps and their records."""

    def __init__(self, args):
        self.args = args
        self.cuda = args.accel == "cuda"
        self.dev = torch.device("cuda", torch.cuda.current_device()) if self.cuda else \
            torch.device("cpu")  # fmt: skip
        self.out: dict = {"mode": args.mode, "tokens": args.tokens, "seq": args.seq,
                          "micro_batch": args.tokens // args.seq, "accelerator": args.accel,
                          "gradient_checkpointing": args.ckpt, "step_store": args.step_store,
                          "phases": {}}  # fmt: skip
        self.rows: list[dict] = []
        self.i = 0

    # --------------------------------------------------------------------- build
    def build(self) -> None:
        from zenflow import ZenFlowEngine

        a = self.args
        t0 = time.perf_counter()
        self.model, cfg = build_model(a, self.dev)
        params = sum(p.numel() for p in self.model.parameters())
        self.out["model"] = {"params": params, "hidden": cfg.hidden_size,
                             "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
                             "build_s": time.perf_counter() - t0}  # fmt: skip
        t0 = time.perf_counter()
        self.engine = ZenFlowEngine(self.model,
                                    engine_config(a.mode, a.tokens // a.seq, a.step_store),
                                    mode=a.mode, accelerator=a.accel,
                                    host_kernel=a.host_kernel)  # fmt: skip
        self.accel = self.engine.accel
        keep = ("host_threads", "training_threads", "copy_buckets", "bucket_elems",
                "host_kernel", "device_update", "stream_grads", "pinned_host_buffers",
                "device_description", "dtype", "host_thread_share", "numa_binding",
                "step_store", "host_clipping")  # fmt: skip
        zw = self.engine.zweights
        self.out["engine"] = {"build_s": time.perf_counter() - t0,
                              "resolved": {k: self.engine.resolved.get(k) for k in keep
                                           if k in self.engine.resolved},
                              "zenflow_weights": len(zw),
                              "pieces_per_step": sum(len(getattr(w, "pieces", ())) for w in zw)
                              or None}  # fmt: skip
        g = torch.Generator().manual_seed(1)
        mb = a.tokens // a.seq
        self.batches = [torch.randint(0, cfg.vocab_size, (mb, a.seq), generator=g).to(self.dev)
                        for _ in range(4)]  # fmt: skip

    # --------------------------------------------------------------------- one step
    def step(self, syncs: SyncCounter) -> dict:
        e, b = self.engine, self.batches[self.i % len(self.batches)]
        self.i += 1
        m0, t0 = self.accel.mark(), time.perf_counter()

        def on_device(fn):  # sim: tensors from the simulated device's pool (cuda: no-op)
            def run():
                with self.accel.device_scope():
                    return fn()

            return run

        @on_device
        def fwd():
            with e.autocast():
                return self.model(input_ids=b, labels=b).loss

        loss, s_fwd = syncs.run(fwd)
        m1 = self.accel.mark()
        _, s_bwd = syncs.run(on_device(lambda: e.backward(loss)))
        m2, t2 = self.accel.mark(), time.perf_counter()
        if not self.cuda:  # sim: the device computed on this thread (the overlap figure)
            self.accel.note_compute(t0, t2)
        st, s_step = syncs.run(on_device(lambda: e.step(loss)))
        e.zero_grad()
        m3, t3 = self.accel.mark(), time.perf_counter()
        kind = "steady"
        if st.warmup:
            kind = "warm-up"
        elif st.step in e.selection_steps:
            kind = "selection" if e.selection_steps[0] == st.step else "re-selection"
        elif st.window_len:
            kind = "window-end"
        return {"step": st.step, "kind": kind, "marks": (m0, m1, m2, m3),
                "host_ms": (t3 - t0) * 1e3,
                # the step's device peak (cuda: max_memory_allocated from the last step's
                # end, forward and backward included; sim: the engine's accounting)
                "device_peak_bytes": st.device_peak_bytes,
                "syncs": None if s_fwd is None else {"forward": s_fwd, "backward": s_bwd,
                                                     "step": s_step},
                "engine": {"step_ms": st.step_ms, "stall_ms": st.stall_ms,
                           "d2h_reads": st.d2h_reads, "full_syncs": st.full_syncs,
                           "d2h_bytes": st.d2h_bytes, "h2d_bytes": st.h2d_bytes,
                           "overlap_share": st.overlap_share, "loss": st.loss,
                           "skipped": st.skipped, "host_update": st.host_update}}  # fmt: skip

    def profiled_step(self, syncs: SyncCounter) -> dict:
        """``step`` under cProfile (this thread: the step's selection and hand-over; not
        autograd's device threads, which run the gradient hooks on CUDA); a selection or
        re-selection keeps its host functions by own time: where its seconds go."""
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        try:
            row = self.step(syncs)
        finally:
            prof.disable()
        if row["kind"] in ("selection", "re-selection"):
            st = pstats.Stats(prof)
            top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:HOST_PROFILE_TOP]
            row["host_profile"] = [
                {"function": f"{os.path.relpath(f, ROOT) if f.startswith('/') else f}:{line}"
                             f"({name})",
                 "calls": nc, "own_ms": round(tt * 1e3, 2), "cumulative_ms": round(ct * 1e3, 2)}
                for (f, line, name), (_, nc, tt, ct, _) in top
            ]  # fmt: skip
        return row

    def finish(self, rows: list[dict]) -> None:
        """Turn the rows' marks into milliseconds (cuda: after the device passed them)."""
        if self.cuda:
            torch.cuda.synchronize()  # not the accelerator's: the engine's count stays clean
        ms = self.accel.elapsed_ms
        for k, r in enumerate(rows):
            m0, m1, m2, m3 = r.pop("marks")
            r["fwd_ms"], r["bwd_ms"], r["opt_ms"] = ms(m0, m1), ms(m1, m2), ms(m2, m3)
            nxt = rows[k + 1]["marks"][0] if k + 1 < len(rows) else m3
            r["device_step_ms"] = ms(m0, nxt)

    def phase(self, name: str, n: int, syncs: SyncCounter, host_profile=False) -> list[dict]:
        t0 = time.perf_counter()
        rows = [self.profiled_step(syncs) if host_profile else self.step(syncs)
                for _ in range(n)]  # fmt: skip
        self.finish(rows)
        self.out["phases"][name] = {"steps": rows, "wall_s": time.perf_counter() - t0}
        print(f"case: {name}: {n} steps in {time.perf_counter() - t0:.1f} s, kinds "
              f"{[r['kind'] for r in rows]}", flush=True)  # fmt: skip
        return rows


def steps_peak(rows: list[dict]) -> int:
    """The largest device peak of the steps ``rows`` (each step's own, read by the engine
    before it restarts the counter for the next)."""
    return max(int(r["device_peak_bytes"]) for r in rows)


def summarize(rows: list[dict], tokens: int) -> dict:
    def med(key):
        return statistics.median(r[key] for r in rows)

    def agg(fn):
        return max((fn(r) for r in rows), default=0)

    host_s = sum(r["host_ms"] for r in rows) / 1e3
    return {
        "steps": len(rows),
        "device_step_ms_median": med("device_step_ms"),
        "device_step_ms_mean": statistics.mean(r["device_step_ms"] for r in rows),
        "device_step_ms_max": max(r["device_step_ms"] for r in rows),
        "fwd_ms_median": med("fwd_ms"), "bwd_ms_median": med("bwd_ms"),
        "opt_ms_median": med("opt_ms"), "host_step_ms_median": med("host_ms"),
        "tokens_per_s": tokens * len(rows) / host_s if host_s else None,
        "engine_stall_ms_mean": statistics.mean(r["engine"]["stall_ms"] for r in rows),
        "engine_reads_max": agg(lambda r: r["engine"]["d2h_reads"]),
        "engine_full_syncs_max": agg(lambda r: r["engine"]["full_syncs"]),
        "link_bytes_per_step": statistics.mean(
            r["engine"]["d2h_bytes"] + r["engine"]["h2d_bytes"] for r in rows),
        "kinds": sorted({r["kind"] for r in rows}),
    }  # fmt: skip


def sync_summary(rows: list[dict], counter: SyncCounter, cuda: bool) -> dict:
    """Syncs per step kind: torch's count on cuda, the engine's own count everywhere."""
    by_kind: dict[str, dict] = {}
    for r in rows:
        k = by_kind.setdefault(r["kind"], {"steps": 0, "engine_reads_max": 0,
                                           "engine_full_syncs_max": 0})  # fmt: skip
        k["steps"] += 1
        k["engine_reads_max"] = max(k["engine_reads_max"], r["engine"]["d2h_reads"])
        k["engine_full_syncs_max"] = max(k["engine_full_syncs_max"], r["engine"]["full_syncs"])
        if r["syncs"] is not None:
            for part in ("forward", "backward", "step"):
                key = f"torch_{part}_max"
                k[key] = max(k.get(key, 0), r["syncs"][part])
    out = {"by_kind": by_kind}
    if cuda:
        out["places"] = dict(sorted(counter.places.items(), key=lambda kv: -kv[1])[:12])
    else:
        out["torch_sync_debug"] = NO_CUDA
        out["note"] = "sim: the engine's own count (Accelerator.read / synchronize) only"
    return out


def copy_overlap_profile(case: Case, n: int) -> dict:
    """Copy time under kernels and the GPU's busy share, from torch.profiler (cuda)."""
    import bisect

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rows = [case.step(SyncCounter(False)) for _ in range(n)]
        torch.cuda.synchronize()
    case.finish(rows)
    kernels, copies = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        if ev.name.startswith("Memcpy"):
            copies.append((span, ev.name))
        elif not ev.name.startswith("Memset"):
            kernels.append(span)
    merged: list[list[float]] = []
    for s, e in sorted(kernels):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    starts = [m[0] for m in merged]
    by_kind: dict[str, list[float]] = {}
    for (s, e), name in copies:
        lo = max(0, bisect.bisect_right(starts, s) - 1)
        hi = bisect.bisect_left(starts, e)
        under = sum(max(0.0, min(e, m1) - max(s, m0)) for m0, m1 in merged[lo:hi])
        k = by_kind.setdefault(name, [0.0, 0.0, 0])
        k[0], k[1], k[2] = k[0] + (e - s), k[1] + under, k[2] + 1
    link = [v for name, v in by_kind.items() if "HtoD" in name or "DtoH" in name]
    total = sum(v[0] for v in link)
    span_us = (merged[-1][1] - merged[0][0]) if merged else 0.0
    busy = sum(e - s for s, e in merged)
    return {
        "steps": n, "source": "torch.profiler (CUDA kernels vs Memcpy intervals)",
        "copy_under_compute_share": sum(v[1] for v in link) / total if total else None,
        "link_copy_ms": total / 1e3, "gpu_busy_share": busy / span_us if span_us else None,
        "span_ms": span_us / 1e3,
        "copies": {name: {"ms": v[0] / 1e3, "under_kernels": v[1] / v[0] if v[0] else None,
                          "count": v[2]} for name, v in by_kind.items()},
        "device_step_ms_median": statistics.median(r["device_step_ms"] for r in rows),
    }  # fmt: skip


def sim_overlap(case: Case, n: int) -> dict:
    """sim: the modelled share of link bytes moved while the device computed."""
    rows = [case.step(SyncCounter(False)) for _ in range(n)]
    case.finish(rows)
    num = den = 0.0
    for r in rows:
        eng = r["engine"]
        if eng["overlap_share"] is None:
            continue
        b = eng["d2h_bytes"] + eng["h2d_bytes"]
        num, den = num + eng["overlap_share"] * b, den + b
    return {"steps": n, "copy_under_compute_share": NO_CUDA, "gpu_busy_share": NO_CUDA,
            "sim_modelled_overlap_share": num / den if den else None,
            "note": "sim: link bytes moved while the training thread computed (the sim's "
            "copy log against its noted compute), not a profiler figure"}  # fmt: skip


def memory(case: Case) -> dict:
    """Host peak RSS; pinned bytes as the engine accounts them and as CUDA's caching pinned
    allocator holds them; the process's locked (VmLck) and pinned (VmPin) pages."""
    acc = case.accel
    out = {"host_peak_rss_bytes": process_rss_peak(),
           "host_rss_bytes": proc_status_bytes("VmRSS") or 0,
           "engine_host_bytes": sum(acc.host_held().values()),
           "engine_pinned_bytes": acc.pinned_bytes(),
           "vmlck_bytes": proc_status_bytes("VmLck") or 0,
           "vmpin_bytes": proc_status_bytes("VmPin") or 0}  # fmt: skip
    for name in ("host_peak_bytes", "caching_pinned_bytes"):  # where the engine has them
        fn = getattr(acc, name, None)
        if callable(fn):
            out[f"engine_{name}"] = fn()
    if case.cuda:
        held = _pinned_allocated()
        out["torch_pinned_allocator_bytes"] = held
        # what the engine believes the caching allocator holds (else all it pinned)
        ref = out.get("engine_caching_pinned_bytes") or out["engine_pinned_bytes"]
        if held is not None and ref:
            out["pinned_allocated_over_accounted"] = held / ref
        out["device_reserved_bytes"] = torch.cuda.memory_reserved()
    else:
        out["torch_pinned_allocator_bytes"] = NO_CUDA
    return out


def run(args) -> dict:
    case = Case(args)
    out = case.out
    try:
        case.build()
        emit(out)
        sync_on = case.cuda
        warm_counter = SyncCounter(sync_on)
        warm = case.phase("warm", PHASES["warm"], warm_counter, host_profile=True)
        out["warm"] = sync_summary(warm, warm_counter, case.cuda)
        if case.cuda:
            out["device_peak_through_warm_bytes"] = steps_peak(warm)
        emit(out)
        timed = case.phase("timed", PHASES["timed"], SyncCounter(False))
        out["timed"] = summarize(timed, args.tokens)
        out["device_peak_bytes"] = steps_peak(timed) if case.cuda else NO_CUDA
        if not case.cuda:
            out["engine_accounted_peak_bytes"] = steps_peak(timed)  # sim's accounting
            # the simulated device's pool (warm-up and timed steps): what its live tensors
            # held at most, activations included (None without the pool)
            out["sim_device_allocated_peak_bytes"] = case.accel.memory_allocated_peak_bytes()
        emit(out)
        counter = SyncCounter(sync_on)
        rows = case.phase("sync", PHASES["sync"], counter, host_profile=True)
        out["sync"] = sync_summary(rows, counter, case.cuda)
        emit(out)
        p = PHASES["profile"]
        out["profile"] = copy_overlap_profile(case, p) if case.cuda else sim_overlap(case, p)
        out["memory"] = memory(case)
        out["status"] = "measured"
    except Exception as exc:  # noqa: BLE001 - reported, and the check goes on
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in first.lower()
        out["status"] = "failed"
        out["error"] = ("device out of memory: " if oom else f"{type(exc).__name__}: ") + first
        out["traceback"] = traceback.format_exc()[-3000:]
        print(out["traceback"], flush=True)
    finally:
        engine = getattr(case, "engine", None)
        if engine is not None:
            try:
                engine.close()
            except Exception as exc:  # noqa: BLE001
                out.setdefault("close_error", f"{type(exc).__name__}: {exc}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["device", "zenflow", "offload"], required=True)
    ap.add_argument("--tokens", type=int, required=True, help="tokens per optimizer step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--accel", choices=["cuda", "sim"], default="cuda")
    ap.add_argument("--arch", default="llama-1b", help="a built-in architecture name")
    ap.add_argument("--shape", default=None, help="LlamaConfig keywords as JSON (rehearsals)")
    ap.add_argument("--no-ckpt", dest="ckpt", action="store_false")
    ap.add_argument("--host-kernel", default="native", choices=["native", "reference"])
    ap.add_argument(
        "--step-store",
        default=None,
        choices=["auto", "on", "off", "q8"],
        help="zfctl.step_store of a zenflow case (default: the config's default)",
    )
    args = ap.parse_args(argv)
    if args.step_store is not None and args.mode != "zenflow":
        ap.error("--step-store is a zenflow setting")
    if args.tokens % args.seq:
        ap.error("--tokens must be a multiple of --seq")
    out = run(args)
    emit(out)
    return 0 if out.get("status") == "measured" else 1


if __name__ == "__main__":
    sys.exit(main())
