"""The simulator fails where a GPU would (issue 15): each guard of the strict + lag sim is
shown failing a run into which a test double puts back the defect it exists for, and the
same run without the defect passing clean.

| guard | defect put back | the run fails by |
|---|---|---|
| source guard (strict) | a copy's source rewritten before it ran | ``SourceChanged`` |
| the same, in the engine | the host step's wait for the image copies removed | a violation |
| lag | the accumulator skipping its copy's event | NaN norms: steps skipped |
| sync counter | a full sync per micro-batch; an extra read | ``full_syncs``, waits, ``d2h_reads`` |

The defects this file found when it was written (the sim's blocking device-side wait, a
second read at the first selection with the auto interval, uncounted waits at a
re-selection, a false alarm on chained copies) are fixed; their tests stay as regressions.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import MLP, make_config, mlp_batches, strict_lagged_init, train_engine

from zenflow import ZenFlowEngine
from zenflow.engine.accelerator import DONE, SimAccelerator, SourceChanged
from zenflow.engine.host import Accumulator
from zenflow.engine.zenflow.window import Window

# random.Random(seed * 2 + (engine == "h2d")).uniform(0, lag) is each copy engine's first
# delay: seed 1 draws 0.956 * lag (d2h) and 0.238 * lag (h2d), both far longer than the few
# microseconds a test needs to rewrite a source or read a destination.
FIRST_DRAW_LONG = 1
ZF_AUTO = {"topk_ratio": 0.25, "update_interval": "auto", "overlap_step": True,
           "auto_ratio": 0.5, "select_strategy": "step", "select_interval": 3}  # fmt: skip
CLIP = 0.5  # below every step's gradient norm on these batches: clipping is active


def _mlp_engine(
    accel, zf: dict, clip: float = 0.0, **extra
) -> tuple[torch.nn.Module, ZenFlowEngine]:
    torch.manual_seed(0)
    model = MLP()
    cfg = make_config(zf, clip=clip, **extra)
    engine = ZenFlowEngine(model, cfg, accelerator=accel, sim_strict=True, min_numel=1000,
                           host_kernel="reference")  # fmt: skip
    return model, engine


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


# ------------------------------------------------------------------ 1. the source guard


@pytest.mark.parametrize("rewrite", ["one value", "two values swapped", "none"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_source_guard_fails_a_copy_whose_source_changed_before_it_ran(direction, rewrite):
    """A copy held by the lag (a GPU running behind the host) whose source the host rewrites
    before it ran: the event raises SourceChanged. A device->host destination was never
    written (poison); a host->device one holds the values at enqueue, which device work
    queued after the copy sees (lag mode models the device's in-order stream)."""
    sim = SimAccelerator(strict=True, lag_s=0.2, lag_seed=FIRST_DRAW_LONG)
    try:
        src = torch.arange(1000, dtype=torch.float32)
        sent = src.clone()
        dst = torch.empty_like(src)
        copy = sim.copy_h2d if direction == "h2d" else sim.copy_d2h
        ev = copy(dst, src)
        assert not ev.query()  # held by the lag (>= 48 ms here)
        if direction == "h2d":  # the device sees the copy at once; compute_wait returns
            sim.compute_wait(ev)
            assert torch.equal(dst, sent) and not ev.query()
        if rewrite == "one value":  # the defect: the source rewritten under a queued copy
            src[7] += 1.0
        elif rewrite == "two values swapped":  # same sum: the checksum weighs positions
            src[[3, 5]] = src[[5, 3]]
        if rewrite == "none":
            ev.synchronize()
            assert torch.equal(dst, sent) and sim.guard_violations == []
            return
        with pytest.raises(RuntimeError, match="source guard") as info:
            ev.synchronize()
        assert isinstance(info.value.__cause__, SourceChanged)
        assert len(sim.guard_violations) == 1 and f"{direction} copy" in sim.guard_violations[0]
        if direction == "d2h":
            assert torch.isnan(dst).all()  # nothing was delivered: still poison
        else:
            assert torch.equal(dst, sent)  # what the device saw: the values at enqueue
    finally:
        sim.close()


@pytest.mark.parametrize("rewrite", [False, True])
def test_a_copy_after_an_event_guards_its_source_from_that_event_on(rewrite):
    """With ``after``, the source may be written until that event completes (a chained
    copy landing the source first is not a false alarm); a rewrite after it, while the copy
    is still held by the lag, is caught."""
    sim = SimAccelerator(strict=True, bandwidth=1e6, latency=0.0, lag_s=0.2,
                         lag_seed=FIRST_DRAW_LONG)  # fmt: skip
    try:
        first = torch.zeros(25_000)
        ev1 = sim.copy_d2h(first, torch.ones(25_000))  # lands the next copy's source
        second = torch.zeros(2)
        ev2 = sim.copy_d2h(second, first[:2], after=ev1)
        if rewrite:
            ev1.synchronize()  # the source is written; the second copy still waits its lag
            first[0] = 5.0
            with pytest.raises(RuntimeError, match="source guard"):
                ev2.synchronize()
        else:
            ev2.synchronize()
            assert torch.equal(second, torch.ones(2)) and sim.guard_violations == []
    finally:
        sim.close()


def test_the_after_guard_is_taken_when_the_event_completes_not_when_the_copy_runs():
    """A copy with ``after`` guards the source from the instant ``after`` completes. The
    copy engine may reach the copy much later (here the d2h engine is busy with a lagged
    copy for 0.96 s while the h2d copy it waits for completes at 0.24 s): a rewrite in
    between is a missing wait and is caught. (A checksum taken when the engine reaches the
    copy would see the rewritten source and pass it: the race a loaded machine exposed.)"""
    sim = SimAccelerator(strict=True, bandwidth=1e7, latency=0.0, lag_s=1.0,
                         lag_seed=FIRST_DRAW_LONG)  # fmt: skip
    try:
        sim.copy_d2h(torch.zeros(4), torch.ones(4))  # holds the d2h engine ~0.96 s
        src = torch.zeros(3)
        landed = sim.copy_h2d(src, torch.ones(3))  # lands the source after ~0.24 s
        dst = torch.zeros(3)
        ev = sim.copy_d2h(dst, src, after=landed)
        landed.synchronize()
        src[0] = 5.0  # after the source's last legal write, before the copy has run
        with pytest.raises(RuntimeError, match="source guard"):
            ev.synchronize()
        assert len(sim.guard_violations) == 1
    finally:
        sim.close()


# ------------------------------------------------------------------ 2. the image race


class _Deadline:
    """An event completing at a fixed time (a copy queued after it starts no earlier)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        left = self.at - time.perf_counter()
        if left > 0:
            time.sleep(left)


class _Behind:
    """The event of an image copy on ``ImagesBehind``: completes after the guarded read."""

    __slots__ = ("event",)

    def __init__(self, event) -> None:
        self.event = event

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


class ImagesBehind(SimAccelerator):
    """A strict sim whose device runs ``behind_s`` behind the host for the host->device
    copies of the weights' images, as a GPU does: ``compute_wait`` on such a copy queues
    the wait on the device and returns (the shipped sim blocks the host there, so an image's
    copies have always run by the time the next host step is submitted, and the race
    cannot happen on it). The device work after the wait still sees the copied values (the
    double delivers them at once, as the in-order device stream would), while the copy
    engine reads the image, with the source guard, ``behind_s`` later: an image rewritten
    before that is caught."""

    def __init__(self, behind_s: float, **kw) -> None:
        super().__init__(strict=True, **kw)
        self.behind_s = behind_s
        # the storages a host step's result goes back from (the weights' compact masters),
        # looked up at each copy: the host state is made at the first selection
        self.images = lambda: set()

    def copy_h2d(self, dst, src, after=None):
        if after is not None or src.untyped_storage().data_ptr() not in self.images():
            return super().copy_h2d(dst, src, after)
        dst.copy_(src)
        late = _Deadline(time.perf_counter() + self.behind_s)
        return _Behind(super().copy_h2d(torch.empty_like(src), src, after=late))

    def compute_wait(self, event) -> None:
        if not isinstance(event, _Behind):
            super().compute_wait(event)


def _without_image_copy_wait(monkeypatch) -> None:
    """The defect of issue item 6: the next host step does not wait for the copies that
    still read the last applied job's images (they look finished to ``_window_tasks``)."""
    window_tasks = Window._window_tasks

    def hidden_copies(self, *args):
        job = self.last_applied
        if job is None:
            return window_tasks(self, *args)
        copies, job.copies = job.copies, []
        try:
            return window_tasks(self, *args)
        finally:
            job.copies = copies

    monkeypatch.setattr(Window, "_window_tasks", hidden_copies)


# Host steps back to back (one-step windows, overlap): each host step starts right after the
# last one's images were queued for the device, whose copies run 0.1 s later.
ZF_RACE = {"topk_ratio": 0.25, "update_interval": 1, "overlap_step": True}


def _race_run(accel, bf16: bool | str, steps: int = 5):
    """``bf16`` "image": a bf16 model whose host results go back as the host step's bf16
    images (zfctl.return_image "always"), which the copies then read instead."""
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    if bf16 == "image":
        extra["zfctl"] = {"return_image": "always"}
    model, engine = _mlp_engine(accel, ZF_RACE, **extra)
    if isinstance(accel, ImagesBehind):
        returns = engine.impl.image_return

        def images():
            out = {w.host.master.untyped_storage().data_ptr()
                   for w in engine.zweights if w.host is not None}  # fmt: skip
            return out | {im.untyped_storage().data_ptr() for im in returns.images.values()}

        accel.images = images
    with engine:
        train_engine(engine, model, mlp_batches(steps))
    if bf16 == "image":
        assert any(j.meta.get("images") for j in engine.impl.window.host_log)
    return model


@pytest.mark.parametrize("bf16", [False, True, "image"], ids=["fp32", "bf16", "bf16-image"])
def test_image_race_is_caught_without_the_wait_and_gone_with_it(bf16, monkeypatch):
    unlagged = _race_run(SimAccelerator(strict=True), bf16)
    behind = ImagesBehind(0.1, lag_s=0.002, lag_seed=FIRST_DRAW_LONG)
    _assert_same_weights(_race_run(behind, bf16), unlagged)  # the fix: clean and exact
    assert behind.guard_violations == []
    _without_image_copy_wait(monkeypatch)
    racing = ImagesBehind(0.1, lag_s=0.002, lag_seed=FIRST_DRAW_LONG)
    _race_run(racing, bf16)
    assert racing.guard_violations, "an image rewritten under its copies went unnoticed"
    assert all("h2d copy" in v for v in racing.guard_violations)


def test_shipped_strict_lag_sim_catches_the_image_race(monkeypatch):
    """The shipped sim in lag mode: ``compute_wait`` on a host->device copy returns at once
    (as a device-side wait does), so without the next host step's wait for the image
    copies the worker rewrites an image the copy engine has yet to read: caught."""
    _without_image_copy_wait(monkeypatch)
    racing = SimAccelerator(strict=True, lag_s=0.01, lag_seed=FIRST_DRAW_LONG)
    _race_run(racing, bf16=False, steps=4)
    assert racing.guard_violations


# ------------------------------------------------------------------ 3. lag and missing waits


def test_lag_shows_a_host_read_that_skips_its_copy_event():
    sim = SimAccelerator(strict=True, lag_s=0.2, lag_seed=FIRST_DRAW_LONG)  # d2h: 191 ms late
    try:
        src = torch.arange(1000, dtype=torch.float32)
        dst = torch.empty_like(src)
        ev = sim.copy_d2h(dst, src)
        assert torch.isnan(dst.sum())  # the defect: read at once, the GPU is still behind
        ev.synchronize()
        assert torch.equal(dst, src)  # waited for: the data
    finally:
        sim.close()


def _skip_accumulator_copy_wait(monkeypatch) -> None:
    """The defect: the accumulator adds a gradient piece without waiting for its copy."""
    add = Accumulator.add

    def add_at_once(self, event, *args, **kw):
        return add(self, DONE, *args, **kw)

    monkeypatch.setattr(Accumulator, "add", add_at_once)


def _acc_run(accel, monkeypatch=None, steps: int = 4):
    """Two micro-batches a step, summed on the host: each step's first micro-batch's pieces
    overwrite the step sum as they arrive (no gate to wait for), the accumulator reading
    each one right after its copy was queued. ``monkeypatch``: the defect, put in after the
    first step (the first selection's whole gradient)."""
    zf = {"topk_ratio": 0.25, "update_interval": 2, "overlap_step": True}
    model, engine = _mlp_engine(accel, zf, clip=1.0, gradient_accumulation_steps=2)
    batches = iter(mlp_batches(2 * steps))
    stats = []
    with engine:
        for step in range(steps):
            if step == 1 and monkeypatch is not None:
                _skip_accumulator_copy_wait(monkeypatch)
            losses = []
            for _ in range(2):
                loss = model(*next(batches))
                engine.backward(loss / 2)
                losses.append(loss.detach())
            stats.append(engine.step(torch.stack(losses).mean()))
            engine.zero_grad()
    return model, stats


def test_lag_shows_an_accumulator_that_skips_its_copy_wait(monkeypatch):
    # Each copy up to 5 ms late: the accumulator, idle, reads a piece's staging microseconds
    # after its copy was queued and finds poison; the step's norm (its host share summed
    # there) is NaN and the step is skipped. Without lag the same defect mostly goes unseen.
    unlagged, _ = _acc_run(SimAccelerator(strict=True))
    lagged, stats = _acc_run(SimAccelerator(strict=True, lag_s=0.005, lag_seed=3))
    _assert_same_weights(lagged, unlagged)
    assert not any(s.skipped for s in stats)
    _, broken = _acc_run(SimAccelerator(strict=True, lag_s=0.005, lag_seed=3), monkeypatch)
    assert not broken[0].skipped  # before the defect
    assert all(s.skipped and math.isnan(s.grad_norm) for s in broken[1:])


# ------------------------------------------------------------------ 4. the sync counter


class CopyLog(SimAccelerator):
    """A strict sim that keeps every device->host copy's event (to check what a sync drained)."""

    def __init__(self, **kw) -> None:
        super().__init__(strict=True, **kw)
        self.d2h_events: list = []

    def copy_d2h(self, dst, src, after=None):
        ev = super().copy_d2h(dst, src, after)
        self.d2h_events.append(ev)
        return ev


def _trainer_loop(engine, model, steps: int, gas: int = 1, sync_in_timing: bool = False,
                  extra_read_at: int | None = None):  # fmt: skip
    """The trainer's loop in small: phase marks around forward and backward per micro-batch,
    one engine step. ``sync_in_timing``: the defect of issue item 1, a full synchronize in
    the phase timing of every micro-batch; ``extra_read_at``: a second scalar read (a stray
    ``.item()`` through the accelerator) at that step. Returns (stats, seconds blocked in
    each planted synchronize)."""
    accel = engine.accel
    batches = iter(mlp_batches(steps * gas))
    out, blocked = [], []
    for step in range(steps):
        losses = []
        for _ in range(gas):
            x, y = next(batches)
            m0 = accel.mark()
            loss = model(x, y)
            m1 = accel.mark()
            engine.backward(loss / gas)
            if sync_in_timing:
                issued = len(accel.d2h_events)
                t0 = time.perf_counter()
                accel.synchronize()
                blocked.append(time.perf_counter() - t0)
                assert all(ev.query() for ev in accel.d2h_events[:issued])  # it drained them
            m2 = accel.mark()
            assert accel.elapsed_ms(m0, m1) >= 0 and accel.elapsed_ms(m1, m2) >= 0
            losses.append(loss.detach())
        if extra_read_at == step:
            accel.read([losses[0]])
        out.append(engine.step(torch.stack(losses).mean()))
        engine.zero_grad()
    return out, blocked


def test_a_full_sync_per_micro_batch_is_counted_and_waits_for_the_copies():
    # A slow link (200 kB/s: each 576-768-byte gradient piece busies the copy engine for
    # 3-4 ms) so a sync right after backward has the last pieces to wait for.
    accel = CopyLog(bandwidth=2e5, lag_s=0.002, lag_seed=FIRST_DRAW_LONG)
    model, engine = _mlp_engine(accel, ZF_AUTO, clip=CLIP, gradient_accumulation_steps=2)
    with engine:
        stats, blocked = _trainer_loop(engine, model, steps=3, gas=2, sync_in_timing=True)
    assert [s.full_syncs for s in stats] == [2, 2, 2]  # one per micro-batch, all counted
    # each sync waits at least for the last piece of its backward (63-100 ms in all, over 6
    # syncs, measured on a loaded 2-core machine)
    piece_s = 576 / accel.bandwidth  # the smallest piece's modelled copy time: 2.9 ms
    assert len(blocked) == 6 and sum(blocked) >= len(blocked) * piece_s, blocked


def _reads_expected(stats, engine) -> list[int]:
    """Per step: its own read, one for a re-selection's new columns (not the first
    selection: its scores are on the host) and one for the leaving columns' state when
    columns moved."""
    reselected = set(engine.selection_steps[1:])
    return [1 + (s.step in reselected) + bool(s.step in reselected and s.selection_changed)
            for s in stats]  # fmt: skip


def test_the_engine_loop_does_no_full_sync_and_one_read_per_step():
    """Done-when of issue 15, on sim: 0 full syncs and 1 device->host read per step, with
    overlap, clipping and the auto interval on, windows ending, host steps in flight; a
    re-selection that moves columns reads twice more (the new columns of every weight in
    one read, the hand-over is planned on the host; then the leaving columns' state, one
    read for all weights), the first selection does not (its scores are on the host)."""
    accel = CopyLog(lag_s=0.002, lag_seed=FIRST_DRAW_LONG)
    model, engine = _mlp_engine(accel, ZF_AUTO, clip=CLIP)
    with engine:
        stats, _ = _trainer_loop(engine, model, steps=8)
        assert engine.max_in_flight == 1
    assert [s.full_syncs for s in stats] == [0] * 8
    assert [s.d2h_reads for s in stats] == _reads_expected(stats, engine)
    assert all(s.grad_norm > CLIP for s in stats)  # clipping active every step
    assert sum(s.window_len > 0 for s in stats) >= 2 and any(s.host_update for s in stats)
    assert any(s.selection_changed for s in stats[1:])  # a reselection happened


def test_an_extra_read_on_the_training_thread_is_counted():
    accel = CopyLog(lag_s=0.002, lag_seed=FIRST_DRAW_LONG)
    model, engine = _mlp_engine(accel, ZF_AUTO, clip=CLIP)
    with engine:
        stats, _ = _trainer_loop(engine, model, steps=4, extra_read_at=2)
    hand_over = [r - 1 for r in _reads_expected(stats, engine)]
    assert [s.d2h_reads - h for s, h in zip(stats, hand_over, strict=True)] == [1, 1, 2, 1]
    assert [s.full_syncs for s in stats] == [0] * 4


def test_the_first_selection_step_reads_once_with_the_auto_interval():
    model, engine = _mlp_engine(CopyLog(), ZF_AUTO, clip=CLIP)
    with engine:
        stats, _ = _trainer_loop(engine, model, steps=1)
    assert stats[0].d2h_reads == 1


class _WaitCount:
    """A device->host copy's event that counts host waits on the training thread for it
    (``compute_wait`` unwraps it first: that wait is on the device on a GPU)."""

    __slots__ = ("event", "sim")

    def __init__(self, event, sim) -> None:
        self.event = event
        self.sim = sim

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        if threading.get_ident() == self.sim.training_thread:
            self.sim.host_waits += 1
        self.event.synchronize()


class HostWaits(SimAccelerator):
    """Counts the training thread's host waits on device->host copies: each is a
    device-to-host read on a GPU (it waits for the device work before the copy), counted or
    not in ``d2h_reads``."""

    def __init__(self, **kw) -> None:
        super().__init__(strict=True, **kw)
        self.training_thread = threading.get_ident()
        self.host_waits = 0

    def copy_d2h(self, dst, src, after=None):
        return _WaitCount(super().copy_d2h(dst, src, after), self)

    def compute_wait(self, event) -> None:
        super().compute_wait(event.event if isinstance(event, _WaitCount) else event)


def test_a_reselection_step_waits_for_the_device_once_and_counts_it():
    """A re-selection reads every weight's new columns (ONE read: the hand-over is planned
    on the host) and hands the leaving columns' device state to the host (ONE read for all
    weights): the training thread waits for the device there twice, each counted in
    d2h_reads beside the step's own read; every other step waits only in its one read."""
    accel = HostWaits(lag_s=0.002, lag_seed=FIRST_DRAW_LONG)
    model, engine = _mlp_engine(accel, ZF_AUTO, clip=CLIP)
    waits, moved, reads = [], [], []
    with engine:
        for x, y in mlp_batches(8):
            accel.host_waits = 0
            loss = model(x, y)
            engine.backward(loss)
            st = engine.step(loss)
            moved.append(st.selection_changed)
            reads.append(st.d2h_reads)
            engine.zero_grad()
            waits.append(accel.host_waits)
    later = range(1, len(moved))  # step 1 waits for the whole gradient: by design
    assert any(moved[i] for i in later)  # a re-selection happened after the first selection
    reselected = set(engine.selection_steps[1:])
    for i in later:
        expected = int(i + 1 in reselected) + bool(i + 1 in reselected and moved[i])
        assert waits[i] == expected, (i, waits)
        assert reads[i] == 1 + waits[i], (i, reads)


# ------------------------------------------------------------------ 5. the real trainer


def test_finetune_metrics_show_no_full_sync_and_one_read_per_step(tiny_gpt2_dir, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """``zfctl finetune --device sim`` with overlap, clipping and the auto interval on, two
    micro-batches a step, its sim strict and lagged (a run has no option for that: the
    class is patched as ZENFLOW_TEST_SIM_LAG would): metrics.jsonl records 0 full syncs
    and 1 read per step."""
    from zenflow.config import load_config
    from zenflow.train import runs
    from zenflow.train.data import write_sst2_sample
    from zenflow.train.spec import RunSpec
    from zenflow.train.trainer import run_finetune

    monkeypatch.chdir(tmp_path)  # no ./hw.json
    lagged = strict_lagged_init(SimAccelerator.__init__, 0.002, FIRST_DRAW_LONG)
    monkeypatch.setattr(SimAccelerator, "__init__", lagged)
    data = write_sst2_sample(tmp_path / "data", n=48, n_dev=8)
    config = load_config({
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                              "zenflow": {**ZF_AUTO, "topk_ratio": 0.1}},
    })  # fmt: skip
    spec = RunSpec(model=str(tiny_gpt2_dir), task="sst2", config=config, data_dir=str(data),
                   seq_len=16, runs_root=tmp_path / "runs", max_eval_samples=8, max_steps=6,
                   device="sim")  # fmt: skip
    summary = run_finetune(spec)
    run_dir = Path(summary["run_dir"])
    resolved = json.loads((run_dir / "config.json").read_text())["engine_resolved"]
    assert "strict, lag <= 2 ms" in resolved["device_description"]
    lines = (run_dir / runs.METRICS_FILE).read_text()
    steps = [m for m in map(json.loads, lines.splitlines()) if m["type"] == "step"]
    assert len(steps) == 6 and all("full_syncs" in m and "d2h_reads" in m for m in steps)
    assert [m["full_syncs"] for m in steps] == [0] * 6
    # one read per step, and two more for a re-selection that moves columns (its new
    # columns, the hand-over); the first selection's scores are on the host
    assert [m["d2h_reads"] for m in steps] == [1 + 2 * bool(i and m["selection_changed"])
                                               for i, m in enumerate(steps)]  # fmt: skip
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > CLIP for m in steps)
    assert any(m["window_len"] for m in steps) and any(m["host_update"] for m in steps)
