"""Tokenised examples -> rows of ``seq_len`` tokens: one example per row, or packed.

Contract:

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

Owns: the rows, packing and the packed mask. Must not: tokenise (``record_encoding``).
"""

from __future__ import annotations

from collections.abc import Sequence

from zenflow.errors import DataError, EngineError
from zenflow.train.data.record_encoding import IGNORE, Tokenised

# Model types whose transformers 5 code passes a 4-D mask through unchanged
# (masking_utils._preprocess_mask_arguments) and uses position_ids for its positions
# (learned table or rotary); each is checked by tests/train/test_sft.py.
PACKING_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
PACKING_ATTENTION = ("eager", "sdpa")  # flash-attention kernels ignore a 4-D mask


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


def check_packing_support(model, seq_len: int | None = None) -> None:
    """EngineError unless packed rows give ``model`` exactly what each example gives alone:
    a model type in PACKING_MODEL_TYPES, eager or sdpa attention, and no sliding window
    shorter than ``seq_len``."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    attn = getattr(config, "_attn_implementation", None) or "eager"
    fix = "Train without packing (drop --pack), which works with every causal LM."
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
            f"own, which differs for rows longer than that (--seq-len {seq_len}). Use "
            f"--seq-len {window} or less, or: {fix}"
        )
