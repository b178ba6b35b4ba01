"""Streamed gradients (``zfctl.stream_grads``) give what the whole-gradient path gives.

With streaming, each gradient is routed by its post-accumulate-grad hook during backward
(``zenflow.engine.streaming``): the selected columns into the device buffer, the rest in
pieces to the host, and everything the step needs (column scores, the global norm, the
non-finite check, the auto-interval masses, micro-batch sums) is computed from those
pieces. Without it, the gradients stay whole until the optimizer step. Every case here runs
the same model, data and config both ways and compares element-wise.

What "the whole-gradient path" is depends on the device, and so does the tolerance:

- ``sim`` (strict): the non-streamed run routes every gradient at the start of the step by
  the same code the hooks run. Only the ORDER differs (hooks fire in backward order, the
  step routes in model order), and ZenFlow keeps its partial sums per weight and totals
  them in weight order, so the weights must be bit-identical (``torch.equal``) and the
  grad norm too, up to the float64 host sums of micro-batches, which are totalled in
  routing order (seen: 2e-16 relative; asserted: 1e-12). The offload mode stacks its
  per-gradient norms in routing order (fp32: about an ulp apart), so with clipping it
  takes the CPU tolerance below.
- ``cpu``: the non-streamed run is the zero-copy path (the whole gradient summed where
  autograd wrote it, per-tensor norms), a different implementation. Its parameter updates
  are bit-identical while no clipping is active (same fp32 sums, same AdamW op order). With
  clipping, the global norm is summed in another order (per-tensor norms there, per-piece
  squares here), so it and the clip coefficient may differ by about one ulp; see
  ``_assert_clipped_close`` for what that does to AdamW and the tolerance it needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from conftest import (
    ACCELERATORS,
    BETAS,
    EPS,
    LR,
    MLP,
    NATIVE_SKIP,
    WD,
    engine_kw,
    gpt2_batches,
    loss_of,
    make_config,
    mlp_batches,
    tiny_gpt2,
)

from zenflow import ZenFlowEngine

STEPS = 10
CLIP = 0.05  # the MLP's and tiny GPT-2's gradient norms are 2..4: clipping every step
ZF = {"topk_ratio": 0.1, "update_interval": 3, "overlap_step": True}
# (gradient_accumulation_steps, zfctl.grad_accumulation)
MICRO = [(1, "host"), (2, "host"), (2, "device")]
MICRO_IDS = ["gas1", "gas2-host", "gas2-device"]


@dataclass
class Run:
    """What one training run left: weights, per-step records, the schedule's decisions."""

    params: dict[str, torch.Tensor]
    init: dict[str, torch.Tensor]
    stats: list = field(default_factory=list)
    selections: list[list[torch.Tensor | None]] = field(default_factory=list)  # per step
    window_lengths: list[int] = field(default_factory=list)
    peak_grads: list[int] = field(default_factory=list)  # largest "grads" holder, per step
    peak_held: list[dict] = field(default_factory=list)  # holders at the step's peak
    resolved: dict = field(default_factory=dict)
    sel_elems: int = 0  # selected gradient elements (all ZenFlow weights)
    dense_numel: int = 0  # always-important parameters' elements
    zf_numels: list[int] = field(default_factory=list)  # each ZenFlow weight's elements
    sel_shares: list[int] = field(default_factory=list)  # each one's selected elements
    threads: int = 0  # the engine's training threads
    exact_norms: list[float] = field(default_factory=list)  # float64 norm of each step's grads


def _model(kind: str):
    if kind == "mlp":
        torch.manual_seed(0)
        return MLP()
    if kind == "mlp3":  # three equal 64x64 matrices: no single gradient dominates the model
        torch.manual_seed(0)
        return MLP(d_in=64, d_hidden=64, d_out=64)
    return tiny_gpt2()


def _batches(kind: str, steps: int):
    if kind == "gpt2":
        return gpt2_batches(steps, bs=2)
    d_out = 64 if kind == "mlp3" else 10
    return mlp_batches(steps, d_out=d_out, bs=8)


def _micro(batch, gas: int, m: int):
    """Micro-batch ``m`` of ``gas`` of a step's batch (equal slices)."""
    if isinstance(batch, tuple):
        n = batch[0].shape[0] // gas
        return tuple(t[m * n : (m + 1) * n] for t in batch)
    n = batch.shape[0] // gas
    return batch[m * n : (m + 1) * n]


def _poisoned(batch):
    """The MLP micro-batch with an inf in its input."""
    x = batch[0].clone()
    x[0, 0] = float("inf")
    return (x, *batch[1:])


def _run(
    accelerator: str,
    stream: bool,
    zf: dict | None = ZF,
    *,
    kind: str = "mlp",
    gas: int = 1,
    grad_acc: str = "host",
    clip: float = 0.0,
    mode: str = "zenflow",
    kernel: str = "reference",
    bf16: bool = False,
    steps: int = STEPS,
    poison: tuple[int, int] | None = None,
    poison_grad: bool = False,
    drop: int | None = None,
    min_numel: int = 1000,
    record_norm: bool = False,
) -> Run:
    """Train ``steps`` optimizer steps of ``gas`` micro-batches each (loss / gas, then one
    ``engine.step``). ``poison`` = (step, micro-batch): that micro-batch gets an inf in its
    input, or with ``poison_grad`` an inf in one non-selected column of fc1's gradient
    only; the step's loss given to the engine is the sum of its finite micro-batch losses
    (None if there is none), so a skip must come from the gradient check. ``drop``: leave
    that step's batch out. ``record_norm`` (one micro-batch): the float64 norm of every
    step's gradients as they become final (hooks that run before the engine's)."""
    model = _model(kind)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    sq = [0.0]
    if record_norm:
        assert gas == 1
        for p in model.parameters():  # registered first: run before the engine frees it
            p.register_post_accumulate_grad_hook(
                lambda p: sq.__setitem__(0, sq[0] + float(p.grad.double().square().sum()))
            )
    extra = {"zfctl": {"stream_grads": stream, "grad_accumulation": grad_acc}}
    if gas > 1:
        extra["gradient_accumulation_steps"] = gas
    if bf16:
        extra["bf16"] = {"enabled": True}
    cfg = make_config(zf, clip=clip, **extra)
    batches = _batches(kind, steps)
    out = Run(params={}, init=init)
    with ZenFlowEngine(model, cfg, mode=mode, host_kernel=kernel, min_numel=min_numel,
                       **engine_kw(accelerator)) as e:  # fmt: skip
        assert e.stream_grads is stream
        out.resolved = dict(e.resolved)
        out.sel_shares = [w.rows * w.k for w in e.zweights]
        out.sel_elems = sum(out.sel_shares)
        out.threads = e.training_threads
        out.dense_numel = sum(d.spec.param.numel() for d in e.dense)
        out.zf_numels = [w.spec.param.numel() for w in e.zweights]
        peak = _watch_grads(e)
        for i, batch in enumerate(batches):
            if i == drop:
                continue
            finite = []
            for m in range(gas):
                mb = _micro(batch, gas, m)
                bad = poison == (i, m) and not poison_grad
                hook = None
                if bad:
                    mb = _poisoned(mb)
                elif poison == (i, m):
                    hook = model.fc1.weight.register_hook(_inf_column(e.zweights[0]))
                with e.autocast():
                    loss = loss_of(model, mb) / gas
                e.backward(loss)
                if hook is not None:
                    hook.remove()
                if not bad:
                    finite.append(loss.detach())
            step_loss = torch.stack(finite).sum() if finite else None
            out.stats.append(e.step(step_loss))
            out.exact_norms.append(math.sqrt(sq[0]))
            sq[0] = 0.0
            out.peak_grads.append(peak.pop())
            out.peak_held.append(dict(e.last_peak_held))
            e.zero_grad()
            out.selections.append([None if w.sel_dev is None else w.sel_dev.clone()
                                   for w in e.zweights])  # fmt: skip
        out.window_lengths = list(e.window_lengths)
    out.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _inf_column(w):
    """A gradient hook (before accumulation) that puts an inf into the first column of
    ``w`` that is not selected (column 0 before the first selection)."""
    assert w.spec.name == "fc1.weight"
    col = 0
    if w.sel_host is not None:
        col = min(set(range(w.n_cols)) - set(w.sel_host.tolist()))

    def hook(g):
        g = g.clone()
        g.select(w.cd, col)[3] = float("inf")
        return g

    return hook


class _GradsPeak:
    """The largest "grads" holder of the device accounting between two ``pop`` calls: every
    gradient the device holds is accounted through ``Accelerator.track`` (the streamed ones
    by the hooks, the selected-gradient buffers at construction), so watching it catches
    the holder's own peak, not only its share at the moment of the total's peak."""

    def __init__(self, accel):
        self.accel = accel
        self.max = accel.held().get("grads", 0)

    def pop(self) -> int:
        m = max(self.max, self.accel.held().get("grads", 0))
        self.max = self.accel.held().get("grads", 0)
        return m


def _watch_grads(engine) -> _GradsPeak:
    accel = engine.accel
    peak = _GradsPeak(accel)
    track = accel.track

    def watched(t, tag):
        out = track(t, tag)
        if tag == "grads":
            peak.max = max(peak.max, accel.held().get("grads", 0))
        return out

    accel.track = watched
    return peak


# ---------------------------------------------------------------------------- assertions
def _assert_moved(run: Run) -> None:
    """Every parameter trained (a step that did nothing would pass the comparisons)."""
    for n, p in run.params.items():
        assert torch.isfinite(p).all(), n
        assert not torch.equal(p, run.init[n]), f"{n} did not move"


def _assert_equal(a: Run, b: Run) -> None:
    for n in a.params:
        assert torch.equal(a.params[n], b.params[n]), (
            f"{n}: max |diff| {(a.params[n].float() - b.params[n].float()).abs().max():.3g}"
        )


def _assert_clipped_close(a: Run, b: Run, lr: float = LR) -> None:
    """The CPU device with clipping (see the module docstring): the two norms are sums of
    the same squares in another order, equal to a few fp32 ulps, so the clip coefficients
    may differ by an ulp. For almost every element that is a relative change of ~1e-7 in
    its AdamW step. The exception: an element whose window-mean gradient is a near-total
    cancellation of larger per-step gradients (|mean| far below eps = 1e-8) takes an AdamW
    step of about lr * mean / eps, so an ulp of the larger terms moves it by up to
    lr * 1e-3 (seen: 1.1e-5 on the MLP, 2.4e-5 on tiny GPT-2 at lr 1e-2). Hence: at most
    lr * 5e-3 anywhere, and at most 1e-6 for all but 0.1% of the elements."""
    _assert_norms_close(a, b, rel=1e-6)
    total = off = 0
    for n in a.params:
        d = (a.params[n].float() - b.params[n].float()).abs()
        assert d.max() <= lr * 5e-3, f"{n}: max |diff| {d.max():.3g}"
        total += d.numel()
        off += int((d > 1e-6).sum())
    assert off <= 1e-3 * total, f"{off} of {total} elements differ by more than 1e-6"


def _assert_norms_close(a: Run, b: Run, rel: float) -> None:
    for i, (s, t) in enumerate(zip(a.stats, b.stats, strict=True)):
        if math.isfinite(t.grad_norm):
            assert s.grad_norm == pytest.approx(t.grad_norm, rel=rel, abs=0), f"step {i + 1}"
        else:
            assert not math.isfinite(s.grad_norm), f"step {i + 1}"


def _assert_same_run(
    a: Run, b: Run, accelerator: str, clipped: bool, norm_rel: float | None = None
) -> None:
    """Streamed ``a`` against whole-gradient ``b``: same skips, same windows, same
    selections at every step, same weights (tolerance: the module docstring)."""
    assert [s.skipped for s in a.stats] == [s.skipped for s in b.stats]
    assert [s.window_len for s in a.stats] == [s.window_len for s in b.stats]
    assert a.window_lengths == b.window_lengths
    for i, (sa, sb) in enumerate(zip(a.selections, b.selections, strict=True)):
        for x, y in zip(sa, sb, strict=True):
            assert (x is None and y is None) or torch.equal(x, y), f"selection at step {i + 1}"
    if accelerator == "sim" or not clipped:
        _assert_equal(a, b)
    else:
        _assert_clipped_close(a, b)
    if norm_rel is None:
        norm_rel = 1e-12 if accelerator == "sim" else 1e-6
    _assert_norms_close(a, b, rel=norm_rel)
    _assert_moved(a)


def _pair(accelerator: str, **kw) -> tuple[Run, Run]:
    streamed = _run(accelerator, True, **kw)
    whole = _run(accelerator, False, **kw)
    assert streamed.resolved["grad_path"].startswith("streamed during backward")
    return streamed, whole


# ---------------------------------------------------------------------------- ZenFlow
@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("grad_acc", ["host", "device"])
def test_micro_batches_streamed_equal_whole(accelerator, grad_acc):
    """Two micro-batches per step: summed on the host in fp32 (every micro-batch streams)
    or by autograd on the device (only the last one streams); the whole-gradient run sums
    them in the device gradient. fp32 sums of the same two terms: bit-identical."""
    a, b = _pair(accelerator, gas=2, grad_acc=grad_acc)
    _assert_same_run(a, b, accelerator, clipped=False)
    # "host" really routes every micro-batch: twice the device->host bytes of "device"
    # once the selection is made (steps 2.., where only non-selected columns travel)
    other = _run(accelerator, True, gas=2, grad_acc="device" if grad_acc == "host" else "host")
    ratio = [s.d2h_bytes / o.d2h_bytes for s, o in zip(a.stats[1:], other.stats[1:], strict=True)]
    expected = 2.0 if grad_acc == "host" else 0.5
    assert all(r == pytest.approx(expected, rel=0.05) for r in ratio), ratio


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("gas,grad_acc", MICRO, ids=MICRO_IDS)
def test_clipping_streamed_equals_whole(accelerator, gas, grad_acc):
    """The global norm from the streamed pieces (device partials, or the host's sums of the
    micro-batches) equals the whole gradient's, and clipping scales both paths alike."""
    a, b = _pair(accelerator, gas=gas, grad_acc=grad_acc, clip=CLIP)
    for s in a.stats:  # the clip coefficient clip / (norm + 1e-6) is < 1 on every step
        assert CLIP / (s.grad_norm + 1e-6) < 0.1, s.grad_norm
    _assert_same_run(a, b, accelerator, clipped=True)
    # and clipping changed the result (the comparison is not of two unclipped runs)
    unclipped = _run(accelerator, True, gas=gas, grad_acc=grad_acc)
    assert not torch.equal(a.params["fc1.weight"], unclipped.params["fc1.weight"])


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("gas,grad_acc", MICRO, ids=MICRO_IDS)
def test_reselection_streamed_equals_whole(accelerator, gas, grad_acc):
    """Re-selection every 2 steps (at the next window end: steps 3, 6, 9): the column
    scores come from the selected buffer and the pieces (or the host's micro-batch sums);
    they select the same columns as the whole gradient's scores at every step."""
    zf = {**ZF, "select_strategy": "step", "select_interval": 2}
    a, b = _pair(accelerator, zf=zf, gas=gas, grad_acc=grad_acc)
    _assert_same_run(a, b, accelerator, clipped=False)
    # the selection really changed after the first one, in both runs
    assert sum(s.selection_changed for s in a.stats[1:]) > 0
    for run in (a, b):
        changed = [
            i for i in range(1, STEPS)
            if any(not torch.equal(x, y) for x, y in
                   zip(run.selections[i], run.selections[0], strict=True))
        ]  # fmt: skip
        assert changed, "no re-selection changed a column"


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("gas,grad_acc", MICRO, ids=MICRO_IDS)
def test_auto_interval_streamed_equals_whole(accelerator, gas, grad_acc):
    """update_interval "auto": the window-ending vote from the streamed masses (device
    column scores of the pieces, or the host's micro-batch sums) ends the same windows."""
    a, b = _pair(accelerator, zf={**ZF, "update_interval": "auto"}, gas=gas, grad_acc=grad_acc,
                 steps=12)  # fmt: skip
    _assert_same_run(a, b, accelerator, clipped=False)
    # the vote fired (windows well below the bound) with more than one length
    assert len(a.window_lengths) >= 3 and max(a.window_lengths) < 64
    assert len(set(a.window_lengths)) > 1, a.window_lengths


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("gas,grad_acc", MICRO, ids=MICRO_IDS)
@pytest.mark.parametrize("bad_step", [0, 4], ids=["first-selection", "mid-window"])
@pytest.mark.parametrize("where", ["input", "nonselected-grad"])
def test_nonfinite_step_skipped_alike(accelerator, gas, grad_acc, bad_step, where):
    """An inf in the first micro-batch's input, or in a single element of one non-selected
    column of fc1's gradient (so only the pieces that go to the host carry it): the loss
    given to the step is finite (the clean micro-batches', or none), so the skip comes from
    the streamed gradient's check. Both runs skip that step and only it; what they leave
    equals a run that never saw that batch (a skipped step changes nothing). Step 0 is the
    first selection (whole gradients to the host), step 4 a split step with a host step in
    flight."""
    kw = dict(gas=gas, grad_acc=grad_acc, poison=(bad_step, 0),
              poison_grad=where == "nonselected-grad")  # fmt: skip
    a, b = _pair(accelerator, **kw)
    for run in (a, b):
        assert [s.skipped for s in run.stats] == [i == bad_step for i in range(STEPS)]
        bad = run.stats[bad_step]
        assert not math.isfinite(bad.grad_norm)
        assert (bad.loss is None) == (gas == 1 and where == "input")
        assert bad.loss is None or math.isfinite(bad.loss)
    _assert_same_run(a, b, accelerator, clipped=False)
    without = _run(accelerator, True, gas=gas, grad_acc=grad_acc, drop=bad_step)
    _assert_equal(a, without)


# ---------------------------------------------------------------------------- bf16, GPT-2
@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("kind", ["mlp", "gpt2"])
@pytest.mark.parametrize(
    "bf16",
    [False, True],
    ids=["fp32", "bf16"],
)
def test_grad_norm_is_the_whole_gradients_norm(accelerator, kind, bf16):
    """StepStats.grad_norm, streamed and not, is the norm of every gradient of the step
    (as held: fp32, or bf16), against float64 sums of squares taken by hooks that run
    before the engine's: equal up to fp32 summation (1e-5), so streamed and whole-gradient
    clipping coefficients agree."""
    kw = dict(zf={**ZF, "select_strategy": "step", "select_interval": 2}, kind=kind,
              bf16=bf16, steps=7, record_norm=True)  # fmt: skip
    a, b = _pair(accelerator, **kw)
    for run in (a, b):
        for i, (s, exact) in enumerate(zip(run.stats, run.exact_norms, strict=True)):
            assert s.grad_norm == pytest.approx(exact, rel=1e-5), f"step {i + 1}"
    _assert_norms_close(a, b, rel=1e-5)


@pytest.mark.parametrize(
    "accelerator,clip", [("cpu", 0.0), ("sim", 0.0), ("sim", CLIP)], ids=["cpu", "sim", "sim-clip"]
)
def test_bf16_gpt2_streamed_equals_whole(accelerator, clip):
    """bf16 weights and gradients, tiny GPT-2 (tied embedding, Conv1D weights) and a
    re-selection: bit-identical. With clipping on sim too. Not compared: clipping on the
    cpu device, where the whole-gradient path scales the bf16 gradient in place (the
    product rounded to bf16) and the streamed path scales its pieces in fp32 on the host:
    different roundings by design."""
    zf = {**ZF, "select_strategy": "step", "select_interval": 2}
    a, b = _pair(accelerator, zf=zf, kind="gpt2", bf16=True, clip=clip, steps=7)
    assert all(p.dtype == torch.bfloat16 for p in a.params.values())
    _assert_same_run(a, b, accelerator, clipped=clip > 0)
    assert sum(s.selection_changed for s in a.stats[1:]) > 0


def test_bf16_micro_batches_on_device_equal_whole_on_sim():
    """bf16, two micro-batches summed by autograd (grad_accumulation "device"): the
    streamed run routes the same bf16 sum the whole-gradient run does. (With "host" the
    streamed run sums the bf16 micro-batch gradients in fp32 on the host, while the
    whole-gradient run can only route autograd's bf16 sum: a precision difference by
    design, not compared.)"""
    a, b = _pair("sim", gas=2, grad_acc="device", bf16=True, clip=CLIP)
    _assert_same_run(a, b, "sim", clipped=True)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_gpt2_streamed_equals_whole(accelerator):
    """tiny GPT-2 in fp32 (tied embedding, Conv1D weights, columns on both axes), two
    micro-batches summed on the host and a re-selection."""
    zf = {**ZF, "select_strategy": "step", "select_interval": 2}
    a, b = _pair(accelerator, zf=zf, kind="gpt2", gas=2, steps=7)
    _assert_same_run(a, b, accelerator, clipped=False)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_native_kernel_streamed_equals_whole(accelerator):
    """The native host ops (accumulate, compact AdamW) on the streamed side against the
    native full-shape ops (cpu) or the same ops at the step (sim)."""
    if NATIVE_SKIP:
        pytest.skip(NATIVE_SKIP)
    zf = {**ZF, "select_strategy": "step", "select_interval": 2}
    a, b = _pair(accelerator, zf=zf, gas=2, kernel="native")
    _assert_same_run(a, b, accelerator, clipped=False)


# ---------------------------------------------------------------------------- AdamW
def _adamw(kind: str, steps: int, gas: int, clip: float, threads: int):
    """torch.optim.AdamW (single-tensor) over the same micro-batches: ``gas`` backward
    passes of loss / gas, clip_grad_norm_, one step."""
    model = _model(kind)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                weight_decay=WD, foreach=False)  # fmt: skip
        for batch in _batches(kind, steps):
            for m in range(gas):
                (loss_of(model, _micro(batch, gas, m)) / gas).backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(before)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("gas,grad_acc", MICRO, ids=MICRO_IDS)
def test_topk1_streamed_equals_adamw(accelerator, gas, grad_acc):
    """Every column selected: nothing goes to the host, the streamed gradient is the
    whole gradient in the device buffer, and the device AdamW (the reference: torch's
    single-tensor op order) is torch.optim.AdamW's, bit for bit."""
    zf = {"topk_ratio": 1.0, "update_interval": 3, "overlap_step": True}
    a = _run(accelerator, True, zf=zf, gas=gas, grad_acc=grad_acc)
    assert all(s.d2h_bytes == 0 for s in a.stats[1:])  # nothing left the device after step 1
    ref = _adamw("mlp", STEPS, gas, 0.0, a.threads)
    for n, p in a.params.items():
        assert torch.equal(p, ref[n]), n
    _assert_moved(a)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("gas,grad_acc", MICRO, ids=MICRO_IDS)
@pytest.mark.parametrize("clip", [0.0, CLIP], ids=["noclip", "clip"])
def test_offload_streamed_equals_whole_and_adamw(accelerator, gas, grad_acc, clip):
    """ZeRO-Offload (every gradient to the host, CPU AdamW): streamed equals the whole-
    gradient run (cpu: the zero-copy path) and torch.optim.AdamW. Bit-identical without
    clipping; with it, the norms' order differs on both devices (see the module docstring).
    Against AdamW the host kernel's op order differs from torch's (a valid reordering of
    the same arithmetic), so 2e-6 as test_equivalence.py's offload case, and with clipping
    the norm's order too (clip_grad_norm_: per tensor), so ``_assert_clipped_close``'s
    bound."""
    a, b = _pair(accelerator, zf=None, mode="offload", gas=gas, grad_acc=grad_acc, clip=clip)
    assert [s.skipped for s in a.stats] == [s.skipped for s in b.stats] == [False] * STEPS
    if clip == 0:
        _assert_equal(a, b)
        _assert_norms_close(a, b, rel=1e-6)
    else:
        _assert_clipped_close(a, b)
    _assert_moved(a)
    if clip:
        assert all(CLIP / (s.grad_norm + 1e-6) < 0.1 for s in a.stats)
    ref = _adamw("mlp", STEPS, gas, clip, a.threads)
    atol = 2e-6 if clip == 0 else LR * 5e-3
    for n, p in a.params.items():
        torch.testing.assert_close(p, ref[n], atol=atol, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------------------- device memory
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_device_never_holds_a_whole_model_gradient_on_sim(bf16):
    """A model of three equal 64x64 matrices (plus biases and a LayerNorm): at no moment of
    a step (backward included) does the device hold more gradient than the selected
    columns' buffers, the always-important parameters' gradients, one whole gradient in
    flight (the one its hook is routing) and, in bf16, the fp32 scratch of the selected
    columns' update. Without streaming it holds the whole model's gradient."""
    a = _run("sim", True, kind="mlp3", bf16=bf16, steps=6)
    b = _run("sim", False, kind="mlp3", bf16=bf16, steps=6)
    _assert_equal(a, b)
    size = 2 if bf16 else 4
    whole = (sum(a.zf_numels) + a.dense_numel) * size
    assert len(a.zf_numels) == 3 and a.dense_numel < 0.05 * sum(a.zf_numels)
    expected = (a.sel_elems + a.dense_numel + max(a.zf_numels)) * size
    if bf16:  # the fp32 scratch of the device update: the largest selected share
        expected += max(a.sel_shares) * 4
    for i, (peak, held) in enumerate(zip(a.peak_grads, a.peak_held, strict=True)):
        # seen: exactly this; 2% leaves room for a small buffer accounted as "grads"
        assert peak == pytest.approx(expected, rel=0.02), (i, peak, expected, held)
        assert held.get("grads", 0) <= peak
        assert a.stats[i].device_peak_bytes == sum(held.values())
    assert max(a.peak_grads) < 0.6 * whole
    for peak in b.peak_grads:  # the whole-gradient path: every gradient until the step
        assert peak >= whole
    # and the device's total peak (weights, optimizer state, buffers) is lower for it
    assert max(s.device_peak_bytes for s in a.stats) < min(s.device_peak_bytes for s in b.stats)


@pytest.mark.parametrize("by_rows", [True, False], ids=["rows", "columns"])
def test_a_large_pieces_column_scores_are_taken_in_chunks(monkeypatch, by_rows):
    """A piece's column scores (re-selection, auto interval) are ``column_scores``'s: in
    chunks of rows, so a 48M-element piece never widens whole to fp32 twice over, and
    equal to the plain sum of squares to fp32 rounding."""
    from types import SimpleNamespace

    from zenflow.engine import selection
    from zenflow.engine.copies import Piece
    from zenflow.engine.zenflow.route import GradRoute

    monkeypatch.setattr(selection, "SCORE_CHUNK", 64)  # 1,200 elements: many chunks
    widened = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float",
                        lambda t: widened.append(t.numel()) or real_float(t))  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    bucket = torch.randn(40, 30, generator=gen).to(torch.bfloat16)
    w = SimpleNamespace(scores_ns=None, n_nonsel=30 if by_rows else 50)
    pc = Piece(0, 40, True, (40, 30)) if by_rows else Piece(5, 45, False, (40, 30))
    GradRoute._score_piece(None, w, pc, bucket)
    assert widened and max(widened) <= 64
    plain = real_float(bucket).square()
    if by_rows:
        torch.testing.assert_close(w.scores_ns, plain.sum(dim=0), rtol=1e-6, atol=0)
    else:
        torch.testing.assert_close(w.scores_ns[5:45], plain.sum(dim=1), rtol=1e-6, atol=0)
        assert not w.scores_ns[:5].any() and not w.scores_ns[45:].any()
