"""The README's commands: the two at the top exist as Make targets that do what they say, and
every `zfctl` line of the walk-through names real commands and options."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from zenflow.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def code_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def commands(block: str) -> list[str]:
    """Logical lines (backslash continuations joined), comments dropped."""
    text = block.replace("\\\n", " ")
    return [ln.split("#")[0].strip() for ln in text.splitlines() if ln.split("#")[0].strip()]


def test_exactly_two_commands_at_the_top():
    first = README.index("```bash")
    assert README[:first].count("\n") <= 2, "the commands must open the README"
    assert commands(code_blocks()[0]) == ["make demo", "make test"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
@pytest.mark.parametrize("target", ["demo", "test"])
def test_make_targets_set_up_first(target, monkeypatch):
    monkeypatch.setenv("GLUE_DIR", "/data/glue")
    out = subprocess.run(
        ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    setup = out.index("scripts/setup.sh")  # raises when the target does not set up
    if target == "demo":
        assert setup < out.index("scripts/demo.sh")  # tests/test_demo.py: what it runs
    else:
        assert setup < out.index("ruff check") < out.index("pytest")


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    assert "HF_HUB_OFFLINE=1" in ci and "HF_DATASETS_OFFLINE=1" in ci and "GLUE_DIR" in ci


def walkthrough() -> list[list[str]]:
    lines = [c for b in code_blocks()[1:] for c in commands(b) if c.startswith("zfctl ")]
    assert len(lines) >= 5
    return [shlex.split(c) for c in lines]


@pytest.mark.parametrize("argv", walkthrough(), ids=lambda a: " ".join(a[:2]))
def test_walkthrough_options_exist(argv, cli):
    """Every --flag the README shows is accepted by that command (checked against --help)."""
    sub = argv[1]
    help_text = cli(sub, "--help")
    assert help_text.exit_code == 0, help_text.output
    for tok in argv[2:]:
        if tok.startswith("--"):
            assert tok.split("=")[0] in help_text.output, (sub, tok)


@pytest.mark.parametrize(
    "argv", [a for a in walkthrough() if a[1] == "init"], ids=lambda a: " ".join(a[2:4])
)
def test_walkthrough_init_runs(argv, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli(*argv[1:])
    assert r.exit_code == 0, r.output
    out = argv[argv.index("--output") + 1]
    assert load_config(tmp_path / out).raw == json.loads((tmp_path / out).read_text())


# ---- "What fits where": the host table is the estimate's own figures (zenflow.hardware)

HOST_TABLE_HEAD = "| model (params) | ZeRO-Offload | ZenFlow exact | ZenFlow compact |"
HOSTS_GIB = (64, 128, 256)


def host_fit_table() -> list[str]:
    """The README's host table, computed: each model's whole-run host peak (`zfctl estimate
    MODEL --device-mem 80GiB --gradient-checkpointing --micro-batch 4 --seq-len 512
    --topk-ratio 0.05 --json`'s host_peak_bytes) for ZeRO-Offload and ZenFlow in both host
    states, and what each host size holds (ZenFlow: exact when it fits, else compact)."""
    from zenflow.hardware import estimate as est

    settings = est.Settings(topk_ratio=0.05, micro_batch=4, seq_len=512,
                            gradient_checkpointing=True)  # fmt: skip
    lines = [
        HOST_TABLE_HEAD + "".join(f" {h} GB host |" for h in HOSTS_GIB),
        "|---|---|---|---|" + "---|" * len(HOSTS_GIB),
    ]
    for name in ("llama-1b", "llama-7b", "llama-13b"):
        c = est.resolve_census(name)
        r = est.estimate(c, settings, est.Budget(80 * 2**30, 2**60, False, "d", "h"))
        peaks = {row: r.engines[row].host_peak_bytes
                 for row in ("offload", "zenflow", "zenflow (compact)")}  # fmt: skip
        cells = []
        for h in HOSTS_GIB:
            fit = [label for row, label in (("offload", "offload"), ("zenflow", "ZenFlow exact"),
                                            ("zenflow (compact)", "ZenFlow compact"))
                   if peaks[row] <= h * 2**30]  # fmt: skip
            if "ZenFlow exact" in fit:  # exact is chosen where it fits
                fit.remove("ZenFlow compact")
            cells.append(", ".join(fit) or "none")
        figures = " | ".join(est.human_bytes(p) for p in peaks.values())
        lines.append(f"| {name} ({c.params / 1e9:.3g}B) | {figures} | " + " | ".join(cells) + " |")
    return lines


def test_readme_host_table_is_what_the_estimate_computes():
    section = README[README.index("### What fits where") :]
    start = section.index(HOST_TABLE_HEAD)
    shown = section[start:].split("\n\n")[0].splitlines()
    assert shown == host_fit_table()
