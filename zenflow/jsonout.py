"""Strict JSON out: every file and stream zfctl writes parses with a strict JSON parser.

Python's ``json`` writes a non-finite float as the bare tokens ``NaN``, ``Infinity`` and
``-Infinity``, which are not JSON: strict parsers (JavaScript's ``JSON.parse``, Go's
``encoding/json``, ``json.loads`` with a ``parse_constant`` that refuses them) reject the
whole document. One convention throughout zfctl: a non-finite number is a missing value,
written ``null`` (a NaN loss, an undefined ratio). metrics.jsonl, summary.json,
config.json, hw.json, ``--json`` event lines and every command's ``--json`` output go
through ``dumps``/``dump``; readers keep accepting the bare tokens of files written
before (``json.loads``' default) and treat them as missing too.
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import PurePath
from typing import Any, TextIO


def plain(value: Any) -> Any:
    """``value`` as plain JSON data: NaN and +-inf as None, paths as strings, mappings as
    dicts with string keys, tuples and sets as lists, numpy-style numbers as Python's, any
    other object as its ``str``."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, PurePath):
        return str(value)
    if hasattr(value, "items"):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    return str(value)


def dumps(value: Any, **kw: Any) -> str:
    """``json.dumps`` of ``plain(value)``; ``allow_nan=False`` proves no NaN got through."""
    return json.dumps(plain(value), allow_nan=False, **kw)


def dump(value: Any, f: TextIO, **kw: Any) -> None:
    f.write(dumps(value, **kw))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (a strict parser rejects it)")


def loads_strict(text: str | bytes) -> Any:
    """Parse as a strict parser does: ``NaN``, ``Infinity`` and ``-Infinity`` are errors."""
    return json.loads(text, parse_constant=_refuse_constant)
