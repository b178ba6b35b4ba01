"""`zfctl finetune MODEL --objective causal-lm --data FILE`: a causal LM trained on text,
prompt/completion or chat records, end to end through the CLI.

A prompt/completion run states what it read and where the loss is, and reports perplexity
and choice accuracy; a stopped and resumed run equals the straight one; two ranks train
what one process trains (the token mean is over the global micro-batch); packing, chat
records, the engines, and the flags that do not belong to a causal LM.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error
from safetensors.torch import load_file

from zenflow.train import runs
from zenflow.train.learning import WEIGHTS_FIELDS

ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", COLUMNS="200")
ENV.pop("WORLD_SIZE", None)
ZF = ["--set", "zero_optimization.zenflow.update_interval=2",
      "--set", "zero_optimization.zenflow.select_strategy=step",
      "--set", "zero_optimization.zenflow.select_interval=3"]  # fmt: skip
LM = ("--objective", "causal-lm")
SHORT = ("--seq-len", "32", "--micro-batch", "4", "--no-dashboard", "--lr", "1e-3")

# tests/train/test_sft.py's template made short enough for 32 tokens: each turn is
# "role: content\n"; the generation prompt is "assistant:" (a conversation below: 23 tokens).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _save_lm(d: Path, chat_template: str | None = None) -> Path:
    """A tiny GPT2LMHeadModel without dropout (two ranks draw dropout masks for half a batch
    each, one process for all of it: with dropout they would differ by design) and the
    GPT-2 tokenizer, optionally with a chat template."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from zenflow.train.models import packaged_gpt2_tokenizer

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=50257, pad_token_id=50256,
        bos_token_id=50256, eos_token_id=50256, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(d)
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> Path:
    return _save_lm(tmp_path_factory.mktemp("tiny-gpt2-lm"))


@pytest.fixture(scope="module")
def chat_lm_dir(tmp_path_factory) -> Path:
    return _save_lm(tmp_path_factory.mktemp("tiny-gpt2-chat"), TEMPLATE)


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _sentiment(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"Review {i}: the film was {'great' if i % 2 else 'dull'}. Verdict:",
             "completion": " positive" if i % 2 else " negative"}
            for i in range(start, start + n)]  # fmt: skip


@pytest.fixture(scope="module")
def pc_files(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("pc")
    return _write_jsonl(d / "train.jsonl", _sentiment(40)), _write_jsonl(
        d / "dev.jsonl", _sentiment(8, 100)
    )


WORDS = "the quick brown fox jumps over a lazy dog while seven owls watch".split()


@pytest.fixture(scope="module")
def ragged_file(tmp_path_factory) -> Path:
    """Completions of 1 to 11 words (2 to 12 loss tokens with the eos): the rows of a
    micro-batch, and so the two ranks' halves, carry different numbers of loss tokens."""
    recs = [{"prompt": f"Item {i}:", "completion": " " + " ".join(WORDS[: 1 + (i * 7) % 11])}
            for i in range(40)]  # fmt: skip
    return _write_jsonl(tmp_path_factory.mktemp("ragged") / "ragged.jsonl", recs)


def _weights(run_dir: Path) -> dict:
    return load_file(run_dir / runs.MODEL_DIR / "model.safetensors")


def _losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in runs.read_run(run_dir)["metrics"]]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# ------------------------------------------------------------------------ a plain run


def test_a_prompt_completion_run_reports_perplexity_and_choice_accuracy(cli, tmp_path, lm_dir,
                                                                         pc_files):  # fmt: skip
    train, dev = pc_files
    r = cli("finetune", lm_dir, *LM, "--data", train, "--eval-data", dev, *SHORT,
            "--max-steps", 4, "--run-dir", tmp_path / "run")  # fmt: skip
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "train.jsonl: 40 prompt/completion records read, 40 kept, none dropped" in out
    assert "dev.jsonl: 8 prompt/completion records read, 8 kept" in out
    # " positive"/" negative" are one token each, + eos: 2 loss tokens per record
    assert "loss on: the completion tokens and the end-of-sequence token, not the prompt; " \
           "80 tokens in all" in out  # fmt: skip
    assert "eval also scores choice_accuracy" in out and "' negative', ' positive'" in out
    s = _summary(tmp_path / "run")
    assert s["status"] == "finished" and s["steps"] == 4 and s["samples"] == 16
    ev = s["eval"]
    assert ev["step"] == 4 and ev["eval_samples"] == 8 and ev["eval_tokens"] == 16
    assert ev["perplexity"] == pytest.approx(math.exp(ev["eval_loss"]))
    assert 0 < ev["eval_loss"] < 12  # log(50257) = 10.8 for a random model
    assert ev["choice_accuracy"] in {k / 8 for k in range(9)}
    assert runs.run_config(tmp_path / "run")["run"]["objective"] == "causal-lm"
    losses = _losses(tmp_path / "run")
    assert len(losses) == 4 and all(0 < x < 12 for x in losses)
    # the saved model is a causal LM whose weights moved
    saved = json.loads((tmp_path / "run" / runs.MODEL_DIR / "config.json").read_text())
    assert saved["architectures"] == ["GPT2LMHeadModel"]
    before = load_file(lm_dir / "model.safetensors")
    after = _weights(tmp_path / "run")
    assert not torch.equal(before["transformer.wte.weight"], after["transformer.wte.weight"])


def test_resume_is_exact(cli, tmp_path, lm_dir, ragged_file):
    """Stopped at step 3 and resumed to 6: the step losses and the final weights are those
    of the straight run, bit for bit (update_interval 2 crosses host windows)."""
    common = (*LM, "--data", ragged_file, *SHORT, *ZF)
    straight = cli("finetune", lm_dir, *common, "--max-steps", 6, "--run-dir",
                   tmp_path / "straight")  # fmt: skip
    assert straight.exit_code == 0, straight.output
    first = cli("finetune", lm_dir, *common, "--max-steps", 3, "--run-dir", tmp_path / "split")
    assert first.exit_code == 0, first.output
    again = cli("finetune", lm_dir, "--resume", tmp_path / "split", "--max-steps", 6,
                "--no-dashboard")  # fmt: skip
    assert again.exit_code == 0, again.output
    a, b = _losses(tmp_path / "straight"), _losses(tmp_path / "split")
    assert len(a) == 6 and a == b
    wa, wb = _weights(tmp_path / "straight"), _weights(tmp_path / "split")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert _summary(tmp_path / "split")["eval"] == _summary(tmp_path / "straight")["eval"]


def _zfctl(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zfctl", *map(str, args)], env=ENV, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def test_two_ranks_train_what_one_process_trains(cli, tmp_path, lm_dir, ragged_file):
    """Each rank's loss is its summed loss over the global micro-batch's loss tokens (x 2):
    with completions of different lengths the ranks' token counts differ, and a per-rank
    token mean would train something else."""
    common = (*LM, "--data", ragged_file, "--seq-len", 32, "--no-dashboard", "--lr", "1e-3",
              *ZF, "--max-steps", 4)  # fmt: skip
    one = cli("finetune", lm_dir, *common, "--micro-batch", 4, "--run-dir", tmp_path / "one")
    assert one.exit_code == 0, one.output
    two = _zfctl("finetune", lm_dir, *common, "--micro-batch", 2, "--nproc", 2,
                 "--run-dir", tmp_path / "two")  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 data-parallel ranks" in two.stdout
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    s1, s2 = _summary(tmp_path / "one"), _summary(tmp_path / "two")
    assert s2["world_size"] == 2 and s2["samples"] == s1["samples"] == 4 * 4
    assert abs(s2["final_loss"] - s1["final_loss"]) < 1e-4
    assert s2["eval"]["eval_loss"] == pytest.approx(s1["eval"]["eval_loss"], abs=1e-4)
    l1, l2 = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert l2 == pytest.approx(l1, abs=1e-4)


# ----------------------------------------------------------------------------- packing


def test_a_packed_run_finishes_and_says_its_rows_are_packed(cli, tmp_path, lm_dir, ragged_file):
    r = cli("finetune", lm_dir, *LM, "--pack", "--data", ragged_file, *SHORT, "--max-steps", 3,
            "--run-dir", tmp_path / "packed")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "36 examples packed into" in r.stdout and "attends only within its own example" \
        in r.stdout  # fmt: skip
    s = _summary(tmp_path / "packed")
    assert s["status"] == "finished" and s["steps"] == 3
    assert math.isfinite(s["final_loss"]) and s["eval"]["eval_samples"] == 4


def test_pack_needs_the_causal_lm_objective(cli, tmp_path, lm_dir, ragged_file):
    r = cli("finetune", lm_dir, "--pack", "--data", ragged_file, "--runs-root", tmp_path / "runs")
    assert_user_error(r, "--pack", "--objective causal-lm")
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory) -> Path:
    """A tiny OPT causal LM (a model type packing is not proven for) with the GPT-2
    tokenizer."""
    from transformers import OPTConfig, OPTForCausalLM

    from zenflow.train.models import packaged_gpt2_tokenizer

    d = tmp_path_factory.mktemp("tiny-opt")
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=50272, hidden_size=16, word_embed_proj_dim=16, ffn_dim=32,
                    num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64,
                    pad_token_id=50256, bos_token_id=50256, eos_token_id=50256)  # fmt: skip
    OPTForCausalLM(cfg).save_pretrained(d)
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(d)
    return d


def test_packing_a_model_type_it_is_not_proven_for_is_refused(cli, tmp_path, opt_dir,
                                                               ragged_file):  # fmt: skip
    r = cli("finetune", opt_dir, *LM, "--pack", "--data", ragged_file, *SHORT, "--max-steps", 2,
            "--runs-root", tmp_path / "runs")  # fmt: skip
    assert_user_error(r, "Packing is not supported for model type 'opt'", "gpt2, llama",
                      "without packing")  # fmt: skip
    assert not (tmp_path / "runs").exists()


# -------------------------------------------------------------------------------- chat


def _conversation(i: int) -> dict:
    return {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is {i} plus one?"},
        {"role": "assistant", "content": f"It is {i + 1}."},
    ]}  # fmt: skip


def test_chat_records_train_with_the_tokenizers_template(cli, tmp_path, chat_lm_dir):
    data = _write_jsonl(tmp_path / "chat.jsonl", [_conversation(i) for i in range(20)])
    r = cli("finetune", chat_lm_dir, *LM, "--data", data, *SHORT, "--max-steps", 3,
            "--run-dir", tmp_path / "chat")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "chat.jsonl: 18 chat records read, 18 kept, none dropped" in r.stdout
    assert "loss on: the assistant turns" in r.stdout
    s = _summary(tmp_path / "chat")
    assert s["status"] == "finished" and s["eval"]["eval_samples"] == 2
    assert "choice_accuracy" not in s["eval"]  # chat records: perplexity only


def test_chat_records_without_a_template_or_with_an_unknown_role_exit_2(cli, tmp_path, lm_dir,
                                                                         chat_lm_dir):  # fmt: skip
    data = _write_jsonl(tmp_path / "chat.jsonl", [_conversation(i) for i in range(20)])
    r = cli("finetune", lm_dir, *LM, "--data", data, *SHORT, "--max-steps", 2,
            "--runs-root", tmp_path / "runs")  # fmt: skip
    assert_user_error(r, "chat template", "chat.jsonl")
    assert not (tmp_path / "runs").exists()

    bad = [_conversation(i) for i in range(20)]
    bad[1]["messages"][2]["role"] = "bot"
    data = _write_jsonl(tmp_path / "bad.jsonl", bad)
    r = cli("finetune", chat_lm_dir, *LM, "--data", data, *SHORT, "--max-steps", 2,
            "--runs-root", tmp_path / "runs")  # fmt: skip
    assert_user_error(r, "bad.jsonl, line 2", "unknown role 'bot'", "assistant")


# --------------------------------------------------------------------------- bad flags


@pytest.mark.parametrize(
    "args,fragments",
    [
        ([*LM], ["--objective causal-lm", "pass --data FILE"]),
        ([*LM, "--data", "DATA", "--label-field", "y"],
         ["--label-field", "classification table"]),
        ([*LM, "--data", "DATA", "--text-field", "a", "--text-field", "b"],
         ["give --text-field once"]),
        (["--objective", "lm", "--data", "DATA"], ["--objective", "'lm'", "causal-lm"]),
    ],
)  # fmt: skip
def test_flags_that_do_not_fit_a_causal_lm_exit_2(cli, tmp_path, lm_dir, ragged_file, args,
                                                  fragments):  # fmt: skip
    args = [ragged_file if a == "DATA" else a for a in args]
    r = cli("finetune", lm_dir, *args, "--runs-root", tmp_path / "runs")
    assert_user_error(r, *fragments)
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- engines


@pytest.mark.parametrize("engine", ["offload", "device"])
def test_the_other_engines_train_a_causal_lm(cli, tmp_path, lm_dir, pc_files, engine):
    """3 steps: WarmupLR (DeepSpeed's) runs steps 1 and 2 at warmup_min_lr = 0, so step 3 is
    the first that moves the weights."""
    train, dev = pc_files
    r = cli("finetune", lm_dir, *LM, "--data", train, "--eval-data", dev, *SHORT,
            "--max-steps", 3, "--engine", engine, "--run-dir", tmp_path / engine)  # fmt: skip
    assert r.exit_code == 0, r.output
    s = _summary(tmp_path / engine)
    assert s["status"] == "finished" and s["engine_mode"] == engine and s["steps"] == 3
    assert "choice_accuracy" in s["eval"] and math.isfinite(s["eval"]["eval_loss"])
    before = load_file(lm_dir / "model.safetensors")["transformer.wte.weight"]
    assert not torch.equal(before, _weights(tmp_path / engine)["transformer.wte.weight"])


# ------------------------------------------------------------- zfctl eval and the export

PLAIN = """
import json, sys, torch, torch.nn.functional as F
from transformers import AutoModelForCausalLM
model_dir, rows_file, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = json.load(open(rows_file))
m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
total, tokens = 0.0, 0
with torch.no_grad():
    for b in range(0, len(rows["input_ids"]), batch):
        ids = torch.tensor(rows["input_ids"][b : b + batch])
        mask = torch.tensor(rows["attention_mask"][b : b + batch])
        labels = torch.tensor(rows["labels"][b : b + batch])
        logits = m(input_ids=ids, attention_mask=mask).logits
        target = labels[:, 1:]
        keep = target != -100
        at = keep.nonzero()
        picked = logits[:, :-1][at[:, 0], at[:, 1]]
        total += float(F.cross_entropy(picked.float(), target[keep], reduction="none").sum())
        tokens += int(keep.sum())
print(json.dumps({"eval_loss": total / tokens, "tokens": tokens,
                  "zfctl": any(k.startswith(("zfctl", "zenflow")) for k in sys.modules)}))
"""


def test_eval_reproduces_the_run_and_the_export_is_plain_transformers(cli, tmp_path, lm_dir,
                                                                      pc_files):  # fmt: skip
    """`zfctl eval RUN` (another process, the exported model/) gives the run's final
    evaluation exactly; transformers alone, without zfctl, loads model/ as a causal LM and
    its loss on the eval rows is the one the trainer measured on the model in memory, to
    the bit (the same rows, batches and sums)."""
    from zenflow.train.data import build_sft, read_records
    from zenflow.train.models import packaged_gpt2_tokenizer

    train, dev = pc_files
    run = tmp_path / "run"
    r = cli("finetune", lm_dir, *LM, "--data", train, "--eval-data", dev, *SHORT,
            "--max-steps", 3, "--run-dir", run)  # fmt: skip
    assert r.exit_code == 0, r.output
    final = runs.read_run(run)["evals"][-1]
    e = _zfctl("eval", run, "--json")
    assert e.returncode == 0, e.stderr
    doc = json.loads(e.stdout)
    assert doc["objective"] == "causal-lm"
    assert doc["metrics"] == {
        k: v for k, v in final.items() if k not in ("type", "step", *WEIGHTS_FIELDS)
    }

    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    rows, _ = build_sft(read_records(dev), tok, 32)
    t = rows.tensors()
    rows_file = tmp_path / "rows.json"
    rows_file.write_text(json.dumps({k: t[k].tolist() for k in ("input_ids", "attention_mask",
                                                                "labels")}))  # fmt: skip
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    plain = subprocess.run([sys.executable, "-c", PLAIN, str(run / runs.MODEL_DIR),
                            str(rows_file), "8"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=300)  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    got = json.loads(plain.stdout)
    assert got["zfctl"] is False and got["tokens"] == final["eval_tokens"]
    assert got["eval_loss"] == final["eval_loss"]

    # any causal-LM folder on a file: per-record choices written on request
    pred = tmp_path / "pred.jsonl"
    f = _zfctl("eval", run / runs.MODEL_DIR, "--data", dev, "--seq-len", 32, "--predictions",
               pred, "--json")  # fmt: skip
    assert f.returncode == 0, f.stderr
    metrics = json.loads(f.stdout)["metrics"]
    lines = [json.loads(x) for x in pred.read_text().splitlines()]
    assert len(lines) == 8 and {x["completion"] for x in lines} == {" positive", " negative"}
    right = sum(x["choice"] == x["completion"] for x in lines)
    assert metrics["choice_accuracy"] == right / 8 == final["choice_accuracy"]
    assert metrics["eval_loss"] == final["eval_loss"]
