"""zenflow.hardware.topk: topk_ratio's memory and time bounds on synthetic figures, and the
memory table against the estimate's own layout."""

from __future__ import annotations

import dataclasses

import pytest

from zenflow.hardware import topk
from zenflow.hardware.topk import Bound, MemoryBudget, TimeModel, TopkMemory


def table(other: int = 500, host: int = 0, per_percent: int = 10) -> tuple[TopkMemory, ...]:
    """Selected state 10 bytes per percent of k (k=0.30 -> 300 bytes), the rest fixed."""
    return tuple(TopkMemory(k, round(k * 100) * per_percent, other, host) for k in topk.TOPK_GRID)


def time_model(**kw) -> TimeModel:
    base = dict(
        fb_ms=30.0,
        device_adam_rate=1e7,
        dense_params=10_000,
        zenflow_params=1_000_000,
        dtype_bytes=4,
        d2h_bytes_per_s=4e9,
        h2d_bytes_per_s=4e9,
        link="test link",
    )
    base.update(kw)
    return TimeModel(**base)


def test_grid_is_hundredths():
    assert topk.TOPK_GRID[0] == 0.01 and topk.TOPK_GRID[-1] == 1.0
    assert len(topk.TOPK_GRID) == 100
    assert topk.TOPK_GRID[29] == 0.3  # exact grid values, not accumulated floats


def test_memory_bound_separate_device():
    # 500 bytes of everything else + 10 per percent of k on an 800-byte device: k <= 0.30.
    b = topk.memory_bound(table(), MemoryBudget(800, 10**9, False, "test device"))
    assert b.value == 0.3 and b.met
    assert b.figures["headroom_bytes"] == 300 and b.figures["selected_bytes"] == 300
    assert b.figures["other_bytes"] == 500
    assert "device headroom" in b.reason and "holds topk <= 0.3" in b.reason
    # The host side does not count against a separate device.
    big_host = topk.memory_bound(table(host=10**6), MemoryBudget(800, 10**9, False, "d"))
    assert big_host.value == 0.3


def test_memory_bound_shared_memory_counts_both_sides():
    # One memory of 1000 bytes: 500 other + 200 host + 10 per percent -> k <= 0.30.
    b = topk.memory_bound(table(host=200), MemoryBudget(1000, 1000, True, "RAM"))
    assert b.value == 0.3
    assert b.figures["headroom_bytes"] == 300 and b.figures["shared"] is True
    assert "RAM headroom" in b.reason and "host's state" in b.reason


def test_memory_bound_everything_fits_and_nothing_fits():
    assert topk.memory_bound(table(), MemoryBudget(10**6, 10**9, False, "d")).value == 1.0
    none = topk.memory_bound(table(), MemoryBudget(505, 10**9, False, "d"))
    assert none.value is None and not none.met
    assert none.figures["need_bytes"] == 510  # 500 + 10 at k = 0.01
    assert "does not fit even at topk 0.01" in none.reason and "zfctl estimate" in none.reason
    # issue 31: bf16 is advised only when the run is not in bf16 already
    assert "bf16" not in none.reason
    off = topk.memory_bound(table(), MemoryBudget(505, 10**9, False, "d"), bf16=False)
    assert "(bf16, a smaller micro-batch" in off.reason


def test_step_cost_formula():
    """Per step: device update of Pd + k*Pz, D2H of the (1-k) share every step, H2D of it
    once per window of S steps: (1-k)*(1+1/S)*Pz*dt bytes."""
    tm = time_model(device_adam_rate=1e8, dense_params=0, dtype_bytes=2, d2h_bytes_per_s=1e9,
                    h2d_bytes_per_s=5e8)  # fmt: skip
    c = topk.step_cost(0.25, 4, tm)
    assert c["device_update_ms"] == pytest.approx(2.5)  # 250k params at 100M/s
    assert c["d2h_ms"] == pytest.approx(1.5)  # 0.75 * 1M * 2 bytes at 1 GB/s
    assert c["h2d_ms"] == pytest.approx(0.75)  # a quarter of that at 0.5 GB/s
    assert c["traffic_bytes"] == pytest.approx(0.75 * 1.25 * 2e6)
    assert c["total_ms"] == pytest.approx(4.75)
    assert topk.step_cost(1.0, 1, tm)["traffic_bytes"] == 0


def test_time_bound_device_update_binds():
    # Update: (10k + k * 1M) / 10M/s = 1 + 100k ms; copies at most 2 x 1 us: k <= 0.28.
    b = topk.time_bound(time_model(d2h_bytes_per_s=4e12, h2d_bytes_per_s=4e12), lambda k: 1)
    assert b.value == 0.28 and b.met
    assert b.figures["total_ms"] == pytest.approx(29.0, abs=0.01)
    assert b.figures["fb_ms"] == 30.0
    assert "traffic + device update at k=0.28 takes 29.0 ms of the 30.0 ms" in b.reason


def test_time_bound_uses_the_interval_for_each_k():
    seen = []

    def interval_of(k: float) -> int:
        seen.append(k)
        return 4

    b = topk.time_bound(time_model(), interval_of)
    assert seen == list(topk.TOPK_GRID)
    assert b.figures["update_interval"] == 4


def test_time_bound_hide_fraction():
    # Half of 60 ms is the same budget as all of 30 ms.
    fast_link = dict(d2h_bytes_per_s=4e12, h2d_bytes_per_s=4e12)
    half = topk.time_bound(time_model(fb_ms=60.0, hide_fraction=0.5, **fast_link), lambda k: 1)
    assert half.value == 0.28 and "0.5 of 60.0 ms" in half.reason


def test_time_bound_traffic_dominated_prefers_more_columns():
    # A slow link (0.4 GB/s: 10 ms per MB-share) and a fast device update (~1 ms at k=1):
    # each column kept on the device saves traffic, so every k fits and the bound is 1.
    slow = dict(device_adam_rate=1e9, d2h_bytes_per_s=4e8, h2d_bytes_per_s=4e8)
    assert topk.time_bound(time_model(**slow), lambda k: 1).value == 1.0
    # Nothing hides under 0.5 ms: the cheapest k (all on the device, 1.01 ms) is taken, said.
    b = topk.time_bound(time_model(fb_ms=0.5, **slow), lambda k: 1)
    assert b.value == 1.0 and not b.met
    assert b.figures["total_ms"] == pytest.approx(1.01)
    assert "nothing hides under the 0.5 ms forward+backward" in b.reason


def test_host_share_is_costed_per_step():
    """The host sums (1-k)*Pz elements every step and runs Adam over them once per window:
    0.75M / 0.5 G/s = 1.5 ms, plus 0.75M / 4 / 100M/s = 1.875 ms."""
    tm = time_model(host_accumulate_rate=5e8, host_adam_rate=1e8)
    assert topk.step_cost(0.25, 4, tm)["host_ms"] == pytest.approx(3.375)
    assert topk.step_cost(0.25, 4, time_model())["host_ms"] is None  # not measured


def test_a_host_that_cannot_keep_pace_is_said_with_the_fix():
    """The device allows k = 0.28 (test_time_bound_device_update_binds), but summing 0.72M
    elements per step at 20M/s takes 36 ms, over the 30 ms forward+backward: no window
    length helps (the sum is per step), so the bound is not met and says what does."""
    fast = dict(d2h_bytes_per_s=4e12, h2d_bytes_per_s=4e12)
    slow = topk.time_bound(time_model(host_accumulate_rate=2e7, host_adam_rate=1e9, **fast),
                           lambda k: 64)  # fmt: skip
    assert slow.value == 0.28 and not slow.met
    assert slow.figures["host_keeps_pace"] is False
    assert slow.figures["host_ms"] == pytest.approx(0.72e6 / 2e7 * 1e3 + 0.72e6 / 64 / 1e9 * 1e3)
    assert "the host cannot keep pace" in slow.reason and "More tokens per step" in slow.reason
    keeps = topk.time_bound(time_model(host_accumulate_rate=2e9, host_adam_rate=1e9, **fast),
                            lambda k: 4)  # fmt: skip
    assert keeps.met and keeps.figures["host_keeps_pace"] is True
    assert "the host sums 0.7M elements per step at 2.00 G/s" in keeps.reason


def test_decide_takes_the_smaller_bound_and_names_it():
    mem, tim = Bound(0.3, True, {}, "M"), Bound(0.28, True, {}, "T")
    k, binds, why = topk.decide(mem, tim)
    assert (k, binds) == (0.28, "time")
    assert why.startswith("0.28 = min(memory 0.3, time 0.28): the time bound binds")
    assert "Memory: M" in why and "Time: T" in why
    assert topk.decide(Bound(0.1, True, {}, "M"), tim)[:2] == (0.1, "memory")
    assert topk.decide(Bound(0.28, True, {}, "M"), tim)[1] == "both"


def test_decide_clamps():
    tim = Bound(1.0, True, {}, "T")
    # Nothing fits the device: the smallest allowed topk, said.
    k, binds, why = topk.decide(Bound(None, False, {}, "M"), tim)
    assert (k, binds) == (0.01, "memory")
    assert "does not fit the device at any topk" in why
    assert topk.decide(Bound(0.004, True, {}, "M"), tim)[0] == 0.01
    assert topk.decide(Bound(2.0, True, {}, "M"), Bound(1.5, True, {}, "T"))[0] == 1.0
    assert topk.decide(Bound(0.123, True, {}, "M"), tim)[0] == 0.12  # on the 0.01 grid


@pytest.fixture(scope="module")
def census():
    from zenflow.hardware.estimate import census_of
    from zenflow.hardware.measure import load_probe_model
    from zenflow.hardware.tune_run import arch_shape

    pm = load_probe_model("builtin:gpt2-2x128", 2, 8, device="cpu")
    return census_of(pm.model, name=pm.name, source=pm.source, arch=arch_shape(pm.model))


@pytest.mark.parametrize("bf16, fp32_state", [(True, 12), (False, 8)])
def test_memory_table_matches_the_estimate(census, bf16, fp32_state):
    from zenflow.hardware.estimate import Budget, Settings, check

    s = Settings(bf16=bf16, overlap_step=True, micro_batch=2, seq_len=8)
    rows = topk.memory_table(census, s)
    assert [r.topk for r in rows] == list(topk.TOPK_GRID)
    budget = Budget(10**12, 10**12, False, "test", "test")
    for r in rows[::11] + rows[-1:]:
        sel, cols = census.selected(r.topk)
        # The selected columns' fp32 state (master + moments, or moments), their gradient in
        # the training dtype and a step count each; the update's fp32 scratch (bf16: the
        # widened gradients; both: the per-column denominators).
        dt = 2 if bf16 else 4
        scratch = max(census.largest_selected(r.topk), sel // 64) * 4
        assert r.selected_bytes == sel * (fp32_state + dt) + cols * 8 + scratch
        est = check(census, "zenflow", dataclasses.replace(s, topk_ratio=r.topk), budget)
        assert r.device_bytes == est.device_bytes
        assert r.host_bytes == est.host_bytes
        assert r.host_peak_bytes == est.host_peak_bytes  # the whole run's, for shared RAM
    assert len({r.other_device_bytes for r in rows}) == 1  # the rest does not depend on k
    assert rows[-1].selected_bytes > rows[0].selected_bytes


def test_memory_table_of_a_run_without_clipping_peaks_without_the_step_store(census):
    """Without clipping zfctl finetune drops the step store where it does not fit, so the
    table's whole-run peaks (what tune-hw chooses the host state by) are the lower of with
    and without it, in both host states (without: a fixed ring, so at a large k the store
    is the smaller); with clipping the store's; the steady state keeps the store."""
    from zenflow.hardware.estimate import Settings

    s = Settings(bf16=True, overlap_step=True, micro_batch=2, seq_len=8)
    clipped = topk.memory_table(census, s)
    free = topk.memory_table(census, dataclasses.replace(s, clipping=False))
    off = topk.memory_table(census, dataclasses.replace(s, clipping=False, step_store="off"))
    for c, f, o in zip(clipped, free, off, strict=True):
        assert f.host_peak_bytes == min(c.host_peak_bytes, o.host_peak_bytes)
        assert f.host_peak_compact_bytes == min(c.host_peak_compact_bytes,
                                                o.host_peak_compact_bytes)  # fmt: skip
        assert f.host_bytes == c.host_bytes
        # the peak with the store is kept where the one to fit is without it
        store_off = o.host_peak_bytes < c.host_peak_bytes
        assert f.host_peak_store_bytes == (c.host_peak_bytes if store_off else 0)
        store_off = o.host_peak_compact_bytes < c.host_peak_compact_bytes
        assert f.host_peak_compact_store_bytes == (c.host_peak_compact_bytes if store_off else 0)
        assert c.host_peak_store_bytes == c.host_peak_compact_store_bytes == 0  # clipping
        # with clipping the peaks without the store are beside them (tune-hw may choose
        # them, window clipping); without clipping there are none (the check takes them)
        assert c.host_peak_window_clip_bytes == o.host_peak_bytes
        assert c.host_peak_compact_window_clip_bytes == o.host_peak_compact_bytes
        assert f.host_peak_window_clip_bytes == f.host_peak_compact_window_clip_bytes == 0
    assert free[0].host_peak_bytes < clipped[0].host_peak_bytes  # k 0.01: the store is 99%
    assert free[0].host_peak_compact_bytes < clipped[0].host_peak_compact_bytes
    # at a large k the ring without the store outweighs the store (6% of the columns): the
    # check keeps the store, and a run that fits in neither is reported with it (short by
    # least)
    from zenflow.hardware.estimate import Budget, check

    big_k = dataclasses.replace(s, clipping=False, topk_ratio=0.94)
    room = Budget(2**40, 2**40, False, "d", "h")
    kept = check(census, "zenflow", big_k, room).host_peak_bytes
    ring = check(census, "zenflow", dataclasses.replace(big_k, step_store="off"), room)
    assert ring.host_peak_bytes > kept
    got = check(census, "zenflow", big_k, Budget(2**40, kept - 1, False, "d", "h"))
    assert got.short == {"host": 1} and got.step_store == "auto"  # the store kept
