"""The long commands' --help fits a terminal (issue 29): options grouped in panels
(zfctl.panels), one line of help each, the details in README.md's option reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zfctl import panels

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")

# The panels each command's options fall in (a command shows only the ones it has).
PANELS = {
    "finetune": panels.PANELS,
    "estimate": (panels.MODEL, panels.TRAINING, panels.ENGINE, panels.DEVICES, panels.OUTPUT),
    "tune-hw": (panels.MODEL, panels.TRAINING, panels.ENGINE, panels.DEVICES, panels.OUTPUT),
    "init": (panels.TRAINING, panels.ENGINE, panels.OUTPUT),
}


def _help(cli, monkeypatch, command: str) -> str:
    monkeypatch.setenv("COLUMNS", "100")  # after the fixture's 200: a common terminal's width
    r = cli(command, "--help")
    assert r.exit_code == 0, r.output
    return r.output


def _panel_titles(text: str) -> list[str]:
    return re.findall(r"^╭─ (\S[^─]*?) ─", text, flags=re.M)


def test_finetune_help_fits_a_terminal(cli, monkeypatch):
    text = _help(cli, monkeypatch, "finetune")
    assert len(text.splitlines()) < 120, text
    assert max(len(line) for line in text.splitlines()) <= 100


@pytest.mark.parametrize("command", sorted(PANELS))
def test_options_are_grouped_in_panels(cli, monkeypatch, command):
    """The command's panels, in zfctl.panels' order; the plain "Options" panel holds only
    --help (every option of the command names its panel)."""
    text = _help(cli, monkeypatch, command)
    titles = _panel_titles(text)
    assert [t for t in titles if t in panels.PANELS] == list(PANELS[command]), titles
    options = text.split("╭─ Options ─", 1)[1].split("╰", 1)[0]
    assert re.findall(r"--[\w-]+", options) == ["--help"], options


@pytest.mark.parametrize("command", sorted(PANELS))
def test_every_option_is_in_the_readme_reference(cli, command):
    """Help is one line; what it leaves out is in README.md's option reference, which
    names every option of the command."""
    text = cli(command, "--help").output
    start = README.index(f"### `zfctl {command}`")
    section = README[start : README.find("\n### ", start + 1)]
    for flag in sorted(set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text)) - {"--help"}):
        assert re.search(rf"(?<![\w-]){flag}(?![\w-])", section), (command, flag)
