"""Load a DeepSpeed config: read the JSON, apply CLI overrides, validate once (``load_config``).

Config flows one way: a JSON file (or dict) plus CLI overrides -> ``load_config`` ->
``Config`` -> engine. The engine never reads the file again.

Reading is strict where JSON itself is lax: a key given twice in one object is an error
(Python's json keeps the last silently; DeepSpeed refuses duplicates), and so is nesting
deeper than ``MAX_DEPTH`` levels (no DeepSpeed config nests beyond 5; deeper input would
otherwise end in a RecursionError inside the parser or the validation).
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from zenflow.config.rules import validate
from zenflow.config.schema import Config, ConfigError, ConfigProblem
from zenflow.config.zenflow_block import parse_zenflow
from zenflow.errors import undecodable_at

# Levels of objects/arrays allowed (the top-level object is level 1).
MAX_DEPTH = 32

# --------------------------------------------------------------------------------------
# Loading and overrides
# --------------------------------------------------------------------------------------


def _file_problem(path: str, what: str, fix: str) -> ConfigError:
    return ConfigError([ConfigProblem("(file)", path, what, fix)], path)


def _read_json(path: str) -> Any:
    """The JSON document in ``path``. A UTF-8 byte-order mark (Windows editors write one) is
    skipped; a directory, a symbolic link loop, bytes that are not UTF-8 (by line and byte)
    and bad JSON (by line and column) are ``ConfigError``s naming the file."""
    if os.path.isdir(path):
        raise _file_problem(path, "is a directory", "give the JSON file, not its folder")
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _file_problem(
                path, "is a symbolic link loop (the links never reach a file)",
                "point the link at the JSON file",
            ) from None  # fmt: skip
        raise _file_problem(
            path,
            f"cannot be read ({exc.strerror or exc})",
            "check the path, or create a config with `zfctl init`",
        ) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _file_problem(
            path, f"is not UTF-8 text ({undecodable_at(data, exc)})", "save the config as UTF-8"
        ) from None
    if _nests_too_deep(text):  # before the recursive parser is ever near its limit
        raise ConfigError([_depth_problem("(top level)")], path)
    try:
        return _parse_strict(text, path)
    except RecursionError:
        raise ConfigError([_depth_problem("(top level)")], path) from None
    except json.JSONDecodeError as exc:
        line_text = text.splitlines()[exc.lineno - 1] if text.splitlines() else ""
        raise ConfigError(
            [
                ConfigProblem(
                    f"(JSON syntax) line {exc.lineno}, column {exc.colno}",
                    line_text.strip(),
                    f"not valid JSON: {exc.msg}",
                    f"correct the JSON at line {exc.lineno}, column {exc.colno} of {path} "
                    "(common causes: a trailing comma, a missing comma, single quotes, "
                    "or a comment)",
                )
            ],
            path,
        ) from None


def _nests_too_deep(text: str) -> bool:
    """Whether the JSON ``text`` opens more than ``MAX_DEPTH`` objects/arrays at once, by a
    linear scan (brackets inside strings do not count). Parsing 50,000 levels would run
    the recursive decoder to Python's recursion limit, where any finalizer that runs then
    fails too."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _depth_problem(where: str) -> ConfigProblem:
    return ConfigProblem(
        where,
        "...",
        f"nests objects/arrays more than {MAX_DEPTH} levels deep (a DeepSpeed config "
        "needs at most 5)",
        "remove the extra nesting; the file may be generated wrongly",
    )


def _parse_strict(text: str, source: str) -> Any:
    """json.loads, with a key given twice in one object reported (a ConfigError naming
    every such key by its dotted path) instead of keeping the last value silently."""
    repeated: list[tuple[dict, str, list]] = []

    def hook(pairs: list[tuple[str, Any]]) -> dict:
        obj: dict = {}
        seen: dict[str, list] = {}
        for key, value in pairs:
            seen.setdefault(key, []).append(value)
            obj[key] = value
        repeated.extend((obj, k, vals) for k, vals in seen.items() if len(vals) > 1)
        return obj

    data = json.loads(text, object_pairs_hook=hook)
    if repeated:
        paths = _object_paths(data)
        problems = [
            ConfigProblem(
                _join(paths.get(id(obj), "?"), key),
                vals,
                f"is given {len(vals)} times in the same JSON object (JSON readers keep "
                "only the last one silently; DeepSpeed refuses the file)",
                f"keep one {key!r} entry",
            )
            for obj, key, vals in repeated
        ]
        raise ConfigError(problems, source)
    return data


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _object_paths(data: Any) -> dict[int, str]:
    """id(dict) -> its dotted path ("" for the top level), walked without recursion."""
    out: dict[int, str] = {}
    stack = [(data, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            out[id(node)] = path
            stack.extend((v, _join(path, k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return out


def _too_deep(data: Any) -> str | None:
    """The dotted path where ``data`` first nests deeper than MAX_DEPTH, else None
    (walked without recursion, so any depth is safe to check)."""
    stack = [(data, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, (Mapping, list, tuple)):
            continue
        if depth > MAX_DEPTH:
            return path or "(top level)"
        if isinstance(node, Mapping):
            stack.extend((v, _join(path, k), depth + 1) for k, v in node.items())
        else:
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))
    return None


def _check_depth(data: Any, source: str) -> None:
    where = _too_deep(data)
    if where is not None:
        raise ConfigError([_depth_problem(where)], source)


def load_config(
    src: str | os.PathLike | Mapping,
    overrides: Mapping[str, Any] | None = None,
    *,
    world_size: int = 1,
) -> Config:
    """Read, override and validate a DeepSpeed config; raise ``ConfigError`` listing every problem.

    ``src`` is a path to a JSON file or an already-parsed dict (source ``"<dict>"``).
    ``overrides`` maps dotted paths to values (see ``apply_overrides``), applied before
    validation; ``Config.raw`` holds the result. ``world_size`` enters the batch-size rule.
    """
    if isinstance(src, Mapping):
        source = "<dict>"
        _check_depth(src, source)  # before deepcopy, which recurses
        raw = copy.deepcopy(dict(src))
    else:
        source = os.fspath(src)
        raw = _read_json(source)
        _check_depth(raw, source)
    if overrides:
        if not isinstance(raw, Mapping):
            validate(raw, source, world_size)  # raises the top-level problem
        _check_depth(dict(overrides), "--set")
        raw = apply_overrides(raw, overrides, source=source)
        try:
            return validate(raw, source, world_size)
        except ConfigError as exc:
            raise _blame_overrides(exc, overrides) from None
    return validate(raw, source, world_size)


def _set_text(key: str, value: Any) -> str:
    """The ``--set`` item as the user wrote it (as near as the parsed value allows)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return f"--set {key}={text}"


def _blame_overrides(exc: ConfigError, overrides: Mapping[str, Any]) -> ConfigError:
    """``exc`` with each problem at (or inside, or above) an overridden key said to come
    from that ``--set`` item, not from the file it was applied to; the source is "--set"
    when every problem came from one."""
    problems = []
    blamed = 0
    for p in exc.problems:
        key = next(
            (k for k in overrides
             if p.path == k or p.path.startswith(k + ".") or str(k).startswith(p.path + ".")),
            None,
        )  # fmt: skip
        if key is None:
            problems.append(p)
            continue
        blamed += 1
        problems.append(dataclasses.replace(p, origin=_set_text(key, overrides[key])))
    source = "--set" if blamed == len(problems) else f"{exc.source} with --set"
    return ConfigError(problems, source)


def apply_overrides(raw: Mapping, overrides: Mapping[str, Any], *, source: str = "--set") -> dict:
    """Return a deep copy of ``raw`` with each dotted path in ``overrides`` set to its value.

    Missing intermediate objects are created. A path whose intermediate exists but is not an
    object (``"bf16.enabled"`` when ``bf16`` is ``true``) is a ``ConfigError``; all such
    paths are reported together.
    """
    out = copy.deepcopy(dict(raw))
    problems: list[ConfigProblem] = []
    for dotted, value in overrides.items():
        parts = str(dotted).split(".")
        if not all(parts):
            problems.append(
                ConfigProblem(
                    str(dotted),
                    value,
                    "must be a dotted key path",
                    "write it like zero_optimization.zenflow.topk_ratio",
                )
            )
            continue
        node: dict = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                problems.append(
                    ConfigProblem(
                        prefix,
                        child,
                        f"is not a JSON object, so {dotted} cannot be set",
                        f"override {prefix} itself, or fix the path {dotted}",
                    )
                )
                break
            node = child
        else:
            node[parts[-1]] = copy.deepcopy(value)
    if problems:
        raise ConfigError(problems, source)
    return out


def parse_set_args(items: Sequence[str]) -> dict[str, Any]:
    """Parse CLI ``--set a.b.c=value`` items into ``{"a.b.c": value}``.

    The value is parsed as JSON when it parses (``0.05``, ``true``, ``4``, ``"x"``, ``[0.9,
    0.99]``, ``null``) and kept as a string otherwise (``auto``, ``AdamW``). Items without
    ``=`` or with an empty key are reported together in one ``ConfigError``.
    """
    out: dict[str, Any] = {}
    problems: list[ConfigProblem] = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not all(key.split(".")):
            problems.append(
                ConfigProblem(
                    "--set",
                    item,
                    "must look like KEY.PATH=VALUE",
                    "write e.g. --set zero_optimization.zenflow.topk_ratio=0.05",
                )
            )
            continue
        try:
            value: Any = json.loads(text)
        except (ValueError, RecursionError):
            value = text
        out[key] = value
    if problems:
        raise ConfigError(problems, "--set")
    return out


def replace_zenflow(config: Config, **changes: Any) -> Config:
    """Return a copy whose zenflow block has ``changes`` applied (validated like the JSON).

    Starts from the current block, or from the defaults when there is none. Only the
    block's own rules are checked (not the stage/offload rules of the whole file). Raises
    ``ConfigError`` on a bad field or value.
    """
    base = dataclasses.asdict(config.zenflow) if config.zenflow else {}
    block = {**base, **changes}
    problems: list[ConfigProblem] = []

    zf = parse_zenflow(block, "zero_optimization.zenflow", problems)
    if problems:
        raise ConfigError(problems, config.source)
    raw = copy.deepcopy(dict(config.raw))
    zero = raw.setdefault("zero_optimization", {})
    if isinstance(zero, dict):
        zero["zenflow"] = dataclasses.asdict(zf)
    return dataclasses.replace(config, zenflow=zf, raw=raw)
