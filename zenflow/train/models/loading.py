"""What every model resolution shares: the result (``ResolvedModel``), the Auto class and
label count for the head, loading saved weights without transformers' raw load report
(``load_weights``: the layers that are new or not used, in words for the run header), the
errors that mean "these weight files are bad" and their reason in words, and ``_finish``
(fp32, train mode, a pad token the classifier can pool by).

Knows nothing of where a model comes from (``zenflow.train.models.resolve`` decides that);
imports transformers and torch only inside functions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from zenflow.errors import ModelSourceError

CAUSAL_LM = 0  # task_num_labels of a causal LM: its own LM head, no classification head


@dataclass
class ResolvedModel:
    """A model ready to fine-tune (fp32, train mode) plus its tokenizer and provenance."""

    model: Any  # a transformers *ForSequenceClassification model
    tokenizer: Any
    sources: dict[str, str] = field(default_factory=dict)  # keys: model, tokenizer, config


def _load_errors() -> tuple[type[BaseException], ...]:
    """What loading weights from files raises when the files are bad, not the code:
    missing/unreadable (OSError), malformed config or arguments (ValueError), truncated or
    corrupt safetensors (SafetensorError), shapes that do not fit the config
    (RuntimeError "size mismatch" / "ignore_mismatched_sizes"), a broken pickle (.bin)."""
    import pickle

    errors: list[type[BaseException]] = [OSError, ValueError, RuntimeError, EOFError]
    errors.append(pickle.UnpicklingError)
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # pragma: no cover - safetensors is a transformers dependency
        pass
    return tuple(errors)


def _load_reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "ignore_mismatched_sizes" in text or "size mismatch" in text:
        return (
            "the saved weights' shapes do not match the model's config.json (weights and "
            "config come from different models)"
        )
    return text.rstrip(".")


def load_weights(cls, where, **kwargs):
    """``cls.from_pretrained(where, **kwargs)`` without transformers' load report and
    progress bar; returns ``(model, info)``: ``info`` is transformers' loading info
    (missing, unexpected and mismatched keys), ``new_layers(info, seed)`` words it."""
    with _quiet_transformers():
        return cls.from_pretrained(where, output_loading_info=True, **kwargs)


def new_layers(info: dict, seed: int | None = None) -> str | None:
    """The run header's sentence for the layers a load did not take from the files (a new
    classification head, its size changed or missing) and the saved ones it did not use;
    None when every layer came from the files and every saved one was used."""
    parts = []
    resized = [f"{k} (saved {list(old)}, now {list(new)})"
               for k, old, new in sorted(info.get("mismatched_keys") or ())]  # fmt: skip
    missing = sorted(info.get("missing_keys") or ())
    init = "random init" + (f" (seed {seed})" if seed is not None else "")
    if resized or missing:
        parts.append(f"new classification head: {', '.join(resized + missing)}, {init}")
    unused = sorted(info.get("unexpected_keys") or ())
    if unused:
        parts.append(f"saved layers not used (this model has no such layer): {', '.join(unused)}")
    return "; ".join(parts) or None


def _model_class(task_num_labels: int):
    """The Auto class: a causal LM for CAUSAL_LM, else a sequence classifier."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if task_num_labels == CAUSAL_LM:
        return AutoModelForCausalLM
    return AutoModelForSequenceClassification


def _set_labels(config, task_num_labels: int) -> None:
    if task_num_labels != CAUSAL_LM:
        config.num_labels = task_num_labels


def _labels_kwargs(config, task_num_labels: int) -> dict:
    if task_num_labels == CAUSAL_LM:
        return {}
    kw: dict = {"num_labels": task_num_labels}
    if getattr(config, "num_labels", None) != task_num_labels:
        # A new classification head of a different size: drop the saved one.
        kw["ignore_mismatched_sizes"] = True
    return kw


def _finish(model, tokenizer, task_num_labels: int, sources: dict[str, str] | None = None):
    """fp32, train mode, pad token = eos where the tokenizer has none (GPT-2, Llama).

    transformers' decoder classifiers (GPT-2, and Llama / Qwen2 through
    GenericForSequenceClassification) pool the logits of each row's rightmost token that is
    not ``config.pad_token_id`` and refuse batches of more than one row without it; with
    right padding to a fixed length that is the last real token. An assigned pad token is
    said in ``sources["pad token"]``.
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelSourceError(
                "The tokenizer has neither a pad token nor an eos token to pad with; pass a "
                "model directory whose tokenizer defines one."
            )
        tokenizer.pad_token = tokenizer.eos_token
        if sources is not None:
            sources["pad token"] = (
                f"{tokenizer.pad_token} (id {tokenizer.pad_token_id}), the tokenizer's EOS: it "
                "has no pad token; the classifier reads each row's last non-pad token"
            )
    model.config.pad_token_id = tokenizer.pad_token_id
    if task_num_labels == 1:
        model.config.problem_type = "regression"
    model.float()
    model.train()
    return model


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' load report and progress bar for a load whose new head is
    expected and announced in the sources."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
