"""The simulated accelerator behaves as a separate device, and strict mode catches a missing
wait (ZENFLOW.md 2c): a test double that drops one wait makes the engine's result wrong."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import MLP, make_config, mlp_batches, torch_style_kernel, train_engine

from zenflow import ZenFlowEngine
from zenflow.engine.accelerator import DONE, DeviceOutOfMemory, SimAccelerator


def test_copies_are_asynchronous_poisoned_and_counted():
    sim = SimAccelerator(strict=True, bandwidth=1e6, latency=0.0)  # 1 MB/s: slow on purpose
    try:
        src = torch.arange(25_000, dtype=torch.float32)  # 100 kB: 0.1 s on this link
        dst = sim.host_empty(src.shape)
        ev = sim.copy_d2h(dst, src)
        assert not ev.query()  # still on the copy engine
        assert torch.isnan(dst).all()  # poisoned until the event completes
        ev.synchronize()
        assert torch.equal(dst, src)
        assert dst.data_ptr() != src.data_ptr()
        assert sim.traffic.d2h_bytes == 100_000 and sim.traffic.h2d_bytes == 0
        assert sim.busy_s("d2h") == pytest.approx(0.1)
        ints = sim.host_empty((3,), torch.int64)
        ev = sim.copy_h2d(ints, torch.tensor([1, 2, 3]))
        ev.synchronize()
        assert ints.tolist() == [1, 2, 3] and sim.traffic.h2d_bytes == 24
        with pytest.raises(ValueError, match="share storage"):
            sim.copy_d2h(src, src)
    finally:
        sim.close()


def test_a_copy_waits_for_its_after_event():
    sim = SimAccelerator(bandwidth=1e6, latency=0.0)
    try:
        first = torch.zeros(25_000)
        ev1 = sim.copy_h2d(first, torch.ones(25_000))
        second = torch.zeros(2)
        ev2 = sim.copy_d2h(second, first[:2], after=ev1)  # reads first only after ev1
        ev2.synchronize()
        assert ev1.query() and second.tolist() == [1.0, 1.0]
    finally:
        sim.close()


def test_an_event_wakes_every_waiter_after_its_hooks_and_reports_a_failure():
    """A copy's event (a bare lock, not a threading.Event): every waiter on any thread
    returns once it completed, a hook registered before completion has run by then (one
    registered after runs at once), and a failed copy is raised to each waiter."""
    sim = SimAccelerator(bandwidth=1e6, latency=0.0)
    try:
        src = torch.arange(25_000, dtype=torch.float32)  # 0.1 s on this link
        dst = sim.host_empty(src.shape)
        ev = sim.copy_d2h(dst, src)
        seen, ran = [], []
        ev.on_complete(lambda: ran.append("before"))
        waiters = [threading.Thread(target=lambda: (ev.synchronize(), seen.append(list(ran))))
                   for _ in range(3)]  # fmt: skip
        for t in waiters:
            t.start()
        assert not ev.query()
        for t in waiters:
            t.join(10)
        assert ev.query() and seen == [["before"]] * 3 and torch.equal(dst, src)
        ev.on_complete(lambda: ran.append("after"))  # completed: runs now
        assert ran == ["before", "after"]
        ev.synchronize()  # again: returns at once
        bad = sim.copy_d2h(torch.zeros(2), torch.zeros(2), after=_Failed())
        for _ in range(2):
            with pytest.raises(RuntimeError, match="sim copy engine failed"):
                bad.synchronize()
    finally:
        sim.close()


class _Failed:
    """An ``after`` event whose wait fails (the copy engine reports it on the copy's event)."""

    def synchronize(self):
        raise OSError("broken upstream")


def test_memory_is_accounted_per_holder_and_the_budget_raises():
    sim = SimAccelerator(budget_bytes=10_000)
    a = sim.empty((1000,), torch.float32, "optimizer")  # 4000 bytes
    assert sim.held() == {"optimizer": 4000}
    with pytest.raises(DeviceOutOfMemory, match=r"10,000-byte budget.*optimizer 0.0 MiB"):
        sim.empty((2000,), torch.float32, "staging")
    del a  # freed: no longer held
    assert sim.held() == {}
    sim.close()
    model = MLP()  # 64*96+96+96*2+96*64+64+64*10+10 params, fp32: ~55 kB of weights
    budget = SimAccelerator(budget_bytes=20_000)
    with pytest.raises(DeviceOutOfMemory, match="weights"):
        ZenFlowEngine(model, make_config({"update_interval": 2}), accelerator=budget)
    budget.close()


class DroppedWait(SimAccelerator):
    """A strict sim whose engine-side waits are dropped for one kind of copy: "h2d" (the
    scatter of an updated piece does not wait for its copy) or "d2h" (the accumulator and
    the bucket reuse do not wait for the gradient piece's copy)."""

    def __init__(self, which: str):
        super().__init__(strict=True, bandwidth=2e6, latency=1e-3)  # slow copies
        self.which = which

    def copy_d2h(self, dst, src, after=None):
        ev = super().copy_d2h(dst, src, after)
        return DONE if self.which == "d2h" else ev

    def compute_wait(self, event) -> None:
        if self.which != "h2d":
            super().compute_wait(event)


def _train(accelerator, steps=8):
    torch.manual_seed(0)
    model = MLP()
    zf = {"topk_ratio": 0.25, "update_interval": 2, "overlap_step": True}
    kw = {"accelerator": accelerator, "sim_strict": True, "min_numel": 1000}
    with ZenFlowEngine(model, make_config(zf), host_kernel=torch_style_kernel, **kw) as e:
        train_engine(e, model, mlp_batches(steps))
    return model


@pytest.mark.parametrize("which", ["h2d", "d2h"])
def test_strict_mode_catches_a_missing_wait(which):
    faithful = _train(SimAccelerator(strict=True, bandwidth=2e6, latency=1e-3))
    on_cpu = _train("cpu")
    for p, q in zip(faithful.parameters(), on_cpu.parameters(), strict=True):
        assert torch.equal(p, q)  # the slow, strict sim is right when every wait is kept
    try:
        broken = _train(DroppedWait(which))
    except OverflowError:  # poisoned step counts (int64 min) reached the bias correction
        assert which == "h2d"  # the counts come to the device at the first selection
        return
    except IndexError as exc:  # poisoned index sets (int64 min) of the first hand-over
        assert which == "h2d" and "out of bounds" in str(exc)  # planned on the host, sent
        return
    except RuntimeError as exc:  # the source guard: a bucket rewritten under its copy
        assert "source guard" in str(exc)
        return
    bad = [n for (n, p), q in zip(broken.named_parameters(), faithful.parameters(), strict=True)
           if not torch.equal(p, q)]  # fmt: skip
    assert bad, "dropping a wait went unnoticed"
    assert any(torch.isnan(p).any() for p in broken.parameters())  # poison reached weights


def test_device_and_host_state_never_share_storage():
    model = MLP()
    cfg = make_config({"topk_ratio": 0.25, "update_interval": 2})
    with ZenFlowEngine(model, cfg, accelerator="sim", min_numel=1000) as e:
        train_engine(e, model, mlp_batches(3))
        device = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for w in e.zweights:
            device |= {t.untyped_storage().data_ptr() for t in (w.exp_avg_dev,
                       w.exp_avg_sq_dev, w.steps_dev.counts)}  # fmt: skip
            host = [w.host.master, w.host.exp_avg, w.host.exp_avg_sq, *w.acc]
            assert not {t.untyped_storage().data_ptr() for t in host} & device
        sd = copy.deepcopy(e.state_dict())  # the checkpoint path copies through the sim
    assert sd["global_step"] == 3
