"""tune-hw's topk_ratio: the largest k the device's memory and time allow (ZENFLOW.md 2b).

Two bounds, each a pure function of measured or estimated numbers, over the grid
0.01, 0.02, ..., 1.00 (the engine's ``num_selected`` keeps at least one column per weight
at any k):

- **memory**: the device holds the selected columns' fp32 state (master and moments, a step
  count per column) beside everything else it holds (weights, gradients, dense-parameter
  state, copy buckets, activations). The bytes come from ``zfctl estimate``'s layout
  (``zenflow.hardware.layout.layout``, engine ``zenflow``) at each candidate k:
  ``memory_table``. The bound is the largest k whose layout fits the device (on a CPU,
  device and host share the RAM, so both sides must fit it together).
- **time**: every step the device updates the selected columns and the dense params, and
  copies the non-selected gradient to the host; once per window of S steps the host's
  updated columns come back. With Pz ZenFlow params of dt bytes, per step::

      device_update(k) = (Pd + k * Pz) / device AdamW rate
      traffic(k)       = (1 - k) * Pz * dt / d2h bandwidth  +  (1 - k) * Pz * dt / S / h2d bandwidth

  (the two directions are added as if one link carried both: an upper bound, as a GPU's
  two copy engines can overlap them). The bound is the largest k whose device_update +
  traffic fits ``hide_fraction`` of forward+backward, the work it has to hide under. S is
  the interval that hides the host step of the (1 - k) share, so it is a function of k
  (``interval_of``). When no k fits, the cheapest k is taken and said.

  The host must keep pace too: every step it sums the (1 - k) share of the gradient into
  fp32 (the accumulator), and once per window it runs the CPU Adam over that share::

      host(k) = (1 - k) * Pz / accumulate rate  +  (1 - k) * Pz / S / host Adam rate

  which must also fit under forward+backward, or the device waits for the host. Unlike the
  device's part it shrinks as k grows, and no window length removes its first term: when
  the host cannot keep pace at the largest k the device allows, the bound says so and what
  helps (more tokens per step, which forward+backward grows with and the host's work does
  not; device-side micro-batch accumulation; a faster host).

``decide`` takes the smaller bound and says which one binds, with the numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from zenflow.hardware.estimate import human_bytes

TOPK_MIN = 0.01
TOPK_MAX = 1.0
TOPK_GRID = tuple(i / 100 for i in range(1, 101))  # 0.01 steps, the grid topk is rounded to
# The per-step device work and copies must fit under forward+backward: a step then costs
# no more than twice forward+backward even where nothing overlaps.
HIDE_FRACTION = 1.0


# --------------------------------------------------------------------------------------
# Memory


@dataclass(frozen=True)
class TopkMemory:
    """The zenflow engine's bytes at one topk (from the estimate's layout)."""

    topk: float
    selected_bytes: int  # device: the selected columns' fp32 state and their step counts
    other_device_bytes: int  # device: weights, grads, dense state, buckets, activations
    host_bytes: int  # the host's steady state
    host_peak_bytes: int = 0  # the whole run's host peak (zenflow.hardware.host_peak), exact
    host_peak_compact_bytes: int = 0  # the same with zfctl.host_state "compact"
    pinned_bytes: int = 0  # the host bytes the link pins (the master, the ring)
    # the same two peaks with the step store, where the peaks above are without it (no
    # clipping: zfctl finetune takes the store off where it does not fit); else 0
    host_peak_store_bytes: int = 0
    host_peak_compact_store_bytes: int = 0
    # with clipping, the two peaks without the step store (zfctl.step_store "off": each
    # window's host part clipped by its steps' smallest coefficient, a choice tune-hw makes
    # only where neither state fits with the store); else 0
    host_peak_window_clip_bytes: int = 0
    host_peak_compact_window_clip_bytes: int = 0
    # with clipping, the two peaks with the step store's 8-bit copies (zfctl.step_store
    # "q8": each step's host part clipped by its own coefficient from a copy of its pieces,
    # tried before "off"); else 0
    host_peak_q8_bytes: int = 0
    host_peak_compact_q8_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        return self.selected_bytes + self.other_device_bytes


@dataclass(frozen=True)
class MemoryBudget:
    """What the layout must fit. ``shared``: device and host are one memory (the CPU, or
    the simulated device without a given size), so both sides fit ``host_bytes`` together."""

    device_bytes: int
    host_bytes: int
    shared: bool
    source: str  # where device_bytes came from, in words


def _host(row: TopkMemory) -> int:
    return row.host_peak_bytes or row.host_bytes


def fits(row: TopkMemory, budget: MemoryBudget) -> bool:
    if budget.shared:  # the RAM holds the device's side and the host's whole-run peak
        return row.device_bytes + _host(row) <= budget.host_bytes
    return row.device_bytes <= budget.device_bytes


def headroom(row: TopkMemory, budget: MemoryBudget) -> int:
    """Bytes left for the selected columns' state once everything else is placed."""
    if budget.shared:
        return budget.host_bytes - row.other_device_bytes - _host(row)
    return budget.device_bytes - row.other_device_bytes


def is_selected_item(item) -> bool:
    """An estimate ``Item`` that grows with the selected columns: their fp32 state and
    gradient (formula ``S*...``), the update's fp32 scratch (``rows*k``) or their per-column
    step counts (``8*sum(k)``)."""
    f = item.formula
    return item.side == "device" and (f.startswith("S*") or "sum(k)" in f or "rows*k" in f)


def memory_table(census, settings, grid: tuple[float, ...] = TOPK_GRID) -> tuple[TopkMemory, ...]:
    """The zenflow layout of ``census`` at every k of ``grid`` (``settings``: an estimate
    ``Settings``; its topk_ratio is replaced by each k)."""
    from zenflow.hardware.host_peak import host_peak, host_phases
    from zenflow.hardware.layout import layout

    def layout_peak(s) -> int:
        return host_peak(host_phases(census, "zenflow", s, layout(census, "zenflow", s)))[0]

    def peak(s) -> tuple[int, int]:
        """(the peak to fit, the peak with the store where that is not it, else 0).
        Without clipping zfctl finetune runs without the step store where it does not fit
        (zenflow.hardware.estimate.fallbacks): the lower peak is the one to fit (not always
        the store-free one: its ring is fixed, the store shrinks as k grows)."""
        with_store = layout_peak(s)
        if not s.store_optional:
            return with_store, 0
        without = layout_peak(dataclasses.replace(s, step_store="off"))
        return (without, with_store) if without < with_store else (with_store, 0)

    def clipped_peak(s, setting: str) -> int:
        """With clipping, the peak with the step store ``setting`` ("off": none; "q8": its
        8-bit copies), 0 where there is no store to drop."""
        return layout_peak(dataclasses.replace(s, step_store=setting)) if s.store_window_clip else 0

    rows = []
    for k in grid:
        s = dataclasses.replace(settings, topk_ratio=k, host_state="exact")
        items = layout(census, "zenflow", s)
        selected = sum(i.bytes for i in items if is_selected_item(i))
        device = sum(i.bytes for i in items if i.side == "device")
        host = sum(i.bytes for i in items if i.side == "host")
        pinned = sum(i.bytes for i in items if i.side == "host" and i.pinned)
        sc = dataclasses.replace(s, host_state="compact")
        (exact, exact_store), (compact, compact_store) = peak(s), peak(sc)
        rows.append(TopkMemory(k, selected, device - selected, host, exact, compact, pinned,
                               exact_store, compact_store, clipped_peak(s, "off"),
                               clipped_peak(sc, "off"), clipped_peak(s, "q8"),
                               clipped_peak(sc, "q8")))  # fmt: skip
    return tuple(rows)


@dataclass(frozen=True)
class Bound:
    """One bound on topk: its value (None: not even the smallest k qualifies), whether it
    was met (False: nothing qualified and ``value`` is the fallback), figures and reason."""

    value: float | None
    met: bool
    figures: dict
    reason: str


def memory_bound(table: tuple[TopkMemory, ...], budget: MemoryBudget, bf16: bool = True) -> Bound:
    """The largest k of ``table`` whose layout fits ``budget`` (``bf16``: the run's dtype, so
    a refusal advises bf16 only when it is off)."""
    ok = [r for r in table if fits(r, budget)]
    where = "RAM" if budget.shared else "device"
    if not ok:
        first = table[0]
        need = first.device_bytes + (_host(first) if budget.shared else 0)
        levers = ("" if bf16 else "bf16, ") + "a smaller micro-batch or --engine offload"
        have = budget.host_bytes if budget.shared else budget.device_bytes
        figures = {"topk": None, "need_bytes": need, "have_bytes": have, "source": budget.source,
                   "shared": budget.shared}  # fmt: skip
        return Bound(None, False, figures,
                     f"does not fit even at topk {first.topk:g}: the {where} needs "
                     f"{human_bytes(need)} of {human_bytes(have)} ({budget.source}); "
                     f"`zfctl estimate` shows the layout ({levers} may fit)")  # fmt: skip
    row = ok[-1]
    room = headroom(row, budget)
    total = budget.host_bytes if budget.shared else budget.device_bytes
    others = "weights, gradients, dense-param state, copy buckets, activations"
    if budget.shared:
        others += " and the host's state (device and host share it)"
    figures = {
        "topk": row.topk,
        "headroom_bytes": room,
        "memory_bytes": total,
        "other_bytes": total - room,
        "selected_bytes": row.selected_bytes,
        "source": budget.source,
        "shared": budget.shared,
    }
    why = (
        f"{where} headroom {human_bytes(room)} holds topk <= {row.topk:g} (selected columns' "
        f"fp32 state {human_bytes(row.selected_bytes)}): {human_bytes(total)} "
        f"({budget.source}) minus {human_bytes(total - room)} of {others}"
    )
    return Bound(row.topk, True, figures, why)


# --------------------------------------------------------------------------------------
# Time


@dataclass(frozen=True)
class TimeModel:
    """The measured figures of the time bound. Times in ms, rates per second."""

    fb_ms: float  # forward+backward on the device, the work to hide under
    device_adam_rate: float  # device AdamW params/s (the engine's update, measured at k=1)
    dense_params: int  # Pd: updated on the device every step at any k
    zenflow_params: int  # Pz: k of each weight's columns on the device, the rest travel
    dtype_bytes: int  # the training dtype's bytes (what the copies carry)
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    link: str  # the bandwidth's source, in words
    hide_fraction: float = HIDE_FRACTION
    # the host's share: its accumulation (elements/s) and CPU Adam (params/s) on the cores
    # it has; None: not measured, not bounded
    host_accumulate_rate: float | None = None
    host_adam_rate: float | None = None


def step_cost(k: float, interval: int, tm: TimeModel) -> dict[str, float]:
    """Per-step device update and traffic (ms) at topk ``k`` and update interval S."""
    update_ms = (tm.dense_params + k * tm.zenflow_params) / tm.device_adam_rate * 1e3
    moved = (1.0 - k) * tm.zenflow_params * tm.dtype_bytes
    d2h_ms = moved / tm.d2h_bytes_per_s * 1e3
    h2d_ms = moved / interval / tm.h2d_bytes_per_s * 1e3
    host_ms = None
    if tm.host_accumulate_rate and tm.host_adam_rate:
        n = (1.0 - k) * tm.zenflow_params
        host_ms = (n / tm.host_accumulate_rate + n / interval / tm.host_adam_rate) * 1e3
    return {"topk": k, "update_interval": interval, "device_update_ms": update_ms,
            "d2h_ms": d2h_ms, "h2d_ms": h2d_ms, "traffic_bytes": moved * (1 + 1 / interval),
            "total_ms": update_ms + d2h_ms + h2d_ms, "host_ms": host_ms}  # fmt: skip


def time_bound(
    tm: TimeModel, interval_of: Callable[[float], int], grid: tuple[float, ...] = TOPK_GRID
) -> Bound:
    """The largest k of ``grid`` whose device update + traffic fits under forward+backward
    (``hide_fraction`` of it); when none does, the cheapest k, said."""
    budget_ms = tm.hide_fraction * tm.fb_ms
    costs = [step_cost(k, interval_of(k), tm) for k in grid]
    ok = [c for c in costs if c["total_ms"] <= budget_ms]
    met = bool(ok)
    c = ok[-1] if ok else min(costs, key=lambda x: (x["total_ms"], -x["topk"]))
    # the host's share shrinks with k: the largest k the device allows is its best case
    host_slow = c["host_ms"] is not None and c["host_ms"] > budget_ms
    figures = {**c, "fb_ms": tm.fb_ms, "budget_ms": budget_ms, "hide_fraction": tm.hide_fraction,
               "device_adam_rate": tm.device_adam_rate, "d2h_bytes_per_s": tm.d2h_bytes_per_s,
               "h2d_bytes_per_s": tm.h2d_bytes_per_s, "dtype_bytes": tm.dtype_bytes,
               "link": tm.link, "host_accumulate_rate": tm.host_accumulate_rate,
               "host_adam_rate": tm.host_adam_rate, "host_keeps_pace": not host_slow}  # fmt: skip
    share = "" if tm.hide_fraction == 1 else f"{tm.hide_fraction:g} of "
    parts = (
        f"device update {c['device_update_ms']:.1f} ms (AdamW at "
        f"{tm.device_adam_rate / 1e6:.0f}M params/s) + copies {c['d2h_ms'] + c['h2d_ms']:.1f} ms "
        f"({c['traffic_bytes'] / 2**20:.0f} MiB per step at S={c['update_interval']}, "
        f"{tm.link})"
    )
    if c["host_ms"] is not None:
        n = (1.0 - c["topk"]) * tm.zenflow_params
        parts += (
            f"; the host sums {n / 1e6:.1f}M elements per step at "
            f"{tm.host_accumulate_rate / 1e9:.2f} G/s and runs Adam over them once per window "
            f"at {tm.host_adam_rate / 1e6:.0f}M params/s: {c['host_ms']:.1f} ms per step"
        )
    if met and host_slow:
        met = False
        why = (
            f"the host cannot keep pace: at k={c['topk']:g} (the largest the device allows) "
            f"it needs {c['host_ms']:.1f} ms per step against the {share}{tm.fb_ms:.1f} ms "
            f"forward+backward, so the device would wait for it: {parts}. More tokens per "
            "step (a larger micro-batch or sequence, or micro-batches summed on the device: "
            'zfctl.grad_accumulation "device") grow forward+backward and not the host\'s '
            "work; a host with more cores or memory bandwidth does too"
        )
    elif met:
        why = (
            f"traffic + device update at k={c['topk']:g} takes {c['total_ms']:.1f} ms of the "
            f"{share}{tm.fb_ms:.1f} ms forward+backward: {parts}"
        )
    else:
        why = (
            f"nothing hides under the {share}{tm.fb_ms:.1f} ms forward+backward; the cheapest "
            f"k={c['topk']:g} takes {c['total_ms']:.1f} ms: {parts}"
        )
    return Bound(c["topk"], met, figures, why)


# --------------------------------------------------------------------------------------
# The decision


def decide(mem: Bound, tim: Bound) -> tuple[float, str, str]:
    """topk = min(memory bound, time bound) on the grid, clamped to [0.01, 1]; returns
    (topk, which bound binds: "memory" | "time" | "both", the reason)."""
    mem_k = mem.value if mem.value is not None else TOPK_MIN
    tim_k = tim.value if tim.value is not None else TOPK_MAX
    k = min(TOPK_MAX, max(TOPK_MIN, round(min(mem_k, tim_k), 2)))
    binds = "both" if mem_k == tim_k else ("memory" if mem_k < tim_k else "time")
    if mem.value is None:
        head = f"{k:g} (the smallest allowed): the run does not fit the device at any topk"
    else:
        head = f"{k:g} = min(memory {mem_k:g}, time {tim_k:g}): " + (
            "both bounds bind" if binds == "both" else f"the {binds} bound binds"
        )
    return k, binds, f"{head}. Memory: {mem.reason}. Time: {tim.reason}."
