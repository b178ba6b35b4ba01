"""bench/host_bytes.py: a window's host work per element per step from timed native kernels,
its effective bytes at the copy's rate, and the break-even tokens that follow."""

from __future__ import annotations

import json

import pytest

from bench import host_bytes as hb
from zenflow.hardware import predict
from zenflow.hardware.layout import Settings


def test_a_window_is_one_first_add_s_minus_one_adds_and_one_adam_per_s_steps():
    sec = {"exact first add": 1.0, "exact add": 2.0, "exact adam": 4.0,
           "exact staged add": 3.0}  # fmt: skip
    assert hb.per_step(sec, "exact", 4, 1) == (1 + 3 * 2 + 4) / 4
    # staged (before): every add paid the ring's copy into the store, the first too
    assert hb.per_step(sec, "exact", 4, 1, staged=True) == (2 + 3 * 3 + 4) / 4
    assert hb.per_step(sec, "exact", 1, 2) == (1 + 4) / 2


def test_a_q8_window_keeps_copies_after_its_first_write_and_corrects_its_last_step():
    """zfctl.step_store "q8", clipping biting at every step: the first write as without it;
    the second add keeps its copy and takes in the first's multiplier, each later one the
    step before's correction; the last step's correction inside the window's Adam; at
    S = 1 the multiplier's pass."""
    sec = {"exact first add": 1.0, "exact adam": 4.0, "exact q8 keep mul": 2.5,
           "exact q8 keep delta": 3.0, "exact q8 adam folded": 4.5,
           "exact q8 correct": 1.5}  # fmt: skip
    # the last correction inside the Adam
    assert hb.per_step(sec, "exact", 4, 1, q8=True) == (1 + 2.5 + 2 * 3.0 + 4.5) / 4
    assert hb.per_step(sec, "exact", 2, 1, q8=True) == (1 + 2.5 + 4.5) / 2
    assert hb.per_step(sec, "exact", 1, 2, q8=True) == (1 + 1.5 + 4) / 2


def test_effective_bytes_are_the_cpu_time_at_the_copy_rate_plus_the_counted_dma():
    n = 1000
    sec = {"copy": 8 * n / 10e9}  # 10 GB/s
    for st in hb.STATES:
        sec.update({f"{st} first add": 1e-7, f"{st} add": 2e-7, f"{st} adam": 4e-7,
                    f"{st} q8 keep mul": 2.5e-7, f"{st} q8 keep delta": 3e-7,
                    f"{st} q8 correct": 1.5e-7, f"{st} q8 adam folded": 4.5e-7})  # fmt: skip
    sec["exact staged add"] = 3e-7
    out = {r["arm"]: r for r in hb.rows(sec, 4, n)}
    exact = out["exact"]
    cpu = (1e-7 + 3 * 2e-7 + 4e-7) / 4 / n
    assert exact["cpu_ns_per_element_step"] == pytest.approx(cpu * 1e9)
    # DMA: the landing writes 2 (bf16), the return reads the fp32 master once per window
    assert exact["effective_bytes"] == pytest.approx(cpu * 10e9 + 2 + 4 / 4)
    assert exact["counted_bytes"] == predict.zenflow_host_bytes(Settings(bf16=True)) == 19
    assert out["exact, staged (before)"]["counted_bytes"] == 19 + 4
    assert out["compact"]["counted_bytes"] < exact["counted_bytes"]
    q8 = out["exact, q8"]
    cpu_q8 = (1e-7 + 2.5e-7 + 2 * 3e-7 + 4.5e-7) / 4 / n
    assert q8["effective_bytes"] == pytest.approx(cpu_q8 * 10e9 + 2 + 4 / 4)
    assert q8["counted_bytes"] == 19 + 6 * (1 + 4 / 256) / 4
    assert (
        out["compact, q8"]["counted_bytes"]
        == out["compact"]["counted_bytes"] + 6 * (1 + 4 / 256) / 4
    )


def test_the_bench_runs_the_native_kernels_and_reports_json(capsys):
    assert hb.main(["--numel", "65536", "--repeats", "1", "--model", "gpt2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["arm"] for r in out["rows"]] == ["exact", "compact", "exact, staged (before)",
                                               "exact, q8", "compact, q8"]  # fmt: skip
    for r in out["rows"]:
        assert r["cpu_ns_per_element_step"] > 0 and r["effective_bytes"] > 0
    assert out["meta"]["copy_gb_per_s"] > 0
    assert set(out["break_even_tokens"]) == {"exact", "compact", "exact, q8", "compact, q8"}
    assert all(t > 0 for t in out["break_even_tokens"].values())
