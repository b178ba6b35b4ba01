"""SIGTERM is handled like the first Ctrl-C (issue 10 item 4): deferred to the step boundary,
checkpointed, exit status 143; its grace period bounds the wait, never interrupting the
engine's step."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
from trainhelp import assert_same_params, final_model, losses, make_spec

from zenflow.train import signals
from zenflow.train.events import RunInterrupted, StepEvent
from zenflow.train.trainer import run_finetune


@pytest.fixture(scope="module")
def straight(tiny_gpt2_dir, sample_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    s = run_finetune(make_spec(tiny_gpt2_dir, sample_dir, root, max_steps=6))  # zenflow
    return losses(s["run_dir"]), final_model(s["run_dir"])


def test_sigterm_checkpoints_at_the_boundary_and_resumes_exactly(
    tiny_gpt2_dir, sample_dir, tmp_path, straight
):
    ref_losses, ref_params = straight
    steps = []

    def on_event(e):
        if isinstance(e, StepEvent):
            steps.append(e.stats.step)
            if e.stats.step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends

    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, max_steps=6)
    with pytest.raises(RunInterrupted) as exc:
        run_finetune(spec, on_event)
    err = exc.value
    assert steps == [1, 2] and err.step == 2 and err.checkpoint.name == "step-0000002.pt"
    assert err.signal == "SIGTERM" and err.exit_code == 143
    assert "--resume" in err.resume_command
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # grace timer disarmed
    run_dir = err.checkpoint.parent.parent
    s = run_finetune(dataclasses.replace(spec, resume=str(run_dir)))
    assert s["steps"] == 6 and losses(run_dir) == ref_losses
    assert_same_params(final_model(run_dir), ref_params)


def test_sigterm_grace_period_bounds_a_long_step(
    tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch, straight
):
    """SIGTERM after step 2, then step 3's forward hangs: when the grace period is over the
    run stops in that forward, saves step 2's boundary and resumes from it exactly."""
    ref_losses, _ = straight
    monkeypatch.setattr(signals, "TERM_GRACE_S", 0.05)
    import zenflow.train.models

    real = zenflow.train.models.resolve_model
    seen = {"forwards": 0, "hang_ended": None}

    def hooked(*a, **kw):
        r = real(*a, **kw)

        def hang(module, args, output):
            seen["forwards"] += 1
            if seen["forwards"] == 3:  # step 3 (one micro-batch per step): a stuck forward
                for _ in range(6000):  # 60 s unless interrupted
                    time.sleep(0.01)
                seen["hang_ended"] = "by itself"

        r.model.score.register_forward_hook(hang)
        return r

    monkeypatch.setattr(zenflow.train.models, "resolve_model", hooked)

    def on_event(e):
        if isinstance(e, StepEvent) and e.stats.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, max_steps=6)
    with pytest.raises(RunInterrupted) as exc:
        run_finetune(spec, on_event)
    assert seen["hang_ended"] is None  # cut short by the grace timer
    assert exc.value.checkpoint.name == "step-0000002.pt" and exc.value.exit_code == 143
    monkeypatch.setattr(zenflow.train.models, "resolve_model", real)
    run_dir = exc.value.checkpoint.parent.parent
    run_finetune(dataclasses.replace(spec, resume=str(run_dir)))
    assert losses(run_dir) == ref_losses


def test_grace_timer_waits_for_the_engine_step():
    """While ``critical`` (the engine's step) the timer re-arms instead of interrupting."""
    with signals.StopRequests(term_grace_s=0.01) as stops:
        stops.critical = True
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.requested == "SIGTERM" and stops.exit_code == 143
        for _ in range(30):  # the timer fires (and re-arms) during these sleeps
            time.sleep(0.01)
        stops.critical = False
        with pytest.raises(KeyboardInterrupt):
            for _ in range(6000):
                time.sleep(0.01)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_second_ctrl_c_interrupts_at_once_first_only_asks():
    with signals.StopRequests() as stops:
        os.kill(os.getpid(), signal.SIGINT)
        assert stops.requested == "SIGINT" and stops.exit_code == 130
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(6000):
                time.sleep(0.01)
