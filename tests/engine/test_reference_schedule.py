"""The fast engine matches the plain reference schedule bit for bit, step by step
(same host kernel on both sides; the device arithmetic is element-wise identical)."""

from __future__ import annotations

import pytest
import torch
from conftest import ACCELERATORS, BETAS, EPS, LR, WD, engine_kw, make_config
from transformers.pytorch_utils import Conv1D

from zenflow import ZenFlowEngine
from zenflow.engine.reference_schedule import run_reference
from zenflow.engine.zenflow.early import ramp_length


class ParamModel(torch.nn.Module):
    """Params only (gradients are set by the test): a Linear [24, 40] (columns along dim 1),
    a GPT-2 Conv1D [36, 20] (columns along dim 0), a small matrix and a bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(40, 24)  # weight [24, 40] + bias [24]
        self.conv = Conv1D(20, 36)  # weight [36, 20] = [in, out]
        self.small = torch.nn.Parameter(torch.randn(4, 5))


COLUMN_DIMS = {"lin.weight": 1, "lin.bias": None, "conv.weight": 0, "conv.bias": None}


def _reference_inputs():
    """A fresh ParamModel's parameter names, initial values and column dims: what the
    reference schedule is run on."""
    model = ParamModel()
    names = [n for n, _ in model.named_parameters()]
    return names, [p.detach().clone() for p in model.parameters()], \
        [COLUMN_DIMS.get(n) for n in names]  # fmt: skip


def make_grad_fn(n_attempts, nonfinite_at=()):
    gen = torch.Generator().manual_seed(7)
    noise = {}

    def grad_fn(i, params):
        if i not in noise:
            noise[i] = [torch.randn(p.shape, generator=gen) for p in params]
        grads = []
        for p, z in zip(params, noise[i], strict=True):
            g = z.clone()
            if p.dim() == 2:  # skewed column importance that drifts over time
                cols = p.shape[1] if p.shape[0] in (24, 4) else p.shape[0]
                scale = 1.0 + 4.0 * torch.sin(torch.arange(cols) * 0.7 + i * 0.3).abs()
                g = g * (scale if p.shape[0] in (24, 4) else scale[:, None])
            g = g + 0.1 * p  # depends on the current weights: staleness changes values
            grads.append(g)
        if i in nonfinite_at:
            grads[0][0, 0] = float("inf")
        return grads

    return grad_fn


CASES = {
    "S2-sel3-overlap": dict(update_interval=2, select_interval=3, overlap_step=True),
    "S2-sel3-sync": dict(update_interval=2, select_interval=3, overlap_step=False),
    "S3-sel4-warm2-overlap": dict(
        update_interval=3, select_interval=4, overlap_step=True, full_warm_up_rounds=2
    ),
    "S1-sel2-overlap-topk25": dict(
        update_interval=1, select_interval=2, overlap_step=True, topk_ratio=0.25
    ),
    "auto-sel5-overlap": dict(update_interval="auto", select_interval=5, overlap_step=True),
    "auto-sel5-sync": dict(update_interval="auto", select_interval=5, overlap_step=False),
    # S = 4 with a re-selection every 8 steps: columns move between a side that counted 2
    # host windows and one that counted 8 device steps; each keeps its own count
    "S4-sel8-overlap": dict(update_interval=4, select_interval=8, overlap_step=True),
    # zfctl.window_lr "sum": a host step at the sum of its window's lrs
    "S4-sel8-overlap-sumlr": dict(
        update_interval=4, select_interval=8, overlap_step=True, window_lr="sum"
    ),
    "S4-sel8-overlap-sqrtlr": dict(
        update_interval=4, select_interval=8, overlap_step=True, window_lr="sqrt"
    ),
    "auto-sel5-sync-sqrtlr": dict(
        update_interval="auto", select_interval=5, overlap_step=False, window_lr="sqrt"
    ),
    "auto-sel5-sync-sumlr": dict(
        update_interval="auto", select_interval=5, overlap_step=False, window_lr="sum"
    ),
    # zfctl.select_schedule "doubling": re-selections 2, 4, then 6 (the cap) steps apart
    "S2-sel6-overlap-doubling": dict(
        update_interval=2, select_interval=6, overlap_step=True, select_schedule="doubling"
    ),
    "auto-sel9-sync-doubling": dict(
        update_interval="auto",
        select_interval=9,
        overlap_step=False,
        select_schedule="doubling",
    ),
    # zfctl.early: windows 1 (steps 1-5), 2 (6-11), then 4 over a 12-step early phase
    "S4-sel8-overlap-early-ramp": dict(
        update_interval=4, select_interval=8, overlap_step=True, early={"steps": 12}
    ),
    # ... with the early windows' host steps applied at their own ends
    "S4-sel8-overlap-early-ramp-sync": dict(
        update_interval=4,
        select_interval=8,
        overlap_step=True,
        early={"steps": 12, "overlap": False},
    ),  # fmt: skip
    "S4-sel8-overlap-early-fixed-sync": dict(
        update_interval=4,
        select_interval=8,
        overlap_step=True,
        early={"steps": 9, "windows": "fixed", "overlap": False},
    ),  # fmt: skip
    # after 2 warm-up rounds, windows 1, 2, then 3 (not a power of two) over 7 early steps;
    # the non-finite attempt after the phase, inside a window (see skip_at below)
    "S3-sel4-warm2-overlap-early-ramp": dict(
        update_interval=3,
        select_interval=4,
        overlap_step=True,
        full_warm_up_rounds=2,
        early={"steps": 7},
        skip_at=(12,),
    ),  # fmt: skip
    "auto-sel5-overlap-early-sync": dict(
        update_interval="auto",
        select_interval=5,
        overlap_step=True,
        early={"steps": 6, "windows": "fixed", "overlap": False},
    ),  # fmt: skip
}


# The compact host state (zfctl.host_state "compact": 8-bit moments, bf16 window sum and
# pieces) against the reference's compact statement, on the cases that exercise what it
# changes: windows with overlap, warm-up then the first selection, re-selections that
# re-lay the 8-bit moments (fixed and auto intervals), per-column counts.
COMPACT_CASES = ["S2-sel3-overlap", "S3-sel4-warm2-overlap", "auto-sel5-sync",
                 "S4-sel8-overlap", "S4-sel8-overlap-sumlr",
                 "S4-sel8-overlap-early-ramp-sync"]  # fmt: skip
STATES = [("exact", case) for case in CASES] + [("compact", case) for case in COMPACT_CASES]


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("state,case", STATES, ids=[f"{s}-{c}" for s, c in STATES])
@pytest.mark.parametrize("clip", [0.0, 30.0])
def test_engine_matches_reference(case, accelerator, clip, state):
    zf = {"topk_ratio": 0.1, **CASES[case], "select_strategy": "step", "auto_ratio": 0.99}
    window_lr = zf.pop("window_lr", "last")
    select_schedule = zf.pop("select_schedule", "fixed")
    early = zf.pop("early", {})
    attempts = 21 if case.startswith("S4") else 17
    # A non-finite attempt: skipped, nothing moves. Not on a window-end step while a host
    # step is in flight on a separate device: that step's backward has already copied the
    # in-flight result's ready weights back (apply_in_backward) when the step turns out
    # non-finite; they stay (the same values are applied again at the real window end), so
    # the next forward sees them one step early, which the reference does not model.
    skip_at = zf.pop("skip_at", (5,))
    model = ParamModel()
    names = [n for n, _ in model.named_parameters()]
    init = [p.detach().clone() for p in model.parameters()]
    grad_fn = make_grad_fn(attempts, nonfinite_at=skip_at)
    engine = ZenFlowEngine(
        model,
        make_config(zf, clip=clip, zfctl={"window_lr": window_lr, "host_state": state,
                                          "select_schedule": select_schedule, "early": early}),
        host_kernel="reference", min_numel=100,
        **engine_kw(accelerator),
    )  # fmt: skip
    assert [w.spec.name for w in engine.zweights] == ["lin.weight", "conv.weight"]
    assert [w.cd for w in engine.zweights] == [1, 0]
    ui = None if zf["update_interval"] == "auto" else zf["update_interval"]
    ref = run_reference(
        init, [COLUMN_DIMS.get(n) for n in names], grad_fn, attempts,
        lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, topk_ratio=zf["topk_ratio"],
        update_interval=ui, select_every=zf["select_interval"], overlap=zf["overlap_step"],
        warmup_rounds=zf.get("full_warm_up_rounds", 0), auto_ratio=0.99, clip=clip,
        window_lr=window_lr, select_schedule=select_schedule, host_state=state,
        bf16_link=accelerator != "cpu",  # the CPU device sums in fp32 where autograd writes
        early_steps=early.get("steps", 0), early_windows=early.get("windows", "ramp"),
        early_overlap=early.get("overlap", True),
    )  # fmt: skip
    # Bit for bit where the gradient is whole (the CPU device sums it in place). Streamed
    # (sim), the global norm is summed from the pieces as they pass (another rounding order
    # than the reference's per-tensor norms), so with clipping the coefficient may differ
    # in its last bit; the schedule (windows, applied steps, selections) must still match.
    tol = 0.0 if engine.resolved["accelerator"] == "cpu" or clip == 0 else 1e-6
    moved = 0
    mixed_counts = False
    with engine:
        for i in range(attempts):
            params = list(model.parameters())
            for p, g in zip(params, grad_fn(i, [p.detach().clone() for p in params]), strict=True):
                p.grad = g
            st = engine.step(1.0)
            moved += st.selection_changed
            assert st.skipped == (i in skip_at)
            for n, p, r in zip(names, model.parameters(), ref["history"][i], strict=True):
                torch.testing.assert_close(
                    p.detach(), r, atol=tol, rtol=tol, msg=lambda m, n=n, i=i: f"{i} {n}: {m}"
                )
            engine.zero_grad()
            mixed_counts |= any(
                w.steps_dev.uniform is None or w.host.steps.uniform is None for w in engine.zweights
            )
        assert engine.skipped_steps == len(skip_at)
        assert engine.window_lengths == [w[2] for w in ref["windows"]]
        assert [j.applied_step for j in engine.host_log if j.applied_step] == ref["applied"]
        assert engine.selection_steps == ref["selected_at"]
    assert moved > 2 * 4  # reselection really moved columns (beyond the first selection)
    # columns really carried different step counts (the per-column path ran), except with
    # one-step windows, where every column takes exactly one step per step on either side
    assert mixed_counts == (zf["update_interval"] != 1)
    if ui is None:
        assert len(set(engine.window_lengths)) > 1 or max(engine.window_lengths) > 1
    for p, p0 in zip(model.parameters(), init, strict=True):
        assert not torch.equal(p.detach(), p0)


def test_compact_state_is_not_the_exact_one():
    """The reference's compact statement really runs other arithmetic (8-bit moments, a
    bf16 window sum): the non-selected columns end elsewhere than with the exact state,
    close to it (about 5% of what they moved here), while the schedule is the same."""
    names, init, dims = _reference_inputs()
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, topk_ratio=0.1, update_interval=2,
              select_every=3, overlap=True)  # fmt: skip
    runs = {s: run_reference(init, dims, make_grad_fn(17), 17, host_state=s, **kw)
            for s in ("exact", "compact")}  # fmt: skip
    assert runs["exact"]["windows"] == runs["compact"]["windows"]
    lin = names.index("lin.weight")
    exact, compact = runs["exact"]["params"][lin], runs["compact"]["params"][lin]
    moved = (exact - init[lin]).abs().max()
    diff = (exact - compact).abs().max()
    assert 0 < diff < 0.15 * moved, (diff, moved)


def test_window_lr_sum_moves_a_window_by_its_steps_lrs():
    """The reference's window_lr "sum" (what the engine is compared with above): after the
    first 4-step window without overlap, the non-selected columns are those of a host step
    at 4 x lr (their gradients depend only on their own values, unchanged until then),
    and not those of "last" at lr."""
    names, init, dims = _reference_inputs()
    kw = dict(betas=BETAS, eps=EPS, weight_decay=WD, topk_ratio=0.1, update_interval=4,
              select_every=1000, overlap=False)  # fmt: skip

    def after_window(lr, window_lr):
        ref = run_reference(init, dims, make_grad_fn(4), 4, lr=lr, window_lr=window_lr, **kw)
        return ref["history"][3][names.index("lin.weight")]  # [24, 40], columns along dim 1

    summed = after_window(LR, "sum")
    last, last4 = after_window(LR, "last"), after_window(4 * LR, "last")
    # every column moved; the 4 device columns (top 10% of 40) are those of "last" at lr,
    # the 36 host columns those of a host step at 4 x lr, exactly
    assert not torch.isclose(summed, init[names.index("lin.weight")]).all(dim=0).any()
    device_cols = (summed == last).all(dim=0)
    host_cols = (summed == last4).all(dim=0)
    assert device_cols.sum() == 4 and host_cols.sum() == 36
    assert not (device_cols & host_cols).any()


def test_doubling_reselects_at_gaps_that_double_up_to_the_interval():
    """The reference's select_schedule (what the engine is compared with above), by hand:
    S = 2, select interval 6, 25 steps. The first selection at step 1; re-selection is due
    2, 4, 6, 6, ... steps after the last and taken at the first window end (even steps) at
    or after that: 4 (3 >= 2), 8 (4 >= 4), 14 (6 >= 6; 12 - 8 = 4 is too soon), 20, then 26
    is past the end. "fixed" re-selects every 6: at 8 (7 >= 6), 14, 20. With one-step
    "auto"-like windows (S = 1) the gaps are 1, 2, 4, 8 from step 1: 2, 4, 8, 16, 32."""
    names, init, dims = _reference_inputs()
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, topk_ratio=0.1, overlap=True)

    def selected_at(schedule, interval, every, steps=25):
        ref = run_reference(init, dims, make_grad_fn(steps), steps, update_interval=interval,
                            select_every=every, select_schedule=schedule, **kw)  # fmt: skip
        return ref["selected_at"]

    assert selected_at("doubling", 2, 6) == [1, 4, 8, 14, 20]
    assert selected_at("fixed", 2, 6) == [1, 8, 14, 20]
    assert selected_at("doubling", 1, 1000, steps=40) == [1, 2, 4, 8, 16, 32]


def test_window_lr_sqrt_takes_half_the_sum_and_twice_the_decay_over_four_steps():
    """The reference's window_lr "sqrt" by hand: after the first 4-step window without
    overlap, the host columns are those of one "last" step at lr 4 x LR / sqrt(4) = 2 x LR
    with weight decay 2 x WD (the window decays by 4 x LR x WD, as four AdamW steps do)."""
    names, init, dims = _reference_inputs()
    kw = dict(betas=BETAS, eps=EPS, topk_ratio=0.1, update_interval=4, select_every=1000,
              overlap=False)  # fmt: skip

    def after_window(lr, wd, window_lr):
        ref = run_reference(init, dims, make_grad_fn(4), 4, lr=lr, weight_decay=wd,
                            window_lr=window_lr, **kw)  # fmt: skip
        return ref["history"][3][names.index("lin.weight")]

    sqrt = after_window(LR, WD, "sqrt")
    host_cols = (sqrt == after_window(2 * LR, 2 * WD, "last")).all(dim=0)
    device_cols = (sqrt == after_window(LR, WD, "last")).all(dim=0)
    assert host_cols.sum() == 36 and device_cols.sum() == 4
    assert not (sqrt == after_window(2 * LR, WD, "last")).all(dim=0).any()  # decay matters


def test_early_ramp_and_sync_windows_by_hand():
    """The early schedule (what the engine is compared with above), by hand: S = 4 over a
    12-step phase, 20 steps. Ramp: windows of 1 (early steps 1-5: 4 x 5 // 12 < 2), 2 (6-11),
    then 4; with overlap each host step reaches the weights at the next window's end. With
    early overlap off the early windows' results land at their own ends. "fixed" keeps S.
    The ramp's rule, ``ramp_length``, on the numbers of its docstring."""
    names, init, dims = _reference_inputs()
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, topk_ratio=0.1, update_interval=4,
              select_every=1000, overlap=True)  # fmt: skip

    def run(**early):
        ref = run_reference(init, dims, make_grad_fn(20), 20, **kw, **early)
        return [w[2] for w in ref["windows"]], ref["applied"]

    ramp, ramp_applied = run(early_steps=12)
    assert ramp == [1] * 5 + [2] * 3 + [4] * 2
    assert ramp_applied == [2, 3, 4, 5, 7, 9, 11, 15, 19]  # each at the next window's end
    sync, sync_applied = run(early_steps=12, early_overlap=False)
    assert sync == ramp
    # early windows (ending at steps 1-5, 7, 9, 11) at their own ends; then overlap again
    assert sync_applied == [1, 2, 3, 4, 5, 7, 9, 11, 19]
    fixed, fixed_applied = run(early_steps=9, early_windows="fixed", early_overlap=False)
    assert fixed == [4] * 5 and fixed_applied == [4, 8, 16, 20]
    assert run() == ([4] * 5, [8, 12, 16, 20])
    assert [ramp_length(t, 4, 100) for t in (1, 49, 50, 99, 100)] == [1, 1, 2, 2, 4]
    assert [ramp_length(t, 3, 7) for t in range(1, 8)] == [1, 1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_pending_host_work_is_what_the_weights_do_not_show_yet(accelerator):
    """``pending_host``, what an evaluation's metrics line reports: S = 4 with overlap,
    after step 5 the window 1-4's host step is in flight and the window 5 is open: two host
    updates, five steps of non-selected gradients; none once flushed."""
    model = ParamModel()
    zf = {"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step",
          "select_interval": 100, "overlap_step": True}  # fmt: skip
    grad_fn = make_grad_fn(5)
    seen = []
    with ZenFlowEngine(model, make_config(zf), host_kernel="reference", min_numel=100,
                       **engine_kw(accelerator)) as engine:  # fmt: skip
        for i in range(5):
            params = list(model.parameters())
            for p, g in zip(params, grad_fn(i, [p.detach().clone() for p in params]), strict=True):
                p.grad = g
            engine.step(1.0)
            engine.zero_grad()
            seen.append(engine.pending_host())
        engine.flush()
        flushed = engine.pending_host()
    assert seen[2] == {"host_updates": 1, "steps": 3}  # the open window only
    assert seen[3] == {"host_updates": 1, "steps": 4}  # 1-4 in flight, none open
    assert seen[4] == {"host_updates": 2, "steps": 5}
    assert flushed == {"host_updates": 0, "steps": 0}
