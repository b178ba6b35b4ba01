"""``--engine lora``: LoRA adapters (peft) on a model's linear projections, the head trained
whole, the base frozen; what such a run checkpoints (its trainable weights) and exports (the
merged model).

- ``wrap_lora(model, options, objective, seed)``: peft's ``get_peft_model`` with
  ``target_modules="all-linear"``: every ``nn.Linear`` / transformers ``Conv1D`` of the
  attention and MLP blocks (GPT-2's c_attn / c_proj / c_fc, BERT's query / key / value /
  dense, Llama's q/k/v/o/gate/up/down_proj), never the output layer. Not peft's per-family
  defaults, which adapt only the query and value projections (GPT-2: c_attn), not the MLP;
  and not a list of our own per family, which would miss every family not on it. On
  BERT-style encoders "all-linear" also adapts the pooler's dense, the projection in front
  of the classifier. A classification head is peft's ``SEQ_CLS`` task: the new head is a
  ``modules_to_save`` copy, trained whole; ``causal-lm`` is ``CAUSAL_LM`` (adapters only).
  The engine that trains it is the device engine's AdamW (``ZenFlowEngine`` mode
  "device") over the trainable parameters: fp32 master and moments on the device beside the
  bf16 weights, the same optimizer the full fine-tuning baseline uses, so step times compare.
- ``lora_counts`` / ``lora_resolved`` / ``lora_note``: what the run says about its adapters.
- ``TrainableWeights``: the model part of a LoRA checkpoint: the trainable weights (adapters
  and head) and a digest of the frozen base, so a resume on other base weights is refused.
- ``merged_for_export``: the adapters merged into the base (peft's ``merge_and_unload``),
  a plain transformers model that ``save_pretrained`` writes to model/.
- ``lora_linear_shapes``: the (in, out) of each projection "all-linear" adapts and the
  head's size, from a model on the meta device, for ``zfctl estimate``; it restates peft's
  rule without importing peft (tests hold the two equal).

Must not step the engine, write the run directory or report events (the trainer does).
peft is imported inside the functions that need it, never at module import.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

from zenflow.errors import UserInputError

TARGETS = "all-linear"  # peft's shorthand: every linear projection but the output layer
HEAD_NAMES = ("score", "classifier")  # peft's SEQ_CLS_HEAD_NAMES, in its order
_TASK_TYPES = {"classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM"}
_DIGEST_RTOL = 1e-9  # fp64 norms of the same values reduced in another order agree to ~1e-15


def _peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise UserInputError(
            f"--engine lora needs peft (pip install peft; scripts/setup.sh installs it): {exc}"
        ) from exc
    return peft


def wrap_lora(model, options, objective: str, seed: int):
    """``model`` (on the host, before placement) with LoRA adapters: peft's model, whose
    trainable parameters are the adapters and (classification) the new head. ``options`` is
    the config's ``zfctl.lora`` (``LoraOptions``). The adapters' random init (lora_A; lora_B
    starts at zero, so the wrapped model computes what the base does) is drawn from ``seed``
    without touching the global RNG."""
    import torch

    peft = _peft()
    task_type = _TASK_TYPES.get(objective, "SEQ_CLS")
    config = peft.LoraConfig(
        task_type=task_type, target_modules=TARGETS, r=int(options.rank),
        lora_alpha=float(options.alpha), lora_dropout=float(options.dropout),
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft asks transformers' deprecated is_gradient_checkpointing, and turns on
        # fan_in_fan_out for GPT-2's Conv1D itself: neither is the user's news
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r"fan_in_fan_out is set to False")
        torch.manual_seed(seed)
        try:
            wrapped = peft.get_peft_model(model, config)
        except ValueError as exc:  # e.g. a model with no linear projection to adapt
            raise UserInputError(
                f"--engine lora cannot adapt {type(model).__name__}: {exc}. Use --engine "
                "device or zenflow for this model."
            ) from None
    return wrapped


@dataclass(frozen=True)
class LoraCounts:
    """Parameters of a wrapped model by role."""

    base: int  # the base model's own (frozen; the head's original included)
    adapters: int  # lora_A + lora_B
    head: int  # the trained copy of the classification head (0 for causal-lm)
    modules: int  # projections that carry an adapter

    @property
    def trainable(self) -> int:
        return self.adapters + self.head


def lora_counts(model) -> LoraCounts:
    """Count a peft-wrapped model's parameters by role (each shared tensor once)."""
    base = adapters = head = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if ".lora_A." in name or ".lora_B." in name:
            adapters += p.numel()
        elif ".modules_to_save." in name:
            head += p.numel()
        else:
            base += p.numel()
    modules = sum(1 for m in model.modules() if hasattr(m, "lora_A") and len(m.lora_A) > 0)
    return LoraCounts(base, adapters, head, modules)


def lora_resolved(model) -> dict:
    """What ``engine.resolved`` says of a LoRA run (the device engine's own keys stay)."""
    cfg = model.peft_config["default"]
    counts = lora_counts(model)
    return {
        "engine": "lora",
        "lora": {
            "library": f"peft {_peft().__version__}",
            "rank": int(cfg.r),
            "alpha": float(cfg.lora_alpha),
            "dropout": float(cfg.lora_dropout),
            "targets": TARGETS,
            "adapted_modules": counts.modules,
            "base_params": counts.base,
            "adapter_params": counts.adapters,
            "head_params": counts.head,
            "trainable_params": counts.trainable,
        },
    }


def lora_note(lora: dict) -> str:
    """The run header's line about the adapters."""
    share = lora["trainable_params"] / max(1, lora["base_params"])
    head = f" + the head's {lora['head_params']:,}" if lora["head_params"] else ""
    return (
        f'LoRA ({lora["library"]}, target_modules "{lora["targets"]}"): rank '
        f"{lora['rank']}, alpha {lora['alpha']:g}, dropout {lora['dropout']:g} on "
        f"{lora['adapted_modules']} projections; trains {lora['adapter_params']:,} adapter "
        f"params{head} ({100 * share:.2f}% of the base's {lora['base_params']:,}), the base "
        "frozen; model/ gets the adapters merged into the base (plain transformers)."
    )


# ---------------------------------------------------------------------------- checkpoints


_DIGEST_CHUNK = 1 << 22  # elements widened to fp64 at a time: 32 MB, whatever the tensor


def _frozen_digest(model):
    """Per frozen tensor, its L1 and L2 norms in fp64, as a [n, 2] CPU tensor. Widened a
    chunk at a time, so no fp64 copy of a whole weight is made (a 7B model's embedding would
    need 1 GB on the device)."""
    import torch

    rows = []
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                continue
            flat = p.detach().reshape(-1)
            l1 = torch.zeros((), dtype=torch.float64, device=flat.device)
            l2 = torch.zeros((), dtype=torch.float64, device=flat.device)
            for chunk in flat.split(_DIGEST_CHUNK):
                wide = chunk.to(torch.float64)
                l1 += wide.abs().sum()
                l2 += wide.square().sum()
            rows.append(torch.stack([l1, l2.sqrt()]))
    return torch.stack(rows).cpu() if rows else torch.zeros(0, 2, dtype=torch.float64)


class TrainableWeights:
    """The model part of a LoRA run's checkpoint: ``state_dict`` holds the trainable weights
    (adapters and head, by parameter name) and the frozen base's digest; the base itself is
    loaded from the model source again at resume. ``load_state_dict`` refuses a checkpoint
    whose names, shapes or base digest do not match this model (``RuntimeError`` /
    ``KeyError``, which the resume turns into a sentence)."""

    def __init__(self, model):
        self.model = model
        self.base_digest = _frozen_digest(model)  # taken in the training dtype, on the device

    def _trainable(self) -> dict:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict:
        return {
            "trainable": {n: p.detach() for n, p in self._trainable().items()},
            "base_digest": self.base_digest.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        import torch

        saved, digest = state["trainable"], state["base_digest"]
        mine = self._trainable()
        missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
        if missing or unexpected:
            raise RuntimeError(
                f"the checkpoint's LoRA weights do not match this model's (missing: "
                f"{', '.join(missing[:3]) or '-'}; unexpected: {', '.join(unexpected[:3]) or '-'})"
            )
        bad = [n for n, p in mine.items() if tuple(saved[n].shape) != tuple(p.shape)]
        if bad:
            raise RuntimeError(f"LoRA weights of another shape in the checkpoint: {bad[0]} "
                               "(another rank or model)")  # fmt: skip
        if digest.shape != self.base_digest.shape or not torch.allclose(
            digest.double(), self.base_digest, rtol=_DIGEST_RTOL, atol=0.0
        ):
            raise RuntimeError(
                "the frozen base weights differ from those this run was trained on (their "
                "norms, kept in the checkpoint); the base model's files changed"
            )
        with torch.no_grad():
            for n, p in mine.items():
                p.copy_(saved[n])


# ---------------------------------------------------------------------------- export


def merged_for_export(model):
    """The adapters merged into the base weights and the peft wrapping removed
    (``merge_and_unload``, in place): the base model's class with the trained head, which
    plain transformers loads. The wrapped model is unusable afterwards (end of the run)."""
    import torch

    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        return model.merge_and_unload()


# ---------------------------------------------------------------------------- the estimate


def lora_linear_shapes(model) -> tuple[tuple[tuple[int, int], ...], int]:
    """((in, out) of each projection peft's "all-linear" adapts, params of the head trained
    whole) of a transformers model (the meta device is enough). peft's rule: every
    ``nn.Linear`` and ``Conv1D`` except the output embeddings (a causal LM's head) or, when
    there are none, the classification head (``score`` or ``classifier``), which is then
    trained whole (``modules_to_save``)."""
    import torch

    out_emb = None
    with contextlib.suppress(AttributeError, NotImplementedError):
        out_emb = model.get_output_embeddings()
    head = None
    if out_emb is None:
        head = next((getattr(model, n) for n in HEAD_NAMES
                     if isinstance(getattr(model, n, None), torch.nn.Module)), None)  # fmt: skip
    skip = out_emb if out_emb is not None else head
    shapes = []
    for module in model.modules():
        if module is skip:
            continue
        if isinstance(module, torch.nn.Linear):
            shapes.append((module.in_features, module.out_features))
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            n_in, n_out = module.weight.shape  # transformers' Conv1D stores [in, out]
            shapes.append((int(n_in), int(n_out)))
    head_params = sum(p.numel() for p in head.parameters()) if head is not None else 0
    return tuple(shapes), head_params
