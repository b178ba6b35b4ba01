"""zenflow.hardware.measure: CPU Adam, forward+backward, overlap and engine timings."""

from __future__ import annotations

import pytest

from zenflow.hardware import measure


def test_resolve_adam_never_falls_back_silently(monkeypatch):
    from zenflow import ops

    monkeypatch.setenv("ZENFLOW_OPS", "reference")
    fn, backend, reason = measure.resolve_adam()
    assert (fn, backend) == (ops.adamw_step_reference_, "reference")
    assert "ZENFLOW_OPS=reference" in reason

    monkeypatch.delenv("ZENFLOW_OPS")
    not_built = {"state": "not-built", "ops": "native", "cached_library": False}
    monkeypatch.setattr(ops, "native_status", lambda: not_built)
    fn, backend, reason = measure.resolve_adam(allow_build=False)
    assert backend == "reference" and "--quick does not build" in reason


def test_measure_cpu_adam_updates_and_reports():
    probe = measure.measure_cpu_adam(4097, num_threads=1, repeats=2)
    assert probe.backend in ("native", "reference")
    assert (probe.backend == "reference") == (probe.fallback_reason is not None)
    assert probe.numel == 4097 and probe.num_threads == 1
    assert probe.params_per_s == pytest.approx(4097 / (probe.ms / 1e3))


def test_measure_cpu_adam_restores_threads():
    import torch

    before = torch.get_num_threads()
    measure.measure_cpu_adam(1024, num_threads=1, repeats=1)
    assert torch.get_num_threads() == before


@pytest.fixture(scope="module")
def tiny_probe_model():
    return measure.load_probe_model("builtin:gpt2-2x128", micro_batch=2, seq_len=8)


def test_probe_model_counts(tiny_probe_model):
    pm = tiny_probe_model
    params = list(pm.model.parameters())
    assert pm.params_total == sum(p.numel() for p in params)
    assert pm.params_2d == sum(p.numel() for p in params if p.dim() == 2)
    assert pm.params_2d < pm.params_total
    assert pm.batch["input_ids"].shape == (2, 8)
    assert "random init" in pm.source


def test_measure_fwd_bwd_runs_backward_and_restores_threads(tiny_probe_model):
    import torch

    before = torch.get_num_threads()
    ms = measure.measure_fwd_bwd(tiny_probe_model, num_threads=1, repeats=2)
    assert ms > 0
    assert torch.get_num_threads() == before
    # fwd_bwd_once leaves no gradients behind (zero_grad after each step).
    assert all(p.grad is None for p in tiny_probe_model.model.parameters())


def test_measure_overlap_runs_the_whole_host_step(tiny_probe_model):
    """A counting Adam: the worker covers every offloaded param, on the right threads."""
    calls: list[tuple[int, int]] = []

    def counting_adam(param, grad, exp_avg, exp_avg_sq, *, num_threads, **_):
        calls.append((param.numel(), num_threads))
        exp_avg.add_(grad)

    host_numel, repeats, s = 2500, 2, 3
    ov = measure.measure_overlap(
        tiny_probe_model,
        update_interval=s,
        train_threads=1,
        worker_threads=1,
        all_threads=2,
        host_numel=host_numel,
        adam=(counting_adam, "reference", "test"),
        repeats=repeats,
        chunk_numel=1000,
    )
    windows = 2 * (repeats + 1)  # on and off, each with one warm-up window
    assert [n for n, _ in calls] == [1000, 1000, 500] * windows
    on_calls, off_calls = calls[: 3 * (repeats + 1)], calls[3 * (repeats + 1) :]
    assert {t for _, t in on_calls} == {1} and {t for _, t in off_calls} == {2}
    assert ov.update_interval == s and ov.host_numel == host_numel
    # Per window: the window contains the worker's host step (on) and the host step (off).
    assert ov.on_window_ms >= ov.on_host_ms > 0
    assert ov.off_window_ms >= ov.off_host_ms > 0
    assert ov.on_window_ms >= ov.on_wait_ms >= 0


def test_measure_engine_times_whole_windows(tiny_probe_model):
    import torch

    before = torch.get_num_threads()
    block = {
        "topk_ratio": 0.1,
        "update_interval": 2,
        "select_strategy": "auto",
        "select_interval": "auto",
        "overlap_step": True,
        "pt_reserved_cores_perc": 0.5,
    }
    results = [
        measure.measure_engine(tiny_probe_model, block, on, windows=1) for on in (True, False)
    ]
    assert [r["overlap_step"] for r in results] == [True, False]
    assert all(
        r["steps"] == 2 and r["update_interval"] == 2 and r["ms_per_step"] > 0 for r in results
    )
    assert torch.get_num_threads() == before


def test_measure_overlap_reraises_a_worker_failure(tiny_probe_model):
    def broken_adam(*args, **kwargs):
        raise RuntimeError("adamw_step_: grad is not contiguous")

    with pytest.raises(RuntimeError, match="not contiguous"):
        measure.measure_overlap(
            tiny_probe_model,
            update_interval=1,
            train_threads=1,
            worker_threads=1,
            all_threads=2,
            host_numel=10,
            adam=(broken_adam, "reference", "test"),
            repeats=1,
        )


def test_measure_overlap_off_split_keeps_the_split(tiny_probe_model):
    """A separate device keeps its reserved cores: the off window's host step runs on the
    worker's threads, not on all of them."""
    calls: list[int] = []

    def counting_adam(param, grad, exp_avg, exp_avg_sq, *, num_threads, **_):
        calls.append(num_threads)

    ov = measure.measure_overlap(
        tiny_probe_model,
        update_interval=1,
        train_threads=1,
        worker_threads=1,
        all_threads=2,
        host_numel=100,
        adam=(counting_adam, "reference", "test"),
        repeats=1,
        off_split=True,
    )
    assert ov.off_split is True
    assert calls == [1] * 4  # on and off, each a warm-up window and one timed window


def test_measure_device_adam_covers_the_model_and_leaves_it_alone(tiny_probe_model):
    import torch

    pm = tiny_probe_model
    before = [p.detach().clone() for p in pm.model.parameters()]
    threads = torch.get_num_threads()
    whole = measure.measure_device_adam(pm, num_threads=1, repeats=1, max_numel=10**9)
    assert whole.numel == pm.params_total  # every trainable param, updated once per pass
    assert whole.params_per_s == pytest.approx(whole.numel / (whole.ms / 1e3))
    assert (whole.device, whole.num_threads, whole.dtype) == ("cpu", 1, "float32")
    assert torch.get_num_threads() == threads
    assert all(torch.equal(a, b) for a, b in zip(before, pm.model.parameters(), strict=True))
    # A cap cuts the pass: the first weight (the 50257 x 128 embedding, whose columns are
    # its 50257 token rows of 128) keeps only the columns that fit, at least one.
    cut = measure.measure_device_adam(pm, num_threads=1, repeats=1, max_numel=3 * 128)
    assert cut.numel == 3 * 128
    one = measure.measure_device_adam(pm, num_threads=1, repeats=1, max_numel=10)
    assert one.numel == 128


def test_bf16_probe_model_runs_as_the_engine_would():
    import torch

    pm = measure.load_probe_model("builtin:gpt2-2x128", 2, 8, device="cpu", bf16=True)
    assert pm.bf16 and pm.device == "cpu"
    assert {p.dtype for p in pm.model.parameters()} == {torch.bfloat16}
    assert measure.measure_fwd_bwd(pm, num_threads=1, repeats=1) > 0
    probe = measure.measure_device_adam(pm, num_threads=1, repeats=1, max_numel=10**9)
    assert probe.dtype == "bfloat16" and probe.numel == pm.params_total


def test_measure_engine_on_the_simulated_device(tiny_probe_model):
    block = {
        "topk_ratio": 0.5,
        "update_interval": 1,
        "select_strategy": "auto",
        "select_interval": "auto",
        "overlap_step": True,
        "pt_reserved_cores_perc": 0.5,
    }
    r = measure.measure_engine(tiny_probe_model, block, True, windows=1, accelerator="sim")
    assert r["accelerator"] == "sim" and r["steps"] == 1 and r["ms_per_step"] > 0
