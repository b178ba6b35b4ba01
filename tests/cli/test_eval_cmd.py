"""`zfctl eval`: a run's model reproduces the run's final evaluation exactly; any model
folder on a table; predictions; and the exported model is plain Hugging Face."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from clihelp import assert_user_error

from zenflow.train import runs
from zenflow.train.learning import WEIGHTS_FIELDS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _zfctl(*args, cwd):
    """zfctl in a fresh interpreter (not the test's), like a user's second command."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "zfctl", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def table_run(tmp_path_factory, tiny_gpt2_dir):
    """A finished --data run (string labels, a seeded split, 12 of its eval rows)."""
    d = tmp_path_factory.mktemp("eval")
    rows = [("a fine, moving film", "pos"), ("dull and far too long", "neg"),
            ("a joy to watch", "pos"), ("nothing works here", "neg")] * 15  # fmt: skip
    with open(d / "reviews.jsonl", "w", encoding="utf-8") as f:
        for i, (text, label) in enumerate(rows):
            f.write(json.dumps({"body": f"{text} ({i})", "verdict": label}) + "\n")
    r = _zfctl("finetune", tiny_gpt2_dir, "--data", d / "reviews.jsonl", "--text-field", "body",
               "--label-field", "verdict", "--max-steps", "4", "--micro-batch", "4",
               "--seq-len", "16", "--max-eval-samples", "5", "--run-dir", d / "run",
               "--no-dashboard", cwd=d)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return d


def test_a_runs_model_reproduces_its_final_evaluation(table_run):
    final = runs.read_run(table_run / "run")["evals"][-1]
    r = _zfctl("eval", table_run / "run", "--json", cwd=table_run)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # bit for bit: the in-memory trained model at its final evaluation and the exported
    # model loaded in another process give the same figures (eval_loss sums every logit)
    assert doc["metrics"] == {
        k: v for k, v in final.items() if k not in ("type", "step", *WEIGHTS_FIELDS)
    }
    assert doc["metrics"]["eval_samples"] == 5 and "seeded split" in doc["source"]
    assert final["weights"] == "flushed"  # a ZenFlow run's final evaluation: nothing pending


def test_a_glue_runs_model_reproduces_its_final_evaluation(cli, tmp_path, tiny_gpt2_dir):
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--sample-data", "--max-steps", "3",
            "--micro-batch", "4", "--seq-len", "16", "--engine", "offload",
            "--run-dir", tmp_path / "run", "--runs-root", tmp_path)  # fmt: skip
    assert r.exit_code == 0, r.output
    final = runs.read_run(tmp_path / "run")["evals"][-1]
    e = _zfctl("eval", tmp_path / "run", "--json", cwd=tmp_path)
    assert e.returncode == 0, e.stderr
    metrics = json.loads(e.stdout)["metrics"]
    assert metrics == {k: v for k, v in final.items() if k not in ("type", "step", *WEIGHTS_FIELDS)}


def test_model_folder_on_a_table_with_predictions_and_plain_transformers(table_run, tmp_path):
    model = table_run / "run" / runs.MODEL_DIR
    data = tmp_path / "more.csv"
    data.write_text("body,verdict\na joy to watch,pos\nnothing works here,neg\nso dull,neg\n")
    out = tmp_path / "pred.jsonl"
    r = _zfctl("eval", model, "--data", data, "--text-field", "body", "--label-field",
               "verdict", "--seq-len", "16", "--predictions", out, "--json",
               cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["metrics"]["eval_samples"] == 3 and doc["run_dir"] is None
    preds = [json.loads(line) for line in out.read_text().splitlines()]
    assert [p["label_name"] for p in preds] == ["pos", "neg", "neg"]  # the model's id2label
    assert [p["label"] for p in preds] == [1, 0, 0]
    assert doc["metrics"]["accuracy"] == sum(p["label"] == p["prediction"] for p in preds) / 3
    # The exported folder is a plain Hugging Face model: transformers alone (no zfctl on the
    # path) loads it and computes the same logits.
    script = textwrap.dedent(f"""
        import json, sys, torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        tok = AutoTokenizer.from_pretrained({str(model)!r})
        m = AutoModelForSequenceClassification.from_pretrained({str(model)!r}).eval()
        enc = tok(["a joy to watch", "nothing works here", "so dull"], padding="max_length",
                  truncation=True, max_length=16, return_tensors="pt")
        with torch.no_grad():
            print(json.dumps({{"logits": m(**enc).logits.tolist(), "id2label": m.config.id2label,
                              "zfctl": any(k.startswith(("zfctl", "zenflow"))
                                           for k in sys.modules)}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    got = json.loads(plain.stdout)
    assert got["zfctl"] is False and got["id2label"] == {"0": "neg", "1": "pos"}
    assert got["logits"] == [p["logits"] for p in preds]


def test_bad_targets_and_flags(cli, tmp_path, table_run):
    assert_user_error(cli("eval", table_run / "run" / runs.MODEL_DIR),
                      "is a model folder, not a run", "--data FILE")  # fmt: skip
    assert_user_error(cli("eval", tmp_path), "neither a zfctl run directory nor")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    cfg = runs.run_config(table_run / "run")
    (unfinished / runs.CONFIG_FILE).write_text(json.dumps(cfg))
    assert_user_error(cli("eval", unfinished), "holds no saved model yet", "--resume")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x", "verdict": "maybe"}\n{"body": "y", "verdict": "pos"}\n')
    assert_user_error(cli("eval", table_run / "run", "--data", bad), "'maybe'",
                      "not one of the classes")  # fmt: skip
    assert_user_error(cli("eval", table_run / "run", "--data", bad, "--task", "sst2"),
                      "pass one of them")  # fmt: skip


# ----------------------------------------------------------------- issue 31


def test_predictions_never_write_over_an_input_or_a_runs_files(cli, table_run, tmp_path):
    """Old: --predictions overwrote the --data file it read and the run's metrics.jsonl,
    exit 0. Now an input or a run's file is refused even with --force, any other existing
    file needs --force, and each refused file keeps its bytes."""
    data = tmp_path / "more.jsonl"
    data.write_text('{"body": "a joy", "verdict": "pos"}\n{"body": "so dull", "verdict": "neg"}\n')
    metrics = table_run / "run" / runs.METRICS_FILE
    kept = {p: p.read_bytes() for p in (data, metrics)}
    run = table_run / "run"
    for force in ((), ("--force",)):
        r = cli("eval", run, "--data", data, "--predictions", data, *force)
        assert_user_error(r, f"--predictions {data} is {data}, which this command reads",
                          "--force does not change that")  # fmt: skip
    link = tmp_path / "link.jsonl"
    link.symlink_to(data)  # the same file by another name
    assert_user_error(cli("eval", run, "--data", data, "--predictions", link, "--force"),
                      "which this command reads")  # fmt: skip
    assert_user_error(cli("eval", run, "--predictions", metrics, "--force"),
                      f"is inside the run {run.resolve()} (metrics.jsonl")  # fmt: skip
    model_file = run / runs.MODEL_DIR / "config.json"
    assert_user_error(cli("eval", run / runs.MODEL_DIR, "--data", data, "--predictions",
                          model_file, "--force"), "(model, which zfctl keeps")  # fmt: skip
    assert {p: p.read_bytes() for p in kept} == kept
    out = tmp_path / "pred.jsonl"
    out.write_text("an older file\n")
    assert_user_error(cli("eval", run, "--data", data, "--predictions", out),
                      f"--predictions {out} already exists; pass --force")  # fmt: skip
    assert out.read_text() == "an older file\n"
    r = cli("eval", run, "--data", data, "--predictions", out, "--force", "--json")
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["label_name"] for line in out.read_text().splitlines()] == [
        "pos", "neg"]  # fmt: skip


def test_a_folder_without_tokenizer_files_is_scored_with_finetunes_tokenizer(cli, table_run,
                                                                            tmp_path):  # fmt: skip
    """Old: transformers 5 gave a one-token tokenizer that encoded every row to [], so every
    row had the same logits and an accuracy was printed. Now the folder takes the tokenizer
    finetune takes (the packaged GPT-2 BPE for a GPT-2 folder) and says so: the same logits
    as the run's own folder, which holds the tokenizer files."""
    import shutil

    model = table_run / "run" / runs.MODEL_DIR
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, bare / name)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"body": t, "verdict": v}) + "\n" for t, v in (
        ("a fine, moving film", "pos"), ("dull and far too long", "neg"),
        ("a joy to watch", "pos"), ("nothing works here", "neg"))))  # fmt: skip
    logits = {}
    for name, folder in (("own", model), ("bare", bare)):
        out = tmp_path / f"{name}.jsonl"
        r = cli("eval", folder, "--data", data, "--text-field", "body", "--label-field",
                "verdict", "--seq-len", "16", "--predictions", out)  # fmt: skip
        assert r.exit_code == 0, r.output
        logits[name] = [json.loads(line)["logits"] for line in out.read_text().splitlines()]
    assert len({tuple(lg) for lg in logits["bare"]}) == 4  # each row scored on its own text
    assert logits["bare"] == logits["own"]
    assert "note: tokenizer: packaged GPT-2 tokenizer files" in r.output
    assert f"(no tokenizer files in {bare})" in " ".join(r.output.split())


def test_a_runs_own_rows_need_its_data_files_unchanged(cli, table_run):
    """Old: after the training file changed, eval of the run scored its seeded split of the
    new file (other rows, or rows the model trained on) as the run's own, exit 0."""
    data = table_run / "reviews.jsonl"
    original = data.read_bytes()
    try:
        data.write_bytes(original + b'{"body": "one more", "verdict": "pos"}\n')
        assert_user_error(cli("eval", table_run / "run"), f"{data}, the run's --data (training) "
                          "file, changed since the run", "zfctl eval")  # fmt: skip
        data.unlink()
        assert_user_error(cli("eval", table_run / "run"), "is not there any more")
    finally:
        data.write_bytes(original)
    assert cli("eval", table_run / "run", "--json").exit_code == 0


def test_eval_of_a_diverged_run_says_it_diverged(cli, table_run, tmp_path):
    """Old: "holds no saved model yet ... the run has not finished. Resume it to the end"."""
    run = tmp_path / "diverged"
    (run / runs.CHECKPOINT_DIR).mkdir(parents=True)
    (run / runs.CONFIG_FILE).write_bytes((table_run / "run" / runs.CONFIG_FILE).read_bytes())
    ckpt = run / runs.CHECKPOINT_DIR / "step-0000006.pt"
    ckpt.write_bytes(b"")
    (run / runs.SUMMARY_FILE).write_text(json.dumps({
        "status": "diverged", "last_good_step": 6,
        "divergence": {"step": 9, "reason": "non-finite loss for 3 steps"}}))  # fmt: skip
    r = cli("eval", run)
    said = f"{run} diverged at step 9 (non-finite loss for 3 steps; last good step 6)"
    assert_user_error(r, said, f"last good checkpoint is {ckpt}", f"--resume {run} --lr")
    assert "not finished" not in r.output
