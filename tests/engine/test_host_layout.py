"""The host side of a ZenFlow run, byte by byte (issue 27): the host holds only the
non-selected columns, in the compact layout, in both host states; a checkpoint copies none
of it; pinned memory is what was asked for; the first selection lands no whole gradient.

Every figure is the accelerator's host accounting (``Accelerator.host_held``: bytes per
holder as allocated through it), checked against the layout's formula per ZenFlow weight
(N non-selected elements, n non-selected columns, dt the link's bytes):

| holder | exact | compact |
|---|---|---|
| host_state | 4N master + 8N moments + 8n counts | 4N + 2N codes + 8 ceil(N/256) scales + 8n |
| window_sums | 4N (fp32) | 2N (bf16) |
| step_pieces | dt N (the training dtype) | 2N (bf16) |
| link | ring: max(4, copy buckets) x bucket x dt | the same in bf16 |
"""

from __future__ import annotations

import io

import pytest
import torch
from conftest import gpt2_batches, make_config, tiny_gpt2, train_engine

from zenflow import ZenFlowEngine
from zenflow.engine import EngineError

ZF = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True,
      "select_strategy": "step", "select_interval": 4}  # fmt: skip


def _engine(state: str, bf16: bool, warm_up: int = 0, clip: float = 0.0, **extra):
    model = tiny_gpt2()
    cfg = make_config({**ZF, "full_warm_up_rounds": warm_up}, clip=clip,
                      bf16={"enabled": bf16}, zfctl={"host_state": state, **extra})  # fmt: skip
    return model, ZenFlowEngine(model, cfg, accelerator="sim", sim_strict=True,
                                host_kernel="reference")  # fmt: skip


def _expected(engine, state: str, bf16: bool) -> dict[str, int]:
    """The layout's bytes per holder, summed over the ZenFlow weights."""
    link = 2 if state == "compact" or bf16 else 4
    out = {"host_state": 0, "window_sums": 0, "step_pieces": 0}
    for w in engine.zweights:
        big_n, n = w.compact_numel, w.n_nonsel
        if state == "exact":
            out["host_state"] += 12 * big_n + 8 * n
            out["window_sums"] += 4 * big_n
        else:
            out["host_state"] += 6 * big_n + 8 * -(-big_n // 256) + 8 * n
            out["window_sums"] += 2 * big_n
        out["step_pieces"] += link * big_n
    return out  # no staging ring: the pieces land in the step store


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state", ["exact", "compact"])
def test_host_holds_the_compact_layout(state, bf16):
    """After the first selection and after windows end (a host step in flight, its result
    applied), the host holds the layout's bytes exactly: no full-shape master or moments,
    no image of the result, no landing, no masters left from set-up. Per parameter of the
    ZenFlow weights (k = 0.1: ~0.9 of each weight non-selected): exact 16 (1-k) + dt (1-k),
    compact 8 (1-k) + 2 (1-k) and the scales."""
    model, e = _engine(state, bf16)
    with e:
        train_engine(e, model, gpt2_batches(1))  # the first selection
        assert e.accel.host_held() == _expected(e, state, bf16)
        train_engine(e, model, gpt2_batches(4, seed=2))  # windows end at 2 and 4
        assert e.accel.host_held() == _expected(e, state, bf16)
        zparams = sum(w.spec.param.numel() for w in e.zweights)
        per_param = (
            sum(_expected(e, state, bf16)[k] for k in ("host_state", "window_sums", "step_pieces"))
            / zparams
        )
        keep = sum(w.compact_numel for w in e.zweights) / zparams
        dt = 2 if state == "compact" or bf16 else 4
        assert per_param == pytest.approx((16 if state == "exact" else 8) * keep + dt * keep,
                                          rel=0.03)  # fmt: skip
        assert e.accel.host_peak_bytes() >= sum(e.accel.host_held().values())


@pytest.mark.parametrize("state", ["exact", "compact"])
def test_a_checkpoint_copies_no_host_state(state):
    """A checkpoint mid-window with a host step in flight (``share_host``, every checkpoint
    of a run): saving it allocates nothing through the engine, and every host tensor it
    holds IS the live one (the compact master, moments, counts and window sum)."""
    model, e = _engine(state, bf16=False)
    with e:
        train_engine(e, model, gpt2_batches(5))  # windows end at 2 and 4, step 5 in a window
        assert e.impl.inflight is not None and e.impl.window_len == 1
        held, peak = e.accel.host_held(), e.accel.host_peak_bytes()
        sd = e.state_dict(share_host=True)
        torch.save(sd, io.BytesIO())
        assert e.accel.host_held() == held and e.accel.host_peak_bytes() == peak
        live = sd["zenflow"]["weights"]
        shared = 0
        for w in e.zweights:
            h = live[w.spec.name]["host"]
            assert h["layout"] == "compact"
            tensors = {"master": w.host.master, "steps": w.host.steps.counts,
                       **w.host.moment_tensors()}  # fmt: skip
            if not w.fresh[e.impl.slot]:
                tensors["grad_accum_sum"] = w.acc[e.impl.slot]
            for key, t in tensors.items():
                assert h[key].data_ptr() == t.data_ptr(), (w.spec.name, key)
                shared += 1
            # the window sum in the compact layout, never a full-shape fp32 temporary
            if h["grad_accum_sum"] is not None:
                assert h["grad_accum_sum"].numel() == w.compact_numel
        assert shared >= 5 * len(e.zweights)


@pytest.mark.parametrize("state,store", [("exact", "on"), ("compact", "on"), ("exact", "q8")])
def test_the_host_state_is_released_before_the_final_save(state, store):
    """At the end of a run (flushed, checkpointed) ``release_host_state`` drops the host
    state, the window sums and the step store (q8: its 8-bit copies): the final model
    save's host copies never sit beside them (issue 27: the final save was the compact
    state's host peak). The weights are the flushed ones, and the engine refuses a
    checkpoint afterwards."""
    model, e = _engine(state, bf16=False, clip=1.0, step_store=store)
    train_engine(e, model, gpt2_batches(5))
    e.flush()
    flushed = {n: p.detach().clone() for n, p in model.named_parameters()}
    held = e.accel.host_held()
    assert held["host_state"] > 0 and held["window_sums"] > 0 and held["step_pieces"] > 0
    e.release_host_state()
    left = e.accel.host_held()
    for tag in ("host_state", "window_sums", "step_pieces"):
        assert left.get(tag, 0) == 0, (tag, left)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), flushed[n]), n
    with pytest.raises(EngineError, match="released"):
        e.state_dict(share_host=True)
    e.close()  # the trainer closes it again: a no-op


def test_pinned_bytes_are_what_was_asked():
    """On sim every pinned buffer of the zenflow mode is modelled as registered memory:
    what is locked is what was asked (the compact masters, the step store the pieces land
    in, the one read buffer a hand-over's and a checkpoint's reads go through), nothing
    comes from a caching pinned allocator."""
    model, e = _engine("exact", bf16=True)
    with e:
        train_engine(e, model, gpt2_batches(6))  # re-selection at step 6 (4 + window end)
        assert any(s > 1 for s in e.selection_steps)
        e.state_dict()  # a copying checkpoint: device tensors through the read buffer
        pinned = e.accel.pinned_held()
        masters = sum(4 * w.compact_numel for w in e.zweights)
        store = sum(2 * w.compact_numel for w in e.zweights)  # bf16 pieces
        read_buffer = max(4 * e.impl.bucket_elems, 1 << 20)  # one fp32 bucket, >= 1 MiB
        assert pinned == {"host_state": masters, "step_pieces": store,
                          "read_buffer": read_buffer}  # fmt: skip
        assert e.accel.pinned_bytes() == sum(pinned.values())
        assert e.accel.caching_pinned_bytes() == 0


def _landing_allocs(engine) -> list[int]:
    """Record the bytes of every host allocation tagged "landing" (whole gradients)."""
    seen: list[int] = []
    host_empty = engine.accel.host_empty

    def spy(shape, dtype=torch.float32, pin=False, tag="host"):
        t = host_empty(shape, dtype, pin, tag)
        if tag == "landing":
            seen.append(t.numel() * t.element_size())
        return t

    engine.accel.host_empty = spy
    return seen


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_first_selection_in_the_hooks_lands_no_whole_gradient(bf16):
    """Streamed, one micro-batch a step: the first selection is made in each gradient's
    hook, so no whole gradient ever lands on the host; the masters taken at set-up are
    consumed by it (none for fp32: the device weight holds them). With micro-batches summed
    on the host the whole-gradient path still lands them (the spy sees it)."""
    model, e = _engine("exact", bf16)
    landed = _landing_allocs(e)
    with e:
        before = e.accel.host_held().get("masters", 0)
        assert (before > 0) == bf16
        train_engine(e, model, gpt2_batches(3))
        assert e.selection_steps == [1]
        assert landed == [] and "masters" not in e.accel.host_held()
    model = tiny_gpt2()
    cfg = make_config(ZF, bf16={"enabled": bf16}, gradient_accumulation_steps=2)
    with ZenFlowEngine(model, cfg, accelerator="sim", host_kernel="reference") as e:
        landed = _landing_allocs(e)
        for batch in gpt2_batches(2):
            for half in (batch[:1], batch[1:]):
                with e.autocast():
                    loss = model(input_ids=half, labels=half).loss / 2
                e.backward(loss)
            e.step(loss)
            e.zero_grad()
        assert len(landed) == len(e.zweights)  # the first step's, freed after it
        assert "landing" not in e.accel.host_held()


@pytest.mark.parametrize("state", ["exact", "compact"])
def test_a_re_selection_re_lays_the_host_state_in_place(state):
    """A re-selection (steps 4 and 8 here) moves columns between the sides without a new
    host array: every weight keeps the storages of its master, moments and counts (a pinned
    master is not registered again), and the host's accounted peak does not grow by a
    weight's state (the old re-layout allocated the new arrays beside the old ones)."""
    model, e = _engine(state, bf16=False)
    with e:
        train_engine(e, model, gpt2_batches(3))  # the first selection, a window end at 2
        fields = ("master", "m_codes", "u_codes") if state == "compact" else \
            ("master", "exp_avg", "exp_avg_sq")  # fmt: skip
        ptrs = {w.spec.name: [getattr(w.host, f).data_ptr() for f in fields]
                + [w.host.steps.counts.data_ptr()] for w in e.zweights}  # fmt: skip
        peak, read = e.accel.host_peak_bytes(), e.accel.host_held().get("read_buffer", 0)
        moved = 0
        for stats in train_engine(e, model, gpt2_batches(6, seed=3)):  # steps 4..9
            moved += stats.selection_changed
        assert moved > 0  # columns did change sides
        for w in e.zweights:
            now = [getattr(w.host, f).data_ptr() for f in fields]
            assert now + [w.host.steps.counts.data_ptr()] == ptrs[w.spec.name], w.spec.name
        # the one read buffer grows to what the leaving columns need (kept: steady state)
        grown = e.accel.host_held().get("read_buffer", 0) - read
        assert e.accel.host_peak_bytes() == peak + grown


@pytest.mark.parametrize("state", ["exact", "compact"])
@pytest.mark.parametrize(("kernel", "warm_up"), [("merge", 0), ("gather", 1)])
def test_the_native_merge_re_lays_as_the_reference_does(state, kernel, warm_up):
    """The same run with one host kernel native and by its PyTorch reference (everything
    else the reference ops): the hand-over's re-layout (``compact_merge_``), or the host's
    column gathers (``gather_columns_``: the first selection compacting warm-up's
    full-shape state and the whole gradients, the entering columns). After re-selections
    that moved columns, every weight's host state is bit for bit the same (both only move
    values)."""
    import dataclasses

    from zenflow import ops

    def run(op):
        model, e = _engine(state, bf16=False, warm_up=warm_up)
        with e:
            e.impl.kernels = dataclasses.replace(e.impl.kernels, **{kernel: op})
            stats = train_engine(e, model, gpt2_batches(9, seed=3))
            e.impl.drain()  # step 8's host step is in flight: read its result, not its middle
            fields = ("master", "m_codes", "m_scales", "u_codes", "u_scales") \
                if state == "compact" else ("master", "exp_avg", "exp_avg_sq")  # fmt: skip
            host = {w.spec.name: [getattr(w.host, f).clone() for f in fields]
                    + [w.host.steps.counts.clone()] for w in e.zweights}  # fmt: skip
        return sum(s.selection_changed for s in stats[1:]), host

    ops.load_native()
    reference, native = {
        "merge": (ops.compact_merge_reference_, ops.compact_merge_),
        "gather": (ops.gather_columns_reference_, ops.gather_columns_),
    }[kernel]
    moved, want = run(reference)
    moved_native, got = run(native)
    assert moved > 0 and moved_native == moved
    for name, tensors in want.items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, got[name], strict=True)), name


def _moment_arrays(e) -> list[tuple]:
    """Records (dtype, element count) of every host array ``e`` allocates as
    ``moments_fp32`` (the arrays 8-bit moments pass through) from now on."""
    made: list[tuple] = []
    plain = e.accel.host_empty

    def host_empty(shape, dtype=torch.float32, pin=False, tag="host"):
        t = plain(shape, dtype, pin, tag)
        if tag == "moments_fp32":
            made.append((t.dtype, t.numel()))
        return t

    e.accel.host_empty = host_empty
    return made


@pytest.mark.parametrize("warm_up", [0, 1], ids=["first-in-hooks", "first-from-warm-up"])
def test_a_selection_passes_every_weights_moments_through_one_pair_of_arrays(warm_up, monkeypatch):
    """The compact state's moments go through fp32 at every selection (the first, from
    the hooks or from warm-up's whole gradients, and each re-selection). The hand-over
    takes one pair of fp32 arrays of the largest weight's size (and one float64 chunk for the
    square root) for the whole selection (``q8_state.MomentScratch``), not two arrays per
    weight of every size, whose freed holes the C heap kept resident; they are gone after
    it. The weights are bit for bit those of the same run with an array pair of its own
    per weight."""
    from zenflow.engine.zenflow.q8_state import MomentScratch
    from zenflow.ops.q8_reference import SQRT_CHUNK

    def run(scratch: bool) -> tuple[dict, list[int], int, int]:
        if not scratch:
            monkeypatch.setattr(MomentScratch, "pair", lambda self, shape: None)
        model, e = _engine("compact", False, warm_up=warm_up)
        with e:
            made = _moment_arrays(e)
            train_engine(e, model, gpt2_batches(9, seed=3))
            assert "moments_fp32" not in e.accel.host_held()
            largest = max(w.compact_numel for w in e.zweights)
            selections = e.impl.handover.selections
        monkeypatch.undo()
        return {k: v.clone() for k, v in model.state_dict().items()}, made, largest, selections

    weights, made, largest, selections = run(scratch=True)
    assert selections >= 2  # the first and a re-selection at least
    wide = (torch.float64, min(largest, SQRT_CHUNK))  # the square root's chunk
    assert made == [(torch.float32, largest), (torch.float32, largest), wide] * selections
    plain_weights, plain_made, _, _ = run(scratch=False)
    assert len(plain_made) > len(made)  # a pair per weight (re-selections: two per weight)
    for k, v in weights.items():
        assert torch.equal(v, plain_weights[k]), k
