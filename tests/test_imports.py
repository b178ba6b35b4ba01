"""Imports flow one way (STYLE.md): zfctl -> zenflow -> torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["zenflow", "zenflow.engine", "zenflow.train.trainer"])
def test_zenflow_never_imports_the_cli(module):
    mods = _modules_after(f"import {module}")
    assert not {"typer", "rich", "zfctl"} & {m.split(".")[0] for m in mods}


def test_cli_help_does_not_import_torch():
    code = (
        "import sys\nfrom zfctl.app import app\n"
        "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
    )
    mods = _modules_after(code)
    assert "zfctl.app" in mods
    assert "torch" not in mods
    assert "zenflow.train.trainer" not in mods
