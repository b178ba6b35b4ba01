"""`zfctl finetune --engine lora` end to end: finetune (with --lora-rank / --lora-alpha), the
header, --json output, eval of the merged model in a second process, report, resume; and
the flags refused where they mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from clihelp import assert_user_error

from zenflow import jsonout
from zenflow.train import runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = ["--task", "sst2", "--sample-data", "--micro-batch", "4", "--seq-len", "16",
         "--max-eval-samples", "16"]  # fmt: skip


def _zfctl(*args, cwd):
    """zfctl in a fresh interpreter, like a user's command (stdout and stderr apart)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "zfctl", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(tiny_gpt2_dir, tmp_path_factory):
    """A finished 3-step LoRA run at rank 4, alpha 16, through `--json`."""
    d = tmp_path_factory.mktemp("lora")
    r = _zfctl("finetune", tiny_gpt2_dir, *QUICK, "--engine", "lora", "--lora-rank", "4",
               "--lora-alpha", "16", "--max-steps", "3", "--run-dir", d / "run",
               "--runs-root", d, "--json", cwd=d)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return d, r


def test_finetune_json_says_lora_and_keeps_stdout_strict(lora_run):
    d, r = lora_run
    # every stdout line is JSON: nothing printed by peft, accelerate or DeepSpeed (which
    # accelerate imports in save_pretrained) on the way
    events = [jsonout.loads_strict(line) for line in r.stdout.splitlines()]
    assert events[0]["event"] == "RunStarted" and events[-1]["event"] == "RunFinished"
    header = events[0]["header"]
    assert header["engine_mode"] == "lora"
    note = next(n for n in header["notes"] if n.startswith("LoRA (peft"))
    assert "rank 4, alpha 16" in note and "all-linear" in note
    cfg = runs.run_config(d / "run")
    assert cfg["zfctl"]["lora"] == {"rank": 4, "alpha": 16.0, "dropout": 0.0}
    assert cfg["engine_resolved"]["lora"]["rank"] == 4
    assert cfg["engine_resolved"]["device_adamw"].startswith("torch.optim.AdamW")


def test_eval_scores_the_merged_model_as_the_run_did(lora_run):
    """model/ holds the adapters merged into the base: `zfctl eval` in another process gives
    the run's final evaluation (the same predictions; the loss to float rounding, since
    W + BA x and W x + B(A x) round differently)."""
    d, _ = lora_run
    final = runs.read_run(d / "run")["evals"][-1]
    e = _zfctl("eval", d / "run", "--json", cwd=d)
    assert e.returncode == 0, e.stderr
    metrics = json.loads(e.stdout)["metrics"]
    assert metrics["accuracy"] == final["accuracy"] and metrics["eval_samples"] == 16
    assert metrics["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-5)


def test_report_and_resume(lora_run, cli, tiny_gpt2_dir, monkeypatch):
    d, _ = lora_run
    monkeypatch.delenv("GLUE_DIR", raising=False)  # the run's data is its --sample-data
    r = cli("report", d / "run")
    assert r.exit_code == 0, r.output
    assert "lora" in r.output
    # a longer run continues from the final checkpoint (its adapters, optimizer, position)
    r = cli("finetune", tiny_gpt2_dir, "--resume", d / "run", "--max-steps", "5",
            "--no-dashboard")  # fmt: skip
    assert r.exit_code == 0, r.output
    summary = runs.read_run(d / "run")["summary"]
    assert summary["steps"] == 5 and summary["engine_mode"] == "lora"
    # other adapters are another run: refused, not mixed into this one
    assert_user_error(
        cli("finetune", tiny_gpt2_dir, "--resume", d / "run", "--engine", "lora",
            "--lora-rank", "16", "--max-steps", "6"),
        "Cannot resume", "config",
    )  # fmt: skip


def test_lora_flags_are_refused_where_they_mean_nothing(cli, tiny_gpt2_dir, tmp_path):
    """Exit 2 before anything starts: no sample data, no run directory under --runs-root."""
    where = [*QUICK, "--runs-root", tmp_path / "runs", "--max-steps", "2"]
    assert_user_error(cli("finetune", tiny_gpt2_dir, *where, "--lora-rank", "4"),
                      "--lora-rank", "--engine lora", "not of --engine zenflow")  # fmt: skip
    assert_user_error(cli("finetune", tiny_gpt2_dir, *where, "--engine", "device",
                          "--lora-alpha", "4", "--lora-rank", "2"),
                      "--lora-rank and --lora-alpha")  # fmt: skip
    assert_user_error(cli("finetune", tiny_gpt2_dir, *where, "--engine", "lora",
                          "--lora-alpha", "0"), "--lora-alpha must be positive")  # fmt: skip
    r = cli("finetune", tiny_gpt2_dir, *where, "--engine", "lora", "--lora-rank", "0")
    assert r.exit_code == 2 and "--lora-rank" in r.output
    assert not (tmp_path / "runs").exists()  # nothing was started
    # the same command with --engine lora does start (the check above could fail)
    r = cli("finetune", tiny_gpt2_dir, *where, "--engine", "lora", "--lora-rank", "2")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "runs").is_dir()


def test_bench_has_a_lora_contender(cli, tmp_path):
    """`zfctl bench` runs LoRA beside full AdamW on the same model and batch: no copy
    traffic, and a device footprint per (base) parameter of the frozen base plus the small
    adapters' state, against AdamW's 16 bytes (fp32 here)."""
    out = tmp_path / "bench.json"
    r = cli("bench", "--model", "2x64", "--rounds", "1", "--steps", "4", "--warmup-windows", "1",
            "--micro-batch", "2", "--seq-len", "8", "--engines", "device,lora",
            "--json", out)  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    eng = doc["engines"]
    assert list(eng) == ["device", "lora"] and eng["lora"]["steps"] == 4
    assert eng["lora"]["bytes_per_step_over_model"] == 0 and eng["lora"]["step_ms"] > 0
    assert eng["device"]["device_bytes_per_param"] == pytest.approx(16.0, abs=0.01)
    assert 4.0 < eng["lora"]["device_bytes_per_param"] < 4.2
    lora = doc["config"]["resolved"]["lora"]["lora"]
    assert lora["rank"] == 8 and lora["base_params"] == doc["params"]


def test_two_ranks_train_the_adapters_one_process_trains(tmp_path):
    """--nproc 2 with --engine lora: the device AdamW averages the adapters' gradients over
    the ranks, so 2 x 2 rows per step train what one process does with 4 (no dropout, so
    the ranks' masks cannot differ by design); the merged model/ is the same."""
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from zenflow.train.data import write_sst2_sample
    from zenflow.train.models import packaged_gpt2_tokenizer

    model = tmp_path / "tiny-nodrop"
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=50257,
                     num_labels=2, pad_token_id=50256, bos_token_id=50256, eos_token_id=50256,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     summary_first_dropout=0.0)  # fmt: skip
    GPT2ForSequenceClassification(cfg).save_pretrained(model)
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(model)
    data = write_sst2_sample(tmp_path / "data", n=48, n_dev=8)
    common = ["finetune", model, "--task", "sst2", "--data-dir", data, "--seq-len", "16",
              "--max-eval-samples", "8", "--engine", "lora", "--lr", "1e-3", "--max-steps",
              "4", "--no-dashboard"]  # fmt: skip
    one = _zfctl(*common, "--micro-batch", "4", "--run-dir", tmp_path / "one", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _zfctl(*common, "--micro-batch", "2", "--nproc", "2", "--run-dir", tmp_path / "two",
                 cwd=tmp_path)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    losses = {
        d: [m["loss"] for m in runs.read_run(tmp_path / d)["metrics"]] for d in ("one", "two")
    }
    assert losses["one"] == pytest.approx(losses["two"], rel=1e-5)
    assert len(set(losses["one"])) == 4  # it trained
    a, b = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("one", "two"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)
    assert (tmp_path / "two" / "checkpoints" / "step-0000004.rank-1.pt").is_file()


def test_a_causal_lm_trains_packed_and_exports_a_plain_causal_lm(tmp_path):
    """--objective causal-lm --pack with --engine lora: peft's CAUSAL_LM task (adapters only,
    the tied LM head and embeddings frozen), packed rows' 4-D mask through the wrapped
    model; model/ loads as a plain AutoModelForCausalLM and `zfctl eval` scores it as the
    run did."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from zenflow.train.models import packaged_gpt2_tokenizer

    model = tmp_path / "tiny-lm"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                               vocab_size=50257, pad_token_id=50256, bos_token_id=50256,
                               eos_token_id=50256)).save_pretrained(model)  # fmt: skip
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(model)
    data = tmp_path / "pc.jsonl"
    rows = [
        {
            "prompt": f"Review {i}: it was {'great' if i % 2 else 'dull'}. Verdict:",
            "completion": " positive" if i % 2 else " negative",
        }
        for i in range(40)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    r = _zfctl("finetune", model, "--objective", "causal-lm", "--data", data, "--pack",
               "--engine", "lora", "--seq-len", "32", "--micro-batch", "4", "--max-steps", "3",
               "--lr", "1e-3", "--run-dir", tmp_path / "run", "--no-dashboard",
               cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lora = runs.run_config(tmp_path / "run")["engine_resolved"]["lora"]
    assert lora["head_params"] == 0 and lora["adapted_modules"] == 8  # 4 projections x 2
    before = load_file(model / "model.safetensors")
    after = load_file(tmp_path / "run" / "model" / "model.safetensors")
    assert torch.equal(before["transformer.wte.weight"], after["transformer.wte.weight"])
    assert not torch.equal(before["transformer.h.0.mlp.c_fc.weight"],
                           after["transformer.h.0.mlp.c_fc.weight"])  # fmt: skip
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")).__name__ == (
        "GPT2LMHeadModel")  # fmt: skip
    final = runs.read_run(tmp_path / "run")["evals"][-1]
    e = _zfctl("eval", tmp_path / "run", "--json", cwd=tmp_path)
    assert e.returncode == 0, e.stderr
    metrics = json.loads(e.stdout)["metrics"]
    assert metrics["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-5)
