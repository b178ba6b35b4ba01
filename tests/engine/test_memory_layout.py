"""Where every byte lives (ZENFLOW.md 2b, streamed) and how step counts cross a hand-over.

A bf16 model on the simulated device holds bf16 weights, the selected columns' fp32 state
and gradient, the always-important parameters' gradients, the gradient backward is
producing and small copy buckets: about 2 + 14k bytes per parameter at the peak of a step
(backward included), since every gradient leaves the device as soon as it is final. The
offload engine holds about 2. And a column moving between the device (which counts steps)
and the host (which counts windows) keeps its own count.
"""

from __future__ import annotations

import pytest
import torch
from conftest import BETAS, EPS, LR, WD, make_config

from zenflow import ZenFlowEngine
from zenflow.engine.zenflow.host_layout import host_columns


def gpt2_small_shape(seed=0, tie=True):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, n_positions=64,
                     tie_word_embeddings=tie)  # fmt: skip
    return GPT2LMHeadModel(cfg).float()


def _steps(mode, zf=None, n=2, **extra):
    model = gpt2_small_shape()
    params = sum(p.numel() for p in model.parameters())
    cfg = make_config(zf, bf16={"enabled": True}, **extra)
    with ZenFlowEngine(model, cfg, mode=mode, accelerator="sim") as e:
        ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
        stats = []
        for _ in range(n):
            with e.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            e.backward(loss)
            stats.append(e.step(loss))
            peak_held = dict(e.last_peak_held)
            e.zero_grad()
        held = e.accel.held()
        pinned = e.accel.pinned_bytes()
    return params, stats[-1], held, peak_held, pinned


def test_bf16_zenflow_streams_its_gradients():
    """The peak over a step (backward included) holds no whole-model gradient."""
    params, st, held, peak, pinned = _steps("zenflow", {"topk_ratio": 0.1, "update_interval": 4})
    assert held["weights"] / params == 2.0  # bf16 on the device
    # between steps: the selected columns' gradient (2 x ~0.1) and the fp32 scratch of
    # their update (here the tied embedding's 4096 rows x 26 columns x 4: 0.16); the
    # always-important parameters' gradients are freed by zero_grad
    assert 0.2 <= held["grads"] / params < 0.4, held
    # at the peak of backward: + the gradient being produced (here the tied embedding's,
    # 40% of this small model's parameters), + the dense grads: never the 2.0 of a whole
    # bf16 gradient
    assert peak["grads"] / params < 1.5, peak
    # selected columns' fp32 master slice + moments (12 bytes x ~0.1) + the always-important
    # params' fp32 state + int64 counts per selected column
    assert 1.15 < held["optimizer"] / params < 1.4, held
    # two copy buckets of <= 1/64, in bf16, two fp32 buckets the host's fp32 master comes
    # back through, and one bf16 bucket the device casts it into before it scatters
    assert held["staging"] <= (2 * 2 + 2 * 4 + 2) * params / 64, held
    assert st.device_peak_bytes == sum(peak.values())
    # 2 + 1.25 + 1.16 + 0.22 here (the tied embedding in flight; the buckets, 14/64 at this
    # size); the whole-gradient layout held 5.3 between steps and more during them
    assert st.device_peak_bytes / params < 4.7
    # pinned: what the device reads or writes directly: the compact fp32 master of the
    # non-selected columns (4 x ~0.9), the step store the pieces land in (bf16: 2 x ~0.9),
    # the read buffer and any staging ring (a few buckets)
    assert 5.2 < pinned / params <= 5.6 and st.pinned_host_bytes == pinned


def test_whole_gradients_without_streaming():
    params, st, held, peak, _ = _steps(
        "zenflow", {"topk_ratio": 0.1, "update_interval": 4}, zfctl={"stream_grads": False}
    )
    assert peak["grads"] / params >= 2.0  # the whole bf16 gradient, until the step


def test_baselines_device_bytes():
    params, st, held, peak, pinned = _steps("offload")
    # bf16 weights; gradients stream to the host through two small buckets
    assert held["weights"] / params == 2.0 and held.get("grads", 0) == 0
    assert st.device_peak_bytes / params < 2.0 + 1.0, peak  # + tied grad + one in flight
    assert 3.9 <= pinned / params <= 4.0  # bf16 landing + bf16 image of every weight
    params, st, held, peak, _ = _steps("device")
    # mixed-precision AdamW: bf16 weights and grads, fp32 master + two fp32 moments (and
    # torch's per-parameter step scalars: a few bytes)
    assert held["optimizer"] == 4 * params and held["optimizer_state"] // params == 8, held
    # the fused step reads fp32 gradients, made one chunk of at most the largest parameter
    # at a time (here the embedding), each bf16 one freed as it is converted: 16 B/param +
    # 4 x the largest, never an fp32 copy of every gradient (20 B/param: the first GPU run's
    # tier caught that)
    largest = max(p.numel() for p in gpt2_small_shape().parameters())
    assert peak["grads"] == 2 * params + 4 * largest, (peak, params, largest)
    assert st.device_peak_bytes / params < 16.01 + 4 * largest / params, peak


class OneMatrix(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 10))


def _grad(t):
    """Column 0 dominates until step 8, column 5 from step 9 on (the rest: small)."""
    g = torch.full((4, 10), 0.01) * (1 + 0.1 * t)
    g[:, 0 if t <= 8 else 5] = 1.0 + 0.05 * t
    return g


def _adamw_column(p, m, v, g, count, lr=LR):
    """One AdamW step of a column in float64 from its own state and count."""
    p, m, v, g = (x.double() for x in (p, m, v, g))
    b1, b2 = BETAS
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * WD)
    return p - lr / (1 - b1**count) * m / ((v / (1 - b2**count)).sqrt() + EPS)


@pytest.mark.parametrize("accelerator", ["cpu", "sim"])
def test_counts_cross_the_hand_over_with_the_moments(accelerator):
    zf = {"topk_ratio": 0.1, "update_interval": 4, "overlap_step": False,
          "select_strategy": "step", "select_interval": 8}  # fmt: skip
    model = OneMatrix()
    kw = {"accelerator": accelerator, "sim_strict": True, "min_numel": 1}
    with ZenFlowEngine(model, make_config(zf), host_kernel="reference", **kw) as e:
        w = e.zweights[0]
        for t in range(1, 13):  # windows end at 4, 8, 12; re-selection at 12 (12-1 >= 8)
            model.w.grad = _grad(t)
            e.step(1.0)
        assert w.sel_host.tolist() == [5]  # column 5 came to the device
        # it carries the host's 3 windows, column 0 carried its 12 device steps to the host
        # (the host holds the non-selected columns only: read by column id)
        assert w.steps_dev.counts.tolist() == [3]
        assert host_columns(w, "counts", [0, 1]).tolist() == [12, 3]
        before = model.w.detach()[:, 5].clone()
        m, v = w.exp_avg_dev[:, 0].clone(), w.exp_avg_sq_dev[:, 0].clone()
        g = _grad(13)
        model.w.grad = g.clone()
        e.step(1.0)
        after = model.w.detach()[:, 5]
        expected = _adamw_column(before, m, v, g[:, 5], count=4)
        torch.testing.assert_close(after.double(), expected, rtol=1e-6, atol=1e-7)
        # the global step count (13) would give a step 10%+ off: the check can tell them apart
        wrong = _adamw_column(before, m, v, g[:, 5], count=13)
        step_right = (expected - before.double()).abs().max()
        assert (wrong - expected).abs().max() > 0.1 * step_right
        # column 0 on the host: its next host step (window 13..16) uses its own count 13
        master0 = host_columns(w, "master", [0])[:, 0].clone()
        hm = host_columns(w, "exp_avg", [0])[:, 0].clone()
        hv = host_columns(w, "exp_avg_sq", [0])[:, 0].clone()
        gsum = g[:, 0].clone()
        for t in range(14, 17):
            model.w.grad = _grad(t)
            gsum += _grad(t)[:, 0]
            e.step(1.0)
        expected0 = _adamw_column(master0, hm, hv, gsum / 4, count=13)
        torch.testing.assert_close(host_columns(w, "master", [0])[:, 0].double(), expected0,
                                   rtol=1e-6, atol=1e-7)  # fmt: skip
        torch.testing.assert_close(model.w.detach()[:, 0].double(), expected0, rtol=1e-6,
                                   atol=1e-7)  # fmt: skip


@pytest.mark.parametrize("mode", ["zenflow", "offload", "device"])
@pytest.mark.parametrize("bf16", [True, False])
def test_estimate_agrees_with_the_engine_on_sim(mode, bf16):
    """``zfctl estimate``'s device bytes per holder equal what the engine holds on the
    simulated device at the peak of a step (backward included, buckets in flight) within
    10%, and never less in total than the peak.

    Untied embeddings: with a tied LM head, autograd keeps the head's share of the shared
    weight's gradient in its own buffer until the embedding's backward adds the rest; the
    estimate counts it (``ParamCensus.largest_zenflow_numel``), the sim's accounting cannot
    see autograd's buffers (``test_tied_weight_is_counted_by_the_estimate``)."""
    tie = False
    from zenflow.hardware.census import census_of
    from zenflow.hardware.estimate import layout, settings_from_config

    zf = {"topk_ratio": 0.1, "update_interval": 4} if mode == "zenflow" else None
    cfg = make_config(zf, bf16={"enabled": bf16})
    census = census_of(gpt2_small_shape(tie=tie), name="gpt2-2x256", source="test")
    items = layout(census, mode, settings_from_config(cfg))
    estimated: dict[str, int] = {}
    for it in items:
        if it.side == "device" and it.category != "activations":
            estimated[it.category] = estimated.get(it.category, 0) + it.bytes
    model = gpt2_small_shape(tie=tie)
    with ZenFlowEngine(model, cfg, mode=mode, accelerator="sim") as e:
        ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(2):  # the second step is a streamed one (the first selects)
            with e.autocast():
                loss = model(input_ids=ids, labels=ids).loss
            e.backward(loss)
            st = e.step(loss)
            peak = dict(e.last_peak_held)
            e.zero_grad()
    peak["optimizer"] = peak.get("optimizer", 0) + peak.pop("optimizer_state", 0)
    peak.pop("handover", None)
    for cat in ("weights", "grads", "optimizer", "staging"):
        if estimated.get(cat, 0) == 0 and peak.get(cat, 0) == 0:
            continue
        assert peak[cat] == pytest.approx(estimated[cat], rel=0.10), (cat, peak, estimated)
    total = sum(estimated.values())
    assert st.device_peak_bytes <= total * 1.001
    assert st.device_peak_bytes == pytest.approx(total, rel=0.10)


def test_tied_weight_is_counted_by_the_estimate():
    """A tied LM head: the estimate's in-flight gradient is the shared weight's plus the
    largest other one (autograd holds the head's share for the whole backward)."""
    from zenflow.hardware.census import census_of

    tied = census_of(gpt2_small_shape(tie=True), name="tied", source="test")
    untied = census_of(gpt2_small_shape(tie=False), name="untied", source="test")
    assert tied.tied_numel == 4096 * 256 and untied.tied_numel == 0
    # tied: wte (1M) + the largest block weight (c_fc, 256 x 1024); untied: lm_head or wte
    assert tied.largest_zenflow_numel == 4096 * 256 + 256 * 1024
    assert untied.largest_zenflow_numel == 4096 * 256
