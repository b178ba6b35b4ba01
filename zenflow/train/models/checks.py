"""What a resolved model can take, checked before any step: the longest sequence its
positions cover, the rows of its input embedding (and whether the tokenizer's ids fit
them), and its parameter count.

Reads a built model and its tokenizer; resolves and changes nothing.
"""

from __future__ import annotations

from zenflow.errors import ModelSourceError


def max_positions(model) -> int | None:
    """The longest sequence the model's position embeddings cover (GPT-2: n_positions,
    most others: max_position_embeddings); None when its config says neither."""
    cfg = getattr(model, "config", None)
    for attr in ("n_positions", "max_position_embeddings"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def embedding_rows(model) -> int | None:
    """Rows of the model's input embedding (the token ids it can look up), else
    ``config.vocab_size``; None when it says neither."""
    try:
        rows = model.get_input_embeddings().weight.shape[0]
    except (AttributeError, NotImplementedError, IndexError):
        rows = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(rows) if isinstance(rows, int) and rows > 0 else None


def check_token_ids(model, tokenizer, splits, model_name: str, *, batch: int = 512) -> None:
    """Refuse, before any step, a tokenizer whose ids the model cannot look up: the pad id
    or an id the data encodes to at or past the embedding's rows (the first forward would
    end in an IndexError deep in torch). ``splits`` are ``data.Encoded`` splits; they are
    tokenised only when the tokenizer is larger than the embedding (the fast path costs
    nothing), and the scan stops at the first id out of range."""
    rows = embedding_rows(model)
    if rows is None:
        return
    fix = (
        "pass the tokenizer the model was trained with (tokenizer.save_pretrained into the "
        "model directory), or a model whose vocabulary covers this tokenizer (--init random "
        f"with a config whose vocab_size is at least {len(tokenizer)}, or "
        f"model.resize_token_embeddings({len(tokenizer)}) before save_pretrained)."
    )
    head = (
        f"Model {model_name} and its tokenizer do not match: the model's vocabulary has "
        f"{rows} tokens (config.vocab_size / input embedding rows, ids 0..{rows - 1}) but"
    )
    pad = getattr(tokenizer, "pad_token_id", None)
    if isinstance(pad, int) and not 0 <= pad < rows:
        raise ModelSourceError(f"{head} the tokenizer's pad id is {pad}. Fix: {fix}")
    if len(tokenizer) <= rows:
        return
    for split in splits:
        for start in range(0, len(split), batch):
            ids = split.take(range(start, min(start + batch, len(split))))["input_ids"]
            top = int(ids.max())
            if top >= rows:
                raise ModelSourceError(
                    f"{head} the tokenizer ({len(tokenizer)} tokens) encodes the data to ids "
                    f"up to at least {top}. Fix: {fix}"
                )


def count_params(model, trainable_only: bool = False) -> int:
    """Number of parameters (each shared tensor counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total
