"""Issue 19, a hostile user's inputs: every one is exit 2 with a message naming the thing
and the fix, never "internal error (a bug in zfctl)" (which was each case's old outcome,
as each test's docstring says)."""

from __future__ import annotations

import json

import pytest
from clihelp import assert_user_error

SHORT = ["--max-steps", "3", "--micro-batch", "4", "--seq-len", "16", "--max-eval-samples", "16"]


def assert_clean_user_error(result, *fragments: str) -> None:
    assert_user_error(result, *fragments)
    assert "internal error" not in result.output


# ----------------------------------------------------------------- model and tokenizer


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory, tiny_gpt2_dir):
    """A GPT-2 classifier with 1000 token rows saved with the full GPT-2 tokenizer."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    d = tmp_path_factory.mktemp("small-vocab")
    torch.manual_seed(0)
    shape = GPT2Config.from_pretrained(tiny_gpt2_dir)  # the tiny model, 1000 token rows
    shape.update({"vocab_size": 1000, "pad_token_id": 999, "eos_token_id": 999,
                  "bos_token_id": 999})  # fmt: skip
    GPT2ForSequenceClassification(shape).save_pretrained(d)
    AutoTokenizer.from_pretrained(tiny_gpt2_dir).save_pretrained(d)
    return d


def test_vocabulary_smaller_than_tokenizer_refused_before_the_run_dir(
    cli, tmp_path, small_vocab_dir, glue_dir
):
    """Old: the first forward ended in IndexError (exit 1) inside a new run directory."""
    runs_root = tmp_path / "runs"
    r = cli("finetune", small_vocab_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", runs_root, "--device", "cpu", *SHORT)  # fmt: skip
    assert_clean_user_error(r, str(small_vocab_dir), "1000 tokens", "50256", "--init random",
                            "resize_token_embeddings")  # fmt: skip
    assert not runs_root.exists() or not any(runs_root.iterdir())


def test_data_ids_past_the_embedding_are_named(tiny_gpt2_dir):
    """The pad id fits but the encoded data's ids do not (the scan's path)."""
    import torch
    from transformers import AutoTokenizer

    from zenflow.errors import ModelSourceError
    from zenflow.train.data import Encoded, Example
    from zenflow.train.models import check_token_ids

    tok = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    tok.pad_token = "!"  # id 0
    model = torch.nn.Module()
    model.get_input_embeddings = lambda: torch.nn.Embedding(300, 4)
    rows = [Example(texts=("a b",), label=0), Example(texts=("zebra crossing",), label=1)]
    check_token_ids(model, tok, [Encoded(rows[:1], tok, 4, False)], "m")  # ids < 300: fine
    with pytest.raises(ModelSourceError, match=r"300 tokens.*ids up to at least \d+"):
        check_token_ids(model, tok, [Encoded(rows, tok, 4, False)], "m")


# ----------------------------------------------------------------- numbers on the command line


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["estimate", "gpt2", "--device-mem", "1e400"], ["--device-mem", "'1e400'", "1 EiB"]),
        (["estimate", "gpt2", "--host-mem", "1e30GiB"], ["--host-mem", "1 EiB"]),
        (["estimate", "gpt2", "--num-labels", "99999999999999999999"], ["--num-labels"]),
        (["estimate", "gpt2", "--micro-batch", "99999999999999999999"], ["--micro-batch"]),
        (["estimate", "gpt2", "--seq-len", "99999999999999999999"], ["--seq-len"]),
        (["finetune", "gpt2", "--task", "sst2", "--lr", "1e400"], ["--lr", "finite"]),
        (["finetune", "gpt2", "--task", "sst2", "--lr", "nan"], ["--lr", "finite"]),
        (["finetune", "gpt2", "--task", "sst2", "--epochs", "inf"], ["--epochs", "finite"]),
        (
            ["finetune", "gpt2", "--task", "sst2", "--max-steps", "99999999999999999999999"],
            ["--max-steps", "2147483647"],
        ),
        (["finetune", "gpt2", "--task", "sst2", "--seed", "-99999999999999"], ["--seed"]),
        (["finetune", "gpt2", "--task", "sst2", "--device-mem", "1e400"], ["--device-mem"]),
        (["init", "--print", "--lr", "inf"], ["--lr", "finite"]),
        (["init", "--print", "--micro-batch", "99999999999999999999"], ["--micro-batch"]),
        (["tune-hw", "--topk", "nan"], ["--topk", "finite"]),
        (["tune-hw", "--device-mem", "1e400"], ["--device-mem"]),
        (["bench", "--deadline", "inf"], ["--deadline", "finite"]),
        (["bench", "--steps", "99999999999999999999"], ["--steps"]),
    ],
)
def test_numbers_past_any_use_are_refused_naming_the_flag(cli, tmp_path, args, fragments):
    """Old: --device-mem 1e400 and --epochs inf ended in OverflowError (exit 1), and
    --max-steps 10**23 started a run whose ETA ran to 10**18 hours; estimate --num-labels
    10**20 and bench --steps 10**20 never returned (transformers built 10**20 label names;
    the bench ran on)."""
    extra = ["--runs-root", tmp_path] if args[0] == "finetune" else []
    r = cli(*args, *extra)
    assert_clean_user_error(r, *fragments)


def test_numeric_set_values_that_overflow(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    """A JSON integer past any run's length is refused naming the key (old: accepted)."""
    huge = "zero_optimization.zenflow.update_interval=" + "1" + "0" * 29
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path, *SHORT, "--set", huge)  # fmt: skip
    assert_clean_user_error(r, "update_interval", "--set")


def test_epochs_past_any_run_length(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    """--epochs 1e300 is finite but its step count is not (old: OverflowError, exit 1)."""
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path / "runs", "--micro-batch", "4", "--seq-len", "16",
            "--device", "cpu", "--epochs", "1e300")  # fmt: skip
    assert_clean_user_error(r, "--epochs 1e+300", "--max-steps")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ----------------------------------------------------------------- config files and --set


def test_set_errors_name_the_set_item_not_the_template(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    """Old: "templates/zenflow.json: 1 problem(s)", as if the shipped file were wrong."""
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path, *SHORT,
            "--set", "zero_optimization.zenflow.topk_ratio=5")  # fmt: skip
    assert_clean_user_error(r, "--set zero_optimization.zenflow.topk_ratio=5", "(0, 1]")
    assert "templates" not in r.output and "zenflow.json" not in r.output


def test_set_and_file_problems_are_told_apart(tmp_path):
    from zenflow.config import ConfigError, load_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 0}))
    with pytest.raises(ConfigError) as exc:
        load_config(path, overrides={"steps_per_print": "often"})
    text = str(exc.value)
    assert text.startswith(f"{path} with --set: 2 problem(s)")
    assert "steps_per_print (from --set steps_per_print=often) = 'often'" in text
    assert "  - train_micro_batch_size_per_gpu = 0" in text  # the file's own problem


def test_config_that_is_a_directory_or_a_link_loop(cli, tmp_path):
    """Old: both were "no such file; write one with zfctl init"."""
    r = cli("estimate", "gpt2", "--config", tmp_path)
    assert_clean_user_error(r, f"--config {tmp_path} is a directory", "give the JSON file")
    loop = tmp_path / "a.json"
    loop.symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(loop)
    r = cli("estimate", "gpt2", "--config", loop)
    assert_clean_user_error(r, f"--config {loop} is a symbolic link loop")


def test_config_loader_names_directories_loops_and_bytes(tmp_path):
    from zenflow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    with pytest.raises(ConfigError, match="symbolic link loop"):
        load_config(loop)
    latin = tmp_path / "latin1.json"
    latin.write_bytes(b'{\n  "steps_per_print": 10, "x": "caf\xe9"\n}')
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(line 2, byte 36 = 0xe9"):
        load_config(latin)


def test_config_with_a_byte_order_mark_is_read(tmp_path):
    """Old: "not valid JSON: Unexpected UTF-8 BOM" for a file Notepad saved."""
    from zenflow.config import load_config

    path = tmp_path / "ds.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"steps_per_print": 7}).encode())
    assert load_config(path).steps_per_print == 7


def test_hw_json_not_utf8_names_line_and_byte(tmp_path):
    from zenflow.errors import UserInputError
    from zenflow.train import runs

    path = tmp_path / "hw.json"
    path.write_bytes(b'{"a": 1,\n "b": "\xff"}')
    with pytest.raises(UserInputError, match=r"hw.json is not UTF-8 text \(line 2, byte 16 = 0xff"):
        runs.read_json(path)
    path.write_bytes(b"\xef\xbb\xbf{}")
    assert runs.read_json(path) == {}


# ----------------------------------------------------------------- data files


def _sst2(folder, *, train=True, dev=True, header=b"sentence\tlabel\n", prefix=b""):
    folder.mkdir(parents=True, exist_ok=True)
    rows = b"".join(b"a fine film %d .\t%d\n" % (i, i % 2) for i in range(8))
    if train:
        (folder / "train.tsv").write_bytes(prefix + header + rows)
    if dev:
        (folder / "dev.tsv").write_bytes(prefix + header + rows)


def test_missing_dev_file_is_named(cli, tmp_path, tiny_gpt2_dir):
    """Old: "looked for train.tsv and dev.tsv" although train.tsv was there."""
    _sst2(tmp_path / "glue" / "sst2", dev=False)
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", tmp_path / "glue",
            "--runs-root", tmp_path / "runs", *SHORT)  # fmt: skip
    where = tmp_path / "glue" / "sst2"
    assert_clean_user_error(r, f"{where / 'dev.tsv'} is missing", "holds train.tsv")
    assert "looked for" not in r.output


def test_tsv_with_a_byte_order_mark_is_read(tmp_path):
    """Old: the first column came out as "\\ufeffsentence", so "missing column 'sentence'"."""
    from zenflow.train.data import load_task

    _sst2(tmp_path / "sst2", prefix=b"\xef\xbb\xbf")
    data = load_task("sst2", tmp_path)
    assert data.train[0].texts == ("a fine film 0 .",) and len(data.dev) == 8


def test_tsv_not_utf8_names_file_line_and_byte(tmp_path):
    from zenflow.errors import DataError
    from zenflow.train.data import load_task

    _sst2(tmp_path / "sst2")
    bad = tmp_path / "sst2" / "dev.tsv"
    bad.write_bytes(b"sentence\tlabel\nok .\t1\ncaf\xe9 .\t0\n")
    with pytest.raises(DataError, match=rf"{bad}, line 3: not UTF-8 text \(byte 25 = 0xe9"):
        load_task("sst2", tmp_path)


# ----------------------------------------------------------------- checkpoints and resume


def test_checkpoint_outside_a_run_dir_is_named(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    """Old: "<dir>/config.json has no run spec" (or no such file) for a copied checkpoint."""
    import torch

    stray = tmp_path / "copies" / "step-0000005.pt"
    stray.parent.mkdir()
    torch.save({"format": 2}, stray)
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path / "runs", "--resume", stray, *SHORT)  # fmt: skip
    assert_clean_user_error(r, f"--resume {stray}", "not inside a zfctl run directory",
                            "runs/<run>/checkpoints/", "Pass the run directory")  # fmt: skip
    assert "config.json has no run spec" not in r.output


@pytest.mark.parametrize("how", ["pickle.dump", "torch legacy"])
def test_raw_pickle_checkpoint_is_refused_without_torchs_advice(tmp_path, how):
    """Old: pickle.dump's file passed on PyTorch's "Re-running torch.load with weights_only
    set to False will likely succeed"; torch's legacy format was read as data."""
    import pickle

    import torch

    from zenflow.train import checkpointing

    path = tmp_path / "step-0000001.pt"
    state = {"format": 2, "step": 1}
    if how == "pickle.dump":
        path.write_bytes(pickle.dumps(state))
    else:
        torch.save(state, path, _use_new_zipfile_serialization=False)
    with pytest.raises(checkpointing.UnsafeCheckpointError) as exc:
        checkpointing.read_checkpoint(torch, path)
    text = str(exc.value)
    assert f"{path} is a raw Python pickle" in text and "nothing in it was executed" in text
    assert "weights_only" not in text


def test_resume_conflict_never_says_run_has_none(tmp_path):
    """Old: "lr: run has None, given 0.001" when the run took the config's lr."""
    import dataclasses

    from zenflow.config import load_config
    from zenflow.errors import UserInputError
    from zenflow.train import runs
    from zenflow.train.spec import RunSpec, merge_resumed_spec, spec_record

    spec = RunSpec(model="m", task="sst2", config=load_config({}))
    record = spec_record(spec)
    del record["seq_len"]  # an older run's config.json without it
    (tmp_path / runs.CONFIG_FILE).write_text(json.dumps({"run": record}))
    asked = dataclasses.replace(spec, lr=1e-3, seq_len=64)
    with pytest.raises(UserInputError) as exc:
        merge_resumed_spec(asked, tmp_path)
    text = str(exc.value)
    assert "None" not in text
    assert "lr: the run did not set it (it took the config's value), given 0.001" in text
    assert "seq_len: the run's config.json does not record it, given 64" in text


# ----------------------------------------------------------------- estimate and run length


def test_estimate_warns_past_the_models_positions(cli):
    """Old: no word about it; finetune then refused the same --seq-len."""
    r = cli("estimate", "gpt2", "--seq-len", "4096", "--json")
    assert r.exit_code == 0, r.output
    (warning,) = json.loads(r.output)["warnings"]
    assert "--seq-len 4096 is past the 1024 positions of gpt2" in warning
    r = cli("estimate", "gpt2", "--seq-len", "4096", "--summary")
    assert "warning: --seq-len 4096 is past the 1024 positions" in r.output
    assert json.loads(cli("estimate", "gpt2", "--json").output)["warnings"] == []


def test_zenflow_settings_longer_than_the_run_are_said():
    from zenflow.config.schema import ZenFlowConfig
    from zenflow.config.zenflow_block import run_length_notes

    zf = ZenFlowConfig(update_interval=2**31 - 1, full_warm_up_rounds=50,
                       select_strategy="step", select_interval=100)  # fmt: skip
    notes = run_length_notes(zf, 40)
    assert len(notes) == 3
    assert "update_interval 2147483647 is longer than this run's 40 steps" in notes[0]
    assert "full_warm_up_rounds 50 covers all 40 steps" in notes[1]
    assert "select_interval 100 steps is longer than the run's 40" in notes[2]
    assert run_length_notes(ZenFlowConfig(update_interval=4), 40) == []


# ----------------------------------------------------------------- issue 31: data and models


def test_data_paths_that_are_not_files_say_what_they_are(cli, tmp_path, tiny_gpt2_dir):
    """Old: a symlink loop was "internal error (a bug in zfctl): RuntimeError: Symlink loop"
    (exit 1); /dev/null and a folder without a suffix were an "unknown table format"."""
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(tmp_path / "back.jsonl")
    (tmp_path / "back.jsonl").symlink_to(loop)
    folder = tmp_path / "mydata"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "a", "label": 1}\n')
    runs_root = tmp_path / "runs"
    for data, said in ((loop, f"{loop} is a symbolic link loop"),
                       ("/dev/null", "/dev/null is a character device, not a data file"),
                       (folder, f"{folder} is a directory, not a data file; it holds "
                        "train.jsonl")):  # fmt: skip
        for objective in ("classification", "causal-lm"):
            r = cli("finetune", tiny_gpt2_dir, "--data", data, "--objective", objective,
                    "--runs-root", runs_root, "--device", "cpu", *SHORT)  # fmt: skip
            assert_clean_user_error(r, said)
            assert "unknown" not in r.output
    assert not runs_root.exists() or not any(runs_root.iterdir())


@pytest.fixture
def eval_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a joy", "label": 1}\n{"text": "so dull", "label": 0}\n')
    return path


def test_eval_of_a_truncated_model_file(cli, tmp_path, tiny_gpt2_dir, eval_rows):
    """Old: internal error (a bug in zfctl): SafetensorError, exit 1."""
    import shutil

    cut = shutil.copytree(tiny_gpt2_dir, tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    r = cli("eval", cut, "--data", eval_rows, "--seq-len", "16")
    assert_clean_user_error(r, f"Could not load the weights in {cut}", "save the model again")


def test_eval_of_a_corrupt_tokenizer(cli, tmp_path, tiny_gpt2_dir, eval_rows):
    """Old: internal error (a bug in zfctl): JSONDecodeError, exit 1 (finetune replaced the
    tokenizer with the packaged GPT-2 one without a word)."""
    import shutil

    broken = shutil.copytree(tiny_gpt2_dir, tmp_path / "broken")
    text = (broken / "tokenizer.json").read_text()
    (broken / "tokenizer.json").write_text(text[: len(text) // 2])
    for args in (("eval", broken, "--data", eval_rows, "--seq-len", "16"),
                 ("finetune", broken, "--data", eval_rows, "--runs-root", tmp_path / "runs",
                  "--device", "cpu", *SHORT)):  # fmt: skip
        assert_clean_user_error(cli(*args), f"The tokenizer file {broken / 'tokenizer.json'} "
                                "is not valid JSON")  # fmt: skip
