"""CliRunner helpers shared by the command tests."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner


@pytest.fixture
def cli(monkeypatch):
    """``cli(*args)`` runs ``zfctl *args`` in-process; a wide terminal so Rich does not wrap."""
    from zfctl.app import app

    monkeypatch.setenv("COLUMNS", "200")
    runner = CliRunner()

    def invoke(*args: str, input: str | None = None):
        return runner.invoke(app, [str(a) for a in args], input=input)

    return invoke
