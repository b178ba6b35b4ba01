"""zenflow.train.sft: SFT records -> rows with loss masks, packing, completion scoring."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zenflow.errors import DataError, EngineError
from zenflow.train.data import (
    CHAT,
    IGNORE,
    PACKING_MODEL_TYPES,
    PROMPT_COMPLETION,
    TEXT,
    RecordFields,
    SFTData,
    Tokenised,
    build_sft,
    check_packing_support,
    completion_logprob,
    encode_chat,
    encode_prompt_completion,
    lm_eval_metrics,
    load_sft,
    pack_examples,
    read_records,
    records_from,
    score_completions,
    token_loss_sum,
)
from zenflow.train.data.record_encoding import _token_loss_mask
from zenflow.train.models import packaged_gpt2_tokenizer

# Each turn: "<|role|>\n" header, content, "<|end|>\n"; the generation prompt is the
# assistant header. The markers are plain text to GPT-2 (several tokens each).
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris, of course."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


@pytest.fixture(scope="module")
def tok():
    return packaged_gpt2_tokenizer()


@pytest.fixture
def chat_tok(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", TEMPLATE, raising=False)
    return tok


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def loss_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The token ids of each maximal run of loss positions."""
    runs: list[list[int]] = []
    prev = False
    for t, y in zip(ids, labels, strict=True):
        on = y != IGNORE
        if on and not prev:
            runs.append([])
        if on:
            runs[-1].append(t)
        prev = on
    return runs


def tiny_gpt2(vocab: int, attn: str = "eager", seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=64)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation=attn).eval()


# ------------------------------------------------------------------- prompt/completion


def test_prompt_completion_loss_only_on_completion_and_eos(tok):
    recs = records_from([{"prompt": "Q: 2+2?\nA:", "completion": " 4"}] * 2, "pc.jsonl")
    assert recs.kind == PROMPT_COMPLETION
    data, report = build_sft(recs, tok, seq_len=16)
    n_prompt = len(tok("Q: 2+2?\nA:")["input_ids"])
    row = data.take([0])
    ids, labels, mask = row["input_ids"][0], row["labels"][0], row["attention_mask"][0]
    n = int(mask.sum())
    assert n == n_prompt + 2  # " 4" is one token, then eos
    assert (labels[:n_prompt] == IGNORE).all()
    assert torch.equal(labels[n_prompt:n], ids[n_prompt:n])
    assert tok.decode(ids[n_prompt:n]) == " 4" + tok.eos_token
    assert (labels[n:] == IGNORE).all() and (mask[n:] == 0).all()
    assert data.loss_tokens.tolist() == [2, 2]
    assert report.loss_tokens == 4 and report.rows == 2


def test_changing_prompt_tokens_does_not_move_the_loss(tok):
    a = encode_prompt_completion(tok, "The sky is", " blue today.")
    b = encode_prompt_completion(tok, "The sea is", " blue today.")
    assert len(a.input_ids) == len(b.input_ids) and a.input_ids != b.input_ids
    assert [y != IGNORE for y in a.labels] == [y != IGNORE for y in b.labels]
    assert [y for y in a.labels if y != IGNORE] == [y for y in b.labels if y != IGNORE]


def test_prompt_positions_get_exactly_zero_gradient(tok):
    model = tiny_gpt2(len(tok))
    ex = encode_prompt_completion(tok, "Translate to French: cat ->", " chat")
    data = SFTData([ex], 16, pad_id=tok.eos_token_id, pack=False)
    batch = data.take([0])
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out.logits
    logits.retain_grad()
    loss = model.loss_function(logits, batch["labels"], vocab_size=len(tok))
    loss.backward()
    grad = logits.grad[0].abs().sum(-1)  # [L]
    n_prompt = next(t for t, y in enumerate(ex.labels) if y != IGNORE)
    # logits at t predict token t + 1: t < n_prompt - 1 sees only prompt targets.
    assert torch.all(grad[: n_prompt - 1] == 0)
    assert torch.all(grad[n_prompt - 1 : len(ex.input_ids) - 1] > 0)
    assert torch.all(grad[len(ex.input_ids) - 1 :] == 0)  # the last token and padding


def test_text_records_loss_on_every_token_but_the_first(tok):
    data, report = build_sft(records_from([{"text": "hello world"}], "t.jsonl"), tok, 8)
    assert report.counts.kind == TEXT
    ids, labels = data.input_ids[0].tolist(), data.labels[0].tolist()
    expect = tok("hello world")["input_ids"] + [tok.eos_token_id]
    assert ids[: len(expect)] == expect
    assert labels[: len(expect)] == [IGNORE, *expect[1:]]
    assert labels[len(expect) :] == [IGNORE] * (8 - len(expect))


# ---------------------------------------------------------------------------------- chat


def test_chat_ids_match_apply_chat_template_and_loss_is_assistant_turns(chat_tok):
    ex = encode_chat(chat_tok, CONVERSATION)
    ref = chat_tok.apply_chat_template(CONVERSATION, tokenize=True)
    ref_ids = ref["input_ids"] if not isinstance(ref, list) else ref
    assert ex.input_ids == list(ref_ids)
    runs = [chat_tok.decode(r) for r in loss_runs(ex.input_ids, ex.labels)]
    assistant = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert runs == [c + "<|end|>\n" for c in assistant]
    # The same spans without the tokenizer's offsets (token-prefix fallback).
    full = chat_tok.apply_chat_template(CONVERSATION, tokenize=False)
    spans = [(m.start() + len("<|assistant|>\n"), 0) for m in _finditer(full, "<|assistant|>")]
    spans = [(s, full.index("<|end|>\n", s) + len("<|end|>\n")) for s, _ in spans]
    with_offsets = _token_loss_mask(chat_tok, full, spans, "x")
    without = _token_loss_mask(chat_tok, full, spans, "x", use_offsets=False)
    assert with_offsets == without
    assert [y != IGNORE for y in ex.labels][1:] == with_offsets[1][1:]


def _finditer(text: str, needle: str):
    import re

    return re.finditer(re.escape(needle), text)


def test_chat_file_rows(chat_tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 3)
    data, report = load_sft(path, chat_tok, 128)
    assert report.counts.kind == CHAT and len(data) == 3
    row = data.take([1])
    n = int(row["attention_mask"].sum())
    ex = encode_chat(chat_tok, CONVERSATION)
    assert row["input_ids"][0, :n].tolist() == ex.input_ids
    assert row["labels"][0, :n].tolist() == ex.labels
    assert "assistant turns" in report.lines()[2]


def test_chat_without_template_is_refused_with_the_fix(tok, tmp_path):
    assert not getattr(tok, "chat_template", None)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(DataError, match="chat template") as e:
        load_sft(path, tok, 64)
    msg = str(e.value)
    assert "chat.jsonl" in msg and "tokenizer.chat_template" in msg
    assert "prompt/completion" in msg


def test_chat_unknown_role_names_line_and_allowed_roles(chat_tok, tmp_path):
    bad = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}, {"messages": bad}])
    with pytest.raises(DataError, match=r"c\.jsonl, line 2: message 2 has the unknown role 'bot'"):
        load_sft(path, chat_tok, 64)
    with pytest.raises(DataError, match="system, user, assistant, tool"):
        load_sft(path, chat_tok, 64)


def test_chat_without_assistant_turn_or_with_non_string_content(chat_tok, tmp_path):
    none = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}, {"messages": none}])
    with pytest.raises(DataError, match=r"line 2: the conversation has no assistant turn"):
        load_sft(path, chat_tok, 64)
    odd = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["x"]}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": odd}])
    with pytest.raises(DataError, match=r"line 1: message 2 \(assistant\).*an array, not a str"):
        load_sft(path, chat_tok, 64)


def test_template_that_rewrites_earlier_turns_is_refused(tok, monkeypatch):
    # Marks the final message: rendering a prefix is not the start of the whole.
    last = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}\n{% endfor %}"
    )
    monkeypatch.setattr(tok, "chat_template", last, raising=False)
    with pytest.raises(DataError, match="not prefix-stable"):
        encode_chat(tok, CONVERSATION, "c.jsonl, line 1")


# ----------------------------------------------------------------------- reading, counts


def test_mixed_record_kinds_name_the_line(tmp_path):
    recs = [{"text": "a"}, {"text": "b"}, {"prompt": "p", "completion": "c"}]
    path = write_jsonl(tmp_path / "m.jsonl", recs)
    with pytest.raises(
        DataError, match=r"m\.jsonl, line 3: a prompt/completion record.*line 1.*text"
    ):
        read_records(path)


def test_field_names_are_configurable_and_unknown_fields_explained(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "q?", "answer": " a"}])
    with pytest.raises(DataError, match="none of the known fields.*'question', 'answer'"):
        read_records(path)
    recs = read_records(path, RecordFields(prompt="question", completion="answer"))
    assert recs.kind == PROMPT_COMPLETION
    half = write_jsonl(tmp_path / "h.jsonl", [{"prompt": "q?"}])
    with pytest.raises(DataError, match="has 'prompt' but no 'completion'"):
        read_records(half)


def test_truncation_and_drops_are_counted(tok, tmp_path):
    long = " ".join(["word"] * 40)
    recs = [
        {"prompt": "Q:", "completion": " short"},
        {"prompt": "Q:", "completion": long},  # truncated, keeps completion tokens
        {"prompt": long, "completion": " lost"},  # truncated inside the prompt: dropped
        {"prompt": "Q:", "completion": "   "},  # blank completion: dropped
        {"prompt": "Q:", "completion": None},  # missing: dropped
    ]
    data, report = load_sft(write_jsonl(tmp_path / "train.jsonl", recs), tok, 16)
    c = report.counts
    assert (c.read, c.kept, c.truncated) == (5, 2, 2)
    assert c.dropped == {
        "with no completion tokens left after truncation at 16": 1,
        "empty 'completion'": 1,
        "missing 'completion' value": 1,
    }
    assert len(data) == 2 and data.labels[1, 15].item() == data.input_ids[1, 15].item()
    assert report.lines()[0] == (
        "train.jsonl: 5 prompt/completion records read, 2 kept, 3 dropped (1 with no "
        "completion tokens left after truncation at 16, 1 empty 'completion', 1 missing "
        "'completion' value), 2 truncated at 16 tokens (end cut off)"
    )


def test_all_dropped_and_bad_files_are_data_errors(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": ""}, {"text": " "}])
    with pytest.raises(DataError, match=r"all 2 records were dropped \(2 empty 'text'\)"):
        load_sft(path, tok, 16)
    (tmp_path / "b.jsonl").write_text('{"text": "a"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"b\.jsonl, line 2: not valid JSON"):
        read_records(tmp_path / "b.jsonl")
    (tmp_path / "c.txt").write_text("x", encoding="utf-8")
    with pytest.raises(DataError, match="unknown record format '.txt'"):
        read_records(tmp_path / "c.txt")
    (tmp_path / "d.json").write_text(json.dumps([{"text": "a"}, {"text": 3}]), encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.json, item 2: field 'text' holds a number"):
        load_sft(tmp_path / "d.json", tok, 16)


# ------------------------------------------------------------------------------- packing


def _tiny(kind: str, attn: str, vocab: int):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    if kind == "gpt2":
        return tiny_gpt2(vocab, attn)
    cls_cfg = {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig, {}),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig, {"head_dim": 8}),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config, {}),
        "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, {"head_dim": 8}),
    }
    cls, cfg_cls, extra = cls_cfg[kind]
    return cls._from_config(cfg_cls(**common, **extra), attn_implementation=attn).eval()


def _random_examples(n: int, vocab: int, seed: int = 1) -> list[Tokenised]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(2, 12))]
        # A prompt of `cut` tokens, then the loss part; cut 0 puts a label on the first
        # token, which packing must not train from the previous example's last token.
        cut = rng.randint(0, len(ids) - 1)
        out.append(Tokenised(ids, [IGNORE] * cut + ids[cut:]))
    return out


CASES = [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "eager"), ("llama", "sdpa")]
CASES += [(k, "sdpa") for k in ("mistral", "qwen2", "qwen3")]


@pytest.mark.parametrize("kind,attn", CASES)
def test_packed_rows_equal_each_example_alone(kind, attn):
    vocab, seq_len = 101, 32
    model = _tiny(kind, attn, vocab)
    check_packing_support(model, seq_len)
    examples = _random_examples(12, vocab)
    data = SFTData(examples, seq_len, pad_id=0, pack=True)
    assert len(data) < len(examples) and data.examples == len(examples)
    batch = data.tensors()
    assert batch["attention_mask"].shape == (len(data), 1, seq_len, seq_len)
    with torch.no_grad():
        packed = model(**batch).logits
        loss_packed, n_packed = token_loss_sum(packed, batch["labels"])
        loss_alone, n_alone = 0.0, 0
        for r, group in enumerate(pack_examples([len(e.input_ids) for e in examples], seq_len)):
            at = 0
            for i in group:
                ex = examples[i]
                k = len(ex.input_ids)
                alone = model(input_ids=torch.tensor([ex.input_ids])).logits
                torch.testing.assert_close(packed[r, at : at + k], alone[0], atol=1e-5, rtol=0)
                s, n = token_loss_sum(alone, torch.tensor([ex.labels]))
                loss_alone, n_alone = loss_alone + s, n_alone + n
                at += k
        # The model's own (mean) loss on the packed rows is the per-example token mean.
        hf = model(**batch).loss.item()
    assert n_packed == n_alone == int(data.loss_tokens.sum())
    assert loss_packed == pytest.approx(loss_alone, rel=1e-5)
    assert hf == pytest.approx(loss_alone / n_alone, rel=1e-5)
    # Control: the same rows with a plain causal mask (no blocks, no restarts) differ.
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"]).logits
    assert not torch.allclose(plain, packed, atol=1e-3)


def test_packing_reduces_rows_and_keeps_order(tok):
    recs = records_from([{"prompt": f"Q{i}:", "completion": " yes"} for i in range(10)], "p")
    unpacked, _ = build_sft(recs, tok, 16)
    packed, report = build_sft(recs, tok, 16, pack=True)
    assert len(unpacked) == 10 and len(packed) < 10
    assert int(packed.loss_tokens.sum()) == int(unpacked.loss_tokens.sum())
    k = len(tok("Q0: yes")["input_ids"]) + 1  # the first example, with its eos
    assert packed.segment_ids[0, : k + 1].tolist() == [1] * k + [2]
    assert packed.position_ids[0, : k + 2].tolist() == [*range(k), 0, 1]
    assert "packed into" in report.lines()[1]
    assert pack_examples([3, 3, 5, 1, 4], 8) == [[0, 1], [2, 3], [4]]
    half = packed.take([0], mask_dtype=torch.bfloat16)["attention_mask"]
    assert half.dtype == torch.bfloat16 and half[0, 0, 0, 1] == torch.finfo(torch.bfloat16).min
    assert half[0, 0, k, k - 1] == torch.finfo(torch.bfloat16).min and half[0, 0, k, k] == 0


def test_packing_support_refusals():
    def fake(**cfg):
        return SimpleNamespace(config=SimpleNamespace(**cfg))

    assert "llama" in PACKING_MODEL_TYPES
    with pytest.raises(EngineError, match="not supported for model type 'bloom'.*drop --pack"):
        check_packing_support(fake(model_type="bloom", _attn_implementation="eager"))
    with pytest.raises(EngineError, match="eager or sdpa.*'flash_attention_2'"):
        check_packing_support(fake(model_type="llama", _attn_implementation="flash_attention_2"))
    with pytest.raises(EngineError, match="sliding-window mask \\(16 tokens\\).*--seq-len 32"):
        check_packing_support(
            fake(model_type="mistral", _attn_implementation="sdpa", sliding_window=16), 32
        )
    qwen = fake(model_type="qwen2", _attn_implementation="sdpa", sliding_window=16)
    qwen.config.use_sliding_window = False
    check_packing_support(qwen, 32)


# ---------------------------------------------------------------------------- evaluation


def test_score_completions_matches_manual_log_softmax(tok):
    model = tiny_gpt2(len(tok), seed=3)
    prompt = "The capital of France is"
    completions = [" Paris", " a large yellow banana", "!"]
    scores = score_completions(model, tok, [prompt] * 3, completions, batch_size=2)
    manual = []
    for c in completions:
        p_ids = tok(prompt)["input_ids"]
        c_ids = tok(c)["input_ids"]
        ids = torch.tensor([p_ids + c_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        manual.append(sum(logp[len(p_ids) + j - 1, t].item() for j, t in enumerate(c_ids)))
    assert scores == pytest.approx(manual, abs=1e-4)
    assert max(range(3), key=scores.__getitem__) == max(range(3), key=manual.__getitem__)
    assert len(set(round(s, 3) for s in scores)) == 3
    one = completion_logprob(model, tok, prompt, completions[1])
    assert one == pytest.approx(manual[1], abs=1e-4)
    assert not model.training


def test_score_completions_picks_the_likelier_completion(tok):
    # Bias the output layer towards one token: the completion made of it must win.
    model = tiny_gpt2(len(tok), seed=4)
    favoured = tok(" yes")["input_ids"][0]
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        w = model.transformer.wte.weight[favoured]  # tied output row: logit = w . bias
        model.transformer.ln_f.bias.copy_(w * 40 / w.dot(w))
    a, b = score_completions(model, tok, ["Is it?", "Is it?"], [" no", " yes"])
    assert b > a and b > -1e-3


def test_lm_eval_metrics():
    m = lm_eval_metrics(6.0, 3)
    assert m == {"eval_loss": 2.0, "perplexity": pytest.approx(math.exp(2.0))}
    assert lm_eval_metrics(1e6, 1)["perplexity"] == math.inf
    with pytest.raises(ValueError, match="no tokens"):
        lm_eval_metrics(0.0, 0)
