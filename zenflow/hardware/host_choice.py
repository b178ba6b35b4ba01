"""tune-hw's host memory check and its choice of ``zfctl.host_state`` (pure functions of the
estimate's figures).

At the chosen topk_ratio the estimate's layout (``zenflow.hardware.topk.memory_table``: the
whole run's host peak in both host states, the pinned bytes) is checked against the host's
available memory: "exact" (the default) when its whole-run peak fits, "compact" (8-bit
moments, a bf16 window sum) when only that fits, and the refusal the run would meet when
neither does. Where the device's tensors live in the same RAM (the CPU, sim without
--device-mem) the device's side counts too. With CUDA the pinned bytes are checked against
the locked-memory limit.

Must not measure or lay out anything itself (``zenflow.hardware.topk`` / ``host_peak`` do).
"""

from __future__ import annotations

from zenflow.hardware.estimate import human_bytes
from zenflow.hardware.topk import MemoryBudget, TopkMemory


def row_at(table: tuple[TopkMemory, ...], k: float) -> TopkMemory:
    """The table's row at topk ``k`` (the nearest on its grid)."""
    return min(table, key=lambda r: abs(r.topk - k))


def memory_check(
    table: tuple[TopkMemory, ...],
    budget: MemoryBudget | None,
    k: float,
    *,
    available: int,
    memlock: int | None,
    cuda: bool,
) -> dict[str, object]:
    """The host memory the run needs at topk ``k`` in each host state against ``available``
    bytes, the state chosen and why; pinned bytes against ``memlock`` with CUDA."""
    if not table:
        return {"checked": False, "ok": None, "host_state": "exact", "pinned_ok": None,
                "reason": "not checked: no memory layout of the model"}  # fmt: skip
    row = row_at(table, k)
    shared = budget is not None and budget.shared
    side = row.device_bytes if shared else 0  # the device's tensors in the same RAM
    need = {"exact": side + row.host_peak_bytes, "compact": side + row.host_peak_compact_bytes}
    choice = next((st for st in ("exact", "compact") if need[st] <= available), None)
    reason = _reason(need, available, choice, shared)
    fit = _store_choice(row, side, available) if choice is None else None
    if fit is not None:  # neither fits with the step store; one does with its copies
        choice, reason = fit[0], _store_reason(need, fit, available)  # or without it
    store = {"exact": row.host_peak_store_bytes, "compact": row.host_peak_compact_store_bytes}
    store_off = choice is not None and store[choice] and side + store[choice] > available
    if store_off:
        reason += (
            f"; it fits without the step store only (with it {choice} needs "
            f"{human_bytes(side + store[choice])}): the run has no gradient clipping, so "
            'zfctl finetune runs it with "zfctl": {"step_store": "off"}, the same weights'
        )
    out: dict[str, object] = {
        "checked": True,
        "topk": row.topk,
        "host_state": choice,
        "ok": choice is not None,
        "needed": need,
        "step_store_off": bool(store_off),
        # with clipping: the state fits only with zfctl.step_store "q8" (each step's host
        # part clipped from an 8-bit copy of its pieces) or "off" (each window's by its
        # steps' smallest coefficient: window_clipping); tune-hw writes it
        "step_store": None if fit is None else fit[2],
        "window_clipping": fit is not None and fit[2] == "off",
        "device_side_in_host": side,
        "available": available,
        "reason": reason,
        "pinned_needed": None,
        "memlock": memlock,
        "pinned_ok": None,
    }
    if cuda:
        out["pinned_needed"] = row.pinned_bytes
        out["pinned_ok"] = memlock is None or memlock >= row.pinned_bytes
    return out


def _store_choice(row: TopkMemory, side: int, available: int) -> tuple[str, int, str] | None:
    """With clipping, the first (host state, what it needs, ``zfctl.step_store``) whose
    whole-run peak fits with the step store's 8-bit copies ("q8", per-step clipping still),
    else without the store ("off"); None: no such peaks (no clipping, no store to drop) or
    none fits."""
    peaks = {
        "q8": {"exact": row.host_peak_q8_bytes, "compact": row.host_peak_compact_q8_bytes},
        "off": {"exact": row.host_peak_window_clip_bytes,
                "compact": row.host_peak_compact_window_clip_bytes},
    }  # fmt: skip
    for setting, states in peaks.items():
        for state, peak in states.items():
            if peak and side + peak <= available:
                return state, side + peak, setting
    return None


STORE_CHANGE = {
    "q8": ("with the step store's 8-bit copies", "each step's host part is clipped by its "
           "own coefficient from an 8-bit copy of its pieces where the coefficient changed "
           "(docs/BENCHMARKS.md, \"Per-step clipping from an 8-bit copy\")"),
    "off": ("without the step store", "each window's host part is clipped by the smallest "
            "coefficient of its steps instead of each step's by its own (docs/BENCHMARKS.md, "
            '"Clipping without the step store")'),
}  # fmt: skip


def _store_reason(need: dict[str, int], fit: tuple[str, int, str], available: int) -> str:
    state, needs, setting = fit
    how, change = STORE_CHANGE[setting]
    return (
        f"{state} {how}: with the store neither state fits (exact needs "
        f"{human_bytes(need['exact'])}, compact {human_bytes(need['compact'])} of the "
        f"{human_bytes(available)} available); {how} {state} needs "
        f"{human_bytes(needs)}, {human_bytes(available - needs)} to spare. The run clips, "
        f'so that changes the training: {change}. Set "zfctl": {{"host_state": '
        f'"{state}", "step_store": "{setting}"}} in the config (--write does)'
    )


def _reason(need: dict[str, int], available: int, choice: str | None, shared: bool) -> str:
    ex, co, have = (human_bytes(need["exact"]), human_bytes(need["compact"]),
                    human_bytes(available))  # fmt: skip
    what = "the device's side and the whole run's host peak" if shared else "whole-run host peak"
    if choice == "exact":
        return (
            f"exact: its {what}, {ex}, fits the {have} available "
            f"({human_bytes(available - need['exact'])} to spare; compact would need {co})"
        )
    if choice == "compact":
        return (
            f"compact: exact needs {ex} ({what}) of the {have} available, short by "
            f"{human_bytes(need['exact'] - available)}; compact (8-bit moments, bf16 window "
            f"sum) needs {co}, {human_bytes(available - need['compact'])} to spare. Set "
            '"zfctl": {"host_state": "compact"} in the config (--write does)'
        )
    return (
        f"neither fits: exact needs {ex}, compact {co} ({what}) of the {have} available; "
        "zfctl finetune's preflight would refuse the run: free memory, use a host with "
        f"more (at least {co}), a larger topk_ratio where the device has room, or "
        "--engine offload where its host state fits"
    )


def memory_verdict(memory: dict) -> str:
    """One plain line: the host state chosen (or OK / NOT OK) and, with CUDA, pinned memory."""
    if not memory.get("checked", True) or "needed" not in memory:
        return f"host memory: {memory.get('reason', 'not checked')}"
    line = (f"host memory {'OK' if memory['ok'] else 'NOT OK'}, zfctl.host_state "
            f"{memory['host_state'] or '(none fits)'}: {memory['reason']}")  # fmt: skip
    if memory["pinned_ok"] is not None:
        lim = memory["memlock"]
        lim_s = "unlimited" if lim is None else human_bytes(lim)
        ok = "OK" if memory["pinned_ok"] else "NOT OK"
        need = human_bytes(memory["pinned_needed"])
        line += f"; pinned memory {ok}: needs {need}, locked-memory limit {lim_s}"
    else:
        line += "; pinned memory: not applicable without CUDA"
    return line
