"""SFT records -> token ids with loss labels, truncated to ``seq_len`` and counted.

Contract:

- Labels follow Hugging Face causal LMs, which shift inside the model: ``labels[t]`` is the
  token at ``t`` where it carries loss, else -100. Position 0 of every example is -100:
  nothing before it predicts it, and in a packed row the label there would otherwise be
  trained from the previous example's last token.
- Prompt and completion are tokenised separately and concatenated (the tokenizer's
  start-of-sequence tokens, if it adds any, go before the prompt), so the split between
  them is exact; write the separator (space, newline) at the end of the prompt or the start
  of the completion, where it belongs.
- Chat loss spans come from rendering the conversation prefix by prefix: assistant turn
  ``i`` adds the text between ``render(messages[:i], add_generation_prompt=True)`` (the
  turn's header) and ``render(messages[:i+1])``: its content and the template's end-of-turn
  markup. Every prefix rendering must be a prefix of the whole one (checked; a template
  that rewrites earlier turns is refused). Character spans map to tokens by the tokenizer's
  offsets (a token that overlaps a span carries loss); a tokenizer without offsets is
  mapped by tokenising the prefixes, which must then be token prefixes too. No reliance on
  ``{% generation %}``. The ids equal ``apply_chat_template(messages, tokenize=True)``.
- Truncation: an example longer than ``seq_len`` keeps its first ``seq_len`` tokens (the
  end is cut off). A text (or a message's content) far longer than that is clipped by
  characters before it is tokenised (``encoding.clip_text``: the same tokens, without the
  cost of tokenising the part that is cut). Those are counted; the ones left without any
  loss token are dropped and counted under their own reason, never silently.

Owns: tokenising a record and its loss labels. Must not: read files (``records``) or put
examples into rows (``packing``).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from zenflow.errors import DataError
from zenflow.train.data.encoding import clip_text
from zenflow.train.data.readers import kind_of, plural
from zenflow.train.data.records import CHAT, PROMPT_COMPLETION, TEXT, Records, check_messages
from zenflow.train.data.reports import SFTCounts

IGNORE = -100  # the label Hugging Face's loss skips


class Tokenised(NamedTuple):
    input_ids: list[int]
    labels: list[int]  # IGNORE where no loss; labels[0] is always IGNORE


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text with ``add_special_tokens=True`` (e.g.
    Llama's BOS; GPT-2: none). What it puts after (some add EOS) is not used: the eos is
    added, or not, by ``add_eos``."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return list(full[:k])
    return []


def eos_ids(tokenizer) -> list[int]:
    """The end-of-sequence id as a list; DataError for a tokenizer without one."""
    if tokenizer.eos_token_id is None:
        raise DataError(
            "The tokenizer has no end-of-sequence token, so examples cannot end with one. "
            "Fine-tune a model whose tokenizer defines one, or set tokenizer.eos_token and "
            "save the tokenizer into the model folder (tokenizer.save_pretrained)."
        )
    return [int(tokenizer.eos_token_id)]


def token_ids(tokenizer, text: str) -> list[int]:
    """The ids of ``text`` alone, without the tokenizer's special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def pad_token_id(tokenizer) -> int:
    """The id padding uses (never attended, never a label): pad, else eos, else 0."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def encode_text(
    tokenizer, text: str, *, add_eos: bool = True, prefix: list[int] | None = None
) -> Tokenised:
    """Start tokens + text (+ eos); loss on every token after the first. ``prefix``: the
    start tokens when already known (``special_prefix``)."""
    prefix = special_prefix(tokenizer) if prefix is None else prefix
    ids = prefix + token_ids(tokenizer, text) + (eos_ids(tokenizer) if add_eos else [])
    return Tokenised(ids, [IGNORE, *ids[1:]])


def encode_prompt_completion(
    tokenizer,
    prompt: str,
    completion: str,
    *,
    add_eos: bool = True,
    prefix: list[int] | None = None,
) -> Tokenised:
    """Start tokens + prompt, then completion (+ eos), tokenised apart; loss on the
    completion (and eos) only."""
    prefix = special_prefix(tokenizer) if prefix is None else prefix
    p = prefix + token_ids(tokenizer, prompt)
    c = token_ids(tokenizer, completion) + (eos_ids(tokenizer) if add_eos else [])
    labels = [IGNORE] * len(p) + c
    labels[0] = IGNORE
    return Tokenised(p + c, labels)


def require_chat_template(tokenizer, where: str = "The records") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where} are conversations, which are rendered with the tokenizer's chat "
            "template, but this tokenizer has none. Fix: fine-tune a model whose tokenizer "
            "has a chat template (an instruction-tuned one), set tokenizer.chat_template, or "
            "write the records as prompt/completion pairs."
        )


def encode_chat(
    tokenizer, messages: list[dict], where: str = "record", messages_field: str = "messages"
) -> Tokenised:
    """The conversation rendered by the tokenizer's chat template, tokenised as
    ``apply_chat_template(messages, tokenize=True)`` does; loss on each assistant turn's
    content and end-of-turn markup (see the module docstring). ``where`` and
    ``messages_field`` name the record in messages."""
    check_messages(messages, where, messages_field)
    require_chat_template(tokenizer, where)

    def render(msgs: list[dict], gen: bool = False) -> str:
        try:
            out = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as exc:  # jinja2 TemplateError, the template's raise_exception
            raise DataError(
                f"{where}: the tokenizer's chat template refused the conversation "
                f"(first {plural(len(msgs), 'message')}): {type(exc).__name__}: {exc}. Fix the "
                "conversation (many templates want user and assistant turns to alternate)."
            ) from exc
        if not isinstance(out, str):
            raise TypeError(f"apply_chat_template(tokenize=False) gave {type(out).__name__}")
        return out

    full = render(messages)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i]) if i else ""
        upto = render(messages[: i + 1])
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError(
                f"{where}: the chat template is not prefix-stable: rendering the first "
                f"{plural(i if not upto.startswith(before) else i + 1, 'message')} is not the "
                "start of rendering the whole conversation (the template rewrites earlier "
                "turns, e.g. drops past reasoning), so the assistant turns cannot be found "
                "turn by turn. Use prompt/completion records, or a model whose template "
                "renders past turns unchanged."
            )
        start = len(before)
        if i:  # the turn's header, when the template writes it as a generation prompt
            header = render(messages[:i], gen=True)
            if upto.startswith(header) and len(header) >= start:
                start = len(header)
        if start >= len(upto) and m["content"].strip():
            raise DataError(
                f"{where}: the tokenizer's chat template renders nothing for the assistant's "
                f"turn (message {i + 1}), so no record has anything to learn from. Fine-tune "
                "a model whose chat template renders assistant turns (an instruction-tuned "
                "one's), set tokenizer.chat_template to one that does, or write the records "
                "as prompt/completion pairs."
            )
        spans.append((start, len(upto)))
    ids, loss = _token_loss_mask(tokenizer, full, spans, where)
    labels = [t if on else IGNORE for t, on in zip(ids, loss, strict=True)]
    if labels:
        labels[0] = IGNORE
    return Tokenised(ids, labels)


def _token_loss_mask(
    tokenizer, text: str, spans: list[tuple[int, int]], where: str, use_offsets: bool = True
) -> tuple[list[int], list[bool]]:
    """The ids of ``text`` and, per token, whether it overlaps a character span."""
    enc = None
    if use_offsets:
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):  # a tokenizer without offsets
            enc = None
    if enc is not None and "offset_mapping" in enc:
        ids = list(enc["input_ids"])
        offsets = enc["offset_mapping"]
        loss = [any(b > s and a < e for s, e in spans) for a, b in offsets]
        return ids, loss
    # Without offsets: the token index of a character boundary is the length of the
    # prefix's tokens, which must be a token prefix of the whole.
    ids = token_ids(tokenizer, text)
    boundary: dict[int, int] = {}
    for c in sorted({c for span in spans for c in span}):
        head = token_ids(tokenizer, text[:c])
        if ids[: len(head)] != head:
            raise DataError(
                f"{where}: the tokens of the conversation up to character {c} are not the "
                "start of the whole conversation's tokens (the tokenizer merges across the "
                "turn boundary), so the assistant turns cannot be found in tokens. Use "
                "prompt/completion records."
            )
        boundary[c] = len(head)
    loss = [False] * len(ids)
    for s, e in spans:
        for t in range(boundary[s], boundary[e]):
            loss[t] = True
    return ids, loss


_LOSS_WHAT = {
    TEXT: "tokens to predict",
    PROMPT_COMPLETION: "completion tokens",
    CHAT: "assistant tokens",
}


def encode_records(
    records: Records, tokenizer, seq_len: int, *, add_eos: bool = True
) -> tuple[list[Tokenised], SFTCounts]:
    """Every record tokenised and truncated to ``seq_len``; the kept ones and the counts."""
    if seq_len < 2:
        raise DataError(f"--seq-len must be at least 2 for next-token loss, got {seq_len}.")
    f, kind, path = records.fields, records.kind, records.path
    if kind == CHAT:
        require_chat_template(tokenizer, f"{path}: the records")
    prefix = special_prefix(tokenizer)
    kept: list[Tokenised] = []
    dropped: Counter[str] = Counter()
    truncated = 0
    what = _LOSS_WHAT[kind]
    for where, rec in records.items:
        at = f"{path}, {where}"
        if kind == CHAT:
            ex = encode_chat(tokenizer, _clipped(rec[f.messages], tokenizer, seq_len), at,
                             f.messages)  # fmt: skip
        else:
            names = (f.text,) if kind == TEXT else (f.prompt, f.completion)
            values = [rec[n] for n in names]
            for n, v in zip(names, values, strict=True):
                if v is not None and not isinstance(v, str):
                    raise DataError(
                        f"{at}: field {n!r} holds {kind_of(v)} ({v!r}), not a string. "
                        "Store the text as a string."
                    )
            missing = [n for n, v in zip(names, values, strict=True) if v is None]
            if missing:
                dropped[f"missing {missing[0]!r} value"] += 1
                continue
            blank = values[-1]  # the text, or the completion (a prompt may be empty)
            if not blank.strip():
                dropped[f"empty {names[-1]!r}"] += 1
                continue
            values = [clip_text(v, tokenizer, seq_len) for v in values]  # never tokenise a cut
            if kind == TEXT:
                ex = encode_text(tokenizer, values[0], add_eos=add_eos, prefix=prefix)
            else:
                ex = encode_prompt_completion(tokenizer, *values, add_eos=add_eos, prefix=prefix)
        if len(ex.input_ids) > seq_len:
            truncated += 1
            ex = Tokenised(ex.input_ids[:seq_len], ex.labels[:seq_len])
            if all(y == IGNORE for y in ex.labels):
                dropped[f"with no {what} left after truncation at {seq_len}"] += 1
                continue
        elif all(y == IGNORE for y in ex.labels):
            dropped[f"with no {what}"] += 1
            continue
        kept.append(ex)
    counts = SFTCounts(path, kind, seq_len, len(records.items), len(kept), truncated, dict(dropped))
    if not kept:
        raise DataError(
            f"{path}: all {plural(counts.read, 'record')} were dropped "
            f"({', '.join(f'{n} {r}' for r, n in dropped.items())}). {_all_dropped_fix(dropped)}"
        )
    return kept, counts


def _clipped(messages, tokenizer, seq_len: int):
    """The conversation with each content clipped (``encoding.clip_text``); anything that is
    not a well-formed message is left for ``check_messages`` to name."""
    if not isinstance(messages, list):
        return messages
    return [{**m, "content": clip_text(m["content"], tokenizer, seq_len)}
            if isinstance(m, dict) and isinstance(m.get("content"), str) else m
            for m in messages]  # fmt: skip


def _all_dropped_fix(dropped: Counter[str]) -> str:
    """The fixes for the reasons the records were dropped, and only those."""
    fixes = []
    if any("after truncation" in r for r in dropped):
        fixes.append("raise --seq-len or shorten the prompts")
    if any(r.startswith(("missing", "empty")) for r in dropped):
        fixes.append("fill in the empty fields")
    if any(r.startswith("with no") and "truncation" not in r for r in dropped):
        fixes.append("give each record text to learn from")
    return "Fix: " + "; ".join(fixes) + "." if fixes else "Check the records."
