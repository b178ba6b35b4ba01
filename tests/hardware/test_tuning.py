"""zenflow.hardware.tuning: the pure decision rules on synthetic figures, and the config update."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from zenflow.hardware import measure, topk, tune_run, tuning


def inputs(**kw) -> tuning.TuneInputs:
    """1M params of 2-D weights, topk 0.1 -> 900k offloaded. A worker rate of 9M params/s
    makes the host step 100 ms on the worker; 18M params/s on all cores makes it 50 ms."""
    base = dict(
        cores=2,
        params_total=1_010_000,
        params_2d=1_000_000,
        fb_all_ms=20.0,
        fb_split_ms=30.0,
        train_threads=1,
        adam_rate_worker=9e6,
        adam_rate_all=18e6,
        mem_available_bytes=10**12,
        topk_ratio=0.1,
    )
    base.update(kw)
    return tuning.TuneInputs(**base)


def overlap_probe(s: int, on_window: float, off_window: float, **kw) -> measure.OverlapProbe:
    base = dict(
        update_interval=s,
        train_threads=1,
        worker_threads=1,
        all_threads=2,
        host_numel=900_000,
        on_window_ms=on_window,
        on_fb_ms=30.0,
        on_host_ms=100.0,
        on_wait_ms=0.0,
        off_window_ms=off_window,
        off_fb_ms=20.0,
        off_host_ms=50.0,
        repeats=3,
    )
    base.update(kw)
    return measure.OverlapProbe(**base)


def test_interval_to_hide():
    assert tuning.interval_to_hide(100, 30) == 4
    assert tuning.interval_to_hide(90, 30) == 3  # exactly hidden: no extra step
    assert tuning.interval_to_hide(10, 30) == 1
    assert tuning.interval_to_hide(0, 30) == 1
    assert tuning.interval_to_hide(10_000, 1) == 64
    assert tuning.interval_to_hide(5, 0) == 64


def test_update_interval_hides_host_step():
    c = tuning.choose(inputs())
    assert c.update_interval == 4  # 100 ms host step, 30 ms forward+backward
    assert c.windows["host_worker_ms"] == pytest.approx(100.0)
    assert c.windows["host_all_ms"] == pytest.approx(50.0)
    assert "S=4" in c.reasons["update_interval"]


def test_update_interval_bounds():
    assert tuning.choose(inputs(adam_rate_worker=1.0)).update_interval == 64
    assert "capped at 64" in tuning.choose(inputs(adam_rate_worker=1.0)).reasons["update_interval"]
    assert tuning.choose(inputs(adam_rate_worker=1e15)).update_interval == 1


@pytest.mark.parametrize(
    "rate, interval, noted", [(9e6, 4, False), (4.5e6, 7, True), (1.0, 64, True)]
)
def test_update_interval_above_the_accuracy_tested_one_says_so(rate, interval, noted):
    # S above 4 hides the host step but the accuracy sweep found staler windows cost accuracy
    c = tuning.choose(inputs(adam_rate_worker=rate))
    assert c.update_interval == interval
    assert ("accuracy sweep" in c.reasons["update_interval"]) is noted


def test_overlap_modelled_without_measurement():
    # on: max(4 x 30, 100) = 120 ms; off: 4 x 20 + 50 = 130 ms -> overlap on.
    c = tuning.choose(inputs())
    assert c.overlap_step is True
    assert c.windows["on_ms"] == pytest.approx(120.0)
    assert c.windows["off_ms"] == pytest.approx(130.0)
    assert c.windows["measured"] is False
    # Faster training on all cores tips it: off = 4 x 10 + 50 = 90 ms < 120 ms.
    c = tuning.choose(inputs(fb_all_ms=10.0))
    assert c.overlap_step is False
    assert c.windows["off_ms"] == pytest.approx(90.0)


def test_overlap_follows_the_measured_windows():
    on = tuning.choose(inputs(overlap=overlap_probe(4, on_window=150.0, off_window=160.0)))
    assert on.overlap_step is True
    assert on.windows["measured"] is True
    assert (on.windows["on_ms"], on.windows["off_ms"]) == (150.0, 160.0)
    assert "150 ms" in on.reasons["overlap_step"] and "160 ms" in on.reasons["overlap_step"]
    off = tuning.choose(inputs(overlap=overlap_probe(4, on_window=170.0, off_window=160.0)))
    assert off.overlap_step is False
    # Equal is not faster: keep the simpler schedule.
    tie = tuning.choose(inputs(overlap=overlap_probe(4, on_window=160.0, off_window=160.0)))
    assert tie.overlap_step is False


def test_interval_from_concurrent_figures_and_rescaled_window():
    # Under contention forward+backward slows to 25 ms and the host step to 130 ms:
    # S = ceil(130 / 25) = 6, not the 4 the window was measured at -> model from its parts.
    ov = overlap_probe(4, 150.0, 160.0, on_fb_ms=25.0, on_host_ms=130.0)
    c = tuning.choose(inputs(overlap=ov))
    assert c.update_interval == 6
    assert c.windows["measured"] is False
    assert c.windows["on_ms"] == pytest.approx(max(6 * 25.0, 130.0))
    assert c.windows["off_ms"] == pytest.approx(6 * 20.0 + 50.0)
    assert c.overlap_step is True  # 150 < 170


def test_core_split_share():
    c = tuning.choose(inputs(cores=8, train_threads=6))
    assert c.pt_reserved_cores_perc == pytest.approx(0.75)
    assert 0 < tuning.choose(inputs()).pt_reserved_cores_perc < 1


def test_single_core_never_overlaps():
    c = tuning.choose(inputs(cores=1, train_threads=1, overlap=None))
    assert c.overlap_step is False
    assert c.pt_reserved_cores_perc == 0.5
    assert c.update_interval == 3  # 50 ms host step on all cores, 20 ms forward+backward


def test_fixed_topk():
    fixed = tuning.choose(inputs(topk_ratio=0.3))
    assert fixed.topk_ratio == 0.3 and "--topk" in fixed.reasons["topk_ratio"]
    # Less offloaded with a larger k: host step 1M x 0.7 / 9M/s = 77.8 ms -> S = 3.
    assert fixed.update_interval == 3


# ---- topk from the measured figures (zenflow.hardware.topk), through choose


def memory_rows(other: int = 500, host: int = 0) -> tuple[topk.TopkMemory, ...]:
    """Selected state 10 bytes per percent of k (k=0.30 -> 300 bytes), the rest fixed."""
    return tuple(topk.TopkMemory(k, round(k * 100) * 10, other, host) for k in topk.TOPK_GRID)


def measured(**kw) -> tuning.TuneInputs:
    """A simulated device (2 cores, 1+1 split), figures for both bounds. Forward+backward on
    the device share: 30 ms. Device AdamW at 10M params/s: (10k + k x 1M) params take
    1 + 100k ms. A 4 TB/s link makes the copies negligible (at most 2 us), so the time
    bound is k <= 0.28. The device holds 500 bytes + 10 per percent of k in 10**6 bytes,
    so memory allows every k."""
    base = dict(
        accelerator="sim",
        topk_ratio=None,
        memory_table=memory_rows(),
        memory_budget=topk.MemoryBudget(10**6, 10**9, False, "test device"),
        device_adam_rate=1e7,
        dtype_bytes=4,
        d2h_bytes_per_s=4e12,
        h2d_bytes_per_s=4e12,
        link="test link",
    )
    base.update(kw)
    return inputs(**base)


def test_host_accumulation_lengthens_the_window_and_a_slow_host_is_said():
    """Summing the 720k offloaded elements per step takes the host 720k / 72M/s = 10 ms of
    each 30 ms step: the 80 ms host Adam hides under S x 20 ms, S = 4 (3 without it). At
    24M/s the sum alone (30 ms) fills the step: the reason says the host cannot keep pace
    and what helps."""
    c = tuning.choose(measured(host_accumulate_rate=7.2e7))
    assert c.topk_ratio == 0.28 and c.update_interval == 4
    assert (
        "S=4 hides it (4x30-10 ms of accumulation = 20 ms per step)" in c.reasons["update_interval"]
    )
    assert c.topk["time"]["host_keeps_pace"] is True
    slow = tuning.choose(measured(host_accumulate_rate=2.4e7))
    assert slow.topk["time"]["host_keeps_pace"] is False
    assert "the host cannot keep pace" in slow.reasons["topk_ratio"]
    assert "More tokens per step" in slow.reasons["topk_ratio"]


def test_topk_time_bound_binds_then_interval_hides_the_rest():
    c = tuning.choose(measured())
    assert c.topk_ratio == 0.28
    assert c.topk["binds"] == "time" and c.topk["memory_bound"] == 1.0
    assert c.topk["time_bound"] == 0.28 and c.topk["time"]["fb_ms"] == 30.0  # the split's
    why = c.reasons["topk_ratio"]
    assert why.startswith("0.28 = min(memory 1, time 0.28): the time bound binds")
    assert "traffic + device update at k=0.28 takes 29.0 ms of the 30.0 ms forward+backward" in why
    assert "device headroom" in why and "holds topk <= 1" in why
    # Then S from the host step of the rest: 720k params at 9M/s = 80 ms over 30 ms -> 3.
    assert c.update_interval == 3
    assert c.windows["host_worker_ms"] == pytest.approx(80.0)
    assert "720.0k offloaded params takes 80 ms" in c.reasons["update_interval"]
    assert c.cpu_only is False


def test_topk_memory_bound_binds():
    # An 800-byte device: 500 + 10 per percent -> k <= 0.30; a fast device update.
    c = tuning.choose(measured(memory_budget=topk.MemoryBudget(800, 10**9, False, "test device"),
                               device_adam_rate=1e12))  # fmt: skip
    assert c.topk_ratio == 0.3 and c.topk["binds"] == "memory"
    assert c.topk["time_bound"] == 1.0
    assert "the memory bound binds" in c.reasons["topk_ratio"]
    # human units (issue 31): the 300 bytes left, not "0.00 GiB"
    assert "device headroom 300 B holds topk <= 0.3" in c.reasons["topk_ratio"]
    # 700k params at 9M/s = 77.8 ms over 30 ms -> S = 3.
    assert c.update_interval == 3


def test_topk_clamped_when_nothing_fits():
    c = tuning.choose(measured(memory_budget=topk.MemoryBudget(100, 10**9, False, "tiny")))
    assert c.topk_ratio == 0.01 and c.topk["memory_bound"] is None
    assert "does not fit the device at any topk" in c.reasons["topk_ratio"]
    # 990k offloaded params at 9M/s = 110 ms over 30 ms -> S = 4.
    assert c.update_interval == 4


def test_topk_time_bound_sees_the_interval_of_each_k():
    """Traffic depends on S, and S on k: with a slow link (4 GB/s: 1 ms per (1-k) share one
    way) and a slow host step, small k pays the H2D share more often."""
    slow = measured(d2h_bytes_per_s=4e9, h2d_bytes_per_s=4e9, adam_rate_worker=1e6)
    c = tuning.choose(slow)
    t = c.topk["time"]
    k = c.topk_ratio
    # The S used for the chosen k is the one the interval rule gives for it.
    host_ms = 1_000_000 * (1 - k) / 1e6 * 1e3
    assert t["update_interval"] == tuning.interval_to_hide(host_ms, 30.0)
    assert t["d2h_ms"] == pytest.approx(1 - k)
    assert t["h2d_ms"] == pytest.approx((1 - k) / t["update_interval"])
    assert t["total_ms"] <= 30.0
    # ... and the next grid step does not fit.
    nxt = round(k + 0.01, 2)
    host_next = 1_000_000 * (1 - nxt) / 1e6 * 1e3
    s_next = tuning.interval_to_hide(host_next, 30.0)
    assert 1 + 100 * nxt + (1 - nxt) * (1 + 1 / s_next) > 30.0


def test_topk_on_cpu_uses_all_cores_and_is_marked_cpu_only():
    # On the CPU the device's work has all cores: forward+backward 20 ms -> k <= 0.18.
    c = tuning.choose(measured(accelerator="cpu"))
    assert c.topk_ratio == 0.18
    assert c.topk["time"]["fb_ms"] == 20.0
    assert c.cpu_only is True
    assert c.reasons["topk_ratio"].startswith("CPU-only (device = host): 0.18")


def test_fixed_topk_is_checked_against_the_bounds():
    small = topk.MemoryBudget(800, 10**9, False, "test device")
    c = tuning.choose(measured(topk_ratio=0.5, memory_budget=small))
    assert c.topk_ratio == 0.5
    why = c.reasons["topk_ratio"]
    assert why.startswith("fixed by --topk 0.5 (measured bounds: memory 0.3, time 0.28)")
    assert "does NOT fit the device memory" in why
    assert c.topk["fixed"] is True
    ok = tuning.choose(measured(topk_ratio=0.2)).reasons["topk_ratio"]
    assert "NOT fit" not in ok


def test_choosing_topk_needs_the_figures():
    with pytest.raises(ValueError, match="memory_table"):
        tuning.choose(inputs(topk_ratio=None))
    with pytest.raises(ValueError, match="device_adam_rate"):
        tuning.choose(measured(device_adam_rate=None))


def test_separate_device_keeps_its_split_when_overlap_is_off():
    """sim/cuda: overlap off runs the host step after the steps on the same split, so
    off = S x fb_split + host on the worker; on = max(S x fb_split, host)."""
    c = tuning.choose(measured(topk_ratio=0.1))
    assert c.overlap_step is True
    assert c.windows["on_ms"] == pytest.approx(max(4 * 30.0, 100.0))
    assert c.windows["off_ms"] == pytest.approx(4 * 30.0 + 100.0)
    assert "a separate device keeps its reserved cores" in c.reasons["overlap_step"]
    assert "kept whether or not overlap_step is on" in c.reasons["pt_reserved_cores_perc"]


def test_sim_split_is_the_engines():
    """run_tune measures a training share t as the sim's split for pt_reserved_cores_perc
    = t / cores: t device threads and cores - t host threads."""
    from zenflow.engine import accelerator

    sim = accelerator.SimAccelerator()
    try:
        for n in range(2, 17):
            for t in {max(1, n // 2), max(1, 3 * n // 4)} - {n}:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(accelerator.base, "cores", lambda n=n: n)
                    assert sim.compute_threads(t / n, True) == (t, n - t)
                    assert sim.compute_threads(t / n, False) == (t, n - t)
    finally:
        sim.close()


def test_link_rates_per_device():
    from zenflow.engine.accelerator import SIM_BANDWIDTH
    from zenflow.hardware import probes

    mem = probes.MemoryProbe(10**10, 10**10, copy_gbs=10.0, add_gbs=12.0, buffer_bytes=1,
                             memlock_bytes=None)  # fmt: skip
    cpu = probes.AcceleratorProbe(kind="cpu", name="CPU")
    d2h, h2d, text = tune_run.link_rates(cpu, mem)
    assert d2h == h2d == 5e9  # a copy reads and writes: half the read+write figure
    assert "memory copy 5.0 GB/s" in text
    sim = probes.probe_accelerator(kind="sim")
    assert sim.kind == "sim" and sim.modelled is True
    assert sim.d2h_pinned_gbs == sim.h2d_pinned_gbs == SIM_BANDWIDTH / 1e9
    assert sim.latency_us == pytest.approx(10.0)
    d2h, h2d, text = tune_run.link_rates(sim, mem)
    assert d2h == h2d == SIM_BANDWIDTH and "modelled by the simulated device" in text
    cuda = probes.AcceleratorProbe(kind="cuda", name="GPU", memory_bytes=80 * 2**30,
                                   h2d_pinned_gbs=24.0, d2h_pinned_gbs=22.0)  # fmt: skip
    d2h, h2d, text = tune_run.link_rates(cuda, mem)
    assert (d2h, h2d) == (22e9, 24e9) and "PCIe measured, pinned" in text
    assert probes.probe_accelerator(kind="cpu").kind == "cpu"


def test_memory_budget_per_device():
    from zenflow.hardware import probes

    mem = probes.MemoryProbe(2 * 10**10, 10**10, 1.0, 1.0, 1, None)
    cuda = probes.AcceleratorProbe(kind="cuda", name="GPU", memory_bytes=80 * 2**30)
    b = tune_run.memory_budget("cuda", None, cuda, mem)
    assert (b.device_bytes, b.host_bytes, b.shared) == (80 * 2**30, 10**10, False)
    assert tune_run.memory_budget("cuda", 24 * 2**30, cuda, mem).device_bytes == 24 * 2**30
    # another process holds part of the GPU: the budget is what is free
    busy = probes.AcceleratorProbe(kind="cuda", name="GPU", memory_bytes=80 * 2**30,
                                   free_bytes=50 * 2**30)  # fmt: skip
    assert tune_run.memory_budget("cuda", None, busy, mem).device_bytes == 50 * 2**30
    sim = tune_run.memory_budget("sim", None, None, mem)
    assert (sim.device_bytes, sim.shared) == (10**10, True)  # its tensors live in RAM
    given = tune_run.memory_budget("sim", 24 * 2**30, None, mem)
    assert (given.device_bytes, given.shared, given.source) == (24 * 2**30, False, "--device-mem")
    cpu = tune_run.memory_budget("cpu", None, None, mem)
    assert cpu.shared and "the device is the CPU" in cpu.source


def test_resolve_device_refuses_before_measuring():
    import torch

    from zenflow.errors import UserInputError

    assert tune_run.resolve_device("sim") == "sim"
    assert tune_run.resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(UserInputError, match="--device-mem applies to --device sim or cuda"):
        tune_run.resolve_device("cpu", 2**30)
    with pytest.raises(UserInputError, match="not one of cpu, sim, cuda"):
        tune_run.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserInputError, match="--device sim"):
            tune_run.resolve_device("cuda")


def host_rows(exact: int, compact: int, pinned: int = 0) -> tuple[topk.TopkMemory, ...]:
    """Every k: 500 device bytes + 10 per percent of k; whole-run host peaks as given."""
    return tuple(topk.TopkMemory(k, round(k * 100) * 10, 500, exact // 2, exact, compact, pinned)
                 for k in topk.TOPK_GRID)  # fmt: skip


def host_inputs(available: int, shared: bool = False, **kw) -> tuning.TuneInputs:
    budget = topk.MemoryBudget(available if shared else 10**6, available, shared, "test")
    return inputs(memory_table=host_rows(1000, 600), memory_budget=budget,
                  mem_available_bytes=available, **kw)  # fmt: skip


def test_host_state_is_exact_when_its_whole_run_peak_fits():
    c = tuning.choose(host_inputs(2000))  # exact peak 1000, compact 600
    assert c.memory["host_state"] == "exact" and c.memory["ok"] is True
    assert c.memory["needed"] == {"exact": 1000, "compact": 600}
    assert c.zfctl_block() == {"host_state": "exact"}
    assert c.reasons["host_state"].startswith("exact:") and "1000 B" in c.reasons["host_state"]
    assert "host memory OK, zfctl.host_state exact" in tuning.memory_verdict(c.memory)


def test_host_state_is_compact_when_only_compact_fits_and_says_why():
    c = tuning.choose(host_inputs(800))
    assert c.memory["host_state"] == "compact" and c.zfctl_block() == {"host_state": "compact"}
    why = c.reasons["host_state"]
    assert why.startswith("compact: exact needs 1000 B") and "short by 200 B" in why
    assert "compact (8-bit moments, bf16 window sum) needs 600 B, 200 B to spare" in why
    assert '"zfctl": {"host_state": "compact"}' in why


def _chooser(rows: tuple[topk.TopkMemory, ...], **peaks):
    """tuning.choose over ``rows`` with ``peaks`` set on every row, at a given available
    host memory (the device never short)."""
    rows = tuple(dataclasses.replace(r, **peaks) for r in rows)
    budget = topk.MemoryBudget(10**6, 1000, False, "test")

    def choose(available: int):
        return tuning.choose(inputs(memory_table=rows, memory_budget=budget,
                                    mem_available_bytes=available))  # fmt: skip

    return choose


def test_a_host_state_that_fits_only_without_the_step_store_says_so():
    """No clipping: the table's peaks are without the store where that is lower (exact 600,
    with the store 900; compact 400, with it 500). The choice says when it relies on the
    store being off, and not when the state fits with the store too."""
    choose = _chooser(host_rows(600, 400), host_peak_store_bytes=900,
                      host_peak_compact_store_bytes=500)  # fmt: skip
    c = choose(700)
    assert c.memory["host_state"] == "exact" and c.memory["step_store_off"] is True
    why = c.reasons["host_state"]
    assert "fits without the step store only (with it exact needs 900 B)" in why
    assert '"zfctl": {"step_store": "off"}' in why
    c = choose(950)
    assert c.memory["host_state"] == "exact" and c.memory["step_store_off"] is False
    assert "step store" not in c.reasons["host_state"]
    c = choose(450)
    assert c.memory["host_state"] == "compact" and c.memory["step_store_off"] is True
    assert "with it compact needs 500 B" in c.reasons["host_state"]


def test_a_clipped_run_that_fits_only_without_the_step_store_is_told_and_written():
    """Clipping on: the table's peaks are with the store (exact 1000, compact 600) and,
    beside them, without it (700, 400). Where neither fits with it and one fits without,
    tune-hw chooses that state with zfctl.step_store "off" (written by --write) and says how
    it changes the clipping; where a state fits with the store, the store stays."""
    choose = _chooser(host_rows(1000, 600), host_peak_window_clip_bytes=700,
                      host_peak_compact_window_clip_bytes=400)  # fmt: skip
    c = choose(500)
    assert c.memory["host_state"] == "compact" and c.memory["ok"] is True
    assert c.memory["window_clipping"] is True
    assert c.zfctl_block() == {"host_state": "compact", "step_store": "off"}
    why = c.reasons["host_state"]
    assert why.startswith("compact without the step store:") and "400 B" in why, why
    assert "smallest coefficient of its steps" in why
    assert '"step_store": "off"' in why
    c = choose(800)  # exact without it fits, but compact with it fits: the store stays
    assert c.memory["host_state"] == "compact" and c.memory["window_clipping"] is False
    assert c.zfctl_block() == {"host_state": "compact"}
    c = choose(300)  # nothing fits either way: the refusal
    assert c.memory["host_state"] is None and c.memory["window_clipping"] is False
    assert c.zfctl_block() == {}


def test_a_clipped_run_takes_the_step_stores_8_bit_copies_before_dropping_the_store():
    """Clipping on, peaks with the store (exact 1000, compact 600), with its 8-bit copies
    (850, 480) and without it (700, 400): where neither fits with the store, the first state
    that fits with the copies (zfctl.step_store "q8": per-step clipping still) is chosen
    before any without the store; "off" only where no state fits with the copies."""
    choose = _chooser(host_rows(1000, 600), host_peak_q8_bytes=850,
                      host_peak_compact_q8_bytes=480, host_peak_window_clip_bytes=700,
                      host_peak_compact_window_clip_bytes=400)  # fmt: skip
    c = choose(500)  # compact with the copies (480) before compact without the store (400)
    assert c.memory["host_state"] == "compact" and c.memory["step_store"] == "q8"
    assert c.memory["window_clipping"] is False
    assert c.zfctl_block() == {"host_state": "compact", "step_store": "q8"}
    why = c.reasons["host_state"]
    assert why.startswith("compact with the step store's 8-bit copies:") and "480 B" in why
    assert "clipped by its own coefficient from an 8-bit copy" in why
    assert '"step_store": "q8"' in why
    c = choose(450)  # compact fits only without the store
    assert c.memory["host_state"] == "compact" and c.memory["step_store"] == "off"
    assert c.memory["window_clipping"] is True
    c = choose(650)  # compact with the store: nothing changes
    assert c.memory["step_store"] is None and c.zfctl_block() == {"host_state": "compact"}


def test_when_neither_host_state_fits_the_refusal_is_said():
    c = tuning.choose(host_inputs(500))
    assert c.memory["host_state"] is None and c.memory["ok"] is False
    assert c.zfctl_block() == {}  # nothing to write
    why = c.reasons["host_state"]
    assert why.startswith("neither fits") and "preflight would refuse" in why
    assert "NOT OK" in tuning.memory_verdict(c.memory)


def test_shared_ram_holds_the_device_side_too():
    """sim without --device-mem, or the CPU: the device's tensors live in the same RAM, so
    the host state must fit beside them (k 0.1: 500 + 100 device bytes)."""
    c = tuning.choose(host_inputs(1500, shared=True))
    assert c.memory["device_side_in_host"] == 600
    assert c.memory["needed"] == {"exact": 1600, "compact": 1200}
    assert c.memory["host_state"] == "compact"


def test_pinned_memory_check_with_cuda():
    cuda = dict(accelerator="cuda", accelerator_memory_bytes=80 * 2**30)
    rows = host_rows(1000, 600, pinned=400)
    budget = topk.MemoryBudget(10**6, 2000, False, "test")
    c = tuning.choose(inputs(memory_table=rows, memory_budget=budget, mem_available_bytes=2000,
                             memlock_bytes=300, **cuda))  # fmt: skip
    assert c.memory["pinned_needed"] == 400 and c.memory["pinned_ok"] is False
    assert "pinned memory NOT OK" in tuning.memory_verdict(c.memory)
    c = tuning.choose(inputs(memory_table=rows, memory_budget=budget, mem_available_bytes=2000,
                             memlock_bytes=None, **cuda))  # fmt: skip
    assert c.memory["pinned_ok"] is True


def test_without_a_layout_the_memory_is_not_checked():
    c = tuning.choose(inputs())
    assert c.memory["checked"] is False and c.zfctl_block() == {}
    assert "not checked" in tuning.memory_verdict(c.memory)


def test_zenflow_block_keys():
    block = tuning.choose(inputs()).zenflow_block()
    assert block == {
        "topk_ratio": 0.1,
        "update_interval": 4,
        "select_strategy": "auto",
        "select_interval": "auto",
        "overlap_step": True,
        "pt_reserved_cores_perc": 0.5,
    }


def test_read_config_document_errors(tmp_path):
    from zenflow.config import ConfigError
    from zenflow.errors import UserInputError

    assert issubclass(ConfigError, UserInputError)  # the CLI shows one red line, exit 2
    with pytest.raises(ConfigError, match="cannot be read"):
        tuning.read_config_document(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,,}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        tuning.read_config_document(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 2}}}')
    with pytest.raises(ConfigError, match="topk_ratio"):
        tuning.read_config_document(wrong)


def test_update_config_keeps_other_keys(tmp_path):
    from zenflow.config import load_config

    template = json.loads((Path(__file__).parents[2] / "templates" / "zenflow.json").read_text())
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(template))
    doc = tuning.read_config_document(path)
    block = tuning.choose(inputs(fb_all_ms=10.0)).zenflow_block()  # overlap off, S=4
    shown = tuning.update_config(path, doc, block, write=False)
    assert json.loads(path.read_text()) == template  # without --write nothing changes
    assert shown["written"] is False
    assert shown["old"]["overlap_step"] is True and shown["new"]["overlap_step"] is False

    written = tuning.update_config(path, doc, block, write=True)
    assert written["written"] is True
    after = json.loads(path.read_text())
    expected = copy.deepcopy(template)
    expected["zero_optimization"]["zenflow"].update(block)
    assert after == expected  # every other key kept, full_warm_up_rounds included
    cfg = load_config(path)
    assert cfg.zenflow.update_interval == 4 and cfg.zenflow.overlap_step is False
    assert cfg.zenflow.pt_reserved_cores_perc == 0.5
    again = tuning.update_config(path, after, block, write=True)
    assert again["written"] is False  # already matches: the file is not rewritten


def test_update_config_writes_the_host_state_into_the_zfctl_block(tmp_path):
    """tune-hw --write: the host state it chose goes to zfctl.host_state, the zfctl block's
    other keys (window_lr) and the zenflow block's stay."""
    from zenflow.config import load_config

    template = json.loads((Path(__file__).parents[2] / "templates" / "zenflow.json").read_text())
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(template))
    doc = tuning.read_config_document(path)
    c = tuning.choose(host_inputs(800))  # only compact fits
    block = c.zenflow_block()
    shown = tuning.update_config(path, doc, block, write=True, zfctl=c.zfctl_block())
    assert shown["old"].get("zfctl.host_state") is None
    assert shown["new"]["zfctl.host_state"] == "compact" and shown["written"] is True
    after = json.loads(path.read_text())
    assert after["zfctl"] == {**template["zfctl"], "host_state": "compact"}
    assert load_config(path).engine.host_state == "compact"
    again = tuning.update_config(path, after, block, write=True, zfctl=c.zfctl_block())
    assert again["written"] is False and again["old"]["zfctl.host_state"] == "compact"


def test_choices_are_json_serialisable():
    c = tuning.choose(inputs())
    json.dumps({"c": dataclasses.asdict(c)})
