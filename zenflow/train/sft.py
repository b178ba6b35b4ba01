"""Supervised fine-tuning data for causal LMs: records -> fixed-length rows with loss masks.

Contract:

- ``read_records`` reads ``.jsonl`` (one JSON object per line, blank lines skipped) or
  ``.json`` (an array of objects), UTF-8 (a byte-order mark allowed). The first record's
  fields decide the file's kind, one kind per file:

  - ``text``: ``{"text": ...}``, loss on every token (and the end-of-sequence token);
  - ``prompt/completion``: ``{"prompt": ..., "completion": ...}``; the input is prompt +
    completion + eos, the loss is on the completion and the eos only;
  - ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered by the
    tokenizer's own chat template; the loss is on the assistant turns only.

  Field names are configurable (``RecordFields``). A record of another kind than the first,
  an unknown role, a non-string content or a conversation without an assistant turn is a
  ``DataError`` naming file and line. A null or blank text/completion drops the record
  (counted under its reason).
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
  end is cut off). Those are counted; the ones left without any loss token are dropped
  and counted under their own reason, never silently.
- Rows (``SFTData``): without packing one example per row, right-padded, a 2-D
  ``attention_mask`` and labels -100 on padding. With ``pack=True`` examples are placed in
  file order into rows of ``seq_len`` (next fit: a new row when the next example does not
  fit); each row has segment ids, ``position_ids`` restarting at 0 per example, and a 4-D
  additive mask [B, 1, L, L] (0 where a query may attend, the dtype's minimum elsewhere)
  that is causal and block-diagonal, so every token sees only its own example. The padding
  tail is one more block (so no softmax row is empty) with labels -100. ``take`` builds
  the batches as stacked tensors; the 4-D mask is built per batch, in the model's dtype.
- Packing is exact only for models that take a ready 4-D mask as is and honour
  ``position_ids``: ``check_packing_support`` allows the model types in
  ``PACKING_MODEL_TYPES`` (checked in transformers 5's code, ``masking_utils``: a 4-D mask
  is returned unchanged; each proven by a test) with eager or sdpa attention, and refuses a
  sliding window shorter than ``seq_len`` (a custom mask replaces the window).
- Evaluation: ``score_completions`` sums the log-likelihood of each completion given its
  prompt; ``token_loss_sum`` gives the summed next-token loss and token count of a batch,
  and ``lm_eval_metrics`` turns the totals into eval loss and perplexity.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from zenflow.errors import DataError, EngineError
from zenflow.train.hub_data import hub_records, is_hub_id, shown_name
from zenflow.train.tables import json_objects, jsonl_objects, kind_of, read_text

IGNORE = -100  # the label Hugging Face's loss skips
TEXT, PROMPT_COMPLETION, CHAT = "text", "prompt/completion", "chat"
ROLES = ("system", "user", "assistant", "tool")
FORMATS = (".jsonl", ".json")

# Model types whose transformers 5 code passes a 4-D mask through unchanged
# (masking_utils._preprocess_mask_arguments) and uses position_ids for its positions
# (learned table or rotary); each is checked by tests/train/test_sft.py.
PACKING_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
PACKING_ATTENTION = ("eager", "sdpa")  # flash-attention kernels ignore a 4-D mask


@dataclass(frozen=True)
class RecordFields:
    """The field names of the records (defaults: text, prompt, completion, messages)."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"

    def kind_fields(self) -> dict[str, tuple[str, ...]]:
        return {
            TEXT: (self.text,),
            PROMPT_COMPLETION: (self.prompt, self.completion),
            CHAT: (self.messages,),
        }


@dataclass
class Records:
    """One file's records, all of one kind."""

    path: Path
    kind: str  # TEXT | PROMPT_COMPLETION | CHAT
    items: list[tuple[str, dict[str, Any]]]  # (where: "line 7" / "item 7", record)
    fields: RecordFields = field(default_factory=RecordFields)


class Tokenised(NamedTuple):
    input_ids: list[int]
    labels: list[int]  # IGNORE where no loss; labels[0] is always IGNORE


def _n(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# ------------------------------------------------------------------------------ reading


def read_records(path: str | Path, fields: RecordFields = RecordFields()) -> Records:
    """The records of one .jsonl or .json file, or of a hub dataset's split
    (``zenflow.train.hub_data``), and their kind (from the first record)."""
    if is_hub_id(path):
        items = hub_records(str(path))
        if not items:
            raise DataError(f"The dataset {path} has no rows.")
        return Records(Path(path), _check_kinds(Path(path), items, fields), items, fields)
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(
            f"{path}: unknown record format {path.suffix or '(no suffix)'!r}; supported are "
            f"{', '.join(FORMATS)} (one JSON object per line, or an array of objects)."
        )
    text = read_text(path, "Record")
    if not text.strip():
        raise DataError(f"{path} is empty; expected JSON records such as {_example(fields)}.")
    example = _example(fields)
    if suffix == ".jsonl":
        items = jsonl_objects(path, text, example)
    else:
        items = json_objects(path, text, example, "record file")
    if not items:
        raise DataError(f"{path} holds no records; add records such as {_example(fields)}.")
    return Records(path, _check_kinds(path, items, fields), items, fields)


def records_from(
    objects: Iterable[dict[str, Any]], name: str = "records", fields: RecordFields = RecordFields()
) -> Records:
    """Records already in memory (``name`` stands for the file in messages)."""
    items = [(f"record {i}", obj) for i, obj in enumerate(objects, start=1)]
    path = Path(name)
    if not items:
        raise DataError(f"{name}: no records.")
    for where, obj in items:
        if not isinstance(obj, dict):
            raise DataError(f"{name}, {where}: {kind_of(obj)}, not an object.")
    return Records(path, _check_kinds(path, items, fields), items, fields)


def _example(fields: RecordFields) -> str:
    return (
        f'{{"{fields.text}": "..."}}, {{"{fields.prompt}": "...", "{fields.completion}": "..."}}'
        f' or {{"{fields.messages}": [{{"role": "user", "content": "..."}}, ...]}}'
    )


def _kind_of_record(path: Path, where: str, rec: dict, fields: RecordFields) -> str:
    kinds = [k for k, names in fields.kind_fields().items() if all(n in rec for n in names)]
    if len(kinds) == 1:
        return kinds[0]
    if len(kinds) > 1:
        raise DataError(
            f"{path}, {where}: the record has the fields of more than one kind "
            f"({' and '.join(kinds)}: {', '.join(repr(k) for k in rec)}); it is unclear which "
            "to train on. Keep one kind's fields, or rename the others."
        )
    if fields.prompt in rec or fields.completion in rec:
        have, lack = (
            (fields.prompt, fields.completion)
            if fields.prompt in rec
            else (fields.completion, fields.prompt)
        )
        raise DataError(
            f"{path}, {where}: the record has {have!r} but no {lack!r}; a prompt/completion "
            f"record needs both. Add the field, or name it with the {lack}_field setting."
        )
    raise DataError(
        f"{path}, {where}: none of the known fields; the record has "
        f"{', '.join(repr(k) for k in rec) or 'no fields'}. Expected {_example(fields)} "
        "(field names can be set with text_field, prompt_field, completion_field, "
        "messages_field)."
    )


def _check_kinds(path: Path, items: list[tuple[str, dict]], fields: RecordFields) -> str:
    first_where, first = items[0]
    kind = _kind_of_record(path, first_where, first, fields)
    for where, rec in items[1:]:
        other = _kind_of_record(path, where, rec, fields)
        if other != kind:
            raise DataError(
                f"{path}, {where}: a {other} record, but the file's first record "
                f"({first_where}) is a {kind} record; one file holds one kind. Split the "
                "file by kind, or convert the records to one kind."
            )
    return kind


# ---------------------------------------------------------------------------- tokenising


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


def _eos(tokenizer) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise DataError(
            "The tokenizer has no end-of-sequence token, so examples cannot end with one. "
            "Set tokenizer.eos_token, or pass add_eos=False."
        )
    return [int(tokenizer.eos_token_id)]


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_text(
    tokenizer, text: str, *, add_eos: bool = True, prefix: list[int] | None = None
) -> Tokenised:
    """Start tokens + text (+ eos); loss on every token after the first. ``prefix``: the
    start tokens when already known (``special_prefix``)."""
    prefix = special_prefix(tokenizer) if prefix is None else prefix
    ids = prefix + _ids(tokenizer, text) + (_eos(tokenizer) if add_eos else [])
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
    p = prefix + _ids(tokenizer, prompt)
    c = _ids(tokenizer, completion) + (_eos(tokenizer) if add_eos else [])
    labels = [IGNORE] * len(p) + c
    labels[0] = IGNORE
    return Tokenised(p + c, labels)


def check_messages(messages: Any, where: str = "record", messages_field: str = "messages"):
    """DataError unless ``messages`` is a non-empty list of {"role", "content": str} with
    known roles and at least one assistant turn."""
    allowed = ", ".join(ROLES)
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: field {messages_field!r} holds {kind_of(messages)}"
            f"{' (empty)' if messages == [] else ''}; it must be a list of messages such as "
            '{"role": "user", "content": "..."}.'
        )
    for j, m in enumerate(messages, start=1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(
                f"{where}: message {j} is {kind_of(m)} without 'role' and 'content'; each "
                f'message is an object such as {{"role": "user", "content": "..."}}.'
            )
        if m["role"] not in ROLES:
            raise DataError(
                f"{where}: message {j} has the unknown role {m['role']!r}; the allowed roles "
                f"are {allowed}. Rename the role."
            )
        if not isinstance(m["content"], str):
            raise DataError(
                f"{where}: message {j} ({m['role']}) has content that is "
                f"{kind_of(m['content'])}, not a string. Write the content as text."
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"{where}: the conversation has no assistant turn, so nothing to learn from "
            f"(roles: {', '.join(m['role'] for m in messages)}; allowed: {allowed}). Add the "
            "assistant's reply, or remove the record."
        )


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
                f"(first {_n(len(msgs), 'message')}): {type(exc).__name__}: {exc}. Fix the "
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
                f"{_n(i if not upto.startswith(before) else i + 1, 'message')} is not the "
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
    ids = _ids(tokenizer, text)
    boundary: dict[int, int] = {}
    for c in sorted({c for span in spans for c in span}):
        head = _ids(tokenizer, text[:c])
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


# ------------------------------------------------------------------------------ counting


@dataclass(frozen=True)
class SFTCounts:
    """What happened to one file's records: read = kept + sum(dropped.values())."""

    path: Path
    kind: str
    seq_len: int
    read: int
    kept: int
    truncated: int  # of the kept and the dropped: examples longer than seq_len
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> records

    def line(self) -> str:
        """ "train.jsonl: 500 prompt/completion records read, 498 kept, 2 dropped (2 with no
        completion tokens left after truncation at 128), 17 truncated at 128 tokens"."""
        name = shown_name(self.path)
        head = f"{name}: {_n(self.read, self.kind + ' record')} read, {self.kept} kept"
        if self.dropped:
            why = ", ".join(f"{n} {reason}" for reason, n in self.dropped.items())
            head += f", {sum(self.dropped.values())} dropped ({why})"
        else:
            head += ", none dropped"
        if self.truncated:
            return head + f", {self.truncated} truncated at {self.seq_len} tokens (end cut off)"
        return head + f", none longer than {self.seq_len} tokens"


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
        raise DataError(f"seq_len must be at least 2 for next-token loss, got {seq_len}.")
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
            ex = encode_chat(tokenizer, rec[f.messages], at, f.messages)
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
            f"{path}: all {_n(counts.read, 'record')} were dropped "
            f"({', '.join(f'{n} {r}' for r, n in dropped.items())}). Raise seq_len, shorten "
            "the prompts, or fill in the empty fields."
        )
    return kept, counts


# ---------------------------------------------------------------------------------- rows


def pack_examples(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Example indices per row, in order, next fit: a row is closed when the next example
    does not fit in what is left of it. Every length must be 1..seq_len."""
    rows: list[list[int]] = []
    used = seq_len  # forces a first row
    for i, n in enumerate(lengths):
        if not 1 <= n <= seq_len:
            raise ValueError(f"example {i} has {n} tokens; packing needs 1..{seq_len}")
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def packed_attention_mask(segment_ids, dtype=None):
    """The additive 4-D mask [B, 1, L, L] of packed rows: 0 where query q may attend key k
    (same segment, k <= q), the dtype's minimum elsewhere. ``segment_ids`` [B, L]."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    seg = segment_ids.long()
    length = seg.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=seg.device).tril()
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal  # [B, q, k]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=seg.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


class SFTData:
    """Rows of ``seq_len`` tokens, stored stacked (int32 on the CPU); ``take`` gives
    batches of stacked int64 tensors, ready for ``model(**batch)``:

    - unpacked: input_ids, attention_mask [B, L] (1 = token), labels;
    - packed: input_ids, attention_mask [B, 1, L, L] (additive, in ``mask_dtype``),
      position_ids, labels.

    ``segment_ids`` (packed: 1.. per example, 0 for the padding tail; unpacked: 1 on
    tokens, 0 on padding) and ``loss_tokens`` (per row) are kept for the trainer.
    """

    def __init__(self, examples: Sequence[Tokenised], seq_len: int, *, pad_id: int, pack: bool):
        import torch

        if not examples:
            raise DataError("No examples to put into rows.")
        self.seq_len = seq_len
        self.packed = pack
        self.pad_id = int(pad_id)
        lengths = [len(ex.input_ids) for ex in examples]
        groups = pack_examples(lengths, seq_len) if pack else [[i] for i in range(len(lengths))]
        n = len(groups)
        self.input_ids = torch.full((n, seq_len), self.pad_id, dtype=torch.int32)
        self.labels = torch.full((n, seq_len), IGNORE, dtype=torch.int32)
        self.position_ids = torch.zeros((n, seq_len), dtype=torch.int32)
        self.segment_ids = torch.zeros((n, seq_len), dtype=torch.int32)
        for r, group in enumerate(groups):
            at = 0
            for s, i in enumerate(group, start=1):
                ex, k = examples[i], lengths[i]
                if k > seq_len:
                    raise ValueError(f"example {i} has {k} tokens, more than seq_len {seq_len}")
                self.input_ids[r, at : at + k] = torch.tensor(ex.input_ids, dtype=torch.int32)
                self.labels[r, at : at + k] = torch.tensor(ex.labels, dtype=torch.int32)
                self.labels[r, at] = IGNORE  # nothing in this example predicts its first token
                self.position_ids[r, at : at + k] = torch.arange(k, dtype=torch.int32)
                self.segment_ids[r, at : at + k] = s
                at += k
            self.position_ids[r, at:] = torch.arange(seq_len - at, dtype=torch.int32)
        self.examples = len(examples)
        self.mask_dtype = None  # the 4-D mask's dtype when take() is given none (float32)
        self.segments_only = False
        self.loss_tokens = (self.labels != IGNORE).sum(dim=1)
        self.real_tokens = int((self.segment_ids > 0).sum())

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def take(self, indices, mask_dtype=None) -> dict:
        """Stacked tensors of the given rows (see the class docstring). Packed rows with
        ``segments_only`` set give their ``segment_ids`` instead of the 4-D mask (the
        trainer builds the mask on the device: L x L per row need not cross the link)."""
        import torch

        idx = torch.as_tensor(list(indices) if not hasattr(indices, "shape") else indices).long()
        batch = {"input_ids": self.input_ids[idx].long(), "labels": self.labels[idx].long()}
        if self.packed:
            if self.segments_only:
                batch["segment_ids"] = self.segment_ids[idx].long()
            else:
                dtype = mask_dtype if mask_dtype is not None else self.mask_dtype
                batch["attention_mask"] = packed_attention_mask(self.segment_ids[idx], dtype)
            batch["position_ids"] = self.position_ids[idx].long()
        else:
            batch["attention_mask"] = (self.segment_ids[idx] > 0).long()
        return batch

    def tensors(self, mask_dtype=None) -> dict:
        return self.take(range(len(self)), mask_dtype)


@dataclass
class SFTReport:
    counts: SFTCounts
    rows: int
    examples: int
    packed: bool
    real_tokens: int
    loss_tokens: int
    add_eos: bool = True

    def lines(self) -> list[str]:
        """Sentences for the run header."""
        c = self.counts
        share = 100 * self.real_tokens / (self.rows * c.seq_len)
        if self.packed:
            rows = (
                f"rows: {_n(self.examples, 'example')} packed into {_n(self.rows, 'row')} of "
                f"{c.seq_len} tokens ({share:.1f}% of positions hold tokens; each token "
                "attends only within its own example, positions restart per example)"
            )
        else:
            rows = (
                f"rows: {_n(self.rows, 'row')} of {c.seq_len} tokens, one example each, "
                f"right-padded ({share:.1f}% of positions hold tokens)"
            )
        eos = " and the end-of-sequence token" if self.add_eos else ""
        on = {
            TEXT: f"every token but the first of each example (nothing precedes it){eos}",
            PROMPT_COMPLETION: f"the completion tokens{eos}, not the prompt",
            CHAT: "the assistant turns (content and the template's end-of-turn markup), not "
            "the system, user or tool turns",
        }[c.kind]
        return [c.line(), rows, f"loss on: {on}; {self.loss_tokens:,} tokens in all"]


def load_sft(
    path: str | Path,
    tokenizer,
    seq_len: int,
    *,
    pack: bool = False,
    fields: RecordFields = RecordFields(),
    add_eos: bool = True,
) -> tuple[SFTData, SFTReport]:
    """Read, tokenise, truncate and (optionally) pack one record file."""
    return build_sft(read_records(path, fields), tokenizer, seq_len, pack=pack, add_eos=add_eos)


def build_sft(
    records: Records, tokenizer, seq_len: int, *, pack: bool = False, add_eos: bool = True
) -> tuple[SFTData, SFTReport]:
    """``load_sft`` for records already read (``read_records`` or ``records_from``)."""
    examples, counts = encode_records(records, tokenizer, seq_len, add_eos=add_eos)
    data = SFTData(examples, seq_len, pad_id=pad_token_id(tokenizer), pack=pack)
    loss_tokens = int(data.loss_tokens.sum())
    report = SFTReport(
        counts, len(data), len(examples), pack, data.real_tokens, loss_tokens, add_eos
    )
    return data, report


def pad_token_id(tokenizer) -> int:
    """The id padding uses (never attended, never a label): pad, else eos, else 0."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def check_packing_support(model, seq_len: int | None = None) -> None:
    """EngineError unless packed rows give ``model`` exactly what each example gives alone:
    a model type in PACKING_MODEL_TYPES, eager or sdpa attention, and no sliding window
    shorter than ``seq_len``."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    attn = getattr(config, "_attn_implementation", None) or "eager"
    fix = "Train without packing (pack=False), which works with every causal LM."
    if model_type not in PACKING_MODEL_TYPES:
        raise EngineError(
            f"Packing is not supported for model type {model_type!r}: it is proven only for "
            f"{', '.join(PACKING_MODEL_TYPES)}, whose code takes a 4-D attention mask as "
            f"given and honours position_ids. {fix}"
        )
    if attn not in PACKING_ATTENTION:
        raise EngineError(
            f"Packing needs eager or sdpa attention (a 4-D mask); this model uses {attn!r}, "
            f"which ignores it. Load the model with attn_implementation='sdpa', or: {fix}"
        )
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    if window and seq_len is not None and seq_len > window:
        raise EngineError(
            f"Packing replaces the model's sliding-window mask ({window} tokens) with its "
            f"own, which differs for rows longer than that (seq_len {seq_len}). Use seq_len "
            f"<= {window}, or: {fix}"
        )


# ---------------------------------------------------------------------------- evaluation


def token_loss_sum(logits, labels) -> tuple[float, int]:
    """(summed next-token cross-entropy, number of predicted tokens) of a batch, as Hugging
    Face shifts it: logits [B, L, V] at t predict labels[t + 1]; -100 is skipped."""
    rows, targets, _ = predicted_positions(logits, labels)
    return float(token_nll(rows, targets).sum()), int(targets.numel())


def predicted_positions(logits, labels):
    """The logits that predict a label (``[K, V]``, at t for labels[t + 1] != -100), their
    targets ``[K]`` and each one's row ``[K]``: the loss needs the softmax of these
    positions only, not of the prompt's and the padding's."""
    target = labels[:, 1:]
    keep = target != IGNORE
    where = keep.nonzero()
    return logits[:, :-1][where[:, 0], where[:, 1]], target[keep], where[:, 0]


def token_nll(rows, targets):
    """Per-position negative log-likelihood, in fp32, of ``targets`` under ``rows``."""
    import torch.nn.functional as F

    return F.cross_entropy(rows.float(), targets, reduction="none")


def lm_eval_metrics(total_loss: float, total_tokens: int) -> dict[str, float]:
    """{"eval_loss": mean loss per predicted token, "perplexity": exp of it (inf if it
    overflows)}."""
    if total_tokens <= 0:
        raise ValueError(f"no tokens were evaluated (total_tokens={total_tokens})")
    loss = total_loss / total_tokens
    try:
        ppl = math.exp(loss)
    except OverflowError:
        ppl = math.inf
    return {"eval_loss": loss, "perplexity": ppl}


def score_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    batch_size: int = 8,
    add_eos: bool = False,
) -> list[float]:
    """The summed log-likelihood (natural log) of each completion given its prompt, encoded
    as ``encode_prompt_completion`` does for training. An empty prompt (with no start
    token) is preceded by the tokenizer's bos or eos token so the first completion token
    has context. The model runs in eval mode (its mode is restored) without gradients."""
    import torch

    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    prefix = special_prefix(tokenizer)
    eos = _eos(tokenizer) if add_eos else []
    encoded = []
    for prompt, completion in zip(prompts, completions, strict=True):
        p = prefix + _ids(tokenizer, prompt)
        if not p:
            start = tokenizer.bos_token_id
            start = tokenizer.eos_token_id if start is None else start
            if start is None:
                raise DataError(
                    "An empty prompt cannot be scored with a tokenizer that has neither a "
                    "start nor an end token: the first completion token has no context."
                )
            p = [int(start)]
        c = _ids(tokenizer, completion) + eos
        encoded.append(Tokenised(p + c, [IGNORE] * len(p) + c))
    device = next(model.parameters()).device
    pad = pad_token_id(tokenizer)
    was_training = model.training
    model.eval()
    scores: list[float] = []
    try:
        with torch.no_grad():
            for b in range(0, len(encoded), batch_size):
                chunk = encoded[b : b + batch_size]
                width = max(len(ex.input_ids) for ex in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                labels = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, ex in enumerate(chunk):
                    k = len(ex.input_ids)
                    ids[r, :k] = torch.tensor(ex.input_ids)
                    labels[r, :k] = torch.tensor(ex.labels)
                    mask[r, :k] = 1
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                rows, targets, row_of = predicted_positions(logits, labels.to(device))
                picked = -token_nll(rows, targets)
                per_row = torch.zeros(len(chunk), dtype=picked.dtype, device=picked.device)
                scores.extend(per_row.index_add_(0, row_of, picked).tolist())
    finally:
        model.train(was_training)
    return scores


def completion_logprob(model, tokenizer, prompt: str, completion: str) -> float:
    """The summed log-likelihood of ``completion`` given ``prompt`` (``score_completions``)."""
    return score_completions(model, tokenizer, [prompt], [completion])[0]
