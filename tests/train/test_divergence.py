"""A run whose loss stays non-finite stops (issue 19): RunDiverged, summary.json "diverged",
no checkpoint or model of the diverged weights; a transient NaN is skipped, counted and the
run finishes. Every file the run writes is strict JSON (NaN as null).

Before the fix a run at lr 1e30 "finished": 9 of 12 steps skipped, a checkpoint and a
model/ of the broken weights written, summary.json "finished" with a bare NaN in it."""

from __future__ import annotations

import math

import pytest
import torch
from trainhelp import CONFIG, make_spec

from zenflow import jsonout
from zenflow.train import runs
from zenflow.train.divergence import DIVERGED_AFTER
from zenflow.train.events import RunDiverged, StepEvent
from zenflow.train.trainer import run_finetune


def strict_lines(path) -> list[dict]:
    """Every line of a metrics.jsonl through a strict parser (NaN/Infinity refused)."""
    return [jsonout.loads_strict(line) for line in path.read_text().splitlines()]


def finite_weights(ckpt) -> bool:
    model = torch.load(ckpt, weights_only=True)["model"]
    return all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point())


def hook_score(monkeypatch, hook, pre: bool = False) -> None:
    """Register ``hook`` as a forward (``pre``: pre-forward) hook on the classifier head of
    the model the run loads."""
    import zenflow.train.models

    real = zenflow.train.models.resolve_model

    def hooked(*a, **kw):
        r = real(*a, **kw)
        score = r.model.score
        (score.register_forward_pre_hook if pre else score.register_forward_hook)(hook)
        return r

    monkeypatch.setattr(zenflow.train.models, "resolve_model", hooked)


def test_huge_lr_diverges_and_keeps_the_last_good_checkpoint(
    tiny_gpt2_dir, sample_dir, tmp_path, cli
):
    config = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 1e30}}}
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, config=config, max_steps=12,
                     checkpoint_every=1)  # fmt: skip
    seen = []
    with pytest.raises(RunDiverged) as exc:
        run_finetune(spec, seen.append)
    err = exc.value
    run_dir = err.checkpoint.parent.parent
    lines = strict_lines(run_dir / runs.METRICS_FILE)
    steps = [m for m in lines if m["type"] == "step"]
    bad = [m["step"] for m in steps if m["skipped"]]
    # The loss stays non-finite: the run stops DIVERGED_AFTER steps into it, not at step 12.
    assert len(bad) == DIVERGED_AFTER and bad == list(range(bad[0], bad[0] + DIVERGED_AFTER))
    assert err.step == bad[-1] == steps[-1]["step"] < 12
    assert err.last_good_step == bad[0] - 1 and err.skipped_steps == DIVERGED_AFTER
    assert all(m["loss"] is None for m in steps if m["skipped"])  # null, not NaN
    # No checkpoint during the non-finite steps: the newest is the last good step's.
    assert err.checkpoint == runs.latest_checkpoint(run_dir)
    assert runs.checkpoint_step(err.checkpoint) == err.last_good_step
    assert all(finite_weights(p) for p in runs.checkpoints(run_dir))
    assert not (run_dir / runs.MODEL_DIR).exists()
    summary = jsonout.loads_strict((run_dir / runs.SUMMARY_FILE).read_text())
    assert summary["status"] == "diverged" and summary["skipped_steps"] == DIVERGED_AFTER
    assert summary["last_good_step"] == err.last_good_step
    assert summary["divergence"]["step"] == err.step
    assert summary["checkpoint"] == str(err.checkpoint)
    # The event comes last, and the message names the step, the causes and the checkpoint.
    assert seen[-1] is err
    for fragment in (f"step {err.step}", "learning rate", "bad input data", "bf16",
                     str(err.checkpoint)):  # fmt: skip
        assert fragment in str(err)
    rep = cli("report", run_dir)  # the report says so too
    assert rep.exit_code == 0, rep.output
    text = " ".join(rep.stdout.split())
    assert f"diverged at step {err.step}" in text and f"last good step {err.last_good_step}" in text


def test_non_finite_parameters_are_never_saved(tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch):
    """A parameter turns NaN at the last step: the final checkpoint and model are not
    written (the run diverged), though fewer than DIVERGED_AFTER steps were non-finite."""
    forwards = {"n": 0}

    def poison(module, args):
        forwards["n"] += 1
        if forwards["n"] == 3:  # step 3 of 3 (one micro-batch per step)
            with torch.no_grad():
                module.weight[0, 0] = math.nan

    hook_score(monkeypatch, poison, pre=True)
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, max_steps=3, engine_mode="device")
    with pytest.raises(RunDiverged) as exc:
        run_finetune(spec)
    err = exc.value
    assert err.step == 3 and "parameters" in err.reason and err.checkpoint is None
    run_dir = runs.latest_run(tmp_path)
    assert runs.checkpoints(run_dir) == [] and not (run_dir / runs.MODEL_DIR).exists()
    assert "No checkpoint was written" in str(err)
    summary = jsonout.loads_strict((run_dir / runs.SUMMARY_FILE).read_text())
    assert summary["status"] == "diverged" and summary["checkpoint"] is None


def test_transient_nan_is_skipped_counted_and_the_run_finishes(
    tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch, cli
):
    forwards = {"n": 0}

    def nan_once(module, args, output):
        forwards["n"] += 1
        if forwards["n"] == 3:  # step 3's forward: a NaN loss for that step only
            return output * math.nan
        return None

    hook_score(monkeypatch, nan_once)
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, max_steps=6)
    skipped_seen = []
    summary = run_finetune(
        spec, lambda e: isinstance(e, StepEvent) and skipped_seen.append(e.stats.skipped)
    )
    assert skipped_seen == [False, False, True, False, False, False]
    run_dir = summary["run_dir"]
    on_disk = jsonout.loads_strict((runs.Path(run_dir) / runs.SUMMARY_FILE).read_text())
    assert on_disk["status"] == "finished" and on_disk["skipped_steps"] == 1
    assert on_disk["divergence"] is None and math.isfinite(on_disk["final_loss"])
    steps = [m for m in strict_lines(runs.Path(run_dir) / runs.METRICS_FILE) if m["type"] == "step"]
    assert [m["loss"] is None for m in steps] == [False, False, True, False, False, False]
    assert (runs.Path(run_dir) / runs.MODEL_DIR).is_dir()

    # zfctl report reads the null loss back as a missing value and says so, once.
    rep = cli("report", run_dir, "--json")
    assert rep.exit_code == 0, rep.output
    doc = jsonout.loads_strict(rep.stdout)
    (warning,) = [w for w in doc["warnings"] if "loss" in w]
    assert "1 step line" in warning and "line 3" in warning
    assert doc["runs"][0]["skipped_steps"] == 1


def test_a_run_that_ends_during_non_finite_steps_diverged(
    tiny_gpt2_dir, sample_dir, tmp_path, monkeypatch
):
    """The loss turns NaN for the last 2 of 6 steps (fewer than DIVERGED_AFTER): the run
    did not show that it recovered, so it ends diverged and writes no final checkpoint or
    model; the newest checkpoint is the last good one (step 4). Before, it finished with
    exit 0 and saved the weights that gave the NaN loss."""
    forwards = {"n": 0}

    def nan_late(module, args, output):
        forwards["n"] += 1
        return output * math.nan if forwards["n"] >= 5 else None  # steps 5 and 6

    hook_score(monkeypatch, nan_late)
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, max_steps=6, checkpoint_every=2)
    with pytest.raises(RunDiverged) as exc:
        run_finetune(spec)
    err = exc.value
    assert err.step == 6 and err.last_good_step == 4 and err.skipped_steps == 2
    assert "up to the run's last step" in err.reason
    run_dir = runs.latest_run(tmp_path)
    assert [p.name for p in runs.checkpoints(run_dir)][-1] == "step-0000004.pt"
    assert err.checkpoint.name == "step-0000004.pt" and finite_weights(err.checkpoint)
    assert not (run_dir / runs.MODEL_DIR).exists()
    summary = jsonout.loads_strict((run_dir / runs.SUMMARY_FILE).read_text())
    assert summary["status"] == "diverged" and summary["last_good_step"] == 4
