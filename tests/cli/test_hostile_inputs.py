"""Issue 19, a hostile user's inputs: every one is exit 2 with a message naming the thing
and the fix, never "internal error (a bug in zfctl)" (which was each case's old outcome,
as each test's docstring says)."""

from __future__ import annotations

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
    from conftest import TINY_GPT2
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    d = tmp_path_factory.mktemp("small-vocab")
    torch.manual_seed(0)
    shape = {**TINY_GPT2, "vocab_size": 1000, "pad_token_id": 999, "eos_token_id": 999,
             "bos_token_id": 999}  # fmt: skip
    GPT2ForSequenceClassification(GPT2Config(**shape)).save_pretrained(d)
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
        (["estimate", "gpt2", "--topk-ratio", "1e400"], ["--topk-ratio"]),
        (["finetune", "gpt2", "--task", "sst2", "--lr", "1e400"], ["--lr", "finite"]),
        (["finetune", "gpt2", "--task", "sst2", "--lr", "nan"], ["--lr", "finite"]),
        (["finetune", "gpt2", "--task", "sst2", "--epochs", "inf"], ["--epochs", "finite"]),
        (
            ["finetune", "gpt2", "--task", "sst2", "--max-steps", "99999999999999999999999"],
            ["--max-steps", "2147483647"],
        ),
        (["finetune", "gpt2", "--task", "sst2", "--seed", "-99999999999999"], ["--seed"]),
        (["finetune", "gpt2", "--task", "sst2", "--device-mem", "inf"], ["--device-mem"]),
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
    --max-steps 10**23 started a run whose ETA ran to 10**18 hours."""
    extra = ["--runs-root", tmp_path] if args[0] == "finetune" else []
    r = cli(*args, *extra)
    assert_clean_user_error(r, *fragments)


def test_numeric_set_values_that_overflow(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    """A JSON integer past any run's length is refused naming the key (old: accepted)."""
    huge = "zero_optimization.zenflow.update_interval=" + "1" + "0" * 29
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path, *SHORT, "--set", huge)  # fmt: skip
    assert_clean_user_error(r, "update_interval", "--set")
