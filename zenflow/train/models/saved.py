"""A fine-tuned model folder loaded exactly as saved, for ``zfctl eval``.

``load_saved`` gives the folder's model and tokenizer: every layer from its weight files (a
layer transformers would create new, a missing or reshaped head, is refused: the evaluation
would score random weights), the tokenizer by the rule finetune uses
(``tokenizer.local_tokenizer``: its own files; a GPT-2 folder without any, the packaged GPT-2
BPE, said in the notes; damaged files refused, naming the file). Files that do not load (a
truncated model.safetensors, a config that is not JSON) are a ``ModelSourceError`` naming the
folder and the fix, never a traceback.

Owns: loading a saved folder for evaluation. Must not: resolve names (hub, cache, packaged
wheels: ``resolve``), add a head, or change the weights.
"""

from __future__ import annotations

from pathlib import Path

from zenflow.errors import ModelSourceError
from zenflow.train.models.loading import _load_errors, _load_reason, load_weights
from zenflow.train.models.tokenizer import local_tokenizer


def load_saved(directory: Path, *, causal_lm: bool) -> tuple:
    """``(model, tokenizer, notes)`` of the model folder ``directory`` (a causal LM with its
    LM head, else a sequence classifier), in eval mode on the CPU; ``notes`` say what did
    not come from the folder (the packaged tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    directory = Path(directory)
    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(
            f"{directory / 'config.json'} does not load: {_load_reason(exc)}. Save the model "
            "into the folder again (model.save_pretrained)."
        ) from exc
    tokenizer, tokenizer_source = local_tokenizer(directory, getattr(config, "model_type", None))
    notes = [] if tokenizer_source.startswith("local directory") else [
        f"tokenizer: {tokenizer_source}, as finetune takes it for this folder"
    ]  # fmt: skip
    cls = AutoModelForCausalLM if causal_lm else AutoModelForSequenceClassification
    try:
        model, info = load_weights(cls, directory)
    except _load_errors() as exc:
        raise ModelSourceError(
            f"Could not load the weights in {directory}: {_load_reason(exc)}. The weight "
            "files are truncated or damaged, or do not match the folder's config.json: save "
            "the model again (model.save_pretrained), or copy the folder anew."
        ) from exc
    new = [k for k, *_ in sorted(info.get("mismatched_keys") or ())]
    new += sorted(info.get("missing_keys") or ())
    if new:
        raise ModelSourceError(
            f"The weights in {directory} lack {', '.join(new)} (or hold them in another "
            "shape), so transformers would initialise them at random and the evaluation "
            "would score random layers. Evaluate a model fine-tuned for this task (a run's "
            "model/ folder), not a base model."
        )
    if tokenizer.pad_token is None:  # as the trainer set it (loading._finish)
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer, notes
