"""`zfctl finetune --nproc 2` (torch.distributed.run on this machine) and `--device sim`.

Two ranks over a global micro-batch of 2 x 4 train what one process with micro-batch 8
trains, within fp32 tolerance; a two-rank run stopped at step 3 and resumed equals the
straight run; a simulated device is named in the header and reports device bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zenflow.train.data import write_sst2_sample

ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", COLUMNS="200")
ENV.pop("WORLD_SIZE", None)
ZF = ["--set", "zero_optimization.zenflow.update_interval=2",
      "--set", "zero_optimization.zenflow.select_strategy=step",
      "--set", "zero_optimization.zenflow.select_interval=3"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_sst2_sample(tmp_path_factory.mktemp("data"), n=48, n_dev=8)


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    """The tiny GPT-2 of tests/conftest.py without dropout: two ranks draw dropout masks
    for half a batch each and one process for all of it, so with dropout they would differ
    by design."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from zenflow.train.models import packaged_gpt2_tokenizer

    d = tmp_path_factory.mktemp("tiny-gpt2-nodrop")
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=50257, num_labels=2,
        pad_token_id=50256, bos_token_id=50256, eos_token_id=50256, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
    )  # fmt: skip
    GPT2ForSequenceClassification(cfg).save_pretrained(d)
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(d)
    return d


def _zfctl(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zfctl", *map(str, args)], env=ENV, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def _finetune(model, data, run_dir, *extra):
    return _zfctl(
        "finetune", model, "--task", "sst2", "--data-dir", data, "--seq-len", 16,
        "--max-eval-samples", 8, "--run-dir", run_dir, "--no-dashboard", "--lr", "1e-3",
        *ZF, *extra,
    )  # fmt: skip


def _weights(run_dir: Path) -> dict:
    return load_file(run_dir / "model" / "model.safetensors")


def test_two_ranks_train_what_one_process_trains(tiny_gpt2_dir, data, tmp_path):
    one = _finetune(tiny_gpt2_dir, data, tmp_path / "one", "--max-steps", 4, "--micro-batch", 8)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _finetune(tiny_gpt2_dir, data, tmp_path / "two", "--max-steps", 4, "--micro-batch", 4,
                    "--nproc", 2)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 data-parallel ranks" in two.stdout  # rank 0 reports, once
    assert two.stdout.count("eval at step 4") == 1
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    s1 = json.loads((tmp_path / "one" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert s2["world_size"] == 2 and s2["samples"] == s1["samples"] == 4 * 8
    dp = s2["data_parallel"]  # re-selection's score all-reduce, next to the gradients
    assert 0 < 10 * dp["selection_score_floats"] < dp["selection_gradient_floats_instead"]
    assert abs(s2["final_loss"] - s1["final_loss"]) < 1e-4
    shards = sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir())
    assert "step-0000004.pt" in shards and "step-0000004.rank-1.pt" in shards


def test_two_rank_run_resumes_exactly(tiny_gpt2_dir, data, tmp_path):
    common = ("--micro-batch", 4, "--nproc", 2)
    straight = _finetune(tiny_gpt2_dir, data, tmp_path / "straight", "--max-steps", 6, *common)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = _finetune(tiny_gpt2_dir, data, tmp_path / "r", "--max-steps", 3, *common)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _zfctl(
        "finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", data, "--resume",
        tmp_path / "r", "--max-steps", 6, "--no-dashboard", "--nproc", 2,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "r")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    wrong = _zfctl("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", data,
                   "--resume", tmp_path / "r", "--max-steps", 8, "--no-dashboard")  # fmt: skip
    assert wrong.returncode == 2 and "--nproc 2" in wrong.stderr, wrong.stderr[-2000:]
    assert "Traceback" not in wrong.stderr


def test_a_bad_input_under_nproc_exits_2_without_a_launcher_traceback(tiny_gpt2_dir, tmp_path):
    r = _zfctl("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", tmp_path / "none",
               "--max-steps", 2, "--nproc", 2, "--runs-root", tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
    assert "data-parallel run failed: rank" in r.stderr


def test_sim_device_is_named_and_reports_device_bytes(tiny_gpt2_dir, data, tmp_path):
    r = _finetune(tiny_gpt2_dir, data, tmp_path / "sim", "--max-steps", 4, "--device", "sim")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "simulated accelerator" in r.stdout
    s = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert s["device"].startswith("sim (simulated")
    assert 4.0 < s["device_bytes_per_param"] < 10.0  # fp32: 4 + 4 + the selected state
    assert s["bytes_per_step_x_model"] > 0.5  # a separate device: the gradient really moves
