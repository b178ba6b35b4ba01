"""bench/sft_demo.py prepare: SST-2 as prompt/completion records, a decoder config, and the
weights a `--init random` run of it starts from (the demo's "before")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from zenflow.train.data import write_sst2_sample
from zenflow.train.models import resolve_model

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sft_demo.py"


def test_prepare_writes_records_decoder_and_the_runs_start(tmp_path):
    glue = write_sst2_sample(tmp_path / "glue", n=24, n_dev=8)
    out = tmp_path / "demo"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(SCRIPT), "prepare", str(out), "--glue-dir",
                        str(glue), "--layers", "1", "--width", "32", "--heads", "2",
                        "--seed", "7"], capture_output=True, text=True, env=env,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    dev = [json.loads(line) for line in (out / "dev.jsonl").read_text().splitlines()]
    assert len(train) == 24 and len(dev) == 8
    tsv = (glue / "sst2" / "train.tsv").read_text().splitlines()[1:]
    sentence, label = tsv[0].rsplit("\t", 1)
    want = " positive" if label == "1" else " negative"
    assert train[0] == {"prompt": f"Review: {sentence.strip()}\nSentiment:", "completion": want}
    assert {rec["completion"] for rec in train} <= {" positive", " negative"}
    # before/ holds exactly the weights `zfctl finetune decoder --init random --seed 7` starts
    # from (the trainer resolves the model the same way).
    start = resolve_model(str(out / "decoder"), task_num_labels=0, init="random", seed=7,
                          head="causal-lm").model.state_dict()  # fmt: skip
    saved = load_file(out / "before" / "model.safetensors")
    assert saved and all(torch.equal(saved[k], start[k]) for k in saved)
    assert "zfctl finetune" in r.stdout and "--init random" in r.stdout
