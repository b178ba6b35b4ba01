"""Non-finite skip, worker faults, staleness / in-flight bounds, real overlap, auto interval."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import pytest
import torch
from conftest import ACCELERATORS, engine_kw, make_config, torch_style_kernel

from zenflow import ZenFlowEngine

# Only a guard: a wait this long means a hang, and the test fails saying so. No assertion
# here depends on how long something took (issue 31: a loaded machine is not a bug).
HANG_S = 300


class Two(torch.nn.Module):
    def __init__(self, shape_a=(8, 32), shape_b=(16, 24)):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(*shape_a))
        self.b = torch.nn.Parameter(torch.randn(*shape_b))
        self.bias = torch.nn.Parameter(torch.randn(5))


def _set_grads(model, i, scale=1.0):
    g = torch.Generator().manual_seed(100 + i)
    for p in model.parameters():
        p.grad = scale * torch.randn(p.shape, generator=g)


def _flat_state(sd, out=None, prefix=""):
    out = {} if out is None else out
    for k, v in sd.items():
        if isinstance(v, dict):
            _flat_state(v, out, f"{prefix}{k}.")
        else:
            out[prefix + k] = v.clone() if torch.is_tensor(v) else v
    return out


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("bad", ["inf_grad", "nan_loss"])
def test_nonfinite_step_is_skipped_without_state_change(bad, accelerator):
    model = Two()
    zf = {"topk_ratio": 0.25, "update_interval": 3, "overlap_step": True}
    kw = engine_kw(accelerator)
    with ZenFlowEngine(model, make_config(zf), host_kernel="reference", min_numel=64, **kw) as e:
        for i in range(4):  # mid-window, a host step in flight
            _set_grads(model, i)
            e.step(1.0)
        before = _flat_state(e.state_dict())
        params = [p.detach().clone() for p in model.parameters()]
        _set_grads(model, 99)
        loss = 1.0
        if bad == "inf_grad":
            model.b.grad[3, 4] = float("inf")
        else:
            loss = torch.tensor(float("nan"))
        st = e.step(loss)
        assert st.skipped and e.skipped_steps == 1 and e.global_step == 4
        after = _flat_state(e.state_dict())
        assert before.keys() == after.keys()
        for k in before:
            if k == "skipped_steps":
                assert after[k] == before[k] + 1
            elif torch.is_tensor(before[k]):
                assert torch.equal(before[k], after[k]), k
            else:
                assert before[k] == after[k], k
        for p, q in zip(model.parameters(), params, strict=True):
            assert torch.equal(p, q)
        _set_grads(model, 5)
        assert not e.step(1.0).skipped and e.global_step == 5


def test_worker_fault_surfaces_and_close_does_not_hang():
    calls = []

    def faulty(*args, **kw):
        calls.append(threading.get_ident())
        raise ValueError("disk on fire 42")

    model = Two()
    zf = {"topk_ratio": 0.25, "update_interval": 2, "overlap_step": True}
    e = ZenFlowEngine(model, make_config(zf), host_kernel=faulty, min_numel=64)
    _set_grads(model, 0)
    e.step(1.0)
    _set_grads(model, 1)
    e.step(1.0)  # window end: submitted to the worker, fails there
    (job,) = e.host_log
    futures.wait([job.future], timeout=HANG_S)  # it has failed before the next step
    assert job.future.done(), f"the failing host step hung for {HANG_S} s"
    assert calls and calls[0] != threading.get_ident()  # it ran on the worker thread
    _set_grads(model, 2)
    with pytest.raises(ValueError, match="disk on fire 42") as info:
        e.step(1.0)
    assert isinstance(info.value.__cause__, ValueError)  # chained to the original
    with pytest.raises(RuntimeError, match="unusable"):
        e.step(1.0)
    closer = threading.Thread(target=e.close)
    closer.start()
    closer.join(timeout=HANG_S)
    assert not closer.is_alive(), f"close() hung for {HANG_S} s"


def test_worker_fault_surfaces_at_close():
    def faulty(*args, **kw):
        raise KeyError("late failure")

    model = Two()
    zf = {"topk_ratio": 0.25, "update_interval": 1, "overlap_step": True}
    e = ZenFlowEngine(model, make_config(zf), host_kernel=faulty, min_numel=64)
    _set_grads(model, 0)
    e.step(1.0)
    with pytest.raises(KeyError, match="late failure"):
        e.close()
    e.close()  # idempotent


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("overlap,bound", [(True, 6), (False, 3)])
def test_staleness_instrumented(overlap, bound, accelerator):
    model = Two()
    zf = {"topk_ratio": 0.25, "update_interval": 3, "overlap_step": overlap,
          "select_interval": 7}  # fmt: skip
    kw = engine_kw(accelerator)
    with ZenFlowEngine(model, make_config(zf), host_kernel="reference", min_numel=64, **kw) as e:
        for i in range(22):
            _set_grads(model, i)
            e.step(1.0)
        assert e.max_staleness == bound  # the bound 2S (S without overlap) is reached
        applied = [j for j in e.host_log if j.applied_step is not None]
        for j in applied:
            assert j.applied_step - j.window_start + 1 <= bound
            assert j.started_at is not None and j.finished_at >= j.started_at
        assert len(applied) >= 5
        # at most one host step in flight, observed: each starts after the previous finished
        for prev, nxt in zip(applied, applied[1:], strict=False):
            assert nxt.started_at >= prev.finished_at


def test_overlap_is_real():
    """The worker's host step runs while the training thread does the next step's work.

    The kernel holds the host step until the training thread, having seen it start, has done
    step 3's work: an order made by events, not by timing."""
    release, entered = threading.Event(), threading.Event()
    seen = {}

    def kernel(*args, **kw):
        if "thread" not in seen:
            seen["thread"] = threading.get_ident()
            entered.set()
            seen["released_while_running"] = release.wait(timeout=HANG_S)
            seen["done_at"] = time.perf_counter()
        torch_style_kernel(*args, **kw)

    model = Two()
    zf = {"topk_ratio": 0.25, "update_interval": 2, "overlap_step": True}
    with ZenFlowEngine(model, make_config(zf), host_kernel=kernel, min_numel=64) as e:
        for i in range(2):
            _set_grads(model, i)
            e.step(1.0)
        # step 3's "forward/backward" happens here, on the training thread, while the host
        # step (submitted at step 2) is inside its kernel
        assert entered.wait(timeout=HANG_S), f"the host step did not start in {HANG_S} s"
        t0 = time.perf_counter()
        _set_grads(model, 2)
        release.set()
        t1 = time.perf_counter()
        e.step(1.0)
        job = e.host_log[0]
        _set_grads(model, 3)
        e.step(1.0)  # window end: waits for and applies the job
        assert job.applied_step == 4
    assert seen["thread"] != threading.get_ident()
    assert seen["released_while_running"]  # the kernel was running while we trained
    assert job.started_at < t1 and seen["done_at"] > t0


def _auto_engine(ratios, auto_ratio, steps):
    """Weights [4, 10]: column 0 gets grad 1.0 (selected, k=1), the others grad r."""
    model = torch.nn.Module()
    model.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(4, 10)) for _ in ratios])
    zf = {"topk_ratio": 0.1, "update_interval": "auto", "auto_ratio": auto_ratio}
    e = ZenFlowEngine(model, make_config(zf), host_kernel="reference", min_numel=16)
    stats = []
    for _ in range(steps):
        for p, r in zip(model.ws, ratios, strict=True):
            g = torch.full((4, 10), r)
            g[:, 0] = 1.0
            p.grad = g
        stats.append(e.step(1.0))
    e.close()
    return e, stats


def test_auto_interval_fires_deterministically():
    # per step: selected mass/column = 4*1, non-selected = 4*r^2: votes after 1/r^2 steps
    e, stats = _auto_engine([0.5], 0.99, 12)
    assert e.window_lengths == [4, 4, 4]
    assert [s.window_len for s in stats] == [0, 0, 0, 4] * 3
    assert e.resolved["update_interval"] == "auto(1..64)"
    # two weights voting after 4 and 16 steps: 0.99 needs both, 0.5 needs one
    e, _ = _auto_engine([0.5, 0.25], 0.99, 32)
    assert e.window_lengths == [16, 16]
    e, _ = _auto_engine([0.5, 0.25], 0.5, 8)
    assert e.window_lengths == [4, 4]
    # uniform columns: one step of non-selected mass equals the selected mass (bound 1)
    e, _ = _auto_engine([1.0], 0.99, 3)
    assert e.window_lengths == [1, 1, 1]


def test_auto_interval_upper_bound():
    e, stats = _auto_engine([0.0], 0.99, 130)
    assert e.window_lengths == [64, 64]


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_flush_applies_everything_pending(accelerator):
    model = Two()
    zf = {"topk_ratio": 0.25, "update_interval": 3, "overlap_step": True}
    kw = engine_kw(accelerator)
    with ZenFlowEngine(model, make_config(zf), host_kernel="reference", min_numel=64, **kw) as e:
        for i in range(5):  # window 1..3 in flight, 4..5 partial
            _set_grads(model, i)
            e.step(1.0)
        assert e.impl.inflight is not None and e.impl.window_len == 2
        w = e.zweights[0]
        stale = w.spec.param.detach().index_select(w.cd, w.nonsel_dev).clone()
        e.flush()
        assert e.impl.inflight is None and e.impl.window_len == 0
        assert e.window_lengths == [3, 2]
        for w in e.zweights:
            dev = w.spec.param.detach().index_select(w.cd, w.nonsel_dev)
            assert torch.equal(dev, w.host.master)  # the host holds the non-selected columns
        assert not torch.equal(
            stale, e.zweights[0].spec.param.detach()[:, e.zweights[0].nonsel_dev]
        )
