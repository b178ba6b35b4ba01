"""Rooms small enough to work in (issue 29): no import circle, no module over 600 lines, no
class over 400, no function body over 60 (docstring and signature not counted), except the
readable reference schedule."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zenflow", "zfctl")
MODULE_LINES, CLASS_LINES, BODY_LINES = 600, 400, 60
# Readable beats short in the reference schedule: it is the plain statement of the algorithm
# the engine is tested against, one function top to bottom.
EXEMPT = {"zenflow/engine/reference_schedule.py"}


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            yield rel, path.read_text(encoding="utf-8")


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _body_lines(node) -> int:
    body = node.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def sizes():
    """(module lines, class lines, function body lines) as lists of (n, where)."""
    mods, classes, funcs = [], [], []
    for rel, src in _sources():
        if rel in EXEMPT:
            continue
        mods.append((len(src.splitlines()), rel))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                funcs.append((_body_lines(node), f"{rel}:{node.lineno}:{node.name}"))
    return mods, classes, funcs


def test_no_module_class_or_function_over_its_limit():
    mods, classes, funcs = sizes()
    over = [f"module {w}: {n} lines (limit {MODULE_LINES})" for n, w in mods if n > MODULE_LINES]
    over += [f"class {w}: {n} lines (limit {CLASS_LINES})" for n, w in classes if n > CLASS_LINES]
    over += [f"function {w}: body {n} lines (limit {BODY_LINES})" for n, w in funcs
             if n > BODY_LINES]  # fmt: skip
    assert not over, "\n".join(over)


def _imports(rel: str, src: str) -> set[str]:
    """The project modules `rel` imports at module level or inside functions (a lazy import
    is still an arrow between two ideas)."""
    here = _module_name(rel)
    pkg = here if rel.endswith("__init__.py") else here.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return {m for m in out if m.split(".")[0] in PACKAGES}


def import_graph() -> dict[str, set[str]]:
    srcs = dict(_sources())
    known = {_module_name(rel) for rel in srcs}
    graph = {}
    for rel, src in srcs.items():
        me = _module_name(rel)
        # `from a.b import c` names module a.b.c when it exists, else a name in a.b; a
        # package's __init__ re-exporting its modules is not a circle with them.
        targets = {m for m in _imports(rel, src) if m in known and m != me}
        graph[me] = {t for t in targets if not me.startswith(t + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_opens_with_what_it_owns():
    missing = [
        rel
        for rel, src in _sources()
        if src.strip() and ast.get_docstring(ast.parse(src)) is None and not src.startswith("#")
    ]
    assert not missing, "modules without an opening docstring or comment: " + ", ".join(missing)
