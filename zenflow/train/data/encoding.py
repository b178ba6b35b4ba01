"""Classification examples -> fixed-length token tensors, and how many the length cuts.

``encode`` makes both splits of a ``TaskData`` into ``Encoded`` rows: tokenised lazily, per
batch, to exactly ``seq_len`` tokens (truncated, right-padded; a pair's two texts
together). ``truncation_line`` is the header sentence saying how many rows ``--seq-len``
truncates. A text far longer than ``seq_len`` tokens is clipped by characters first
(``clip_text``): the tokenizer never sees what truncation would cut, so a 30 MB row costs
what its first few thousand characters cost, and the tokens are those of the whole text.

Owns: the tokenisation of classification rows. Must not: order or batch them
(``batching``) or read files.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from zenflow.errors import DataError
from zenflow.train.data.task import Example, TaskData

CLIP_MARGIN = 64  # tokens past seq_len that a clipped text still holds (the cut's own word)
_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for: the longest vocabulary entry (a byte-level
    entry has a character per byte, so it counts at least the characters it decodes to)."""
    try:
        return _TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    n = max((len(k) for k in tokenizer.get_vocab()), default=1) or 1
    try:
        _TOKEN_CHARS[tokenizer] = n
    except TypeError:  # not weakly referable: computed again next time
        pass
    return n


def clip_text(text: str, tokenizer, seq_len: int) -> str:
    """``text``, or its first ``(seq_len + CLIP_MARGIN) * max_token_chars`` characters when
    those alone hold at least ``seq_len + CLIP_MARGIN`` tokens: truncation to ``seq_len``
    then gives the whole text's tokens (only the last word before the cut can tokenise
    differently, and it lies past the margin), and the rest is never tokenised. A start
    that holds fewer tokens (a tokenizer that drops long runs of whitespace) keeps the
    whole text."""
    limit = (seq_len + CLIP_MARGIN) * max_token_chars(tokenizer)
    if len(text) <= limit:
        return text
    head = text[:limit]
    if len(tokenizer(head, add_special_tokens=False)["input_ids"]) >= seq_len + CLIP_MARGIN:
        return head
    return text


def _texts(rows: Sequence[Example], tokenizer, seq_len: int):
    """The first texts and the second texts (None for single texts) of ``rows``, clipped."""
    firsts = [clip_text(r.texts[0], tokenizer, seq_len) for r in rows]
    if not rows or len(rows[0].texts) < 2:
        return firsts, None
    return firsts, [clip_text(r.texts[1], tokenizer, seq_len) for r in rows]


class Encoded:
    """One split, tokenised to exactly ``seq_len`` tokens (truncated, right-padded).

    Tokenisation is lazy and per example (``take``): a batch costs the same whatever the
    split's size, and a run of 40 steps over MNLI's 393k rows does not tokenise them all
    first. With fixed padding, an example's tensors do not depend on its batch-mates, so
    ``take`` and ``tensors`` agree exactly.
    """

    def __init__(self, rows: Sequence[Example], tokenizer, seq_len: int, regression: bool):
        if not rows:
            raise DataError("No rows to encode.")
        self.rows = rows
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.regression = regression

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, indices) -> dict:
        """Tensors of the given examples: input_ids/attention_mask [B, seq_len], labels [B]."""
        import torch

        rows = [self.rows[int(i)] for i in indices]
        firsts, seconds = _texts(rows, self.tokenizer, self.seq_len)
        enc = self.tokenizer(
            firsts,
            seconds,
            truncation=True,
            max_length=self.seq_len,
            padding="max_length",
            return_tensors="pt",
        )
        dtype = torch.float32 if self.regression else torch.long
        return {
            "input_ids": enc["input_ids"].long(),
            "attention_mask": enc["attention_mask"].long(),
            "labels": torch.tensor([r.label for r in rows], dtype=dtype),
        }

    def tensors(self) -> dict:
        """The whole split at once (tokenises every row)."""
        return self.take(range(len(self.rows)))


TRUNCATION_SAMPLE = 5000  # training rows tokenised up front to count the truncated ones


def is_truncated(rows: Sequence[Example], tokenizer, seq_len: int) -> list[bool]:
    """Per row: is it longer than ``seq_len`` tokens (special tokens included, both texts of
    a pair together), so that ``Encoded`` cuts it?"""
    firsts, seconds = _texts(rows, tokenizer, seq_len)  # a clipped text is still too long
    ids = tokenizer(firsts, seconds, truncation=False, verbose=False)["input_ids"]
    return [len(x) > seq_len for x in ids]


def truncation_line(data: TaskData, tokenizer, seq_len: int, seed: int) -> str:
    """One header sentence: how many rows ``--seq-len`` truncates. Every eval row is
    counted; the training rows too when there are at most ``TRUNCATION_SAMPLE`` of them,
    else a seeded sample of that many (tokenising MNLI's 393k rows would take a minute)."""
    train = data.train
    if len(train) > TRUNCATION_SAMPLE:
        train = random.Random(seed).sample(list(train), TRUNCATION_SAMPLE)

    counts = [(name, sum(is_truncated(rows, tokenizer, seq_len)), len(rows), total)
              for name, rows, total in (("train", train, len(data.train)),
                                        ("eval", data.dev, len(data.dev)))]  # fmt: skip
    parts = ", ".join(
        f"{name} {n} of " + (f"a {k}-row sample of {total}" if k < total else f"{k}")
        + f" ({100 * n / k:.1f}%)" for name, n, k, total in counts
    )  # fmt: skip
    if not any(n for _, n, _, _ in counts):
        return f"none truncated at --seq-len {seq_len} tokens: {parts}"
    return (
        f"truncated to --seq-len {seq_len} tokens (the end cut off): {parts}; raise --seq-len "
        "to keep more of them"
    )


@dataclass
class EncodedTask:
    train: Encoded
    dev: Encoded


def encode(task_data: TaskData, tokenizer, seq_len: int) -> EncodedTask:
    """Both splits of ``task_data``, tokenised (lazily) to fixed length ``seq_len``."""
    if seq_len < 1:
        raise DataError(f"--seq-len must be at least 1, got {seq_len}.")
    reg = task_data.task.is_regression
    return EncodedTask(
        train=Encoded(task_data.train, tokenizer, seq_len, reg),
        dev=Encoded(task_data.dev, tokenizer, seq_len, reg),
    )
