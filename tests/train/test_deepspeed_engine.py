"""``--engine deepspeed``: DeepSpeedAdapter (zenflow/train/deepspeed_engine.py).

Quick tests check the config the adapter hands DeepSpeed and its refusals without importing
DeepSpeed. The DeepSpeed tests run in child processes (DeepSpeed's process group and comm
backend are global state), behind a deadline: a saved tiny GPT-2 must come out of the
adapter's ``deepspeed.initialize`` bit for bit unchanged, with ZenFlow on and with plain
offload, and then train; and a short ``zfctl finetune --engine deepspeed --json`` runs end to
end. The first run JIT-builds DeepSpeed's cpu_adam and shm ops (1-3 minutes on 2 cores,
inside the deadline); with the build cached these take about 30 s together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zenflow.config import load_config
from zenflow.errors import UserInputError
from zenflow.train.deepspeed_engine import (
    UNAVAILABLE_FIELDS,
    DeepSpeedAdapter,
    deepspeed_config,
)

ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).resolve().parent / "deepspeed_adapter_check.py"
DEADLINE_S = 600  # two cold JIT builds fit well inside; past it the child prints its stacks


def _zenflow_config(**overrides):
    return load_config(ROOT / "templates" / "zenflow.json", overrides=overrides)


# ---------------------------------------------------------------- the config DeepSpeed gets


def test_accumulation_is_the_callers_for_offload():
    cfg = load_config(ROOT / "templates" / "offload.json",
                      overrides={"gradient_accumulation_steps": 3})  # fmt: skip
    ds, notes = deepspeed_config(cfg)
    # The trainer divides the loss by 3 and calls step() once: DeepSpeed must neither scale
    # again nor wait for more micro-steps.
    assert ds["gradient_accumulation_steps"] == 1
    assert ds["managed_gradient_accumulation"] is False
    assert ds["train_micro_batch_size_per_gpu"] == 8
    assert "train_batch_size" not in ds
    assert "3 micro-batches" in notes["accumulation"]


def test_no_accumulation_keeps_deepspeeds_default():
    ds, notes = deepspeed_config(load_config(ROOT / "templates" / "offload.json"))
    assert ds["gradient_accumulation_steps"] == 1
    assert "managed_gradient_accumulation" not in ds and "accumulation" not in notes


def test_zenflow_refuses_accumulation():
    cfg = _zenflow_config(gradient_accumulation_steps=2)
    with pytest.raises(UserInputError, match="cannot accumulate micro-batches"):
        deepspeed_config(cfg)


@pytest.mark.parametrize(
    "strategy, interval, spe, expected",
    [
        ("auto", "auto", 50, 50),  # once per epoch, the real epoch length
        ("epoch", 3, 50, 150),
        ("step", 7, None, 7),
        ("step", "auto", 40, 40),
        ("auto", "auto", None, None),  # unknown epoch: DeepSpeed never re-selects (said)
    ],
)
def test_selection_interval_resolved_to_steps(strategy, interval, spe, expected):
    cfg = _zenflow_config(**{"zero_optimization.zenflow.select_strategy": strategy,
                             "zero_optimization.zenflow.select_interval": interval})  # fmt: skip
    ds, notes = deepspeed_config(cfg, steps_per_epoch=spe)
    block = ds["zero_optimization"]["zenflow"]
    assert notes["select_interval_steps"] == expected
    if expected is None:
        assert "never re-selects" in notes["selection_note"]
        assert block["select_strategy"] == strategy
    else:
        assert (block["select_strategy"], block["select_interval"]) == ("step", expected)
    # everything else of the block is handed over as written
    assert block["update_interval"] == 4 and block["topk_ratio"] == 0.1


def test_window_lr_sum_is_said_to_be_zfctls_own():
    from zenflow.train.deepspeed_engine import unsupported_notes

    zf = load_config(ROOT / "templates" / "zenflow.json")
    assert unsupported_notes(load_config({**zf.raw, "zfctl": {"window_lr": "last"}})) == []
    summed = load_config({**zf.raw, "zfctl": {"window_lr": "sum"}})
    (note,) = unsupported_notes(summed)
    assert 'zfctl.window_lr "sum"' in note and "last step" in note
    offload = load_config(ROOT / "templates" / "offload.json")
    assert unsupported_notes(load_config({**offload.raw, "zfctl": {"window_lr": "sum"}})) == []
    doubling = load_config({**zf.raw, "zfctl": {"select_schedule": "doubling"}})
    (note,) = unsupported_notes(doubling)
    assert 'zfctl.select_schedule "doubling"' in note and "every select interval" in note
    early = load_config({**zf.raw, "zfctl": {"early": {"steps": 100}}})
    (note,) = unsupported_notes(early)
    assert "zfctl.early (steps 100)" in note and "from the first step" in note
    image = load_config({**zf.raw, "zfctl": {"return_image": "always"}})
    (note,) = unsupported_notes(image)
    assert 'zfctl.return_image "always"' in note and "its own way" in note
    assert unsupported_notes(load_config({**zf.raw, "zfctl": {"return_image": "never"}})) == []


def test_refuses_a_config_that_is_neither_offload_nor_zenflow():
    import torch

    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}})
    with pytest.raises(UserInputError, match="ZeRO-Offload or ZenFlow"):
        DeepSpeedAdapter(torch.nn.Linear(4, 4), cfg)


def test_resume_is_refused_with_the_reason():
    adapter = DeepSpeedAdapter.__new__(DeepSpeedAdapter)  # no DeepSpeed needed to refuse
    with pytest.raises(UserInputError) as info:
        adapter.load_state_dict({"engine": "deepspeed", "resumable": False})
    assert "cannot be resumed" in str(info.value)
    assert "--engine zenflow" in str(info.value)


# ---------------------------------------------------------------- DeepSpeed itself


def _run(args: list[str], port: str, timeout: float) -> subprocess.CompletedProcess:
    """A child with its own MASTER_PORT (DeepSpeed's shm segment name); the segment must be
    gone afterwards (the adapter unlinks it), and is removed here if not."""
    env = dict(os.environ, MASTER_PORT=port, MASTER_ADDR="127.0.0.1")
    segment = Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0"
    try:
        result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        leaked = segment.exists()
        segment.unlink(missing_ok=True)
    assert not leaked, f"DeepSpeed's shm segment {segment} was left behind"
    return result


@pytest.mark.parametrize("mode", ["zenflow", "offload"])
def test_initialize_keeps_pretrained_weights_and_trains(mode, tiny_gpt2_dir):
    pytest.importorskip("deepspeed")
    port = str(20000 + (os.getpid() * 2 + (mode == "zenflow")) % 20000)
    r = _run([sys.executable, str(CHECK), mode, str(tiny_gpt2_dir), str(DEADLINE_S)], port,
             DEADLINE_S + 60)  # fmt: skip
    output = f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-20000:]}"
    assert r.returncode == 0, output
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("result: ")]
    res = json.loads(line[len("result: ") :])
    # every parameter equal to the saved checkpoint, bit for bit, after initialize
    assert res["unchanged_at_initialize"] == res["params"] > 0
    # ... and the adapter really trains through DeepSpeed
    assert res["finite"] and res["changed_after_steps"] >= res["params"] // 2, res
    assert [s["step"] for s in res["steps"]] == [1, 2, 3, 4]
    assert all(s["mode"] == f"deepspeed-{mode}" and s["step_ms"] > 0 for s in res["steps"])
    if mode == "zenflow":  # the window (update_interval 4) ends at step 4, nowhere else
        assert [s["host_update"] for s in res["steps"]] == [False, False, False, True]
        assert [s["window_len"] for s in res["steps"]] == [0, 0, 0, 4]
        assert res["resolved"]["select_interval_steps"] == 100  # one epoch of 100 steps
    else:  # ZeRO-Offload updates everything on the host every step
        assert all(s["host_update"] for s in res["steps"])
    resolved = res["resolved"]
    assert resolved["engine"] == "deepspeed" and resolved["deepspeed_version"] == "0.19.6"
    assert resolved["mode"] == f"deepspeed-{mode}" and resolved["zero_stage"] == 2
    assert resolved["unavailable_fields"] == list(UNAVAILABLE_FIELDS)
    assert res["contiguous_after_flush"] and res["group_destroyed"]


def test_finetune_engine_deepspeed_end_to_end(tiny_gpt2_dir, tmp_path):
    pytest.importorskip("deepspeed")
    port = str(20000 + (os.getpid() * 2 + 7) % 20000)
    args = [sys.executable, "-m", "zfctl", "finetune", str(tiny_gpt2_dir), "--task", "sst2",
            "--sample-data", "--engine", "deepspeed", "--max-steps", "4", "--micro-batch", "4",
            "--seq-len", "16", "--max-eval-samples", "16", "--runs-root", str(tmp_path),
            "--set", "zero_optimization.zenflow.overlap_step=false", "--json"]  # fmt: skip
    r = _run(args, port, DEADLINE_S + 60)
    assert r.returncode == 0, f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-20000:]}"
    # stdout is JSON lines only: DeepSpeed's own prints and logs were kept off it
    events = [json.loads(line) for line in r.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "RunStarted" and kinds[-1] == "RunFinished"
    header = events[0]["header"]
    assert header["engine_mode"] == "deepspeed"
    resolved = header["engine_resolved"]
    assert resolved["engine"] == "deepspeed" and resolved["mode"] == "deepspeed-zenflow"
    assert "stall_ms" in resolved["unavailable_fields"]
    steps = [e for e in events if e["event"] == "StepEvent"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["loss"] > 0 and s["forward_ms"] > 0 for s in steps)
    assert [s["host_update"] for s in steps] == [False, False, False, True]
    summary = events[-1]["summary"]
    assert summary["steps"] == 4 and summary["engine_mode"] == "deepspeed"
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "summary.json").is_file()
    # the fine-tuned model was saved (DeepSpeed's column-major weights made contiguous) and
    # differs from the starting checkpoint
    from transformers import GPT2ForSequenceClassification

    start = GPT2ForSequenceClassification.from_pretrained(tiny_gpt2_dir).state_dict()
    tuned = GPT2ForSequenceClassification.from_pretrained(run_dir / "model").state_dict()
    assert any(not (start[k] == tuned[k]).all() for k in start)


def test_finetune_engine_deepspeed_trains_a_causal_lm(tmp_path):
    """--objective causal-lm through DeepSpeed's own ZenFlow: the trainer's token-mean loss
    goes through DeepSpeed's backward; the run evaluates perplexity and saves a causal LM
    that moved."""
    pytest.importorskip("deepspeed")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from zenflow.train.models import packaged_gpt2_tokenizer

    model_dir = tmp_path / "lm"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                               vocab_size=50257, eos_token_id=50256, bos_token_id=50256,
                               pad_token_id=50256)).save_pretrained(model_dir)  # fmt: skip
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(model_dir)
    data = tmp_path / "pc.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for i in range(100):  # 10 held out: enough to score the two completions as choices
            word = ("good", "bad")[i % 2]
            f.write(json.dumps({"prompt": f"It was {word} ({i}). Verdict:",
                                "completion": (" yes", " no")[i % 2]}) + "\n")  # fmt: skip
    port = str(20000 + (os.getpid() * 2 + 9) % 20000)
    args = [sys.executable, "-m", "zfctl", "finetune", str(model_dir), "--objective",
            "causal-lm", "--data", str(data), "--engine", "deepspeed", "--max-steps", "4",
            "--micro-batch", "4", "--seq-len", "24", "--runs-root", str(tmp_path / "runs"),
            "--set", "zero_optimization.zenflow.overlap_step=false", "--json"]  # fmt: skip
    r = _run(args, port, DEADLINE_S + 60)
    assert r.returncode == 0, f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-20000:]}"
    events = [json.loads(line) for line in r.stdout.splitlines()]
    summary = events[-1]["summary"]
    assert summary["steps"] == 4 and summary["engine_mode"] == "deepspeed"
    assert events[0]["header"]["objective"] == "causal-lm"
    final = summary["eval"]
    assert final["perplexity"] > 1 and 0 <= final["choice_accuracy"] <= 1
    start = GPT2LMHeadModel.from_pretrained(model_dir).state_dict()
    tuned = GPT2LMHeadModel.from_pretrained(Path(summary["run_dir"]) / "model").state_dict()
    assert any(not torch.equal(start[k], tuned[k]) for k in start)
