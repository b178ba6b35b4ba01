"""The device-side AdamW: the fused path (torch's fused kernel over a list of tensors) against
the plain reference (torch.optim.AdamW's single-tensor op order), element-wise, and the
engine with either one."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    ACCELERATORS,
    MLP,
    assert_params_close,
    engine_kw,
    gpt2_batches,
    make_config,
    mlp_batches,
    tiny_gpt2,
    train_engine,
)

from zenflow import ZenFlowEngine
from zenflow.engine.device_adam import (
    AdamHyper,
    adamw_columns_,
    adamw_columns_multi_,
    adamw_dense_,
    adamw_fused_,
    column_factor_views,
    fused_available,
)
from zenflow.errors import EngineError


def _state(shape, seed, transposed=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=g)
    grads = [torch.randn(shape, generator=g) * 10.0 ** float(k - 3) for k in range(4)]
    if transposed:  # a strided view, as a weight stored column-major would be
        p = p.t().contiguous().t()
    return p, grads


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "strided"])
def test_fused_matches_the_reference_element_wise(adamw_mode, transposed):
    """Several tensors in one fused call, four steps with gradients from 1e-3 to 1: every
    element of the parameters and moments agrees with the reference within float rounding."""
    hp = AdamHyper(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05,
                   adamw_mode=adamw_mode)  # fmt: skip
    shapes = [(37, 19), (64,), (5, 128)]
    states = [_state(s, i, transposed and len(s) == 2) for i, s in enumerate(shapes)]
    ref = [[p.clone(), torch.zeros_like(p), torch.zeros_like(p)] for p, _ in states]
    fus = [[p.clone(), torch.zeros_like(p), torch.zeros_like(p)] for p, _ in states]
    for step in range(1, 5):
        grads = [gs[step - 1] for _, gs in states]
        for (p, m, v), g in zip(ref, grads, strict=True):
            adamw_dense_(p, g, m, v, step, hp)
        adamw_fused_([f[0] for f in fus], grads, [f[1] for f in fus], [f[2] for f in fus],
                     step, hp)  # fmt: skip
    for (p, m, v), (pf, mf, vf), (p0, _) in zip(ref, fus, states, strict=True):
        torch.testing.assert_close(pf, p, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mf, m, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(vf, v, rtol=1e-6, atol=1e-12)
        assert not torch.equal(pf, p0)  # it did update


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("room", [False, True], ids=["new-memory", "in-scratch"])
@pytest.mark.parametrize("decay", [0.0, 0.05], ids=["no-decay", "decay"])
@pytest.mark.parametrize("split", [False, True], ids=["one-call", "factors-once-two-calls"])
def test_per_column_batch_equals_the_per_tensor_reference_element_wise(
    adamw_mode, room, decay, split
):
    """Weights whose columns carry their own counts (after a hand-over), updated together
    (the moments in foreach calls, the factors over all counts at once, the denominators in
    the spent gradients' scratch or in new memory): every element of the parameters and
    moments equals ``adamw_columns_`` run on each tensor alone, over four steps, with
    columns along either dim."""
    hp = AdamHyper(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=decay,
                   adamw_mode=adamw_mode)  # fmt: skip
    layout = [((37, 19), 1), ((24, 8), 0), ((5, 128), 1)]
    gen = torch.Generator().manual_seed(3)
    states = [_state(shape, i) for i, (shape, _) in enumerate(layout)]
    counts = [torch.randint(0, 40, (shape[cd],), generator=gen) for shape, cd in layout]
    ref = [[p.clone(), torch.rand(p.shape, generator=gen) * 1e-2, torch.rand(p.shape) * 1e-4]
           for p, _ in states]  # fmt: skip
    multi = [[t.clone() for t in r] for r in ref]
    cds = [cd for _, cd in layout]
    for step in range(4):
        grads = [gs[step] for _, gs in states]
        for c in counts:
            c.add_(1)
        for (p, m, v), g, c, cd in zip(ref, grads, counts, cds, strict=True):
            adamw_columns_(p, g.clone(), m, v, c, cd, hp)
        spent = [g.clone() for g in grads]
        ps, ms, vs = ([r[j] for r in multi] for j in range(3))
        if not split:
            adamw_columns_multi_(ps, spent, ms, vs, counts, cds, hp,
                                 scratch=spent if room else None)  # fmt: skip
            continue
        # the engine's way: every tensor's factors at once, the update in two batches
        negs, bc2s = column_factor_views(counts, cds, [p.dim() for p in ps], hp)
        for b in (slice(0, 1), slice(1, 3)):
            adamw_columns_multi_(ps[b], spent[b], ms[b], vs[b], counts[b], cds[b], hp,
                                 spent[b] if room else None, (negs[b], bc2s[b]))  # fmt: skip
    for (p, m, v), (pm, mm, vm), (p0, _) in zip(ref, multi, states, strict=True):
        assert torch.equal(pm, p) and torch.equal(mm, m) and torch.equal(vm, v)
        assert not torch.equal(pm, p0)  # it did update


def test_per_column_batch_sees_each_columns_count():
    """The batch's factors follow each column's own count, in each tensor of the batch:
    a column at count 1 moves by lr (the bias-corrected first step), one at count 1000 by
    what its bias correction at 1000 gives, whichever tensor it is in."""
    hp = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    p = [torch.zeros(3, 2), torch.zeros(4, 2)]
    zeros = [torch.zeros(3, 2), torch.zeros(4, 2)]
    g = [torch.ones(3, 2), torch.ones(4, 2)]
    counts = [torch.tensor([1, 1000]), torch.tensor([1000, 1])]
    adamw_columns_multi_(p, g, [z.clone() for z in zeros], [z.clone() for z in zeros],
                         counts, [1, 1], hp)  # fmt: skip
    first, late = p[0][0, 0], p[0][0, 1]
    torch.testing.assert_close(first, torch.tensor(-1e-2), rtol=1e-5, atol=0)
    # moments from zero at count 1000: (1 - beta1) / sqrt((1 - beta2) / (1 - beta2^1000))
    expect = -1e-2 * (0.1 / (1 - 0.9**1000)) / (0.001 / (1 - 0.999**1000)) ** 0.5
    torch.testing.assert_close(late, torch.tensor(expect), rtol=1e-5, atol=0)
    assert torch.equal(p[0][:, 0], first.expand(3)) and torch.equal(p[1][:, 1], first.expand(4))
    assert torch.equal(p[0][:, 1], late.expand(3)) and torch.equal(p[1][:, 0], late.expand(4))


def test_fused_is_torchs_fused_adamw_bit_for_bit():
    """The fused path is the kernel behind torch.optim.AdamW(fused=True), so it reproduces
    it exactly, including the step count it is given (not a counter it keeps)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(33, 17))
    ours = w.detach().clone()
    m, v = torch.zeros_like(ours), torch.zeros_like(ours)
    opt = torch.optim.AdamW([w], lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1,
                            fused=True)  # fmt: skip
    hp = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1)
    for step in range(1, 7):
        g = torch.randn(33, 17)
        w.grad = g.clone()
        opt.step()
        adamw_fused_([ours], [g], [m], [v], step, hp)
        assert torch.equal(ours, w.detach()), step


def test_fused_available_on_the_engine_devices():
    assert fused_available(torch.device("cpu"))
    assert not fused_available(torch.device("meta"))


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_engine_fused_and_reference_agree(accelerator):
    """ZenFlow with overlap, topk 0.1 and 2-step windows: the engine with the fused device
    update (its default) and with the reference end element-wise close, on cpu and on the
    strict simulated device; ``resolved`` names the one in use."""
    torch.manual_seed(0)
    base = MLP()
    batches = mlp_batches(12)
    cfg = make_config({"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True})
    models = {}
    for impl in ("fused", "reference"):
        model = copy.deepcopy(base)
        with ZenFlowEngine(model, cfg, **engine_kw(accelerator, impl)) as e:
            assert e.resolved["device_update"].startswith(impl)
            train_engine(e, model, batches)
        models[impl] = model
    moved = [not torch.equal(p, q) for p, q in
             zip(models["fused"].parameters(), base.parameters(), strict=True)]  # fmt: skip
    assert all(moved)
    assert_params_close(models["fused"], models["reference"], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
def test_engine_per_column_batches_equal_the_reference_weight_by_weight(bf16):
    """After re-selections every weight's selected columns carry their own counts: the
    fused device update takes them in batches (``adamw_columns_multi_``: factors once a
    step, the denominators in the spent scratch, a bf16 model's masters cast in one foreach
    copy) and the reference one weight at a time (``adamw_columns_``). On the strict
    simulated device, with the reference update everywhere else, the two train the same
    weights bit for bit, and so does a run that casts and writes each master alone."""
    zf = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True,
          "select_strategy": "step", "select_interval": 2}  # fmt: skip
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    out, mixed = {}, {}
    # (batched per-column update, the masters cast in one foreach copy)
    arms = [(True, True), (False, True), (False, False)]
    for batched, one_cast in arms:
        model = tiny_gpt2()
        with ZenFlowEngine(model, make_config(zf, **extra), **engine_kw("sim")) as e:
            ds = e.impl.device_step
            assert not ds.batched_columns  # the reference's default
            ds.batched_columns = batched
            if not one_cast:  # each master cast and written alone (``_write_sel``)
                write = ds._write_batch
                ds._write_batch = lambda batch, xs, spent, write=write: write(batch, xs, False)
            train_engine(e, model, gpt2_batches(9))
            mixed[batched, one_cast] = sum(w.steps_dev.uniform is None for w in e.zweights)
            out[batched, one_cast] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert len(set(mixed.values())) == 1 and mixed[True, True] > 0  # the per-column path ran
    for arm in arms[1:]:
        for name, t in out[arm].items():
            assert torch.equal(out[True, True][name], t), (arm, name)


def test_an_fp32_models_per_column_denominators_are_made_in_an_accounted_scratch(monkeypatch):
    """An fp32 model has no widening scratch; its per-column update after a re-selection
    makes the denominators in one fp32 scratch of the same size, made at the first such
    update and accounted on the device (what the estimate counts), not in new memory a
    batch."""
    import zenflow.engine.zenflow.device_step as device_step

    rooms = []
    real = device_step.adamw_columns_multi_

    def spy(*args):
        rooms.append(args[7])
        return real(*args)

    monkeypatch.setattr(device_step, "adamw_columns_multi_", spy)
    zf = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True,
          "select_strategy": "step", "select_interval": 2}  # fmt: skip
    model = tiny_gpt2()
    with ZenFlowEngine(model, make_config(zf), **engine_kw("sim", "fused")) as e:
        ds = e.impl.device_step
        assert ds._scratch is None  # fp32: nothing widened, no re-selection yet
        grads_before = e.accel.held().get("grads", 0)
        train_engine(e, model, gpt2_batches(9))
        assert rooms and all(r is not None for r in rooms)  # the per-column path ran
        assert ds._scratch is not None and ds._scratch.numel() == ds._cap
        base = ds._scratch.untyped_storage().data_ptr()
        end = base + ds._scratch.numel() * 4
        for room in rooms:  # every denominator lies in the scratch
            for d in room:
                assert base <= d.data_ptr() < end
        assert e.accel.held().get("grads", 0) >= grads_before + ds._cap * 4


def test_engine_default_is_fused_and_bad_choice_is_refused():
    model = MLP()
    with ZenFlowEngine(model, make_config({"topk_ratio": 0.1}), accelerator="cpu") as e:
        assert e.resolved["device_update"].startswith("fused")
    with pytest.raises(EngineError, match="device_adam='foreach' is not allowed"):
        ZenFlowEngine(model, make_config(None), accelerator="cpu", device_adam="foreach")


def test_reference_engine_never_calls_the_fused_kernel(monkeypatch):
    """``device_adam="reference"`` really takes the single-tensor path (the two can agree
    bit for bit on some inputs, so equal results alone would not show it), and the default
    really calls the fused kernel."""
    calls = []
    real = torch._fused_adamw_

    def spy(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    batches = mlp_batches(4)
    cfg = make_config({"topk_ratio": 0.1, "update_interval": 2})
    for impl, expect_calls in (("reference", False), ("fused", True)):
        calls.clear()
        torch.manual_seed(0)
        model = MLP()
        with ZenFlowEngine(model, cfg, **engine_kw("cpu", impl)) as e:
            train_engine(e, model, batches)
        assert bool(calls) == expect_calls, (impl, calls)
