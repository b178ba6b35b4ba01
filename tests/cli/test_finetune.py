"""`zfctl finetune` through the CLI: every user error exits 2 with a message; a real short
run on SST-2 rows writes a run that `zfctl report --json` reads back."""

from __future__ import annotations

import json

import pytest
from clihelp import assert_user_error

from zenflow.train import runs

SHORT = ["--max-steps", "3", "--micro-batch", "4", "--seq-len", "16", "--max-eval-samples", "16"]


def test_unknown_task(cli, tmp_path, tiny_gpt2_dir):
    r = cli("finetune", tiny_gpt2_dir, "--task", "nosuch", "--runs-root", tmp_path)
    assert_user_error(r, "'nosuch'", "sst2", "--task")


def test_missing_data(cli, tmp_path, tiny_gpt2_dir, monkeypatch):
    monkeypatch.delenv("GLUE_DIR", raising=False)
    empty = tmp_path / "glue"
    empty.mkdir()
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", empty,
            "--runs-root", tmp_path / "runs", *SHORT)  # fmt: skip
    assert_user_error(r, str(empty))


def test_offline_model_not_cached_says_init_random(cli, tmp_path, glue_dir):
    r = cli("finetune", "no-such-org/no-such-model-zfctl", "--task", "sst2",
            "--data-dir", glue_dir, "--runs-root", tmp_path, *SHORT)  # fmt: skip
    assert_user_error(r, "no-such-org/no-such-model-zfctl", "--init random")
    assert not any(tmp_path.iterdir())  # nothing half-made


def test_unreadable_local_model(cli, tmp_path, glue_dir):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    r = cli("finetune", bad, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path / "runs", *SHORT)  # fmt: skip
    assert_user_error(r, str(bad))


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--engine", "gpu"], ["--engine", "'gpu'", "zenflow, offload, device"]),
        (["--init", "zeros"], ["--init", "'zeros'", "pretrained, random"]),
        (["--epochs", "-1"], ["--epochs", "positive"]),
        (["--config", "missing.json"], ["missing.json", "zfctl init"]),
        (["--set", "zero_optimization.zenflow.topk_ratio=2"], ["topk_ratio", "2"]),
        (["--set", "nonsense"], ["nonsense"]),
    ],
)
def test_bad_flags(cli, tmp_path, tiny_gpt2_dir, glue_dir, args, fragments):
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path, *SHORT, *args)  # fmt: skip
    assert_user_error(r, *fragments)


def test_bad_config_file_lists_problems(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0, "update_interval": -3}},
    }))  # fmt: skip
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path / "runs", "--config", cfg, *SHORT)  # fmt: skip
    assert_user_error(r, str(cfg), "topk_ratio", "update_interval")


def test_resume_auto_without_runs_starts_a_new_run(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    """--resume auto is safe to pass always (README): with no earlier run it starts a new
    one and says so (it used to be an error, exit 2)."""
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path, "--resume", "auto", "--device", "cpu",
            "--max-steps", "1", "--micro-batch", "4", "--seq-len", "16",
            "--max-eval-samples", "8")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert (
        f"no earlier run of {tiny_gpt2_dir} on sst2 under {tmp_path} to resume; starting a "
        "new run" in " ".join(r.output.split())
    )
    (run_dir,) = runs.list_runs(tmp_path)
    assert runs.latest_checkpoint(run_dir) is not None


def test_end_to_end_finetune_then_report(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    root = tmp_path / "runs"
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", root, "--json", "--eval-every", "2", *SHORT)  # fmt: skip
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stdout.splitlines()]  # every line is JSON
    steps = [e for e in events if e.get("event") == "StepEvent"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert all(e["loss"] is not None and e["d2h_bytes"] >= 0 for e in steps)
    run_dir = runs.latest_run(root)
    assert run_dir is not None
    summary = json.loads((run_dir / runs.SUMMARY_FILE).read_text())
    assert summary["steps"] == 3 and summary["status"] == "finished"
    assert str(glue_dir / "sst2" / "train.tsv") in summary["sources"]["data"]
    assert 0.0 <= summary["validation_accuracy"] <= 1.0
    metrics = runs.read_metrics(run_dir / runs.METRICS_FILE)
    assert [m["step"] for m in metrics if m["type"] == "step"] == [1, 2, 3]

    rep = cli("report", "--runs-root", root, "--json")
    assert rep.exit_code == 0, rep.output
    doc = json.loads(rep.stdout)
    (one,) = doc["runs"]
    assert one["steps"] == 3
    assert one["validation_accuracy"] == pytest.approx(summary["validation_accuracy"])
    assert one["final_loss"] == pytest.approx(summary["final_loss"])


def test_plain_lines_when_not_a_terminal(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path, "--engine", "offload", *SHORT)  # fmt: skip
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "offload" in out
    assert "step 1/3 loss" in out and "step 3/3 loss" in out
    assert "report: zfctl report" in out
    # sources are announced, never silent
    assert "tokenizer" in out and str(tiny_gpt2_dir) in out


def test_reference_run_is_shown_beside_each_evaluation(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    """Issue 17: `--reference RUN` shows that run's accuracy at the same step, and this
    run's difference in points, with every evaluation."""
    common = ("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
              "--max-steps", "2", "--micro-batch", "4", "--seq-len", "16",
              "--max-eval-samples", "8", "--eval-every", "1")  # fmt: skip
    ref = cli(*common, "--engine", "device", "--run-dir", tmp_path / "adamw")
    assert ref.exit_code == 0, ref.output
    acc = {e["step"]: e["accuracy"] for e in runs.read_run(tmp_path / "adamw")["evals"]}
    r = cli(*common, "--run-dir", tmp_path / "zf", "--reference", tmp_path / "adamw")
    assert r.exit_code == 0, r.output
    mine = {e["step"]: e["accuracy"] for e in runs.read_run(tmp_path / "zf")["evals"]}
    for step in (1, 2):
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"eval at step {step}:"))
        diff = f"{100 * (mine[step] - acc[step]):+.2f} points"
        assert f"| adamw: accuracy {acc[step]:.4f} at step {step}, this run {diff}" in line
    assert_user_error(cli(*common, "--run-dir", tmp_path / "x", "--reference", tmp_path / "no"),
                      f"run {tmp_path / 'no'} does not exist")  # fmt: skip
    assert not (tmp_path / "x").exists()
