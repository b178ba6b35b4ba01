"""tune-hw's decisions (ZENFLOW.md sections 3 and 7) and the config they are written to.

``choose(TuneInputs) -> Choices`` is a pure function of measured numbers, so its rules are
tested with synthetic figures: topk_ratio from the device's memory and time bounds
(``zenflow.hardware.topk``), then the update interval that hides the host step of the rest,
the overlap and the core split. ``zenflow.hardware.tune_run`` measures the numbers and calls
it; ``update_config`` writes the chosen keys into a config's zenflow block.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zenflow.hardware import host_choice
from zenflow.hardware import topk as topk_bounds
from zenflow.hardware.measure import OverlapProbe
from zenflow.hardware.topk import MemoryBudget, TimeModel, TopkMemory
from zenflow.outputs import write_json_atomic

UPDATE_INTERVAL_MIN = 1
UPDATE_INTERVAL_MAX = 64
# The largest update_interval the accuracy sweep (docs/BENCHMARKS.md) found as close to
# AdamW as the default; above it the update_interval reason says so.
ACCURACY_TESTED_INTERVAL = 4

# --------------------------------------------------------------------------------------
# Decision logic (pure)


@dataclass(frozen=True)
class TuneInputs:
    """The measured numbers ``choose`` decides from. Times in ms, rates in params/s,
    bandwidths in bytes/s.

    Choosing topk_ratio (``topk_ratio`` None) needs the memory and time figures below the
    line; a fixed topk_ratio is still checked against them when they are given.
    """

    cores: int  # cores this process may use
    params_total: int
    params_2d: int  # Pz: the weights scored by columns (k on the device, the rest offloaded)
    fb_all_ms: float  # forward+backward with all cores
    fb_split_ms: float  # forward+backward with the training thread's share
    train_threads: int  # the training share measured for fb_split_ms (1..cores-1)
    adam_rate_worker: float  # host Adam params/s on the worker's cores (cores - train)
    adam_rate_all: float  # host Adam params/s on all cores
    mem_available_bytes: int
    memlock_bytes: int | None = None  # None = unlimited
    accelerator: str = "cpu"  # "cpu", "sim" or "cuda"
    accelerator_memory_bytes: int | None = None
    topk_ratio: float | None = None  # fixed by the user; None = choose
    overlap: OverlapProbe | None = None  # a real concurrent measurement, if taken
    # ---- the topk bounds (zenflow.hardware.topk)
    memory_table: tuple[TopkMemory, ...] = ()  # the zenflow layout at each candidate k
    memory_budget: MemoryBudget | None = None
    # Device AdamW params/s (the engine's update at k=1) with the threads forward+backward
    # has on the device: fb_split_ms's on a separate device that splits the cores, else
    # fb_all_ms's (cuda: the GPU's).
    device_adam_rate: float | None = None
    dtype_bytes: int = 4  # the training dtype (what the copies carry)
    d2h_bytes_per_s: float | None = None  # host<->device bandwidth, per direction
    h2d_bytes_per_s: float | None = None
    link: str = ""  # where the bandwidth comes from, in words
    hide_fraction: float = topk_bounds.HIDE_FRACTION
    # the host's accumulation of gradient pieces (elements/s on the worker's cores: the
    # accumulator shares them with the host Adam); None: not measured
    host_accumulate_rate: float | None = None

    @property
    def separate_device(self) -> bool:
        """sim and cuda: a device of its own that keeps its reserved cores either way."""
        return self.accelerator != "cpu"

    @property
    def can_split(self) -> bool:
        return self.cores >= 2 and 1 <= self.train_threads < self.cores


@dataclass(frozen=True)
class Choices:
    topk_ratio: float
    update_interval: int
    select_strategy: str
    select_interval: str | int
    overlap_step: bool
    pt_reserved_cores_perc: float
    reasons: dict[str, str]
    windows: dict[str, float | bool | int]  # the per-window figures behind overlap_step
    memory: dict[str, object]  # the memory check
    topk: dict[str, object] = field(default_factory=dict)  # the bounds behind topk_ratio
    cpu_only: bool = False  # the device is the CPU: offloading has nothing to win

    def zenflow_block(self) -> dict:
        """The keys this tool sets in a config's zero_optimization.zenflow block."""
        return {
            "topk_ratio": self.topk_ratio,
            "update_interval": self.update_interval,
            "select_strategy": self.select_strategy,
            "select_interval": self.select_interval,
            "overlap_step": self.overlap_step,
            "pt_reserved_cores_perc": self.pt_reserved_cores_perc,
        }

    def zfctl_block(self) -> dict:
        """The keys this tool sets in a config's zfctl block: the host state that fits (none
        when the memory was not checked or neither state fits), and zfctl.step_store "q8"
        or "off" where, with clipping, the state fits only with the store's 8-bit copies or
        without the store."""
        state = self.memory.get("host_state") if self.memory.get("checked") else None
        if not state:
            return {}
        setting = self.memory.get("step_store")
        return {"host_state": state, **({"step_store": setting} if setting else {})}


def interval_to_hide(host_ms: float, fb_ms: float) -> int:
    """Smallest S in 1..64 with host_ms <= S * fb_ms (the host step hides under the window)."""
    if fb_ms <= 0:
        return UPDATE_INTERVAL_MAX
    s = math.ceil(host_ms / fb_ms - 1e-9)
    return min(UPDATE_INTERVAL_MAX, max(UPDATE_INTERVAL_MIN, s))


def _time_model(inp: TuneInputs, fb_device_ms: float, host_rate: float) -> TimeModel | None:
    rates = (inp.device_adam_rate, inp.d2h_bytes_per_s, inp.h2d_bytes_per_s)
    if any(r is None or r <= 0 for r in rates):
        return None
    return TimeModel(
        fb_ms=fb_device_ms,
        device_adam_rate=inp.device_adam_rate,
        dense_params=inp.params_total - inp.params_2d,
        zenflow_params=inp.params_2d,
        dtype_bytes=inp.dtype_bytes,
        d2h_bytes_per_s=inp.d2h_bytes_per_s,
        h2d_bytes_per_s=inp.h2d_bytes_per_s,
        link=inp.link or "measured bandwidth",
        hide_fraction=inp.hide_fraction,
        host_accumulate_rate=inp.host_accumulate_rate,
        host_adam_rate=host_rate if inp.host_accumulate_rate else None,
    )


def choose_topk(
    inp: TuneInputs,
    interval_of: Callable[[float], int],
    fb_device_ms: float,
    host_rate: float | None = None,
) -> tuple[float, str, dict]:
    """topk_ratio from the memory and time bounds (or fixed), its reason and figures.
    ``host_rate``: the host Adam's params/s (default: on the worker's cores)."""
    tm = _time_model(inp, fb_device_ms, host_rate or inp.adam_rate_worker)
    have = bool(inp.memory_table) and inp.memory_budget is not None and tm is not None
    if inp.topk_ratio is None and not have:
        needs = {
            "memory_table": inp.memory_table,
            "memory_budget": inp.memory_budget,
            "device_adam_rate, d2h_bytes_per_s and h2d_bytes_per_s": tm,
        }
        missing = [name for name, value in needs.items() if not value]
        raise ValueError(f"choose() needs {', '.join(missing)} to choose topk_ratio")
    if not have:
        return inp.topk_ratio, f"fixed by --topk {inp.topk_ratio:g}", {"fixed": True}
    mem = topk_bounds.memory_bound(inp.memory_table, inp.memory_budget, inp.dtype_bytes == 2)
    tim = topk_bounds.time_bound(tm, interval_of)
    info = {"memory_bound": mem.value, "memory_met": mem.met, "memory": mem.figures,
            "time_bound": tim.value, "time_met": tim.met, "time": tim.figures}  # fmt: skip
    if inp.topk_ratio is not None:
        k = inp.topk_ratio
        mem_s = "none fits" if mem.value is None else f"{mem.value:g}"
        why = f"fixed by --topk {k:g} (measured bounds: memory {mem_s}, time {tim.value:g})"
        if mem.value is None or k > mem.value:
            why += "; it does NOT fit the device memory: " + mem.reason
        return k, why, {**info, "fixed": True, "binds": None}
    k, binds, why = topk_bounds.decide(mem, tim)
    return k, why, {**info, "fixed": False, "binds": binds}


def choose(inp: TuneInputs) -> Choices:
    """Decide the zenflow block from measured numbers. Pure; every choice has a reason.

    Order: topk_ratio (the device's memory and time bounds), then the update interval S
    that hides the host Adam step of the offloaded (1 - k) share, then overlap and the
    core split.
    """
    reasons: dict[str, str] = {}
    h = _Hiding.of(inp)
    topk, reasons["topk_ratio"], topk_info = choose_topk(
        inp, h.interval_of, h.fb_device, h.host_rate
    )
    if inp.accelerator == "cpu":
        reasons["topk_ratio"] = "CPU-only (device = host): " + reasons["topk_ratio"]
    host_numel = inp.params_2d * (1.0 - topk)
    host_all_ms = host_numel / inp.adam_rate_all * 1e3
    host_worker_ms = host_numel / inp.adam_rate_worker * 1e3

    if not inp.can_split:
        w = _window_unsplit(inp, host_numel, host_all_ms, reasons)
    else:
        w = _window_split(inp, h, topk, host_numel, host_all_ms, host_worker_ms, reasons)
    if w.s > ACCURACY_TESTED_INTERVAL:
        reasons["update_interval"] += (
            f"; note: above S={ACCURACY_TESTED_INTERVAL} windows are staler, and the "
            "accuracy sweep (docs/BENCHMARKS.md, MiniLM on SST-2) measured ZenFlow further "
            'behind AdamW at S=8 and collapsing with 64-step windows under window_lr "sum" '
            "(a window's host step at S x lr); check accuracy with bench/accuracy.py"
        )
    reasons["select_interval"] = (
        "auto: re-select once per epoch (important columns stay for many steps); nothing "
        "measured here argues for another cadence"
    )
    memory = _memory_check(inp, topk)
    reasons["host_state"] = str(memory["reason"])
    windows = {"update_interval": w.s, "on_ms": w.on_ms, "off_ms": w.off_ms,
               "measured": w.measured, "host_all_ms": host_all_ms,
               "host_worker_ms": host_worker_ms}  # fmt: skip
    return Choices(
        topk_ratio=topk,
        update_interval=w.s,
        select_strategy="auto",
        select_interval="auto",
        overlap_step=w.overlap,
        pt_reserved_cores_perc=round(w.perc, 4),
        reasons=reasons,
        windows=windows,
        memory=memory,
        topk={"chosen": topk, **topk_info},
        cpu_only=inp.accelerator == "cpu",
    )


@dataclass(frozen=True)
class _Hiding:
    """What the host step hides under: the host Adam rate and the forward+backward of the
    training thread (with a concurrent measurement, the figures measured under contention),
    and what the device's per-step work hides under."""

    inp: TuneInputs
    host_rate: float  # host Adam params/s
    fb: float  # ms of the forward+backward the host step hides under
    fb_device: float  # ms of the forward+backward the device's per-step work hides under

    @classmethod
    def of(cls, inp: TuneInputs) -> _Hiding:
        ov = inp.overlap
        if inp.can_split:
            measured_rate = ov is not None and ov.host_numel > 0 and ov.on_host_ms > 0
            host_rate = (
                ov.host_numel / ov.on_host_ms * 1e3 if measured_rate else inp.adam_rate_worker
            )
            fb = ov.on_fb_ms if ov else inp.fb_split_ms
        else:
            host_rate, fb = inp.adam_rate_all, inp.fb_all_ms
        # On a separate device that splits the cores, its share's forward+backward; on the
        # CPU (or one core) all cores'.
        fb_device = fb if inp.separate_device and inp.can_split else inp.fb_all_ms
        return cls(inp, host_rate, fb, fb_device)

    def accumulate_ms(self, k: float) -> float:
        """The host's per-step sum of the offloaded share (0: not measured)."""
        inp = self.inp
        if not inp.host_accumulate_rate:
            return 0.0
        return inp.params_2d * (1.0 - k) / inp.host_accumulate_rate * 1e3

    def interval_of(self, k: float) -> int:
        # the window hides the host Adam under what forward+backward leaves the host after
        # its per-step accumulation
        return interval_to_hide(self.inp.params_2d * (1.0 - k) / self.host_rate * 1e3,
                                self.fb - self.accumulate_ms(k))  # fmt: skip


@dataclass(frozen=True)
class _Window:
    """The update interval and the window times behind overlap_step and the core split."""

    s: int
    on_ms: float
    off_ms: float
    measured: bool
    overlap: bool
    perc: float


def _window_unsplit(
    inp: TuneInputs, host_numel: float, host_all_ms: float, reasons: dict[str, str]
) -> _Window:
    """One core (or no split): S amortises the host step over all cores' steps, overlap off."""
    s = interval_to_hide(host_all_ms, inp.fb_all_ms)
    reasons["update_interval"] = (
        f"host Adam over {_count(host_numel)} offloaded params takes {host_all_ms:.0f} ms "
        f"on {inp.cores} core(s), forward+backward {inp.fb_all_ms:.0f} ms: S={s} "
        f"amortises it ({s}x{inp.fb_all_ms:.0f}={s * inp.fb_all_ms:.0f} ms)"
    )
    on_ms, off_ms, measured = math.inf, s * inp.fb_all_ms + host_all_ms, False
    reasons["overlap_step"] = (
        f"off: {inp.cores} core(s) leaves no core for a worker; window {off_ms:.0f} ms"
    )
    reasons["pt_reserved_cores_perc"] = "0.5 (unused: no core split on this machine)"
    return _Window(s, on_ms, off_ms, measured, False, 0.5)


def _window_split(
    inp: TuneInputs,
    h: _Hiding,
    topk: float,
    host_numel: float,
    host_all_ms: float,
    host_worker_ms: float,
    reasons: dict[str, str],
) -> _Window:
    """A training thread and a worker: S hides the host step on the worker under the
    training share's steps; overlap on when its window is the shorter."""
    worker = inp.cores - inp.train_threads
    ov, fb = inp.overlap, h.fb
    host = host_numel / h.host_rate * 1e3
    s = h.interval_of(topk)
    basis = "measured while both ran" if ov else "measured separately"
    acc = h.accumulate_ms(topk)
    left = f"{fb:.0f}" if not acc else f"{fb:.0f}-{acc:.0f} ms of accumulation = {fb - acc:.0f}"
    reasons["update_interval"] = (
        f"host Adam over {_count(host_numel)} offloaded params takes {host:.0f} ms on "
        f"{worker} worker core(s), forward+backward {fb:.0f} ms on {inp.train_threads} "
        f"training core(s) ({basis}): S={s} hides it ({s}x{left} ms per step)"
    )
    if s == UPDATE_INTERVAL_MAX and host > s * fb:
        reasons["update_interval"] += "; capped at 64, the host step is not fully hidden"
    on_ms, off_ms, measured, how = _window_ms(
        inp, s, fb, host, host_numel, host_all_ms, host_worker_ms
    )
    overlap = on_ms < off_ms
    off_cores = (
        f"the same {inp.train_threads}+{worker} split: a separate device keeps its reserved cores"
        if inp.separate_device
        else f"{inp.cores} cores"
    )
    reasons["overlap_step"] = (
        f"{'on' if overlap else 'off'}: per {s}-step window ({how}) overlap on "
        f"({inp.train_threads}+{worker} cores) {on_ms:.0f} ms vs off ({off_cores}) "
        f"{off_ms:.0f} ms"
    )
    perc = inp.train_threads / inp.cores
    used = (
        " (kept whether or not overlap_step is on: the device's compute share)"
        if inp.separate_device
        else ("" if overlap else " (only used with overlap_step on)")
    )
    reasons["pt_reserved_cores_perc"] = (
        f"{perc:.2f}: {inp.train_threads} of {inp.cores} cores for the training thread, "
        f"{worker} for the worker" + used
    )
    return _Window(s, on_ms, off_ms, measured, overlap, perc)


def _window_ms(
    inp: TuneInputs,
    s: int,
    fb: float,
    host: float,
    host_numel: float,
    host_all_ms: float,
    host_worker_ms: float,
) -> tuple[float, float, bool, str]:
    """(window ms with overlap on, off, whether measured, how in words) at S = ``s``."""
    ov = inp.overlap
    # A measured window counts only at the S and the host share it was measured at.
    measured = bool(ov and ov.update_interval == s and ov.host_numel == int(host_numel))
    if measured:
        return ov.on_window_ms, ov.off_window_ms, measured, "measured"
    if ov:  # S or k moved after the measurement: scale its parts to the new S and k
        scale = host_numel / ov.host_numel if ov.host_numel else 0.0
        on_ms = max(s * ov.on_fb_ms, ov.on_host_ms * scale)
        off_ms = s * ov.off_fb_ms + ov.off_host_ms * scale
        return (
            on_ms,
            off_ms,
            measured,
            (f"modelled from the parts of the S={ov.update_interval} measurement"),
        )
    if inp.separate_device:  # off keeps the split: the host step after the steps
        on_ms = max(s * fb, host)
        off_ms = s * inp.fb_split_ms + host_worker_ms
    else:
        on_ms = max(s * fb, host)
        off_ms = s * inp.fb_all_ms + host_all_ms
    return on_ms, off_ms, measured, "modelled from component times"


def _memory_check(inp: TuneInputs, topk: float) -> dict[str, object]:
    """The host memory the choice needs in each host state against what is available, the
    state chosen (``zenflow.hardware.host_choice``) and, with CUDA, the pinned bytes against
    the locked-memory limit."""
    return host_choice.memory_check(
        inp.memory_table, inp.memory_budget, topk, available=inp.mem_available_bytes,
        memlock=inp.memlock_bytes, cuda=inp.accelerator == "cuda",
    )  # fmt: skip


memory_verdict = host_choice.memory_verdict


# --------------------------------------------------------------------------------------
# Config file and hw.json


def read_config_document(path: Path) -> dict:
    """Read and validate a DeepSpeed JSON config before measuring, so errors come fast.

    Unreadable files, bad JSON and invalid values raise ``ConfigError`` (all problems of
    the file together). Returns the file's JSON object as written.
    """
    from zenflow.config import load_config

    return copy.deepcopy(dict(load_config(path).raw))


def update_config(
    path: Path, doc: dict, block: dict, *, write: bool, zfctl: dict | None = None
) -> dict:
    """Set ``block``'s keys in the config's zenflow block (and ``zfctl``'s in its zfctl
    block: the host state), validate, and (if asked) write.

    Every other key is kept. Returns {"old": previous values, "new": the chosen keys as they
    will be written, "written": bool}; zfctl keys appear as "zfctl.KEY".
    """
    from zenflow.config import apply_overrides, load_config

    old = dict(((doc.get("zero_optimization") or {}).get("zenflow")) or {})
    old.update({f"zfctl.{k}": v for k, v in (doc.get("zfctl") or {}).items() if k in (zfctl or {})})
    overrides = {f"zero_optimization.zenflow.{k}": v for k, v in block.items()}
    overrides.update({f"zfctl.{k}": v for k, v in (zfctl or {}).items()})
    new_doc = apply_overrides(copy.deepcopy(doc), overrides)
    load_config(copy.deepcopy(new_doc))  # the result must be a valid config
    new = {k: new_doc["zero_optimization"]["zenflow"][k] for k in block}
    new.update({f"zfctl.{k}": new_doc["zfctl"][k] for k in zfctl or {}})
    changed = any(old.get(k, _UNSET) != v for k, v in new.items())
    if write and changed:
        write_json_atomic(path, new_doc, "--config: cannot write")
    return {"old": old, "new": new, "written": write and changed}


_UNSET = object()


# --------------------------------------------------------------------------------------
# Helpers


def _count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"
