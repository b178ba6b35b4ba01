"""The fine-tuning run end to end on a tiny GPT-2: run files, exact resume, Ctrl-C."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal

import pytest
import torch
from trainhelp import CONFIG
from trainhelp import assert_same_params as _assert_same_params
from trainhelp import final_model as _final_model
from trainhelp import losses as _losses
from trainhelp import make_spec as _spec

from zenflow.config import load_config
from zenflow.errors import UserInputError
from zenflow.train import runs
from zenflow.train.events import (
    CheckpointSaved,
    EvalEvent,
    RunFinished,
    RunInterrupted,
    RunStarted,
    StepEvent,
)
from zenflow.train.spec import RunSpec
from zenflow.train.trainer import run_finetune

# ------------------------------------------------------------------ end to end, real data


def test_end_to_end_sst2_run_files(glue_dir, tiny_gpt2_dir, tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text('{"cores": 2}', encoding="utf-8")
    events = []
    spec = _spec(
        tiny_gpt2_dir, glue_dir, tmp_path / "runs", max_steps=4, eval_every=2, hw_json=hw,
        max_eval_samples=32,
    )  # fmt: skip
    summary = run_finetune(spec, events.append)

    run_dir = runs.latest_run(tmp_path / "runs", str(tiny_gpt2_dir), "sst2")
    assert run_dir is not None and str(run_dir) == summary["run_dir"]
    assert run_dir.name.endswith(f"-{tiny_gpt2_dir.name}-sst2")
    run = runs.read_run(run_dir)

    # Events: started, 4 steps with progress, evals at 2 and 4, checkpoints, finished.
    assert isinstance(events[0], RunStarted) and isinstance(events[-1], RunFinished)
    header = events[0].header
    assert header["train_examples"] == 67349 and header["dev_examples"] == 872
    assert header["steps_per_epoch"] == 67349 // 4 and header["total_steps"] == 4
    assert header["sources"]["model"] == f"local directory: {tiny_gpt2_dir}"
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [e.stats.step for e in steps] == [1, 2, 3, 4]
    assert [e.progress for e in steps] == [0.25, 0.5, 0.75, 1.0]
    assert steps[-1].eta_s == 0.0 and all(e.samples_per_s > 0 for e in steps)
    assert [e.step for e in events if isinstance(e, EvalEvent)] == [2, 4]
    assert [e.step for e in events if isinstance(e, CheckpointSaved)] == [2, 4]

    # metrics.jsonl: one line per step, evals tagged; losses finite and near ln 2.
    assert len(run["metrics"]) == 4 and len(run["evals"]) == 2
    losses = [m["loss"] for m in run["metrics"]]
    assert all(math.isfinite(x) and 0.3 < x < 1.5 for x in losses)
    for m in run["metrics"]:
        assert m["mode"] == "zenflow" and m["lr"] == pytest.approx(1e-3)
        assert m["forward_ms"] > 0 and m["backward_ms"] > 0 and m["wall_ms"] >= m["step_ms"]
        assert m["samples_per_s"] == pytest.approx(4 / (m["wall_ms"] / 1e3))
        assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 16)
    assert [m["window_len"] for m in run["metrics"]] == [0, 2, 0, 2]

    # summary.json agrees with the metrics lines.
    s = run["summary"]
    assert s == json.loads(json.dumps(summary))
    assert s["status"] == "finished" and s["steps"] == 4 and s["samples"] == 16
    assert s["final_loss"] == losses[-1]
    assert s["non_finite_steps"] == 0
    mean_fwd = sum(m["forward_ms"] for m in run["metrics"]) / 4
    assert s["timing_ms_mean"]["forward_ms"] == pytest.approx(mean_fwd)
    d2h = sum(m["d2h_bytes"] for m in run["metrics"])
    h2d = sum(m["h2d_bytes"] for m in run["metrics"])
    assert s["d2h_bytes_total"] == d2h and s["h2d_bytes_total"] == h2d
    assert s["bytes_per_step_x_model"] == pytest.approx((d2h + h2d) / 4 / s["model_bytes"])
    assert s["model_bytes"] == 4 * s["params"]  # fp32
    assert s["sources"]["data"].startswith("GLUE TSV files")
    assert s["eval"]["step"] == 4 and s["eval"]["eval_samples"] == 32
    # Which weights each evaluation saw: at step 2 the window 1-2's host step was in flight
    # (overlap), its 2 steps of non-selected gradients not yet in the weights; the final
    # evaluation is of the flushed model.
    seen = [(e["weights"], e["pending_host_updates"], e["pending_steps"]) for e in run["evals"]]
    assert seen == [("live", 1, 2), ("flushed", 0, 0)]
    assert s["eval"]["weights"] == "flushed" and "pending_steps" not in s["validation"]
    assert s["validation"] == {"accuracy": s["validation_accuracy"]}

    # The reported accuracy is the accuracy of the saved model on the first 32 dev rows.
    from transformers import GPT2ForSequenceClassification

    from zenflow.train.data import encode, load_task
    from zenflow.train.models import packaged_gpt2_tokenizer

    model = GPT2ForSequenceClassification.from_pretrained(tiny_gpt2_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    after = _final_model(run_dir)
    assert not torch.equal(before["score.weight"], after["score.weight"])  # it trained
    model.load_state_dict(after)
    model.eval()
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    dev = encode(load_task("sst2", glue_dir), tok, 16).dev.take(range(32))
    with torch.no_grad():
        pred = model(input_ids=dev["input_ids"], attention_mask=dev["attention_mask"]).logits
    acc = (pred.argmax(-1) == dev["labels"]).float().mean().item()
    assert s["validation_accuracy"] == pytest.approx(acc)

    # config.json: resolved DeepSpeed config + run spec + sources; hw.json copied.
    cfg = run["config"]
    assert cfg["zero_optimization"]["zenflow"]["update_interval"] == 2
    assert cfg["optimizer"]["params"]["lr"] == 1e-3
    assert cfg["run"]["model"] == str(tiny_gpt2_dir) and cfg["run"]["max_steps"] == 4
    assert cfg["sources"]["tokenizer"] == f"local directory: {tiny_gpt2_dir}"
    assert run["hw"] == {"cores": 2}
    assert [p.name for p in runs.checkpoints(run_dir)] == ["step-0000002.pt", "step-0000004.pt"]


# --------------------------------------------------------------------- exact resume


@pytest.fixture(scope="module")
def straight_runs(tiny_gpt2_dir, sample_dir, tmp_path_factory):
    """Uninterrupted 6-step runs, per mode (computed once)."""
    cache = {}

    def get(mode: str, **kw):
        key = (mode, tuple(sorted(kw.items())))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"straight-{mode}")
            spec = _spec(tiny_gpt2_dir, sample_dir, root, engine_mode=mode, max_steps=6, **kw)
            s = run_finetune(spec)
            cache[key] = (_losses(s["run_dir"]), _final_model(s["run_dir"]))
        return cache[key]

    return get


@pytest.mark.parametrize(
    "mode,kw",
    [("device", {}), ("zenflow", {}), ("zenflow", {"micro_batch": 2, "gas": 2, "lr": 2e-3})],
    ids=["device", "zenflow", "zenflow-mb2-gas2"],
)
def test_resume_is_exact(mode, kw, tiny_gpt2_dir, sample_dir, tmp_path, straight_runs):
    losses, params = straight_runs(mode, **kw)
    assert len(losses) == 6 and len(set(losses)) == 6  # steps differ: a real trajectory
    spec = _spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode=mode, max_steps=3, **kw)
    first = run_finetune(spec)
    assert _losses(first["run_dir"]) == losses[:3]
    second = run_finetune(dataclasses.replace(spec, max_steps=6, resume=first["run_dir"]))
    assert second["run_dir"] == first["run_dir"] and second["steps"] == 6
    assert _losses(second["run_dir"]) == losses  # bit for bit, across the epoch boundary
    _assert_same_params(_final_model(second["run_dir"]), params)
    run = runs.read_run(first["run_dir"])
    assert [e["step"] for e in run["evals"]] == [3, 6]
    assert all(m["lr"] == kw.get("lr", 1e-3) for m in run["metrics"])
    assert run["config"]["train_micro_batch_size_per_gpu"] == kw.get("micro_batch", 4)
    assert run["config"]["gradient_accumulation_steps"] == kw.get("gas", 1)


def test_lr_and_micro_batch_override_the_config():
    from pathlib import Path

    from zenflow.train.spec import effective_config as _effective_config

    template = Path(__file__).resolve().parents[2] / "templates" / "zenflow.json"
    cfg = load_config({**json.loads(template.read_text()), "gradient_accumulation_steps": 2})
    spec = RunSpec(model="m", task="sst2", config=cfg, lr=5e-5, micro_batch=3)
    eff = _effective_config(spec)
    assert eff.optimizer.lr == 5e-5
    assert eff.scheduler.params["warmup_max_lr"] == 5e-5  # the scheduler's peak follows --lr
    assert eff.train_micro_batch_size_per_gpu == 3 and eff.gradient_accumulation_steps == 2
    assert eff.source == cfg.source
    assert _effective_config(RunSpec(model="m", task="sst2", config=cfg)) is cfg


def test_every_rank_runs_what_rank_0s_memory_check_fitted(monkeypatch):
    """Each rank of --nproc checks this host's free memory at its own moment, so at the edge
    they may fit the run differently (one with the step store, one with its 8-bit copies):
    on joining the group every rank takes rank 0's fitted settings, which rank 0 wrote
    into the run's config."""
    from zenflow.train import trainer as tr
    from zenflow.train.parallel import Parallel

    sent = []

    def rank_0s(obj, par):  # a two-rank group whose rank 0 kept the store and the images
        sent.append(obj)
        return (None, None)

    monkeypatch.setattr(tr, "init_parallel", lambda kind: Parallel(rank=1, world=2))
    monkeypatch.setattr(tr, "broadcast_object", rank_0s)
    spec = RunSpec(model="m", task="sst2", config=load_config(CONFIG), device="sim",
                   step_store="q8", return_image="never")  # fmt: skip
    run = tr._Run(spec, lambda event: None)
    run.start_parallel()
    assert sent == [("never", "q8")]  # this rank's own, replaced by rank 0's
    assert (run.spec.step_store, run.spec.return_image, run.spec.nproc) == (None, None, 2)


def test_ctrl_c_from_event_checkpoints_and_resumes(
    tiny_gpt2_dir, sample_dir, tmp_path, straight_runs
):
    losses, params = straight_runs("device")
    events = []

    def on_event(e):
        events.append(e)
        if isinstance(e, StepEvent) and e.stats.step == 4:
            raise KeyboardInterrupt

    spec = _spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=6)
    with pytest.raises(RunInterrupted) as exc:
        run_finetune(spec, on_event)
    err = exc.value
    run_dir = err.checkpoint.parent.parent
    assert err.step == 4 and err.checkpoint.name == "step-0000004.pt" and err.checkpoint.exists()
    assert isinstance(events[-1], RunInterrupted) and events[-1] is err
    assert err.resume_command.startswith(
        f"zfctl finetune {tiny_gpt2_dir} --task sst2 --resume {run_dir}"
    )
    assert "--max-steps 6" in err.resume_command and "--engine device" in err.resume_command
    assert "--data-dir" in err.resume_command and "--seq-len 16" in err.resume_command
    assert not (run_dir / "summary.json").exists()
    assert _losses(run_dir) == losses[:4]

    # --resume auto finds it (same model and task, has a checkpoint) and finishes exactly.
    s = run_finetune(dataclasses.replace(spec, resume="auto"))
    assert s["run_dir"] == str(run_dir) and s["steps"] == 6
    assert _losses(run_dir) == losses
    _assert_same_params(_final_model(run_dir), params)


def test_sigint_is_deferred_to_the_step_boundary(tiny_gpt2_dir, sample_dir, tmp_path):
    steps = []

    def on_event(e):
        if isinstance(e, StepEvent):
            steps.append(e.stats.step)
            if e.stats.step == 2:
                os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C

    spec = _spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=6)
    # Python's own Ctrl-C handler, whatever the suite inherited (a shell starts background
    # jobs, nohup included, with SIGINT ignored).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(RunInterrupted) as exc:
            run_finetune(spec, on_event)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert steps == [1, 2] and exc.value.step == 2
    assert len(runs.read_run(exc.value.checkpoint.parent.parent)["metrics"]) == 2


def test_interrupt_mid_step_rewinds(
    tiny_gpt2_dir, sample_dir, tmp_path, straight_runs, monkeypatch
):
    """A KeyboardInterrupt inside the forward of step 3 drops that partial step: the
    checkpoint is step 2's, and resuming reproduces the straight run exactly."""
    losses, params = straight_runs("device")
    import zenflow.train.models

    real = zenflow.train.models.resolve_model
    calls = {"n": 0}

    def hooked(*a, **kw):
        r = real(*a, **kw)

        def hook(module, args, output):
            calls["n"] += 1
            if calls["n"] == 3:  # the forward of step 3 (one micro-batch per step)
                raise KeyboardInterrupt

        # On the classification head: the last layer, after every dropout of the forward
        # has drawn from the RNG, so the rewind of the RNG state is exercised too.
        r.model.score.register_forward_hook(hook)
        return r

    monkeypatch.setattr(zenflow.train.models, "resolve_model", hooked)
    spec = _spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=6)
    with pytest.raises(RunInterrupted) as exc:
        run_finetune(spec)
    assert exc.value.checkpoint.name == "step-0000002.pt"
    monkeypatch.setattr(zenflow.train.models, "resolve_model", real)
    s = run_finetune(dataclasses.replace(spec, resume=str(exc.value.checkpoint)))
    assert _losses(s["run_dir"]) == losses
    _assert_same_params(_final_model(s["run_dir"]), params)


# --------------------------------------------------------------------------- errors


def test_resume_errors(tiny_gpt2_dir, sample_dir, tmp_path):
    spec = _spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="device", max_steps=1)
    # (--resume auto without an earlier run starts a new one: tests/cli/test_finetune.py)
    with pytest.raises(UserInputError, match="no such run directory"):
        run_finetune(dataclasses.replace(spec, resume=str(tmp_path / "nope")))
    s = run_finetune(spec)
    with pytest.raises(UserInputError) as e:
        run_finetune(dataclasses.replace(spec, resume=s["run_dir"], seq_len=32, max_steps=2))
    assert "seq_len: run has 16, given 32" in str(e.value)
    with pytest.raises(UserInputError, match="engine mode 'fast'"):
        run_finetune(dataclasses.replace(spec, engine_mode="fast"))


def test_runs_latest_filters(tmp_path):
    for name, model, task in (
        ("20250101-000000-a-sst2", "a", "sst2"),
        ("20250102-000000-b-sst2", "b", "sst2"),
        ("20250103-000000-a-rte", "a", "rte"),
    ):
        d = tmp_path / name
        d.mkdir()
        runs.write_json_atomic(d / "config.json", {"run": {"model": model, "task": task}})
    assert runs.latest_run(tmp_path).name == "20250103-000000-a-rte"
    assert runs.latest_run(tmp_path, "a", "sst2").name == "20250101-000000-a-sst2"
    assert runs.latest_run(tmp_path, "a", "sst2", with_checkpoint=True) is None
    assert runs.latest_run(tmp_path, "c") is None
    (tmp_path / "20250101-000000-a-sst2" / "metrics.jsonl").write_text(
        '{"type": "step", "step": 1}\n{"type": "eval", "step": 1}\n{"type": "st', encoding="utf-8"
    )
    r = runs.read_run(tmp_path / "20250101-000000-a-sst2")
    assert r["metrics"] == [{"type": "step", "step": 1}] and len(r["evals"]) == 1
    assert r["summary"] is None
    with pytest.raises(UserInputError, match="not a zfctl run directory"):
        runs.read_run(tmp_path)
