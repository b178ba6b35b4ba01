"""Shared fixtures for the CPU Adam op tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def native():
    """The native op, built (about 10-60 s the first time, then cached) once per session."""
    from zenflow.ops import load_native

    load_native()
