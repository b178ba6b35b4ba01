"""Resolving a name to a model ready to fine-tune: ``resolve_model`` and one resolver per
place a model comes from (a local directory, the hub or its cache, a packaged wheel, a
built-in architecture's shape).

Every resolution says where each part came from (``ResolvedModel.sources``) so a run can
never train on random weights, or a substitute tokenizer, without saying so. Nothing falls
back silently. The pieces it assembles live beside it: ``loading`` (the Auto class, the
finish), ``tokenizer``, ``sources`` (hub / cache / offline), ``packaged`` (the wheels).
"""

from __future__ import annotations

import json
from pathlib import Path

from zenflow.config.architectures import (
    GPT2_FAMILY,
    Architecture,
    architecture,
    architecture_names,
    gpt2_family_name,
)
from zenflow.errors import ModelSourceError
from zenflow.train.models.loading import (
    CAUSAL_LM,
    ResolvedModel,
    _finish,
    _labels_kwargs,
    _load_errors,
    _load_reason,
    _model_class,
    _quiet_transformers,
    _set_labels,
    load_weights,
    new_layers,
)
from zenflow.train.models.packaged import PackagedModel, packaged_model, packaged_model_dir
from zenflow.train.models.sources import _fix_hint, _hub_source, _where, pretrained_source
from zenflow.train.models.tokenizer import (
    _load_tokenizer,
    _packaged_tokenizer_source,
    _rehearsal_tokenizer,
    local_tokenizer,
    packaged_gpt2_tokenizer,
)


def resolve_model(
    name_or_path: str,
    *,
    task_num_labels: int,
    init: str = "pretrained",
    seed: int = 42,
    head: str = "classification",
) -> ResolvedModel:
    """Resolve a model for sequence classification (``head="causal-lm"``: a causal LM with
    its LM head; ``task_num_labels`` is then ignored) and its tokenizer.

    ``name_or_path`` is a local directory (config + weights + usually tokenizer), a hub
    id, or a packaged checkpoint's name (``PACKAGED_MODELS``: "minilm" or its hub id). A
    hub id is looked up through ``from_pretrained``; with HF_HUB_OFFLINE set this only
    reads the local cache. A packaged name tries its hub id the same way, then loads the
    checkpoint from its installed wheel (extracted once, see ``packaged_model_dir``). A
    built-in architecture name (``zenflow.config.architectures``) other than GPT-2's loads
    the checkpoint it mirrors from the cache, or with ``init="random"`` builds its exact
    shape (``_resolve_builtin``). ``init="random"`` builds the architecture (config from the
    cache, else the built-in table) with seeded random weights. Nothing falls back silently:
    a missing model with ``init="pretrained"`` raises ModelSourceError, and ``sources``
    always names where the weights came from.
    """
    if init not in ("pretrained", "random"):
        raise ModelSourceError(f"init={init!r} is not allowed; use 'pretrained' or 'random'.")
    if head not in ("classification", "causal-lm"):
        raise ModelSourceError(
            f"head={head!r} is not allowed; use 'classification' or 'causal-lm'."
        )
    if head == "causal-lm":
        task_num_labels = CAUSAL_LM
    how = {"task_num_labels": task_num_labels, "init": init, "seed": seed}

    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return _resolve_local(local, **how)
    pm = packaged_model(name_or_path)
    if pm is not None:
        # The hub id's cache (or the hub) first; the installed wheel when neither has it.
        try:
            return _resolve_hub(pm.hub_id, **how)
        except ModelSourceError:
            return _resolve_packaged(pm, **how)
    arch = architecture(name_or_path)
    if arch is not None and not arch.is_gpt2:  # GPT-2 names: the hub/cache, as any hub id
        return _resolve_builtin(arch, **how)
    return _resolve_hub(name_or_path, **how)


# ------------------------------------------------------------------ a local directory


def _resolve_local(local: Path, *, task_num_labels: int, init: str, seed: int) -> ResolvedModel:
    """A directory written by save_pretrained: its config, its weights (or, with
    ``init="random"``, random ones of its shape) and its tokenizer."""
    import torch
    from transformers import AutoConfig

    sources: dict[str, str] = {}
    try:
        config = AutoConfig.from_pretrained(local)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(
            f"The local directory {local} holds no readable model config (config.json): "
            f"{exc}. Pass a directory written by save_pretrained, or a hub id."
        ) from exc
    sources["config"] = f"local directory: {local}"
    torch.manual_seed(seed)  # a new classification head is initialised from it
    if init == "pretrained":
        model, info = _local_weights(local, config, task_num_labels)
        sources["model"] = _with_new_layers(f"local directory: {local}", info, seed)
    else:
        _set_labels(config, task_num_labels)
        model = _model_class(task_num_labels).from_config(config)
        sources["model"] = f"random init (seed {seed}; config from local directory {local})"
    tokenizer, sources["tokenizer"] = _local_tokenizer(local, config)
    _finish(model, tokenizer, task_num_labels, sources)
    return ResolvedModel(model=model, tokenizer=tokenizer, sources=sources)


def _with_new_layers(source: str, info: dict, seed: int) -> str:
    """A model source and, after it, the layers that did not come from the files."""
    note = new_layers(info, seed)
    return source if note is None else f"{source}; {note}"


def _local_weights(local: Path, config, task_num_labels: int):
    """The directory's pretrained weights and transformers' loading info; ModelSourceError
    when they do not load."""
    try:
        return load_weights(_model_class(task_num_labels), local,
                            **_labels_kwargs(config, task_num_labels))  # fmt: skip
    except _load_errors() as exc:
        raise ModelSourceError(
            f"Could not load weights from the local directory {local}: "
            f"{_load_reason(exc)}. Pass a directory whose weights are complete and "
            "match its config.json (as save_pretrained writes it), or `--init random` "
            "to train the architecture from random weights on purpose."
        ) from exc


def _local_tokenizer(local: Path, config):
    """(tokenizer, its source): ``tokenizer.local_tokenizer`` (the directory's own; a GPT-2
    directory without tokenizer files: the packaged GPT-2 BPE, said)."""
    return local_tokenizer(local, getattr(config, "model_type", None))


# ------------------------------------------------------------------ a built-in architecture


def _resolve_builtin(
    arch: Architecture, *, task_num_labels: int, init: str, seed: int
) -> ResolvedModel:
    """A built-in architecture: the checkpoint it mirrors (cache/hub), or, with
    ``init="random"``, a rehearsal on its exact shape with random weights.

    The rehearsal's tokenizer is the mirrored one when the cache has it, else the packaged
    GPT-2 BPE (said in ``sources``), whose ids must fit the architecture's vocabulary. The
    tokenizer is settled before the model is built, so a refusal costs no weight memory; the
    model is built once, in fp32 (the dtype the engine takes its masters in).
    """
    import torch

    where = _where()
    if init == "pretrained":
        if pretrained_source(arch.hub_id) is None:
            raise ModelSourceError(
                f"{arch.name} is a built-in architecture (the shape of {arch.mirrors}) and "
                f"that model's weights ({arch.hub_id}) are not in {where}; zfctl does not "
                "fall back to random weights. Fix: pass `--init random` to rehearse the run "
                f"on a randomly initialised {arch.name} (exactly this shape), or pass a local "
                "directory holding the weights (config.json and model.safetensors, as "
                "save_pretrained writes them)."
            )
        resolved = _resolve_hub(arch.hub_id, task_num_labels=task_num_labels, init=init, seed=seed)
        resolved.sources["config"] += f" (built-in architecture {arch.name})"
        return resolved

    sources: dict[str, str] = {}
    config = arch.config()
    _set_labels(config, task_num_labels)
    sources["config"] = (
        f"{type(config).__name__} from the built-in table: {arch.name} = {arch.summary()} "
        f"(the shape of {arch.mirrors}, {arch.hub_id})"
    )
    try:
        tokenizer = _load_tokenizer(arch.hub_id)
        sources["tokenizer"] = _hub_source(arch.hub_id, tokenizer)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    if tokenizer is None:
        tokenizer, sources["tokenizer"] = _rehearsal_tokenizer(arch, where)
    torch.manual_seed(seed)
    model = _model_class(task_num_labels).from_config(config)
    sources["model"] = f"random init (seed {seed}), on purpose: --init random"
    _finish(model, tokenizer, task_num_labels, sources)
    return ResolvedModel(model=model, tokenizer=tokenizer, sources=sources)


# ------------------------------------------------------------------ the hub or its cache


def _resolve_hub(name_or_path: str, *, task_num_labels: int, init: str, seed: int) -> ResolvedModel:
    """A hub id through from_pretrained (the cache only, with HF_HUB_OFFLINE set)."""
    import torch
    from transformers import AutoConfig

    sources: dict[str, str] = {}
    # Hub ids are "name" or "org/name"; anything else is meant as a path.
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelSourceError(
            f"Model {name_or_path!r} looks like a path but no such directory exists. Pass an "
            "existing directory written by save_pretrained, or a hub id such as 'gpt2'."
        )

    family = gpt2_family_name(name_or_path)
    where = _where()
    config = None
    config_error: Exception | None = None
    try:
        config = AutoConfig.from_pretrained(name_or_path)
        sources["config"] = _hub_source(name_or_path, config)
    except (OSError, ValueError) as exc:
        config_error = exc

    if init == "pretrained":
        model, info = _hub_weights(name_or_path, config, config_error, where, task_num_labels,
                                   seed)  # fmt: skip
        sources["model"] = _with_new_layers(_hub_source(name_or_path, model), info, seed)
    else:
        if config is None:
            config = _gpt2_table_config(name_or_path, family, where, config_error, sources)
        _set_labels(config, task_num_labels)
        torch.manual_seed(seed)
        model = _model_class(task_num_labels).from_config(config)
        sources["model"] = f"random init (seed {seed}), on purpose: --init random"
        if family is None and getattr(config, "model_type", None) == "gpt2":
            family = "gpt2"
    tokenizer, sources["tokenizer"] = _hub_tokenizer(name_or_path, family, where)
    _finish(model, tokenizer, task_num_labels, sources)
    return ResolvedModel(model=model, tokenizer=tokenizer, sources=sources)


def _hub_weights(name_or_path: str, config, config_error, where: str, task_num_labels: int,
                 seed: int):  # fmt: skip
    """The hub id's pretrained weights (a new head seeded by ``seed``) and transformers'
    loading info; ModelSourceError when its config was not found or its weights do not
    load."""
    import torch

    if config is None:
        raise ModelSourceError(
            f"Model {name_or_path!r} is not in {where}. " + _fix_hint(name_or_path)
        ) from config_error
    torch.manual_seed(seed)
    try:
        return load_weights(_model_class(task_num_labels), name_or_path,
                            **_labels_kwargs(config, task_num_labels))  # fmt: skip
    except _load_errors() as exc:
        raise ModelSourceError(
            f"The config of {name_or_path!r} was found but its weights could not be "
            f"loaded from {where}: {_load_reason(exc)}. " + _fix_hint(name_or_path)
        ) from exc


def _gpt2_table_config(name_or_path: str, family: str | None, where: str, config_error,
                       sources: dict[str, str]):  # fmt: skip
    """A random init's config when the hub id's is not found: a GPT-2 family name's from the
    built-in table (said in ``sources["config"]``); any other name is refused."""
    if family is None:
        raise ModelSourceError(
            f"Cannot build {name_or_path!r} from random weights: its config is not in "
            f"{where} and it is not a built-in architecture "
            f"({', '.join(architecture_names())}). Download its config on a connected "
            "machine, or pass a local directory holding config.json."
        ) from config_error
    gpt2 = architecture(family)
    assert gpt2 is not None  # gpt2_family_name returned its key
    config = gpt2.config()
    n_layer, n_embd, n_head = GPT2_FAMILY[family]
    sources["config"] = (
        f"GPT2Config from built-in table: {family} = {n_layer} layers, {n_embd} wide, "
        f"{n_head} heads (not in {where})"
    )
    return config


def _hub_tokenizer(name_or_path: str, family: str | None, where: str):
    """(tokenizer, its source): the hub id's own, else for the GPT-2 family the packaged
    GPT-2 BPE (said); any other name without a tokenizer is refused."""
    try:
        tokenizer = _load_tokenizer(name_or_path)
        return tokenizer, _hub_source(name_or_path, tokenizer)
    except (OSError, ValueError, TypeError) as exc:
        if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
            # found but not readable (a damaged file in the cache): never replaced silently
            raise ModelSourceError(
                f"The tokenizer of {name_or_path!r} in {where} does not load: "
                f"{_load_reason(exc)}. Its files there are damaged: remove the model's folder "
                "from the Hugging Face cache and download it again."
            ) from exc
        if family is None:
            raise ModelSourceError(
                f"The tokenizer of {name_or_path!r} is not in {where}. " + _fix_hint(name_or_path)
            ) from exc
        tokenizer = packaged_gpt2_tokenizer()
        return tokenizer, _packaged_tokenizer_source() + f" ({name_or_path} not in {where})"


# ------------------------------------------------------------------ a packaged wheel


def _resolve_packaged(
    pm: PackagedModel, *, task_num_labels: int, init: str, seed: int
) -> ResolvedModel:
    """The packaged checkpoint with a new classification head (seeded), and its tokenizer."""
    import torch
    from transformers import AutoConfig

    directory, zip_path, version = packaged_model_dir(pm)
    wheel = f"the {pm.distribution} wheel, {directory}"
    origin = f"(version {version}, extracted from {zip_path})"
    head = (
        "its own LM head"
        if task_num_labels == CAUSAL_LM
        else f"new classification head: {task_num_labels} label(s), random init (seed {seed})"
    )
    with _quiet_transformers():
        config = AutoConfig.from_pretrained(directory)
        torch.manual_seed(seed)
        if init == "pretrained":
            model = _model_class(task_num_labels).from_pretrained(
                directory, **_labels_kwargs(config, task_num_labels)
            )
            model_source = f"pretrained weights from {wheel} {origin}; {head}"
        else:
            _set_labels(config, task_num_labels)
            model = _model_class(task_num_labels).from_config(config)
            model_source = (
                f"random init (seed {seed}), on purpose: --init random (config from {wheel})"
            )
        tokenizer = _load_tokenizer(directory)
    sources = {
        "config": f"{wheel} {origin}",
        "model": model_source,
        "tokenizer": f"{wheel} {origin}",
    }
    _finish(model, tokenizer, task_num_labels, sources)
    return ResolvedModel(model=model, tokenizer=tokenizer, sources=sources)
