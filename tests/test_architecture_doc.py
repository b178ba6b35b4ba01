"""docs/ARCHITECTURE.md draws the step and the packages, and its tables name only files that
exist (issue 29): a module that moves without its row fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# A table's section says where its names live: "### `zenflow/engine/zenflow/`: ..."
_BASE = re.compile(r"^#{2,3} .*?`((?:zenflow|zfctl|csrc)[\w/]*/)`")


def _mermaid_blocks(text: str) -> list[str]:
    return re.findall(r"```mermaid\n(.*?)```", text, flags=re.S)


def test_both_diagrams_are_there():
    blocks = _mermaid_blocks(DOC.read_text(encoding="utf-8"))
    kinds = [b.split("\n", 1)[0].strip() for b in blocks]
    assert "sequenceDiagram" in kinds  # one ZenFlow step and window
    assert any(k.startswith("flowchart") for k in kinds)  # the packages
    step = blocks[kinds.index("sequenceDiagram")]
    for word in ("compute stream", "copy stream d2h", "accumulator thread", "worker thread",
                 "copy stream h2d", "step store", "window sum", "bucket"):  # fmt: skip
        assert word in step, word


def _table_names(text: str):
    """(name, base) for every backticked file or folder in a table's first column."""
    base = None
    section = None
    for line in text.splitlines():
        if line.startswith("#"):
            m = _BASE.match(line)
            section = line
            base = m.group(1) if m else None
            if line.startswith("## zfctl"):
                base = "zfctl/"
            continue
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for name in re.findall(r"`([\w./]+)`", first):
            if name.endswith((".py", "/")):
                yield name, base, section


def _exists(name: str, base: str | None) -> bool:
    candidates = [ROOT / name]
    if base:
        candidates.append(ROOT / base / name)
        candidates.append(ROOT / "zenflow" / name)
    return any(c.exists() for c in candidates)


def test_tables_name_only_files_that_exist():
    text = DOC.read_text(encoding="utf-8")
    names = list(_table_names(text))
    assert len(names) > 60  # the tables are there
    missing = [f"{n} (under {b}, section {s!r})" for n, b, s in names if not _exists(n, b)]
    assert not missing, "docs/ARCHITECTURE.md names files that do not exist: " + "; ".join(missing)


def test_every_module_has_a_row():
    """The reverse: every module of zenflow/engine, its rooms and its accelerator, and of
    zfctl, is named in a table (a new room gets a row)."""
    text = DOC.read_text(encoding="utf-8")
    named = {(b or "") + n for n, b, _ in _table_names(text)}
    flat = " ".join(named)
    for folder in ("zenflow/engine", "zenflow/engine/zenflow", "zenflow/engine/accelerator",
                   "zfctl"):  # fmt: skip
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            assert f"{folder}/{path.name}" in flat or path.name in flat, (
                f"{folder}/{path.name} has no row in docs/ARCHITECTURE.md"
            )
