"""Built-in architectures by name: the one table `zfctl estimate` and `zfctl finetune` share.

An entry is config only: the shape of a real model (``mirrors`` says which) and the hub id of
that model's checkpoint. Nothing here imports torch or transformers; ``Architecture.config()``
builds the transformers config object when asked, so the CLI's help can list the names
cheaply. ``zenflow.hardware.census`` builds these on the meta device to count bytes;
``zenflow.train.models`` builds them with random weights for a rehearsal (``--init random``)
or loads the mirrored checkpoint when the Hugging Face cache has it.

Shapes (the classification head, 2 labels, adds ``hidden x 2`` to the counts below):

| name | mirrors | hidden | inter | layers | heads (kv) | vocab | tied | params |
|---|---|---|---|---|---|---|---|---|
| gpt2 | openai-community/gpt2 | 768 | 3072 | 12 | 12 | 50257 | yes | 124.4M |
| llama-1b | meta-llama/Llama-3.2-1B | 2048 | 8192 | 16 | 32 (8) | 128256 | yes | 1235.8M |
| llama-7b | meta-llama/Llama-2-7b-hf | 4096 | 11008 | 32 | 32 | 32000 | no | 6738.4M |
| qwen2-0.5b | Qwen/Qwen2.5-0.5B | 896 | 4864 | 24 | 14 (2) | 151936 | yes | 494.0M |

(params: with the causal-LM head, tied heads counted once; tests/train/test_architectures.py
checks every entry.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "GPT2_EOS_ID",
    "GPT2_FAMILY",
    "GPT2_VOCAB_SIZE",
    "Architecture",
    "architecture",
    "architecture_names",
    "gpt2_family_name",
]

# GPT-2's byte-level BPE: 50257 tokens, <|endoftext|> = 50256 is BOS, EOS (and pad).
GPT2_VOCAB_SIZE = 50257
GPT2_EOS_ID = 50256
# Shapes of the GPT-2 family: (n_layer, n_embd, n_head); all use vocab 50257, 1024 positions.
GPT2_FAMILY: dict[str, tuple[int, int, int]] = {
    "gpt2": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
    "distilgpt2": (6, 768, 12),
}
# Hub ids that name the same GPT-2 models under their organisation.
_GPT2_HUB_IDS = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}
_GPT2_TITLES = {
    "gpt2": "GPT-2 small",
    "gpt2-medium": "GPT-2 medium",
    "gpt2-large": "GPT-2 large",
    "gpt2-xl": "GPT-2 XL",
    "distilgpt2": "DistilGPT-2",
}
_GPT2_MAKERS = {"distilgpt2": "Hugging Face's"}  # distilled from GPT-2 small; others OpenAI's
# transformers config class per model_type (imported by name, lazily).
_CONFIG_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config"}


@dataclass(frozen=True, eq=False)
class Architecture:
    """One built-in architecture: a real model's shape, config only."""

    name: str  # what the CLI takes, e.g. "qwen2-0.5b"
    model_type: str  # transformers' model_type: "gpt2", "llama", "qwen2"
    mirrors: str  # the real model whose shape this is, e.g. "Qwen2.5 0.5B"
    hub_id: str  # that model's checkpoint, looked up in the Hugging Face cache
    description: str  # one line: what the real model is
    shape: dict[str, Any] = field(default_factory=dict)  # the config class's keyword args

    @property
    def is_gpt2(self) -> bool:
        return self.model_type == "gpt2"

    @property
    def vocab_size(self) -> int:
        return int(self.shape["vocab_size"])

    def config(self, **overrides):
        """A fresh transformers config of this shape (``overrides`` on top, e.g. num_labels).

        The shape is deep-copied: transformers fills nested dicts (rope_parameters) in place.
        """
        import copy

        import transformers

        cls = getattr(transformers, _CONFIG_CLASSES[self.model_type])
        return cls(**copy.deepcopy({**self.shape, **overrides}))

    def summary(self) -> str:
        """The shape in one phrase: "16 layers x 2048 (8192 MLP), 32 heads (8 KV), ..."."""
        s = self.shape
        if self.is_gpt2:
            return (f"{s['n_layer']} layers x {s['n_embd']}, {s['n_head']} heads, vocab "
                    f"{s['vocab_size']}, tied embeddings")  # fmt: skip
        heads = s["num_attention_heads"]
        kv = s.get("num_key_value_heads") or heads
        return (
            f"{s['num_hidden_layers']} layers x {s['hidden_size']} "
            f"({s['intermediate_size']} MLP), {heads} heads"
            + (f" ({kv} KV)" if kv != heads else "")
            + f", vocab {s['vocab_size']}, "
            + ("tied" if s.get("tie_word_embeddings") else "untied")
            + " embeddings"
        )


def _gpt2(name: str) -> Architecture:
    n_layer, n_embd, n_head = GPT2_FAMILY[name]
    maker = _GPT2_MAKERS.get(name, "OpenAI's")
    return Architecture(
        name=name,
        model_type="gpt2",
        mirrors=_GPT2_TITLES[name],
        hub_id=name,  # the hub resolves the short id; the cache holds it under this name
        description=f"{maker} {_GPT2_TITLES[name]} "
        f"({_GPT2_HUB_IDS[name]}): learned positions, tied embeddings, 50257-token BPE",
        shape=dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=GPT2_VOCAB_SIZE,
                   n_positions=1024, bos_token_id=GPT2_EOS_ID, eos_token_id=GPT2_EOS_ID),
    )  # fmt: skip


# Shapes as in each checkpoint's config.json (rope settings in transformers 5's
# rope_parameters form).
_LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
    max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                         low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192),
    bos_token_id=128000, eos_token_id=128001,
)  # fmt: skip
# LLaMA (1 and 2) 7B and 13B: SwiGLU MLP, full multi-head attention, untied embeddings.
_LLAMA_7B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
)  # fmt: skip
_LLAMA_13B = dict(
    hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
    vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
)  # fmt: skip
# Qwen2's attention has q/k/v biases (no config switch: Qwen2Attention always has them).
_QWEN2_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    use_sliding_window=False, max_window_layers=24, bos_token_id=151643, eos_token_id=151643,
)  # fmt: skip

_ENTRIES = [
    *(_gpt2(name) for name in GPT2_FAMILY),
    Architecture(
        name="llama-1b",
        model_type="llama",
        mirrors="Llama 3.2 1B",
        hub_id="meta-llama/Llama-3.2-1B",
        description="Meta's Llama 3.2 1B (meta-llama/Llama-3.2-1B): grouped-query attention, "
        "tied embeddings, 128K vocabulary, llama3 RoPE scaling",
        shape=_LLAMA_1B,
    ),
    Architecture(
        name="llama-7b",
        model_type="llama",
        mirrors="Llama 2 7B",
        hub_id="meta-llama/Llama-2-7b-hf",
        description="Meta's Llama 2 7B (meta-llama/Llama-2-7b-hf; LLaMA 1 7B has the same "
        "weights' shapes): multi-head attention, untied embeddings, 32K vocabulary",
        shape=_LLAMA_7B,
    ),
    Architecture(
        name="llama-13b",
        model_type="llama",
        mirrors="Llama 2 13B",
        hub_id="meta-llama/Llama-2-13b-hf",
        description="Meta's Llama 2 13B (meta-llama/Llama-2-13b-hf; LLaMA 1 13B has the same "
        "weights' shapes): multi-head attention, untied embeddings, 32K vocabulary",
        shape=_LLAMA_13B,
    ),
    Architecture(
        name="qwen2-0.5b",
        model_type="qwen2",
        mirrors="Qwen2.5 0.5B",
        hub_id="Qwen/Qwen2.5-0.5B",
        description="Alibaba's Qwen2.5 0.5B (Qwen/Qwen2.5-0.5B): grouped-query attention with "
        "q/k/v biases, tied embeddings, 152K vocabulary",
        shape=_QWEN2_05B,
    ),
]
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _ENTRIES}
# Other spellings of the same entries: the GPT-2 hub ids under their organisations.
_ALIASES = {hub_id.lower(): name for name, hub_id in _GPT2_HUB_IDS.items()}


def architecture_names() -> list[str]:
    """Every built-in name, in the table's order (GPT-2 family, Llama, Qwen2)."""
    return list(ARCHITECTURES)


def architecture(name: str) -> Architecture | None:
    """The built-in architecture ``name`` means (any case; a GPT-2 org/name hub id too)."""
    key = str(name).lower()
    return ARCHITECTURES.get(_ALIASES.get(key, key))


def gpt2_family_name(name_or_path: str) -> str | None:
    """The GPT-2 family key that ``name_or_path`` names ("gpt2", "openai-community/gpt2"),
    or None."""
    arch = architecture(name_or_path)
    return arch.name if arch is not None and arch.is_gpt2 else None
