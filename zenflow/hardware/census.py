"""A model's trainable parameters as the engine classifies them, from its config alone.

``resolve_census(MODEL)`` reads only a config (a local directory, a built-in architecture such
as ``llama-7b``, or the Hugging Face cache), builds the model on the meta device (no weight is
allocated, whatever its size) and counts its trainable params with the engine's own
``zenflow.engine.selection.classify_params`` / ``num_selected``. The result, ``ParamCensus``,
is what ``zenflow.hardware.estimate`` lays out in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zenflow.config.architectures import architecture, architecture_names
from zenflow.engine.copies import bucket_elems_for, chunk_bucket_elems
from zenflow.engine.selection import DEFAULT_MIN_NUMEL, classify_params, num_selected
from zenflow.errors import UserInputError

HEADS = ("classification", "causal-lm")


class EstimateError(UserInputError):
    """Bad input to the estimate: an unknown architecture, an unparseable size."""


def preset_names() -> list[str]:
    """The built-in architecture names (``zenflow.config.architectures``, shared with
    ``zfctl finetune``)."""
    return architecture_names()


def preset_config(name: str):
    """A transformers config for a built-in architecture name, or None."""
    arch = architecture(name)
    return arch.config() if arch is not None else None


@dataclass(frozen=True)
class ArchShape:
    """What the activation estimate needs from a transformer config."""

    hidden: int
    heads: int
    layers: int
    vocab: int
    num_labels: int
    causal_lm: bool
    positions: int | None = None  # n_positions / max_position_embeddings, when the config says
    # the layer's shape as ``zenflow.hardware.layout.activation_bytes`` models it: "gpt2"
    # (LayerNorm, a four-times MLP with transformers' six-op GELU), "llama" (RMSNorm with its
    # fp32 copy, SwiGLU: llama, mistral, qwen2), None (any other: Korthikanti's layer)
    family: str | None = None
    intermediate: int | None = None  # the MLP's width (family only)
    dropout: bool = False  # gpt2: a hidden dropout > 0 (its masks, one byte each on a GPU)


@dataclass(frozen=True)
class ParamCensus:
    """A model's trainable parameters as the engine classifies them."""

    model: str
    source: str  # where the config came from
    params: int  # P
    dense_params: int  # Pd: 1-D and small params, updated fully on the device
    zenflow_weights: tuple[tuple[int, int], ...]  # (rows, n_cols) of every ZenFlow weight
    largest_numel: int  # largest trainable param (sets the staging bucket)
    arch: ArchShape | None = None
    tied_numel: int = 0  # the largest ZenFlow weight used by two modules (a tied LM head)
    # --engine lora: (in, out) of each projection peft's "all-linear" adapts, and the params
    # of the classification head it trains whole (zenflow.train.lora.lora_linear_shapes)
    lora_linear: tuple[tuple[int, int], ...] = ()
    lora_head: int = 0
    dense_tensors: int = 0  # how many dense params (each its own copy in the offload engine)

    def lora_params(self, rank: int) -> int:
        """Trainable params of --engine lora at ``rank``: r x (in + out) per adapted
        projection, and the head."""
        return sum(rank * (i + o) for i, o in self.lora_linear) + self.lora_head

    @property
    def zenflow_params(self) -> int:  # Pz
        return self.params - self.dense_params

    @property
    def bucket_elements(self) -> int:  # B: the engine's own rule (zenflow.engine.copies)
        return bucket_elems_for(
            [r * c for r, c in self.zenflow_weights] or [self.largest_numel],
            [max(r, c) for r, c in self.zenflow_weights],
            None,
        )

    @property
    def bucket_elements_all(self) -> int:
        """B of the offload engine: its buckets carry whole gradients of every param."""
        return chunk_bucket_elems(self.params, self.largest_numel)

    @property
    def largest_zenflow_numel(self) -> int:
        """L: the gradient elements the ZenFlow stream has in flight at the peak of backward:
        the largest gradient while it is produced, plus, with a tied weight (an embedding
        reused as the LM head), that weight's gradient, which autograd holds from the head's
        backward to the embedding's (the whole backward)."""
        sizes = sorted((r * c for r, c in self.zenflow_weights), reverse=True)
        if not sizes:
            return 0
        if self.tied_numel:
            others = list(sizes)
            others.remove(self.tied_numel)
            return self.tied_numel + (others[0] if others else 0)
        return sizes[0]

    def largest_selected(self, topk_ratio: float) -> int:
        """The largest one weight's selected elements (rows x k)."""
        return max((r * num_selected(c, topk_ratio) for r, c in self.zenflow_weights), default=0)

    def nonselected(self, topk_ratio: float) -> list[int]:
        """N of every ZenFlow weight (rows x its non-selected columns), in census order: the
        elements of its compact host state."""
        return [r * (c - num_selected(c, topk_ratio)) for r, c in self.zenflow_weights]

    def nonselected_columns(self, topk_ratio: float) -> int:
        """Non-selected columns over all ZenFlow weights (a host step count each)."""
        return sum(c - num_selected(c, topk_ratio) for _, c in self.zenflow_weights)

    def selected(self, topk_ratio: float) -> tuple[int, int]:
        """(S, sum of k): selected elements and selected columns over all ZenFlow weights."""
        s = cols = 0
        for rows, n_cols in self.zenflow_weights:
            k = num_selected(n_cols, topk_ratio)
            s += rows * k
            cols += k
        return s, cols


def census_of(model, *, name: str, source: str, arch: ArchShape | None = None) -> ParamCensus:
    """Count ``model``'s trainable params with the engine's own classification."""
    params = dense = largest = tied = dense_tensors = 0
    weights = []
    uses: dict[int, int] = {}
    for module in model.modules():
        for _, p in module.named_parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    for spec in classify_params(model, DEFAULT_MIN_NUMEL):
        n = spec.param.numel()
        params += n
        largest = max(largest, n)
        if spec.is_zenflow:
            weights.append((n // spec.n_cols, spec.n_cols))
            if uses.get(id(spec.param), 0) > 1:
                tied = max(tied, n)
        else:
            dense += n
            dense_tensors += 1
    from zenflow.train.lora import lora_linear_shapes

    lora_linear, lora_head = lora_linear_shapes(model)
    return ParamCensus(name, source, params, dense, tuple(weights), largest, arch, tied,
                       lora_linear, lora_head, dense_tensors)  # fmt: skip


def _positions(config) -> int | None:
    """The longest sequence the config's position embeddings cover (as
    ``zenflow.train.models.max_positions`` reads a model's), None when it says neither."""
    for attr in ("n_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


LLAMA_LIKE = ("llama", "mistral", "qwen2")  # RMSNorm + SwiGLU layers (activation family "llama")


def _family(config) -> tuple[str | None, int | None, bool]:
    """(family, MLP width, dropout) of a config for the activation estimate."""
    kind = getattr(config, "model_type", None)
    try:
        if kind == "gpt2":
            inner = getattr(config, "n_inner", None) or 4 * int(config.hidden_size)
            drop = max(float(getattr(config, k, 0.0) or 0.0)
                       for k in ("resid_pdrop", "embd_pdrop")) > 0  # fmt: skip
            if getattr(config, "activation_function", "gelu_new") == "gelu_new":
                return "gpt2", int(inner), drop
        elif kind in LLAMA_LIKE and getattr(config, "hidden_act", "silu") == "silu":
            return "llama", int(config.intermediate_size), False
    except (AttributeError, TypeError, ValueError):
        pass
    return None, None, False


def arch_of(config, num_labels: int, causal_lm: bool) -> ArchShape | None:
    """The activation estimate's shape of a transformers config, or None where it lacks
    hidden size, heads, layers or vocabulary."""
    family, inner, drop = _family(config)
    try:
        return ArchShape(
            hidden=int(config.hidden_size), heads=int(config.num_attention_heads),
            layers=int(config.num_hidden_layers), vocab=int(config.vocab_size),
            num_labels=num_labels, causal_lm=causal_lm, positions=_positions(config),
            family=family, intermediate=inner, dropout=drop,
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


def resolve_census(model: str, *, head: str = "classification", num_labels: int = 2) -> ParamCensus:
    """Census of MODEL: a local directory, a built-in architecture, or a hub id in the cache.

    Only the config is read (``AutoConfig``; offline with HF_HUB_OFFLINE=1); the model is
    built on the meta device, so no weight memory is allocated whatever its size. ``head``
    picks the model class: ``classification`` (what ``zfctl finetune`` trains) or
    ``causal-lm``.
    """
    if head not in HEADS:
        raise EstimateError(f"--head {head!r} is not allowed; choose one of {', '.join(HEADS)}.")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    local = Path(model).expanduser()
    config = None
    if local.is_dir():
        try:
            config = AutoConfig.from_pretrained(local)
        except (OSError, ValueError) as exc:
            raise EstimateError(
                f"The local directory {local} holds no readable model config (config.json): "
                f"{exc}. Pass a directory written by save_pretrained, a hub id, or an "
                f"architecture name ({', '.join(preset_names())})."
            ) from exc
        source = f"config.json in {local}"
    elif (config := preset_config(model)) is not None:
        source = f"built-in architecture {model.lower()} ({type(config).__name__})"
    else:
        try:
            config = AutoConfig.from_pretrained(model)
        except (OSError, ValueError) as exc:
            raise EstimateError(
                f"Unknown model {model!r}: it is not a local directory, not a built-in "
                f"architecture ({', '.join(preset_names())}) and its config is not in the "
                "Hugging Face cache. Pass one of those, or download the config on a "
                f"connected machine (`huggingface-cli download {model} config.json`)."
            ) from exc
        source = f"Hugging Face cache: {model}"
    causal = head == "causal-lm"
    if not causal:
        config.num_labels = num_labels
    auto = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    try:
        with torch.device("meta"):  # shapes only: no weight is allocated
            net = auto.from_config(config)
    except (ValueError, KeyError) as exc:
        other = "causal-lm" if not causal else "classification"
        raise EstimateError(
            f"transformers has no {head} model for {model!r} ({type(config).__name__}): "
            f"{exc}. Try --head {other}."
        ) from exc
    return census_of(net, name=model, source=source, arch=arch_of(config, num_labels, causal))
