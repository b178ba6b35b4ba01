"""Typed readers for a JSON config that collect problems instead of raising.

``Reader`` reads a bool, an integer in a range, a number that satisfies a rule, a string or a
nested object out of a JSON object; a bad value appends a ``ConfigProblem`` (path, value,
what is allowed, the fix) and gives the default, so one file's problems are reported
together. Keys a section does not honour are collected as ``ignored``.

Knows no config keys of its own: the sections (``zenflow.config.zenflow_block``,
``zenflow.config.training_sections``, ``zenflow.config.rules``) say what to read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from zenflow.config.schema import ConfigProblem

# The largest whole number a config key takes (steps, rounds, intervals, batch sizes): a
# bigger one is a typo or a pasted exponent, and would overflow a C int further in.
MAX_INT = 2**31 - 1


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _type_fix(path: str, what: str, value: Any) -> str:
    leaf = path.rsplit(".", 1)[-1]
    if value == "auto":
        return f'replace "auto" with {what}; only the zenflow block takes "auto" (where allowed)'
    if isinstance(value, str):
        return f'write {leaf} as {what} without quotes, e.g. "{leaf}": ...'
    return f"set {leaf} to {what}"


class Reader:
    """Collects problems while reading typed values out of JSON objects."""

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []
        self.ignored: list[str] = []

    def problem(self, path: str, value: Any, allowed: str, fix: str) -> None:
        self.problems.append(ConfigProblem(path, value, allowed, fix))

    def obj(self, parent: Mapping, key: str, path: str) -> dict | None:
        """A nested JSON object, None when absent or null."""
        value = parent.get(key)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            self.problem(
                path, value, "must be a JSON object", f"write {key} as {{...}} or remove it"
            )
            return None
        return dict(value)

    def boolean(self, parent: Mapping, key: str, path: str, default: bool) -> bool:
        value = parent.get(key)
        if value is None:
            return default
        if not is_bool(value):
            self.problem(
                path, value, "must be true or false", _type_fix(path, "true or false", value)
            )
            return default
        return value

    def integer(
        self, parent: Mapping, key: str, path: str, default: Any, lo: int, hi: int | None = None
    ) -> Any:
        value = parent.get(key)
        if value is None:
            return default
        rng = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"
        if not is_int(value):
            self.problem(path, value, f"must be {rng}", _type_fix(path, rng, value))
            return default
        if hi is None and value > MAX_INT:
            hi, rng = MAX_INT, f"an integer from {lo} to {MAX_INT}"
        if value < lo or (hi is not None and value > hi):
            self.problem(path, value, f"must be {rng}", f"set {key} to {rng}")
            return default
        return value

    def number(
        self,
        parent: Mapping,
        key: str,
        path: str,
        default: Any,
        rule: str,
        ok: Any,
    ) -> Any:
        """A float (JSON ints accepted and converted) that satisfies ``ok``; ``rule`` says it."""
        value = parent.get(key)
        if value is None:
            return default
        if not is_number(value):
            self.problem(
                path, value, f"must be a number {rule}", _type_fix(path, "a number", value)
            )
            return default
        if not ok(value):
            self.problem(path, value, f"must be a number {rule}", f"set {key} to a number {rule}")
            return default
        return float(value)

    def string(self, parent: Mapping, key: str, path: str, default: Any, *, empty: bool):
        """A JSON string (``empty``: "" allowed); null or absent gives ``default``."""
        value = parent.get(key)
        if value is None:
            return default
        if not isinstance(value, str) or (not empty and not value):
            what = "a string" if empty else "a non-empty string"
            self.problem(path, value, f"must be {what}", f'write {key} as "..." or remove it')
            return default
        return value

    def ignore_unknown(self, obj: Mapping, known: Sequence[str], path: str) -> None:
        for key in obj:
            if key not in known:
                self.ignored.append(f"{path}.{key}" if path else str(key))
