"""zenflow.train.lm: the causal-LM loss (token mean over the global micro-batch, split over
ranks), the completion-only loss, the choice set, the seeded eval split, and evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from zenflow.errors import DataError
from zenflow.train.data import (
    IGNORE,
    build_sft,
    choice_set,
    evaluate_lm,
    lm_loss,
    load_lm_data,
    loss_tokens,
    records_from,
    score_completions,
)
from zenflow.train.models import packaged_gpt2_tokenizer

SMALL_VOCAB = 97  # a prime: random ids, no tokenizer


def tiny_lm(vocab: int, seed: int = 0):
    """A 2-layer GPT-2 LM in eval mode (no dropout: every forward is the same function)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=64)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tok():
    t = packaged_gpt2_tokenizer()
    t.pad_token = t.eos_token
    return t


@pytest.fixture(scope="module")
def gpt2_vocab_lm(tok):
    return tiny_lm(len(tok), seed=1)


def ragged_batch(lengths: list[int], width: int = 12, seed: int = 0) -> dict:
    """Right-padded rows of random ids with ``lengths`` real tokens each; labels are the ids
    (-100 at position 0 and on padding), so rows carry different numbers of loss tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL_VOCAB, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, 0] = IGNORE
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------- loss


def test_lm_loss_of_one_process_is_hugging_faces_own_loss():
    model = tiny_lm(SMALL_VOCAB)
    batch = ragged_batch([12, 5, 9, 2])
    # [11, 4, 8, 1] predicted tokens: the shift drops position 0, padding is -100
    assert loss_tokens(batch["labels"]) == 24
    with torch.no_grad():
        out = model(**batch)  # Hugging Face shifts the labels inside and takes the token mean
    mine = lm_loss(out.logits, batch["labels"], loss_tokens(batch["labels"]), world=1)
    torch.testing.assert_close(mine, out.loss.float(), atol=1e-6, rtol=1e-6)
    assert 3.0 < float(mine) < 6.0  # about log(97) = 4.57 for a random model: a real loss


def _param_grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def test_two_ranks_averaged_give_the_one_process_loss_and_gradients():
    """Each rank divides its summed loss by the global micro-batch's tokens (x world); the
    engines' gradient average then gives the global token mean, even when the ranks hold
    very different numbers of loss tokens (here 11 + 10 against 2 + 1)."""
    model = tiny_lm(SMALL_VOCAB)
    batch = ragged_batch([12, 11, 3, 2])
    labels = batch["labels"]
    global_tokens = loss_tokens(labels)
    assert global_tokens == 24

    model.zero_grad()
    one = lm_loss(model(**batch).logits, labels, global_tokens, world=1)
    one.backward()
    grads_one = _param_grads(model)

    losses, grads = [], []
    for rows in (slice(0, 2), slice(2, 4)):  # rank 0, rank 1
        model.zero_grad()
        part = {k: v[rows] for k, v in batch.items()}
        loss = lm_loss(model(**part).logits, part["labels"], global_tokens, world=2)
        loss.backward()
        losses.append(loss.detach())
        grads.append(_param_grads(model))
    torch.testing.assert_close((losses[0] + losses[1]) / 2, one.detach(), atol=1e-6, rtol=1e-6)
    for g_one, g0, g1 in zip(grads_one, grads[0], grads[1], strict=True):
        torch.testing.assert_close((g0 + g1) / 2, g_one, atol=1e-7, rtol=1e-5)
    # Each rank's own token mean, averaged, weighs rank 1's 3 tokens like rank 0's 21: the
    # global count is what makes the two equal.
    naive = []
    for rows in (slice(0, 2), slice(2, 4)):
        part = {k: v[rows] for k, v in batch.items()}
        logits = model(**part).logits
        naive.append(lm_loss(logits, part["labels"], loss_tokens(part["labels"])).detach())
    assert abs(float(sum(naive) / 2) - float(one.detach())) > 1e-3


def _completion_batch(tok):
    records = [
        {"prompt": "Translate to French: cat ->", "completion": " chat"},
        {"prompt": "Q: What is two plus two?\nA:", "completion": " four, of course."},
        {"prompt": "Say hi:", "completion": " hello there"},
    ]
    data, _ = build_sft(records_from(records, "pc.jsonl"), tok, seq_len=20)
    batch = data.take(range(len(data)))
    n_prompt = [len(tok(r["prompt"])["input_ids"]) for r in records]
    n_total = [
        n + len(tok(r["completion"])["input_ids"]) + 1
        for n, r in zip(n_prompt, records, strict=True)
    ]
    return batch, n_prompt, n_total


def test_prompt_tokens_give_no_loss_and_no_gradient(tok, gpt2_vocab_lm):
    """Completion-only loss as the trainer computes it: logits at t predict token t + 1, so
    every position whose next token is a prompt token (or padding) gets exactly zero
    gradient, and no prompt logit can move the loss. The same rows with the prompt's labels
    left on (not -100) give another loss and a gradient there: the mask is what does it."""
    batch, n_prompt, n_total = _completion_batch(tok)
    labels = batch.pop("labels")
    for r, (p, n) in enumerate(zip(n_prompt, n_total, strict=True)):
        assert (labels[r, :p] == IGNORE).all() and (labels[r, n:] == IGNORE).all()
        assert torch.equal(labels[r, p:n], batch["input_ids"][r, p:n])  # completion + eos
    assert loss_tokens(labels) == sum(n - p for p, n in zip(n_prompt, n_total, strict=True))

    logits = gpt2_vocab_lm(**batch).logits.detach().requires_grad_(True)
    loss = lm_loss(logits, labels, loss_tokens(labels))
    loss.backward()
    moved = logits.grad.abs().sum(-1)  # [B, L]
    for r, (p, n) in enumerate(zip(n_prompt, n_total, strict=True)):
        assert torch.all(moved[r, : p - 1] == 0), r  # predicting prompt tokens 1..p-1
        assert torch.all(moved[r, p - 1 : n - 1] > 0), r  # predicting completion + eos
        assert torch.all(moved[r, n - 1 :] == 0), r  # the last token predicts padding

    # Any change to the logits that predict prompt tokens leaves the loss as it is.
    noisy = logits.detach().clone()
    for r, p in enumerate(n_prompt):
        noisy[r, : p - 1] += 5 * torch.randn_like(noisy[r, : p - 1])
    assert torch.equal(lm_loss(noisy, labels, loss_tokens(labels)), loss.detach())

    # The prompt's labels left on: more tokens, another loss, gradient on prompt positions.
    unmasked = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
    unmasked[:, 0] = IGNORE
    logits.grad = None
    other = lm_loss(logits, unmasked, loss_tokens(unmasked))
    other.backward()
    assert abs(float(other.detach()) - float(loss.detach())) > 1e-3
    assert all(torch.all(logits.grad[r, : p - 1].abs().sum(-1) > 0) for r, p in enumerate(n_prompt))
    assert lm_loss(noisy, unmasked, loss_tokens(unmasked)) != other.detach()


# --------------------------------------------------------------------------- choice set


def test_choice_set_is_a_small_label_like_set_of_completions():
    """2..16 distinct completions and at least 4 records per distinct one (the distinct
    count at most a quarter of the records): a label set written as completions."""
    two = [" positive", " negative"] * 4
    assert choice_set(two) == (" negative", " positive")  # sorted, distinct
    assert choice_set(two[:7]) is None  # 2 distinct need at least 4 x 2 = 8 records
    assert choice_set([" yes"] * 40) is None  # 1 distinct: nothing to choose between
    sixteen = [f" c{i}" for i in range(16)] * 4
    assert choice_set(sixteen) == tuple(sorted(set(sixteen)))
    assert choice_set(sixteen[:-1]) is None  # 63 records for 16 distinct: too few
    seventeen = [f" c{i}" for i in range(17)] * 10
    assert choice_set(seventeen) is None  # more than 16 distinct: free text, not labels
    free_text = [f" answer number {i}" for i in range(40)]
    assert choice_set(free_text) is None


# ---------------------------------------------------------------------------------- data


def _pc_records(n: int, completions=(" positive", " negative")) -> list[dict]:
    return [{"prompt": f"Review {i}: it was {'good' if i % 3 else 'bad'}. Sentiment:",
             "completion": completions[i % len(completions)]} for i in range(n)]  # fmt: skip


def test_seeded_split_is_deterministic_and_holds_out_a_tenth(tok, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", _pc_records(30))
    a = load_lm_data(path, None, tok, 32, seed=7)
    b = load_lm_data(path, None, tok, 32, seed=7)
    c = load_lm_data(path, None, tok, 32, seed=8)
    assert len(a.dev) == 3 and len(a.train) == 27  # round(0.1 x 30) held out
    assert a.dev_pairs == b.dev_pairs
    assert torch.equal(a.train.input_ids, b.train.input_ids)
    assert torch.equal(a.dev.input_ids, b.dev.input_ids)
    assert a.dev_pairs != c.dev_pairs  # another seed, another held-out set
    # the held-out records are not trained on: train rows + eval rows = every record, once
    prompts = {r["prompt"] for r in _pc_records(30)}
    dev_prompts = {p for p, _ in a.dev_pairs}
    train_text = {
        tok.decode(row[: int(n)])
        for row, n in zip(a.train.input_ids.tolist(), (a.train.segment_ids > 0).sum(1), strict=True)
    }
    train_prompts = {p for p in prompts if any(t.startswith(p + " ") for t in train_text)}
    assert dev_prompts.isdisjoint(train_prompts) and dev_prompts | train_prompts == prompts
    assert any("3 of the 30 records of train.jsonl held out (seed 7" in ln for ln in a.lines)
    assert "seeded split, seed 7" in a.source
    assert a.task.kind == "prompt/completion" and a.task.choices is None  # 3 eval records


def test_an_eval_file_of_another_kind_is_refused(tok, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", _pc_records(10))
    text = write_jsonl(tmp_path / "eval.jsonl", [{"text": "just some text"}] * 4)
    with pytest.raises(DataError) as e:
        load_lm_data(train, text, tok, 32)
    msg = str(e.value)
    assert "eval.jsonl holds text records" in msg and "prompt/completion records" in msg
    # the same kind is taken as is: no held-out split
    dev = write_jsonl(tmp_path / "dev.jsonl", _pc_records(8))
    data = load_lm_data(train, dev, tok, 32)
    assert len(data.train) == 10 and len(data.dev) == 8
    assert not any("held out" in ln for ln in data.lines)
    assert data.task.choices == (" negative", " positive")
    assert data.task.metrics == ("choice_accuracy", "perplexity")


# ---------------------------------------------------------------------------- evaluation


def test_evaluate_lm_matches_a_hand_computation(tok, gpt2_vocab_lm, tmp_path):
    model = gpt2_vocab_lm
    # 6 positive, 2 negative: a model that always picks one answer scores 0.75 or 0.25
    records = _pc_records(8, completions=(" positive", " positive", " positive", " negative"))
    train = write_jsonl(tmp_path / "train.jsonl", _pc_records(4))
    dev = write_jsonl(tmp_path / "dev.jsonl", records)
    data = load_lm_data(train, dev, tok, 32)
    assert data.task.choices == (" negative", " positive")
    model.train()  # evaluate_lm switches to eval mode and back
    metrics, _ = evaluate_lm(model, data.dev, data.task, batch_size=3, tokenizer=tok,
                             pairs=data.dev_pairs)  # fmt: skip
    assert model.training
    model.eval()

    total, tokens = 0.0, 0
    with torch.no_grad():
        for r in records:  # each record alone, unpadded: prompt, completion, eos
            p = tok(r["prompt"])["input_ids"]
            ids = p + tok(r["completion"])["input_ids"] + [tok.eos_token_id]
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
            for t in range(len(p), len(ids)):  # logits at t - 1 predict token t
                total -= float(logp[t - 1, ids[t]])
                tokens += 1
    assert metrics["eval_tokens"] == tokens == 8 * 2  # " positive"/" negative" + eos
    assert metrics["eval_samples"] == 8
    assert metrics["eval_loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(total / tokens), rel=1e-4)

    right = []
    for r in records:
        neg, pos = score_completions(model, tok, [r["prompt"]] * 2, [" negative", " positive"])
        right.append((" positive" if pos > neg else " negative") == r["completion"])
    assert metrics["choice_accuracy"] == sum(right) / 8

    # limit: the first rows and the first records only
    first, _ = evaluate_lm(model, data.dev, data.task, batch_size=3, limit=4, tokenizer=tok,
                           pairs=data.dev_pairs)  # fmt: skip
    assert first["eval_samples"] == 4 and first["eval_tokens"] == 4 * 2
    assert first["choice_accuracy"] == sum(right[:4]) / 4
