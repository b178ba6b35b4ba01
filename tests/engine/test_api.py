"""Engine API surface: resolved values, errors with fixes, threads, light import."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from conftest import MLP, make_config, mlp_batches, torch_style_kernel, train_engine

from zenflow import ZenFlowEngine
from zenflow.engine import EngineError


def test_epoch_strategy_needs_steps_per_epoch():
    cfg = make_config({"select_strategy": "auto", "select_interval": "auto"})
    with pytest.raises(EngineError, match="steps_per_epoch"):
        ZenFlowEngine(MLP(), cfg)
    with ZenFlowEngine(MLP(), cfg, steps_per_epoch=25) as e:
        assert e.resolved["select_every_steps"] == 25
    cfg = make_config({"select_strategy": "epoch", "select_interval": 2})
    with ZenFlowEngine(MLP(), cfg, steps_per_epoch=10) as e:
        assert e.resolved["select_every_steps"] == 20


def test_dtype_rules():
    # a bf16 model needs bf16.enabled (its fp32 master then lives on the host)
    with pytest.raises(EngineError, match="bf16.enabled"):
        ZenFlowEngine(MLP().bfloat16(), make_config({"update_interval": 2}))
    with pytest.raises(EngineError, match="not supported"):
        ZenFlowEngine(MLP().half(), make_config({"update_interval": 2}, bf16={"enabled": True}))
    model = MLP().bfloat16()
    with ZenFlowEngine(model, make_config({"update_interval": 2}, bf16={"enabled": True})) as e:
        assert e.dtype == torch.bfloat16 and e.resolved["dtype"] == "bfloat16"


def test_model_on_another_device_is_refused(monkeypatch):
    import zenflow.engine.engine_setup as setup

    monkeypatch.setattr(setup, "_device_matches", lambda a, b: False)
    with pytest.raises(EngineError, match="move the model first"):
        ZenFlowEngine(MLP(), make_config({"update_interval": 2}))


def test_cuda_without_gpu_says_how_to_fix():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(EngineError, match="--device sim"):
        ZenFlowEngine(MLP(), make_config({"update_interval": 2}), accelerator="cuda")


def test_core_split_is_observed_on_the_threads(monkeypatch):
    """With 8 cores and 25% kept for the training thread, torch runs 2 threads during
    training and the host kernel is asked for 6, on another thread; close() restores."""
    import zenflow.engine.accelerator.base as accel_mod

    monkeypatch.setattr(accel_mod, "cores", lambda: 8)
    orig = torch.get_num_threads()
    seen = {}

    def kernel(*args, num_threads, **kw):
        seen.setdefault("threads", num_threads)
        seen.setdefault("ident", threading.get_ident())
        torch_style_kernel(*args, num_threads=num_threads, **kw)

    cfg = make_config({"update_interval": 1, "overlap_step": True, "pt_reserved_cores_perc": 0.25})
    model = MLP()
    e = ZenFlowEngine(model, cfg, host_kernel=kernel)
    assert torch.get_num_threads() == 2
    train_engine(e, model, mlp_batches(3))
    e.close()
    assert seen["threads"] == 6 and seen["ident"] != threading.get_ident()
    assert torch.get_num_threads() == orig
    assert e.resolved["training_threads"] == 2 and e.resolved["host_threads"] == 6
    with ZenFlowEngine(MLP(), make_config({"update_interval": "auto"})) as e:
        assert e.resolved["update_interval"] == "auto(1..64)"
        assert "no copy" in e.resolved["grad_path"]  # CPU device: summed in place
    with ZenFlowEngine(MLP(), make_config({"update_interval": 2}), accelerator="sim") as e:
        assert "accumulator" in e.resolved["grad_path"]
        assert e.resolved["accelerator"] == "sim"
        assert "simulated" in e.resolved["device_description"]


def test_cuda_split_keeps_two_cores_for_the_training_thread(monkeypatch):
    """On CUDA the training thread launches kernels: of its reserved share it keeps at most
    2 cores, the host gets the rest (issue 28 item 6); no CUDA needed to check the rule."""
    import zenflow.engine.accelerator.base as accel_mod
    from zenflow.engine.accelerator import SimAccelerator
    from zenflow.engine.accelerator.cuda import CudaAccelerator, cuda_core_split

    monkeypatch.delenv("ZENFLOW_CUDA_TRAINING_THREADS", raising=False)
    monkeypatch.setattr(accel_mod, "cores", lambda: 16)
    cuda = object.__new__(CudaAccelerator)  # the split needs no device
    assert cuda.compute_threads(0.5, True) == (2, 14)
    assert cuda.compute_threads(0.5, True, ranks_per_node=2) == (2, 6)

    assert cuda_core_split(8, 8) == (2, 14)
    assert cuda_core_split(4, 4) == (2, 6)  # two ranks on 16 cores
    assert cuda_core_split(2, 2) == (2, 2)
    assert cuda_core_split(1, 15) == (1, 15)
    assert cuda_core_split(1, 0) == (1, 0)  # one core: nothing to move
    assert CudaAccelerator.host_yields and not SimAccelerator.host_yields


def test_cuda_split_follows_the_environment(monkeypatch):
    """ZENFLOW_CUDA_TRAINING_THREADS replaces the 2 the training thread keeps (the other
    arm of a measurement: 8 is the even split of 16 cores); a bad value is one message."""
    import zenflow.engine.accelerator.base as accel_mod
    from zenflow.engine.accelerator.cuda import CudaAccelerator, cuda_core_split

    monkeypatch.setattr(accel_mod, "cores", lambda: 16)
    monkeypatch.setenv("ZENFLOW_CUDA_TRAINING_THREADS", "8")
    assert object.__new__(CudaAccelerator).compute_threads(0.5, True) == (8, 8)
    assert cuda_core_split(4, 12) == (4, 12)  # never more than the reserved share
    monkeypatch.setenv("ZENFLOW_CUDA_TRAINING_THREADS", "1")
    assert cuda_core_split(8, 8) == (1, 15)
    for bad in ("0", "two", "-3"):
        monkeypatch.setenv("ZENFLOW_CUDA_TRAINING_THREADS", bad)
        with pytest.raises(ValueError, match="ZENFLOW_CUDA_TRAINING_THREADS"):
            cuda_core_split(8, 8)


def test_core_share_yields_half_to_a_running_window_adam():
    """With yielding the accumulator takes every host thread until a window's Adam runs,
    then the half the Adam does not take; without it (sim, cpu) both take all."""
    from zenflow.engine.accumulator import CoreShare

    share = CoreShare(14, yielding=True)
    assert (share.accumulate_threads, share.adam_threads, share.beside_adam) == (14, 7, 7)
    with share.adam() as nt:
        assert nt == 7 and share.accumulate_threads == 7
        with share.adam():  # two at once (never in the engine): still yielded
            assert share.accumulate_threads == 7
        assert share.accumulate_threads == 7
    assert share.accumulate_threads == 14
    share = CoreShare(7, yielding=True)
    with share.adam() as nt:
        assert (nt, share.accumulate_threads) == (3, 4)
    plain = CoreShare(6)
    with plain.adam() as nt:
        assert (nt, plain.accumulate_threads) == (6, 6)
    assert not CoreShare(1, yielding=True).yielding  # one thread: nothing to share


def test_the_accumulator_takes_the_yielded_threads():
    """Each add asks the kernel for the share's current count: all the host threads, or
    the yielded half while a window's Adam runs."""
    from zenflow.engine.accelerator import DONE
    from zenflow.engine.accumulator import Accumulator, CoreShare

    seen = []

    def accumulate(dst, src, scale, overwrite, sumsq, num_threads):
        seen.append(num_threads)
        dst.add_(src, alpha=scale)
        return 0.0

    share = CoreShare(8, yielding=True)
    acc = Accumulator(accumulate, share)
    dst = torch.zeros(4)
    try:
        acc.add(DONE, torch.ones(4), dst, None, False, None)
        acc.drain()
        with share.adam():
            acc.add(DONE, torch.ones(4), dst, None, False, None)
            acc.drain()
    finally:
        acc.close()
    assert seen == [8, 4] and torch.equal(dst, torch.full((4,), 2.0))


def test_yielding_host_threads_on_the_engine(monkeypatch):
    """A backend that yields (as CUDA does; here sim with the flag set, 8 cores, 25% kept):
    the window's Adam runs on half the host threads, the accumulator on all of them or the
    other half, and the training is bit for bit the one without yielding."""
    import zenflow.engine.accelerator.base as accel_mod
    from zenflow.engine.accelerator import SimAccelerator

    monkeypatch.setattr(accel_mod, "cores", lambda: 8)
    cfg = make_config({"update_interval": 2, "overlap_step": True, "pt_reserved_cores_perc": 0.25})

    def run(yields: bool):
        monkeypatch.setattr(SimAccelerator, "host_yields", yields)
        adam, accumulate = set(), set()

        def kernel(*args, num_threads, **kw):
            adam.add(num_threads)
            torch_style_kernel(*args, num_threads=num_threads, **kw)

        torch.manual_seed(0)
        model = MLP()
        e = ZenFlowEngine(model, cfg, host_kernel=kernel, accelerator="sim")
        acc = e.impl.transport.accumulator
        inner = acc._accumulate

        def spy(*args):
            accumulate.add(args[-1])
            return inner(*args)

        acc._accumulate = spy
        with e:
            train_engine(e, model, mlp_batches(6))
            e.impl.drain()
            params = [p.detach().clone() for p in model.parameters()]
        return adam, accumulate, params, e.host_threads

    adam, accumulate, yielded, host = run(True)
    assert host == 6 and adam == {3} and 6 in accumulate and accumulate <= {6, 3}
    adam, accumulate, plain, _ = run(False)
    assert adam == {6} and accumulate == {6}
    assert all(torch.equal(a, b) for a, b in zip(yielded, plain, strict=True))


def test_the_first_selection_borrows_the_host_threads(monkeypatch):
    """Where the training thread keeps few cores (CUDA: 2), the first selection's torch work
    on it, which the step waits for while the host's kernels are idle, runs on the host's
    threads too, and torch's count is the training thread's again after it; the training
    is bit for bit the one that does not borrow (here sim with the flag set, 8 cores)."""
    import zenflow.engine.accelerator.base as accel_mod
    from zenflow.engine.accelerator import SimAccelerator
    from zenflow.engine.zenflow.warmup import Warmup

    monkeypatch.setattr(accel_mod, "cores", lambda: 8)
    cfg = make_config({"update_interval": 2, "overlap_step": True, "full_warm_up_rounds": 1,
                       "pt_reserved_cores_perc": 0.25})  # fmt: skip
    inner = Warmup.first_selection

    def run(lends: bool):
        monkeypatch.setattr(SimAccelerator, "lends_host_cores", lends)
        seen = []

        def spy(self, t, coef):
            seen.append(torch.get_num_threads())
            return inner(self, t, coef)

        monkeypatch.setattr(Warmup, "first_selection", spy)
        torch.manual_seed(0)
        model = MLP()
        with ZenFlowEngine(model, cfg, accelerator="sim") as e:
            train_engine(e, model, mlp_batches(5))
            e.impl.drain()
            after = torch.get_num_threads()
            params = [p.detach().clone() for p in model.parameters()]
            split = (e.training_threads, e.host_threads)
        return seen, after, split, params

    seen, after, split, lent = run(True)
    assert split == (2, 6) and seen == [8] and after == 2
    seen, after, _, plain = run(False)
    assert seen == [2] and after == 2
    assert all(torch.equal(a, b) for a, b in zip(lent, plain, strict=True))


def test_second_submit_while_in_flight_is_refused():
    from zenflow.engine.host import HostJob, HostWorker

    gate = threading.Event()
    worker = HostWorker()
    first = HostJob(window_start=1, submit_step=1)
    worker.submit(first, gate.wait)
    with pytest.raises(RuntimeError, match="in flight"):
        worker.submit(HostJob(window_start=2, submit_step=2), lambda: None)
    gate.set()
    worker.wait(first)
    worker.submit(HostJob(window_start=2, submit_step=2), lambda: None)  # free again
    worker.close()


def test_stats_fields_and_lr_schedule():
    model = MLP()
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                            "warmup_num_steps": 4}}  # fmt: skip
    cfg = make_config({"update_interval": 2, "full_warm_up_rounds": 1}, scheduler=sched)
    with ZenFlowEngine(model, cfg) as e:
        stats = train_engine(e, model, mlp_batches(5))
        assert e.lr == stats[-1].lr
    assert [s.step for s in stats] == [1, 2, 3, 4, 5]
    assert stats[0].warmup and not stats[1].warmup
    assert stats[1].selection_changed > 0  # first selection
    assert [s.window_len for s in stats] == [0, 0, 2, 0, 2]
    assert stats[0].lr < stats[3].lr
    assert all(s.loss is not None and s.grad_norm > 0 and s.step_ms > 0 for s in stats)


def test_import_zenflow_is_light():
    code = (
        "import sys, zenflow; zenflow.StepStats; "
        "bad = [m for m in ('typer', 'rich', 'zfctl') if m in sys.modules]; "
        "assert not bad, bad; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_native_op_is_loaded_at_set_up_not_in_a_step(monkeypatch):
    """Issue 31 item 7: a first build (or a wait for another process's build) takes a
    minute. The engine loads the native op while it is constructed, so that minute is
    set-up time, never the first host step's stall (before, the build ran inside the first
    host op a step called)."""
    from zenflow.ops import loader

    calls = []
    monkeypatch.setenv("ZENFLOW_OPS", "native")
    monkeypatch.setattr(loader, "load_native", lambda: calls.append("load"))
    monkeypatch.setattr("zenflow.ops.load_native", loader.load_native)
    cfg = make_config({"topk_ratio": 0.5, "update_interval": 2})
    with ZenFlowEngine(MLP(), cfg, host_kernel="native") as e:
        assert calls == ["load"] and e.kernel_name == "native"
    monkeypatch.setenv("ZENFLOW_OPS", "reference")  # the plain ops: nothing to load
    calls.clear()
    with ZenFlowEngine(MLP(), cfg, host_kernel="native"):
        assert calls == []
