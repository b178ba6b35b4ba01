"""bench/activations.py: one micro-batch's activation peak on the simulated device's pool,
against the estimate's activation term."""

from __future__ import annotations

import pytest

from bench import activations as act
from zenflow.hardware.layout import Settings, activation_bytes
from zenflow.ops import sim_pool

pytestmark = pytest.mark.skipif(not sim_pool.install(),
                                reason=f"no device pool here: {sim_pool.why_not()}")  # fmt: skip


def _case(name: str) -> act.Case:
    (case,) = [c for c in act.CASES if c.name == name]
    return case


def test_the_pool_sees_what_dropout_and_checkpointing_change():
    """The figure is the forward's and backward's own memory: dropout's masks add to it,
    checkpointing takes most of it away; the estimate is the layout's term for the same
    settings."""
    plain = act.measure(_case("gpt2"), tiny=True)
    no_drop = act.measure(_case("gpt2, no dropout"), tiny=True)
    ckpt = act.measure(_case("gpt2, checkpointing"), tiny=True)
    assert plain["measured_bytes"] > no_drop["measured_bytes"] > 0
    assert ckpt["measured_bytes"] < plain["measured_bytes"]
    model, arch, _ = act.build(_case("gpt2"), tiny=True)
    est, _ = activation_bytes(arch, Settings(micro_batch=8, seq_len=128, bf16=True))
    largest = max(p.numel() * 2 for p in model.parameters())  # bf16
    assert plain["activation_term_bytes"] == est and plain["largest_gradient_bytes"] == largest
    assert plain["estimate_bytes"] == est + largest
    assert plain["measured_over_estimate"] == plain["measured_bytes"] / (est + largest)
    assert "| gpt2 | 8 x 128 |" in act.table([plain])


def test_a_llama_case_runs_and_an_unknown_case_is_refused(capsys):
    row = act.measure(_case("llama, checkpointing"), tiny=True)
    assert row["measured_bytes"] > 0 and row["checkpointing"]
    assert act.main(["--cases", "nope"]) == 2
    assert "unknown case" in capsys.readouterr().err
