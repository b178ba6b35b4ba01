"""zenflow.hardware.predict: the step-time model of each engine by hand on a small census, its
host byte counts, the break-even tokens per step, and the named GPU boxes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from zenflow.hardware import predict as pr
from zenflow.hardware.census import EstimateError, census_of
from zenflow.hardware.layout import Settings

# MLP of tests/hardware/test_estimate.py: P = 12448, Pz = 12288, Pd = 160, S = 1312 selected,
# N = 10976 non-selected at topk 0.1.
P, PD, S_SEL, N = 12448, 160, 1312, 10976


def mlp_census():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    return census_of(model, name="mlp", source="test")


BOX = pr.Box("test", "a test box", peak_flops=2e9, mfu=0.5, link_bytes=1e6, hbm_bytes=1e8,
             latency_s=1e-4)  # fmt: skip


def test_host_bytes_per_non_selected_element():
    """Per step: the DMA's write of a piece into the step store and the accumulator's read
    of it there (the link's dtype), the window sum's read + write, only a write at the
    window's first add; once per window (S = 4) the CPU Adam and the return's read of the
    fp32 master."""
    assert pr.zenflow_host_bytes(Settings(bf16=True)) == 2 * 2 + (8 * 3 + 4) / 4 + (28 + 4) / 4
    assert pr.zenflow_host_bytes(Settings(bf16=True)) == 19
    assert pr.zenflow_host_bytes(Settings(bf16=False)) == 2 * 4 + 7 + 8 == 23
    # every add overwrites at S = 1; S = 8 spreads the window's work thinner
    assert pr.zenflow_host_bytes(Settings(bf16=True, update_interval=1)) == 4 + 4 + 32
    assert pr.zenflow_host_bytes(Settings(bf16=True, update_interval=8)) == 4 + 7.5 + 4
    # compact: bf16 pieces (even for fp32), a bf16 sum, 8-bit moments
    compact = 2 * 2 + (4 * 3 + 2) / 4 + (14.0625 + 4) / 4
    assert pr.zenflow_host_bytes(Settings(bf16=False, host_state="compact")) == compact
    assert pr.zenflow_host_bytes(Settings(host_state="compact", update_interval=1)) == 24.0625
    # two micro-batches summed on the host: no store, their fp32 sum (the first a write),
    # one fold a step (read the step sum, then the window sum's part)
    gas = Settings(bf16=True, gradient_accumulation_steps=2)
    assert pr.zenflow_host_bytes(gas) == (2 + 2 + 4) + (2 + 2 + 8) + (4 + 7) + 8
    # offload: landing write + read, master and moments read + write, the weights back
    assert pr.offload_host_bytes(Settings(bf16=True)) == 2 + 2 + 24 + 4 == 32
    assert pr.offload_host_bytes(Settings(bf16=False)) == 4 + 4 + 24 + 4 == 36


def test_host_bytes_of_the_q8_step_store():
    """zfctl.step_store "q8" with clipping, biting at every step: each add after a window's
    first writes its piece's 8-bit copy (a code and 4 / 256 of a scale) and reads the one
    before it for the folded correction; the last step's correction reads the last copy,
    inside the window's CPU Adam. Without clipping it is "off": the store's bytes, nothing
    more."""
    copy = 1 + 4 / 256
    q8 = Settings(bf16=True, step_store="q8")
    assert pr.q8_store_bytes(q8) == (3 * copy + 2 * copy + copy) / 4
    assert pr.zenflow_host_bytes(q8) == 19 + 6 * copy / 4
    assert pr.zenflow_host_bytes(Settings(bf16=True, step_store="q8", clipping=False)) == 19
    assert pr.zenflow_host_bytes(Settings(bf16=True, step_store="off")) == 19
    # compact: the same copies; S = 1: the multiplier's pass over the sum
    compact = Settings(bf16=True, step_store="q8", host_state="compact")
    assert pr.q8_store_bytes(compact) == 6 * copy / 4
    assert pr.q8_store_bytes(Settings(step_store="q8", update_interval=1)) == 8
    assert pr.q8_store_bytes(Settings(step_store="q8", update_interval=8)) == 14 * copy / 8
    # micro-batches summed on the host: their fp32 sum, no copies (as for "on")
    gas = Settings(bf16=True, step_store="q8", gradient_accumulation_steps=2)
    assert pr.q8_store_bytes(gas) == 0
    assert pr.zenflow_host_bytes(gas) == pr.zenflow_host_bytes(
        Settings(bf16=True, gradient_accumulation_steps=2)
    )


def test_each_engine_by_hand():
    """Forward is a quarter of compute when backward recomputes it; gradients leave during
    backward; each copy pays the link's latency (B = 192: W1's 7296 non-selected elements
    in 38 pieces, W2's 3680 in 20; the offload engine's 194-element chunks: 43 + 22 of the
    weights and one per dense tensor, 2 here)."""
    c = mlp_census()
    s = Settings(bf16=True, micro_batch=2, seq_len=8, gradient_checkpointing=True)
    compute = 6 * P * 16 * (4 / 3) / 1e9  # 6 P T x 4/3 at half of 2 GFLOP/s
    fwd, bwd = compute / 4, compute * 3 / 4
    lat = BOX.latency_s
    assert pr.compute_s(c, s, BOX) == pytest.approx(compute)
    assert pr.pieces(c, s) == 38 + 20
    dev = pr.predict_engine(c, "device", s, BOX, host_bw=1e9)
    assert dev.serial and dev.step_s == pytest.approx(compute + 28 * P / 1e8)
    off = pr.predict_engine(c, "offload", s, BOX, host_bw=1e9)
    chunks = 43 + 22 + 2
    d2h, h2d = P * 2 / 1e6 + chunks * lat, P * 2 / 1e6 + chunks * lat  # bf16 both ways
    host = 32 * P / 1e9
    assert off.terms == pytest.approx({"compute": compute, "d2h": d2h, "h2d": h2d, "host": host})
    assert off.step_s == pytest.approx(fwd + max(bwd, d2h) + host + h2d)
    assert off.bound == "link"
    ov = dataclasses.replace(s, overlap_step=True)
    zf = pr.predict_engine(c, "zenflow", ov, BOX, host_bw=1e9)
    device = (28 * (S_SEL + PD) + (2 + 2) * N + (4 + 2) * N / 4) / 1e8
    zd2h, zh2d = N * 2 / 1e6 + 58 * lat, (N * 4 / 1e6 + 58 * lat) / 4
    assert zf.terms == pytest.approx({
        "compute": compute, "device": device, "d2h": zd2h, "h2d": zh2d,
        "host": 19 * N / 1e9, "window": 0.0,
    })  # fmt: skip
    assert not zf.serial and zf.bound == "link"
    assert zf.step_s == pytest.approx(max(fwd + max(bwd + device, zd2h), 19 * N / 1e9) + zh2d)
    # overlap off: the window's CPU Adam (28 bytes / S per element) follows the window
    sync = pr.predict_engine(c, "zenflow", s, BOX, host_bw=1e9)
    window = 28 / 4 * N / 1e9
    assert sync.terms["window"] == pytest.approx(window)
    assert sync.terms["host"] == pytest.approx(19 * N / 1e9 - window)
    assert sync.step_s == pytest.approx(zf.step_s + window)
    with pytest.raises(EstimateError, match="no step-time model"):
        pr.predict_engine(c, "lora", s, BOX, host_bw=1e9)


def test_the_bound_moves_from_the_host_to_compute_at_the_break_even():
    """ZenFlow's host work is fixed per step; its compute grows with the tokens: below the
    break-even the step is host-bound, above it compute-bound (a fast link and HBM here)."""
    c = mlp_census()
    box = dataclasses.replace(BOX, link_bytes=1e15, hbm_bytes=1e15, latency_s=0.0)
    s = Settings(bf16=True, micro_batch=1, seq_len=1, overlap_step=True)
    bw = 1e5  # a slow host, so the break-even is many tokens
    t = pr.break_even_tokens(c, s, box, host_bw=bw)
    host = 19 * N / bw
    assert 6 * P * t / box.flops == pytest.approx(host, rel=1e-3)  # compute = host there
    below = pr.predict_engine(c, "zenflow", dataclasses.replace(s, seq_len=t // 2), box, bw)
    above = pr.predict_engine(c, "zenflow", dataclasses.replace(s, seq_len=2 * t), box, bw)
    assert below.bound == "host" and above.bound == "device compute"
    # the compact state moves fewer bytes: it breaks even at fewer tokens
    compact = pr.break_even_tokens(c, dataclasses.replace(s, host_state="compact"), box, bw)
    assert compact == pytest.approx(t * 12.015625 / 19, rel=1e-3)


def test_predict_rows_and_break_even_for_every_gpu():
    c = mlp_census()
    out = pr.predict(c, Settings(micro_batch=4, seq_len=128, gradient_accumulation_steps=2),
                     pr.box_of("rtx4090"), host_bw=50e9)  # fmt: skip
    assert out["tokens_per_step"] == 4 * 128 * 2
    assert list(out["engines"]) == ["device", "offload", "zenflow", "zenflow (compact)"]
    assert out["gpu"] == "rtx4090" and out["peak_tflops"] == 165 and out["link_gbs"] == 25
    assert set(out["break_even_by_gpu"]) >= {"h100-sxm", "h100-pcie5", "a100-40g", "a100-80g",
                                             "rtx4090", "l40s"}  # fmt: skip
    assert out["break_even_by_gpu"]["rtx4090"] == out["break_even_tokens"]
    # a faster GPU needs more tokens to hide the same host work
    h100 = out["break_even_by_gpu"]["h100-sxm"]["exact"]
    assert h100 > out["break_even_tokens"]["exact"]


def test_predict_takes_each_states_step_store_as_the_memory_check_took_it():
    """``stores``: where the estimate's check took the step store's 8-bit copies ("q8") for
    a host state, that state's row, host bytes and break-even count the copies; the other
    state keeps the run's setting."""
    c = mlp_census()
    s = Settings(micro_batch=4, seq_len=128)
    box = pr.box_of("h100-sxm")
    plain = pr.predict(c, s, box, host_bw=50e9)
    got = pr.predict(c, s, box, host_bw=50e9, stores={"compact": "q8"})
    q8 = dataclasses.replace(s, host_state="compact", step_store="q8")
    assert got["host_bytes_per_element"]["compact"] == pr.zenflow_host_bytes(q8)
    assert got["host_bytes_per_element"]["compact"] > plain["host_bytes_per_element"]["compact"]
    assert got["host_bytes_per_element"]["exact"] == plain["host_bytes_per_element"]["exact"]
    host = got["engines"]["zenflow (compact)"]["terms_s"]["host"]
    assert host > plain["engines"]["zenflow (compact)"]["terms_s"]["host"]
    assert got["engines"]["zenflow"] == plain["engines"]["zenflow"]
    assert got["break_even_tokens"]["compact"] > plain["break_even_tokens"]["compact"]


def test_gpu_profiles():
    box = pr.box_of("h100-sxm", 0.4)
    assert box.peak_flops == 989e12 and box.flops == pytest.approx(0.4 * 989e12)
    assert pr.box_of("a100-40g").peak_flops == 312e12 and pr.box_of("l40s").link_bytes == 25e9
    with pytest.raises(EstimateError, match="h100-sxm"):
        pr.box_of("tpu-v5")
    with pytest.raises(EstimateError, match="--mfu"):
        pr.box_of("rtx4090", 1.5)
