"""A Hugging Face hub dataset as ``--data`` / ``--eval-data``: ``NAME[:CONFIG][@SPLIT]``.

Contract:

- ``is_hub_id(text)``: ``text`` names a hub dataset when no file or folder of that name
  exists, its name does not end in a table or record suffix (a missing ``train.jsonl`` is
  a missing file, not a dataset) and it has the shape ``name`` or ``org/name``, optionally
  ``:config`` and ``@split`` (``nyu-mll/glue:sst2@validation``). The split defaults to
  ``train``; there is no implicit eval split: name one with ``--eval-data ID@validation``,
  or the trainer holds out its seeded split as for a file.
- ``hub_records(text)`` loads the split through ``datasets.load_dataset`` (the hub, or only
  its cache with ``HF_DATASETS_OFFLINE=1``, as the GLUE tasks do) and returns its rows as
  ``(where, dict)`` records ("row 7"), the same records a JSONL file gives, so the table
  and record readers treat both alike. Failing to load is a ``DataError`` naming the id,
  the reason and the fix.
- ``hub_fingerprint(text)``: the split's ``datasets`` fingerprint, what a resumed run
  compares instead of a file's sha256.

Owns: the id's shape and loading a split. Must not: decide what the rows mean; the table
and record sources read them as they read a file's.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from zenflow.errors import DataError

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(:[\w.-]+)?(@[\w.\-\[\]:%]+)?")


class HubLoadError(DataError):
    """The dataset could not be loaded (the hub, the cache, a bad name, config or split);
    the library's own exception is its ``__cause__``."""


def is_hub_id(text: str | Path) -> bool:
    s = str(text)
    if Path(s).expanduser().exists() or s.lower().endswith(FILE_SUFFIXES):
        return False
    return _ID.fullmatch(s) is not None


def shown_name(path: str | Path) -> str:
    """How a header names a data source: a file by its name, a dataset by its whole id."""
    return str(path) if is_hub_id(path) else Path(path).name


def parse_hub_id(text: str) -> tuple[str, str | None, str]:
    """(name, config or None, split) of ``NAME[:CONFIG][@SPLIT]``."""
    rest, _, split = text.partition("@")
    name, _, config = rest.partition(":")
    return name, config or None, split or "train"


def _where() -> str:
    import os

    offline = (
        os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
    )
    return "the datasets cache (offline: HF_DATASETS_OFFLINE=1)" if offline else "the hub"


@functools.lru_cache(maxsize=4)
def _load(text: str):
    name, config, split = parse_hub_id(text)
    try:
        import datasets

        return datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # the hub, the cache, a bad config or split: one message
        raise HubLoadError(
            f"Could not load the dataset {text!r} (name {name!r}, config {config!r}, split "
            f"{split!r}) from {_where()}: {type(exc).__name__}: {exc}. Fix: check the name, "
            "config and split on the hub (NAME[:CONFIG][@SPLIT]), download it on a connected "
            "machine into the datasets cache, or pass a local file (.jsonl, .json, .csv, "
            ".tsv, .parquet)."
        ) from exc


def hub_records(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The split's rows as records (see the module docstring)."""
    ds = _load(str(text))
    return [(f"row {i}", dict(row)) for i, row in enumerate(ds.to_list(), start=1)]


def hub_fingerprint(text: str) -> str:
    ds = _load(str(text))
    return f"datasets fingerprint {getattr(ds, '_fingerprint', None) or len(ds)}"
