"""Assertions shared by the CLI tests."""

from __future__ import annotations


def assert_user_error(result, *fragments: str) -> None:
    """Exit code 2, one clear message containing every fragment, no traceback."""
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == 2, (result.exit_code, text)
    assert "Traceback" not in text, text
    assert result.exception is None or isinstance(result.exception, SystemExit), text
    for frag in fragments:
        assert frag in text, (frag, text)
