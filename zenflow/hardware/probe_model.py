"""The model whose forward+backward tune-hw times: ``load_probe_model`` builds it (a Hugging
Face model through ``zenflow.train.models``, or a built-in GPT-2 shape, on the device and in
the dtype the engine would train it in) with a random token batch (``random_batch``, also
the batch of ``zfctl bench``), and ``fwd_bwd_once`` runs one forward+backward of it.

Builds and runs the model; timing it is ``zenflow.hardware.measure``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

# Built-in GPT-2 shapes (layers, width, heads; GPT-2 vocabulary), random init. The first is
# the --quick default, the architecture of ZENFLOW.md section 7 (38.4M params); the second
# is a toy for tests.
BUILTIN_SHAPES = {"builtin:gpt2-4x512": (4, 512, 8), "builtin:gpt2-2x128": (2, 128, 4)}
BUILTIN_SMALL = "builtin:gpt2-4x512"


@dataclass
class ProbeModel:
    """The model whose forward+backward is timed, with its parameter counts."""

    name: str
    source: str  # where the weights came from, in words
    model: object
    batch: dict
    params_total: int
    params_2d: int
    micro_batch: int
    seq_len: int
    device: str = "cpu"  # "cpu" or "cuda" (the simulated accelerator computes on the CPU)
    bf16: bool = False  # bf16 weights and bf16 autocast, as the engine trains with bf16


def load_probe_model(
    name: str,
    micro_batch: int,
    seq_len: int,
    seed: int = 0,
    *,
    device: str | None = None,
    bf16: bool = False,
    gradient_checkpointing: bool = False,
) -> ProbeModel:
    """Build the model (2 labels, like a GLUE task) and a random token batch for timing.

    ``device``: "cuda" or "cpu" (None: cuda when available). ``bf16``: the weights cast to
    bf16 and forward run under bf16 autocast, as ``ZenFlowEngine`` does with bf16 enabled.
    ``gradient_checkpointing``: transformers' activation recomputation, as ``zfctl finetune
    --gradient-checkpointing`` runs (forward+backward then includes the recomputation).
    """
    import torch

    torch.manual_seed(seed)
    if name in BUILTIN_SHAPES:
        from transformers import GPT2Config, GPT2ForSequenceClassification

        layers, width, heads = BUILTIN_SHAPES[name]
        cfg = GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, num_labels=2, pad_token_id=50256
        )
        model = GPT2ForSequenceClassification(cfg)
        source = f"built-in GPT-2 shape ({layers} layers, width {width}), random init"
    else:
        model, source = _resolve_named_model(name, seed)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(device).train()
    if bf16:
        model.to(dtype=torch.bfloat16)
    if gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            from zenflow.errors import UserInputError

            raise UserInputError(
                f"--gradient-checkpointing: {type(model).__name__} does not support "
                "activation checkpointing in transformers; run without it."
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = random_batch(model, micro_batch, seq_len, device, name=name)
    params = [p for p in model.parameters() if p.requires_grad]
    return ProbeModel(
        name=name,
        source=source,
        model=model,
        batch=batch,
        params_total=sum(p.numel() for p in params),
        params_2d=sum(p.numel() for p in params if p.dim() == 2),
        micro_batch=micro_batch,
        seq_len=seq_len,
        device=device.type,
        bf16=bf16,
    )


def _resolve_named_model(name: str, seed: int) -> tuple[object, str]:
    """The model through zenflow.train.models: its weights if available, else random init (said)."""
    from zenflow.errors import ModelSourceError
    from zenflow.train.models import resolve_model

    try:
        resolved = resolve_model(name, task_num_labels=2, init="pretrained", seed=seed)
        return resolved.model, resolved.sources.get("model", "pretrained weights")
    except ModelSourceError as exc:
        first = str(exc).split(". ")[0]
        resolved = resolve_model(name, task_num_labels=2, init="random", seed=seed)
        return resolved.model, f"random init, seed {seed} (weights not available: {first})"


def random_batch(model, micro_batch: int, seq_len: int, device, *, name="the model",
                 seed: int | None = None) -> dict:  # fmt: skip
    """Random token ids (no pad tokens: the last position is the sequence end) and 2-class
    labels for a sequence classifier; refuses a ``seq_len`` beyond the model's positions.
    ``seed``: a seeded generator (benchmarks), else torch's global RNG."""
    import torch

    from zenflow.errors import UserInputError

    cfg = model.config
    if getattr(cfg, "pad_token_id", None) is None:
        cfg.pad_token_id = getattr(cfg, "eos_token_id", None) or 0
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if limit and seq_len > limit:
        raise UserInputError(
            f"--seq-len {seq_len} is longer than {name}'s {limit} positions; use --seq-len "
            f"{limit} or less."
        )
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(2, cfg.vocab_size - 1), (micro_batch, seq_len), generator=gen)
    ids[ids == cfg.pad_token_id] = 1
    labels = torch.randint(0, 2, (micro_batch,), generator=gen)
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "labels": labels.to(device),
    }


def fwd_bwd_once(pm: ProbeModel) -> None:
    """One forward+backward; waits for the device so wall time covers its work."""
    import torch

    if pm.bf16:
        with torch.autocast(device_type=pm.device, dtype=torch.bfloat16):
            out = pm.model(**pm.batch)
    else:
        out = pm.model(**pm.batch)
    out.loss.backward()
    pm.model.zero_grad(set_to_none=True)
    from zenflow.engine.accelerator import device_synchronize

    device_synchronize(pm.batch["input_ids"].device)
