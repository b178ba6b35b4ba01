"""Timed measurements of the training work: host Adam, forward+backward, and the overlap.

``measure_cpu_adam`` times the CPU Adam step (native or, with the reason, the reference) on
a given number of threads; ``measure_fwd_bwd`` times forward+backward of a probe model
(``zenflow.hardware.probe_model``: a Hugging Face model or a built-in GPT-2 shape, on the
device and in the dtype the engine would train it in; its names are re-exported here);
``measure_device_adam`` times the engine's device update of every column (topk 1.0);
``measure_overlap`` runs one update window with the host step on a worker thread beside the
device work, and without; ``measure_engine`` times real ``ZenFlowEngine`` steps. Each
returns plain data that ``zenflow.hardware.tuning`` decides from; nothing here decides.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from zenflow.hardware.probe_model import (
    BUILTIN_SHAPES,
    BUILTIN_SMALL,
    ProbeModel,
    fwd_bwd_once,
    load_probe_model,
    random_batch,
)
from zenflow.hardware.probes import median_seconds

__all__ = [
    "BUILTIN_SHAPES", "BUILTIN_SMALL", "AccumulateProbe", "AdamProbe", "DeviceAdamProbe",
    "OverlapProbe", "ProbeModel", "fwd_bwd_once", "load_probe_model", "measure_accumulate",
    "measure_cpu_adam", "measure_device_adam", "measure_engine", "measure_fwd_bwd",
    "measure_overlap", "random_batch", "resolve_adam", "torch_threads",
]  # fmt: skip

# Hyper-parameters of the timed Adam steps (the time does not depend on them).
_ADAM_HP = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


# --------------------------------------------------------------------------------------
# CPU Adam


@dataclass(frozen=True)
class AdamProbe:
    backend: str  # "native" or "reference"
    fallback_reason: str | None  # why the reference ran instead of the native op
    num_threads: int
    numel: int
    ms: float  # median time of one step over numel params
    params_per_s: float


def resolve_adam(allow_build: bool = True) -> tuple[Callable, str, str | None]:
    """(adamw_step fn, backend name, fallback reason). Never falls back silently.

    The native op builds on first use (about a minute); with ``allow_build=False`` an
    op not built yet is left unbuilt and the reference is used, with the reason.
    """
    import torch

    from zenflow import ops

    reference = ops.adamw_step_reference_
    native = getattr(ops, "adamw_step_", None)
    status_fn = getattr(ops, "native_status", None)
    if native is None or status_fn is None:
        return reference, "reference", "the native op is not available in zenflow.ops"
    status = status_fn()
    if status.get("ops") == "reference":
        return reference, "reference", "ZENFLOW_OPS=reference is set"
    ready = status.get("state") in ("built", "cached") or status.get("cached_library")
    if not allow_build and not ready:
        return (
            reference,
            "reference",
            "the native op is not built yet and --quick does not build it (about a minute); "
            "run tune-hw without --quick to build and measure it",
        )
    try:
        t = [torch.zeros(8) for _ in range(4)]
        native(*t, step=1, **_ADAM_HP)  # builds or loads the op
    except Exception as exc:  # a failed build or load: report it, measure the reference
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        return reference, "reference", f"the native op failed to build or load: {first}"
    return native, "native", None


def measure_cpu_adam(
    numel: int,
    num_threads: int,
    repeats: int = 5,
    adam: tuple[Callable, str, str | None] | None = None,
) -> AdamProbe:
    """Median time of one AdamW step over ``numel`` fp32 params on ``num_threads`` threads.

    The reference ignores ``num_threads``, so torch's thread count is set to it while
    measuring (and restored).
    """
    import torch

    fn, backend, reason = adam or resolve_adam()
    param, grad = torch.randn(numel), torch.randn(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    step = [0]

    def one() -> None:
        step[0] += 1
        fn(param, grad, exp_avg, exp_avg_sq, step=step[0], **_ADAM_HP, num_threads=num_threads)

    with torch_threads(num_threads):
        one()  # warm-up
        seconds = median_seconds(one, repeats)
    return AdamProbe(backend, reason, num_threads, numel, seconds * 1e3, numel / seconds)


@dataclass(frozen=True)
class AccumulateProbe:
    """The host's accumulation of gradient pieces: ``dst += scale * src`` into fp32 (the
    engine's accumulator thread, ``zenflow.ops.accumulate_``)."""

    backend: str  # "native" or "reference"
    num_threads: int
    src_dtype: str  # what the pieces arrive in (the training dtype)
    numel: int
    ms: float  # median time of one pass over numel elements
    elements_per_s: float


def measure_accumulate(
    numel: int, num_threads: int, bf16: bool = True, repeats: int = 5
) -> AccumulateProbe:
    """Median time of one accumulation pass of ``numel`` elements (bf16 or fp32 pieces into
    an fp32 sum, scaled, as a clipped step's pieces are) on ``num_threads`` threads."""
    import torch

    from zenflow import ops

    src_dtype = torch.bfloat16 if bf16 else torch.float32
    src = torch.randn(numel).to(src_dtype)
    dst = torch.zeros(numel)
    native = getattr(ops, "adamw_step_", None) is not None and ops.ops_mode() != "reference"
    with torch_threads(num_threads):
        ops.accumulate_(dst, src, 0.5, num_threads=num_threads)  # warm-up (and the build)
        seconds = median_seconds(
            lambda: ops.accumulate_(dst, src, 0.5, num_threads=num_threads), repeats
        )
    return AccumulateProbe("native" if native else "reference", num_threads,
                           str(src_dtype).replace("torch.", ""), numel, seconds * 1e3,
                           numel / seconds)  # fmt: skip


# --------------------------------------------------------------------------------------
# Model forward+backward


def measure_fwd_bwd(pm: ProbeModel, num_threads: int, repeats: int = 5) -> float:
    """Median ms of one forward+backward on ``num_threads`` torch threads (restored after)."""
    with torch_threads(num_threads):
        fwd_bwd_once(pm)  # warm-up (allocator, lazy init)
        return median_seconds(lambda: fwd_bwd_once(pm), repeats) * 1e3


# --------------------------------------------------------------------------------------
# The device's AdamW: the engine's selected-column update at topk 1.0


@dataclass(frozen=True)
class DeviceAdamProbe:
    device: str  # "cpu" or "cuda"
    num_threads: int  # torch threads while measuring (the device's compute share on a CPU)
    dtype: str  # the weights' dtype ("bfloat16": fp32 master beside them, as the engine)
    numel: int  # params updated by one timed pass
    ms: float  # median time of one pass
    params_per_s: float


@dataclass
class _UpdateBlock:
    weight: object  # a copy of (part of) a trainable weight, in the model's dtype
    grad: object
    exp_avg: object
    exp_avg_sq: object
    master: object | None  # fp32 master when the weight is low precision
    column_dim: int | None  # None: a dense param (updated whole, no column gather)
    columns: object | None  # every column's index: the selection at topk 1.0


def measure_device_adam(
    pm: ProbeModel, num_threads: int, repeats: int = 3, max_numel: int = 16 * 2**20
) -> DeviceAdamProbe:
    """Median time of the engine's device update with every column selected (topk 1.0).

    Per ZenFlow weight, as ``zenflow.engine.zenflow`` does each step: the selected
    columns of the gradient gathered in fp32, AdamW (``zenflow.engine.device_adam``: torch's
    fused kernel where the engine would use it, else the reference) on the
    fp32 master (the gathered weight itself in fp32 training), the result written back into
    the weight's columns; dense params are updated whole. Runs on copies of the model's
    trainable weights in order, up to ``max_numel`` elements (the last weight cut by columns
    to fit): AdamW is memory bound, so time per element holds for the whole model. The probe
    model is not changed.
    """
    import torch

    from zenflow.engine.device_adam import AdamHyper, adamw_fused_, fused_available
    from zenflow.engine.selection import classify_params

    blocks: list[_UpdateBlock] = []
    left = max_numel
    for spec in classify_params(pm.model):
        if left <= 0:
            break
        p = spec.param.detach()
        if spec.is_zenflow:
            cd = spec.column_dim
            rows = p.numel() // p.shape[cd]
            take = min(p.shape[cd], max(1, left // rows))
            w = p.narrow(cd, 0, take).clone()
            columns = torch.arange(take, device=p.device)
        else:
            cd, columns = None, None
            w = p.clone()
        left -= w.numel()
        master = w.float() if w.dtype != torch.float32 else None
        blocks.append(_UpdateBlock(
            w, torch.randn_like(w), torch.zeros(w.shape, device=w.device),
            torch.zeros(w.shape, device=w.device), master, cd, columns,
        ))  # fmt: skip
    hp = AdamHyper(_ADAM_HP["lr"], _ADAM_HP["beta1"], _ADAM_HP["beta2"], _ADAM_HP["eps"],
                   _ADAM_HP["weight_decay"])  # fmt: skip
    step = [0]
    cuda = pm.device == "cuda"
    fused = bool(blocks) and fused_available(blocks[0].weight.device)

    def one() -> None:
        step[0] += 1
        for b in blocks:
            if b.column_dim is None:
                x = b.weight if b.master is None else b.master
                adamw_fused_([x], [b.grad.float()], [b.exp_avg], [b.exp_avg_sq], step[0], hp,
                             fused=fused)  # fmt: skip
                if b.master is not None:
                    b.weight.copy_(b.master)
                continue
            g = b.grad.index_select(b.column_dim, b.columns).float()
            x = b.weight.index_select(b.column_dim, b.columns) if b.master is None else b.master
            adamw_fused_([x], [g], [b.exp_avg], [b.exp_avg_sq], step[0], hp, fused=fused)
            b.weight.index_copy_(b.column_dim, b.columns, x.to(b.weight.dtype))
        if cuda:
            from zenflow.engine.accelerator import device_synchronize

            device_synchronize(pm.batch["input_ids"].device)

    numel = sum(b.weight.numel() for b in blocks)
    with torch_threads(num_threads):
        one()  # warm-up
        seconds = median_seconds(one, repeats)
    dtype = str(blocks[0].weight.dtype).replace("torch.", "") if blocks else "float32"
    return DeviceAdamProbe(pm.device, num_threads, dtype, numel, seconds * 1e3, numel / seconds)


# --------------------------------------------------------------------------------------
# Overlap: host step on a background thread while forward+backward runs


@dataclass(frozen=True)
class OverlapProbe:
    """Both options of ZENFLOW.md section 7, measured at one update interval S.

    on: S forward+backward steps on ``train_threads`` while the host step runs concurrently
    on a worker thread with ``worker_threads``; the window ends when both are done.
    off: S forward+backward steps on all threads, then the host step on all threads; with
    ``off_split`` (a separate device, which keeps its reserved cores either way) on
    ``train_threads`` and then ``worker_threads``.
    """

    update_interval: int
    train_threads: int
    worker_threads: int
    all_threads: int
    host_numel: int
    on_window_ms: float
    on_fb_ms: float  # median forward+backward during the window (with the worker running)
    on_host_ms: float  # median worker time of the host step (with training running)
    on_wait_ms: float  # median time the training thread waited for the worker at the end
    off_window_ms: float
    off_fb_ms: float  # median forward+backward on all threads
    off_host_ms: float  # median host step on all threads, after the window's steps
    repeats: int
    off_split: bool = False  # the off window kept the on window's split (separate device)


def measure_overlap(
    pm: ProbeModel,
    *,
    update_interval: int,
    train_threads: int,
    worker_threads: int,
    all_threads: int,
    host_numel: int,
    adam: tuple[Callable, str, str | None],
    repeats: int = 3,
    chunk_numel: int = 16 * 2**20,
    off_split: bool = False,
) -> OverlapProbe:
    """Measure one window each way (median of ``repeats`` after a warm-up).

    The host step covers ``host_numel`` params in chunks of at most ``chunk_numel`` (the
    same buffers reused, 16 bytes/param), which costs the same memory traffic as distinct
    buffers once they exceed the caches while capping memory at 256 MiB.
    """
    host_step = _ChunkedHostStep(adam[0], host_numel, chunk_numel)
    with torch_threads(train_threads):
        on_windows, on_fbs, on_hosts, on_waits = _overlapped_windows(
            pm, host_step, update_interval, worker_threads, repeats
        )
    off_train, off_host = (train_threads, worker_threads) if off_split else (all_threads,) * 2
    with torch_threads(off_train):
        off_windows, off_fbs, off_hosts = _serial_windows(
            pm, host_step, update_interval, off_host, repeats
        )
    med = statistics.median
    return OverlapProbe(
        update_interval=update_interval,
        train_threads=train_threads,
        worker_threads=worker_threads,
        all_threads=all_threads,
        host_numel=host_numel,
        on_window_ms=med(on_windows) * 1e3,
        on_fb_ms=med(on_fbs) * 1e3,
        on_host_ms=med(on_hosts) * 1e3,
        on_wait_ms=med(on_waits) * 1e3,
        off_window_ms=med(off_windows) * 1e3,
        off_fb_ms=med(off_fbs) * 1e3,
        off_host_ms=med(off_hosts) * 1e3,
        repeats=repeats,
        off_split=off_split,
    )


class _ChunkedHostStep:
    """The host step over ``host_numel`` params: the Adam op over chunks of one reused set of
    ``min(host_numel, chunk_numel)``-element fp32 buffers, one step count for every call."""

    def __init__(self, fn: Callable, host_numel: int, chunk_numel: int) -> None:
        import torch

        self.fn, self.host_numel = fn, host_numel
        self.n = n = max(1, min(host_numel, chunk_numel))
        self.param, self.grad = torch.randn(n), torch.randn(n)
        self.exp_avg, self.exp_avg_sq = torch.zeros(n), torch.zeros(n)
        self.step = 0

    def __call__(self, threads: int) -> None:
        self.step += 1
        left = self.host_numel
        while left > 0:
            k = min(left, self.n)
            self.fn(
                self.param[:k],
                self.grad[:k],
                self.exp_avg[:k],
                self.exp_avg_sq[:k],
                step=self.step,
                **_ADAM_HP,
                num_threads=threads,
            )
            left -= k


def _timed_steps(pm: ProbeModel, update_interval: int) -> list[float]:
    """Seconds of each of one window's forward+backward steps."""
    fbs = []
    for _ in range(update_interval):
        t = time.perf_counter()
        fwd_bwd_once(pm)
        fbs.append(time.perf_counter() - t)
    return fbs


def _overlapped_windows(pm: ProbeModel, host_step: _ChunkedHostStep, update_interval: int,
                        worker_threads: int, repeats: int):  # fmt: skip
    """Overlap on: each window's steps on this thread while the host step runs on a worker
    thread; the window ends when both are done. The first window is a warm-up. Returns
    (window, median step, host step, wait at the end) seconds per measured window."""
    on_windows, on_fbs, on_hosts, on_waits = [], [], [], []
    for r in range(repeats + 1):
        host_s: list[float] = []
        failed: list[BaseException] = []

        def worker(out: list[float] = host_s, err: list[BaseException] = failed) -> None:
            t = time.perf_counter()
            try:
                host_step(worker_threads)
            except BaseException as exc:  # re-raised on the training thread below
                err.append(exc)
            out.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        th = threading.Thread(target=worker, name="zenflow-hw-host-step")
        th.start()
        fbs = _timed_steps(pm, update_interval)
        t_join = time.perf_counter()
        th.join()
        t1 = time.perf_counter()
        if failed:
            raise failed[0]
        if r:  # the first window is a warm-up
            on_windows.append(t1 - t0)
            on_fbs.append(statistics.median(fbs))
            on_hosts.append(host_s[0])
            on_waits.append(t1 - t_join)
    return on_windows, on_fbs, on_hosts, on_waits


def _serial_windows(pm: ProbeModel, host_step: _ChunkedHostStep, update_interval: int,
                    host_threads: int, repeats: int):  # fmt: skip
    """Overlap off: each window's steps, then the host step on ``host_threads``. The first
    window is a warm-up. Returns (window, median step, host step) seconds per measured
    window."""
    off_windows, off_fbs, off_hosts = [], [], []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        fbs = _timed_steps(pm, update_interval)
        t_host = time.perf_counter()
        host_step(host_threads)
        t1 = time.perf_counter()
        if r:
            off_windows.append(t1 - t0)
            off_fbs.append(statistics.median(fbs))
            off_hosts.append(t1 - t_host)
    return off_windows, off_fbs, off_hosts


def measure_engine(
    pm: ProbeModel,
    block: dict,
    overlap: bool,
    windows: int = 2,
    accelerator: str | None = None,
) -> dict:
    """Mean ms per step of real ZenFlowEngine steps with ``block`` and overlap on or off.

    Runs on a copy of the model, on ``accelerator`` (None: the engine's default for the
    model's device) and in the probe model's dtype (bf16 enabled when it is bf16): one
    warm-up window (selection, first host step), then ``windows`` whole windows timed, so
    each host step's cost is counted once per window.
    """
    import torch

    from zenflow.config import load_config
    from zenflow.engine import ZenFlowEngine

    s = int(block["update_interval"])
    raw = {
        "train_micro_batch_size_per_gpu": pm.micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": pm.bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": torch.cuda.is_available()},
            "zenflow": {**block, "overlap_step": overlap, "full_warm_up_rounds": 0},
        },
    }
    model = copy.deepcopy(pm.model)
    prev = torch.get_num_threads()
    engine = ZenFlowEngine(
        model, load_config(raw), mode="zenflow", steps_per_epoch=10**6, accelerator=accelerator
    )
    try:

        def one() -> None:
            with engine.autocast():
                loss = model(**pm.batch).loss
            engine.backward(loss)
            engine.step(loss)
            engine.zero_grad()

        for _ in range(s + 1):  # warm-up window, plus the step that applies its host result
            one()
        t0 = time.perf_counter()
        for _ in range(windows * s):
            one()
        ms = (time.perf_counter() - t0) * 1e3 / (windows * s)
    finally:
        engine.close()
        torch.set_num_threads(prev)
    return {"overlap_step": overlap, "update_interval": s, "steps": windows * s,
            "ms_per_step": ms, "host_kernel": engine.resolved.get("host_kernel"),
            "accelerator": engine.resolved.get("accelerator")}  # fmt: skip


class torch_threads:
    """Context manager: torch.set_num_threads(n), restored on exit."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        import torch

        self.prev = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_num_threads(self.prev)
