"""Every command's boundary (issue 10 item 7): each input class the issue found ending in a
traceback now exits 2 with one message naming the input and the fix; an unexpected error is
one line saying it is a bug and where its traceback was written, exit 1."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile

import pytest
from clihelp import assert_user_error

from zenflow.train import runs

SHORT = ["--max-steps", "2", "--micro-batch", "4", "--seq-len", "16", "--max-eval-samples", "8"]


@pytest.fixture
def sample(tmp_path):
    from zenflow.train.data import write_sst2_sample

    return write_sst2_sample(tmp_path / "data", n=16, n_dev=8)


def finetune_args(model, data, root) -> list:
    return ["finetune", model, "--task", "sst2", "--data-dir", data, "--runs-root", root, *SHORT]


def _text(result) -> str:
    return result.output  # stdout and stderr, as the terminal shows them


# ------------------------------------------------------------------------------ structure


def test_every_command_has_the_boundary():
    from zfctl.app import app

    names = [c.name for c in app.registered_commands]
    assert set(names) >= {"init", "tune-hw", "finetune", "report", "env", "estimate"}
    assert all(getattr(c.callback, "zfctl_boundary", False) for c in app.registered_commands)


def test_a_bug_is_one_line_and_a_log(cli, tmp_path, monkeypatch):
    import zfctl.init_cmd

    def broken(name):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(zfctl.init_cmd, "template_path", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = cli("init", "--output", tmp_path / "ds.json")
    assert r.exit_code == 1
    lines = [ln for ln in _text(r).splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0]
    assert lines[0].startswith("internal error (a bug in zfctl): ZeroDivisionError: boom;")
    (log,) = tmp_path.glob("zfctl-error-*.log")
    assert f"the traceback is in {log}" in lines[0]
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "ZeroDivisionError: boom" in text
    assert "in broken" in text


def test_a_bug_during_a_run_logs_into_its_run_dir(
    cli, tmp_path, tiny_gpt2_dir, sample, monkeypatch
):
    from zenflow.train import trainer

    def broken(self, step):
        raise RuntimeError("evaluation exploded")

    monkeypatch.setattr(trainer._Run, "evaluate", broken)
    r = cli(*finetune_args(tiny_gpt2_dir, sample, tmp_path / "runs"))
    assert r.exit_code == 1
    run_dir = runs.latest_run(tmp_path / "runs")
    log = run_dir / runs.ERROR_LOG
    assert f"the traceback is in {log}" in _text(r) and "Traceback" not in _text(r)
    assert "RuntimeError: evaluation exploded" in log.read_text()


@pytest.mark.parametrize(
    "exc, fragments",
    [
        (
            PermissionError(errno.EACCES, "Permission denied", "/x/template.json"),
            ["/x/template.json: Permission denied; check the permissions"],
        ),
        (
            OSError(errno.ENOSPC, "No space left on device", "/x/out"),
            ["/x/out: No space left on device; free space there", "free on /"],
        ),
        (
            UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
            ["not UTF-8 text (byte 0: invalid start byte)", "save it as UTF-8"],
        ),
    ],
    ids=["permission", "no-space", "decode"],
)
def test_known_failure_classes_exit_2(cli, tmp_path, monkeypatch, exc, fragments):
    import zfctl.init_cmd

    def failing(name):
        raise exc

    monkeypatch.setattr(zfctl.init_cmd, "template_path", failing)
    assert_user_error(cli("init", "--output", tmp_path / "ds.json"), *fragments)


# ------------------------------------------------------------------- the model's weights


def test_truncated_weights(cli, tmp_path, tiny_gpt2_dir, sample):
    bad = tmp_path / "model"
    shutil.copytree(tiny_gpt2_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    r = cli(*finetune_args(bad, sample, tmp_path / "runs"))
    assert_user_error(r, f"Could not load weights from the local directory {bad}", "--init random")
    assert not (tmp_path / "runs").exists()


def test_weights_of_the_wrong_shape(cli, tmp_path, tiny_gpt2_dir, sample):
    bad = tmp_path / "model"
    shutil.copytree(tiny_gpt2_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["n_embd"] = 64  # the saved tensors are 32 wide
    (bad / "config.json").write_text(json.dumps(cfg))
    r = cli(*finetune_args(bad, sample, tmp_path / "runs"))
    assert_user_error(r, f"Could not load weights from the local directory {bad}",
                      "shapes do not match the model's config.json")  # fmt: skip


# ------------------------------------------------------------------------- data, lengths


def test_non_utf8_data_file(cli, tmp_path, tiny_gpt2_dir, sample):
    train = sample / "sst2" / "train.tsv"
    lines = train.read_bytes().splitlines(True)
    lines.insert(5, b"caf\xe9 au lait\t1\n")  # latin-1, not UTF-8
    train.write_bytes(b"".join(lines))
    r = cli(*finetune_args(tiny_gpt2_dir, sample, tmp_path / "runs"))
    assert_user_error(r, f"{train}, line 6: not UTF-8 text", "iconv")


def test_seq_len_beyond_the_models_positions_leaves_no_run_dir(
    cli, tmp_path, tiny_gpt2_dir, sample
):
    args = finetune_args(tiny_gpt2_dir, sample, tmp_path / "runs")
    r = cli(*args, "--seq-len", "65")
    assert_user_error(r, "--seq-len 65 is longer than the 64 positions", "--seq-len 64 or less")
    assert not (tmp_path / "runs").exists()
    r = cli(*args, "--seq-len", "65", "--run-dir", tmp_path / "mine")
    assert_user_error(r, "--seq-len 65")
    assert not (tmp_path / "mine").exists()


@pytest.mark.parametrize("flag", ["--runs-root", "--run-dir"])
def test_run_location_that_is_a_file(cli, tmp_path, tiny_gpt2_dir, sample, flag):
    f = tmp_path / "afile"
    f.write_text("x")
    args = finetune_args(tiny_gpt2_dir, sample, tmp_path / "runs")
    r = cli(*args, flag, f)
    assert_user_error(r, f"{flag} {f} is a file, not a directory")
    r = cli(*args, flag, f / "sub")
    assert_user_error(r, f"{flag} {f / 'sub'} is inside {f}, which is a file")


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("depth", [40, 100_000], ids=["deep", "parser-recursion"])
def test_deeply_nested_config(cli, tmp_path, tiny_gpt2_dir, sample, depth):
    cfg = tmp_path / "deep.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 4, "x": ' + "[" * depth + "]" * depth + "}")
    r = cli(*finetune_args(tiny_gpt2_dir, sample, tmp_path / "runs"), "--config", cfg)
    assert_user_error(r, str(cfg), "more than 32 levels deep")


def test_duplicate_keys_in_a_config(cli, tmp_path, tiny_gpt2_dir, sample):
    cfg = tmp_path / "dup.json"
    cfg.write_text(
        '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, '
        '"zenflow": {"topk_ratio": 0.1, "update_interval": 4, "topk_ratio": 0.5}}}'
    )
    r = cli(*finetune_args(tiny_gpt2_dir, sample, tmp_path / "runs"), "--config", cfg)
    assert_user_error(r, str(cfg), "zero_optimization.zenflow.topk_ratio = [0.1, 0.5]",
                      "is given 2 times in the same JSON object")  # fmt: skip


# ----------------------------------------------------------------------------- init


def test_init_output_onto_a_directory(cli, tmp_path):
    assert_user_error(cli("init", "--output", tmp_path), f"--output {tmp_path} is a directory")


def test_init_output_on_a_full_disk_leaves_nothing(cli, tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "ds.json"
    r = cli("init", "--output", out)
    assert_user_error(r, f"--output: cannot write {out}: No space left on device",
                      f"free on {tmp_path}")  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temp file


# ------------------------------------------------------------------------ hw.json (item 8)


def test_hw_json_must_exist_and_be_json(cli, tmp_path, tiny_gpt2_dir, sample, monkeypatch):
    args = finetune_args(tiny_gpt2_dir, sample, tmp_path / "runs")
    missing = tmp_path / "nope.json"
    assert_user_error(cli(*args, "--hw-json", missing), f"--hw-json {missing}: no such file")
    bad = tmp_path / "bad.json"
    bad.write_text('{"cores": 2,')
    assert_user_error(cli(*args, "--hw-json", bad), f"--hw-json {bad} cannot be used",
                      "is not valid JSON", "zfctl tune-hw")  # fmt: skip
    monkeypatch.chdir(tmp_path)  # the implicit ./hw.json: optional, but not when broken
    (tmp_path / "hw.json").write_text("[1, 2]")
    assert_user_error(cli(*args), "hw.json (read by default from the current folder)",
                      "JSON list")  # fmt: skip
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------- Rich emoji codes (issue 31)


def test_every_rich_console_of_zfctl_has_emoji_off():
    """A Console with emoji on turns ":smile:" in any printed path into an emoji; every
    Console zfctl makes passes emoji=False (a new one without it fails here)."""
    import ast
    from pathlib import Path

    import zfctl

    found = []
    for path in sorted(Path(zfctl.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = getattr(node, "func", None)
            name = getattr(func, "id", None) or getattr(func, "attr", None)
            if isinstance(node, ast.Call) and name == "Console":
                emoji = [k.value for k in node.keywords if k.arg == "emoji"]
                ok = len(emoji) == 1 and getattr(emoji[0], "value", None) is False
                found.append((f"{path.name}:{node.lineno}", ok))
    assert len(found) >= 10  # errors, finetune, report, init, eval, env, estimate, ...
    assert [where for where, ok in found if not ok] == []


def test_a_path_with_emoji_codes_is_printed_as_it_is(cli, tmp_path):
    """Old: `a:smile:b` came out as "a😄b" in the error (and in every table)."""
    odd = tmp_path / "run:smile:s:thumbs_up:"
    odd.mkdir()
    r = cli("report", odd)
    assert_user_error(r, f"{odd} is not a zfctl run directory")
    assert "\N{SMILING FACE WITH OPEN MOUTH AND SMILING EYES}" not in r.output
    r = cli("init", "--output", odd / "ds.json")
    assert r.exit_code == 0, r.output
    assert f"wrote {odd / 'ds.json'}" in " ".join(r.output.split())
