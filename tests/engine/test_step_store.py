"""``zfctl.step_store`` "off": each streamed piece is added into its window sum as it arrives
(through the staging ring), unclipped, and no step store exists; and "q8", which adds it
as it arrives too, scaled by the previous step's coefficient and corrected from an 8-bit
copy once the step's own is known (its arithmetic, element for element: ``test_step_q8``).

- q8: without clipping, and with clipping that never bites, the store's weights bit for
  bit; with clipping, the first windows' sums are the store's within 0.6%, where "off"'s
  are more than ten times further; its copies are the bytes the layout counts.

- Without clipping and with no non-finite step it trains the same weights as the store, bit
  for bit, in both host states and both training dtypes: the same adds, in the same order,
  by 1.0. So it does with clipping that never bites.
- With clipping, the window's host step scales its sum by the smallest coefficient of the
  window's steps: with one-step windows that is the store's per-step clipping, bit for bit
  (the exact state); with longer ones each host step's scale is that minimum over the
  window's length, from the steps' own norms.
- Its host holds no step store, only the ring, and the estimate's layout says the same.
- A non-finite step is still skipped on the device; on the host its non-finite piece is
  zeroed before it crosses, so the window sums and the host state stay finite and the run
  goes on.
- The config refuses it with micro-batches summed on the host.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_batches, loss_of, make_config, tiny_gpt2, train_engine

from zenflow import ZenFlowEngine
from zenflow.config import ConfigError, load_config
from zenflow.engine.global_norm import clip_coefficient
from zenflow.engine.zenflow import window as window_room
from zenflow.hardware import layout
from zenflow.hardware.census import census_of
from zenflow.ops import i8_num_blocks
from zenflow.ops.reference import corrected_sum_reference

ZF = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True,
      "select_strategy": "step", "select_interval": 4}  # fmt: skip


def _engine(state: str, bf16: bool, store: str, clip: float = 0.0, **zf):
    model = tiny_gpt2()
    cfg = make_config({**ZF, **zf}, clip=clip, bf16={"enabled": bf16},
                      zfctl={"host_state": state, "step_store": store})  # fmt: skip
    return model, ZenFlowEngine(model, cfg, accelerator="sim", sim_strict=True,
                                host_kernel="reference")  # fmt: skip


def _host_arrays(e, sums: bool = True) -> dict[str, list[torch.Tensor]]:
    out = {}
    for w in e.zweights:
        h = w.host
        fields = [h.master, h.steps.counts]
        fields += [h.m_codes, h.m_scales, h.u_codes, h.u_scales] if hasattr(h, "m_codes") \
            else [h.exp_avg, h.exp_avg_sq]  # fmt: skip
        out[w.spec.name] = [t.clone() for t in fields] + ([a.clone() for a in w.acc] if sums
                                                          else [])  # fmt: skip
    return out


def _on_and_off(state: str, bf16: bool, clip: float = 0.0, sums: bool = True,
                stores=("on", "off"), **zf):  # fmt: skip
    """The same 10 steps with the step store and without (``stores``: "on" and the other):
    (stats, host bytes held, host arrays, parameters) of each."""
    runs = {}
    for store in stores:
        model, e = _engine(state, bf16, store, clip, **zf)
        with e:
            stats = train_engine(e, model, gpt2_batches(10, seed=3))  # re-selections at 4, 8
            e.impl.drain()
            held = e.accel.host_held()
            host = _host_arrays(e, sums)
            params = [p.detach().clone() for p in model.parameters()]
        runs[store] = (stats, held, host, params)
    return runs[stores[0]], runs[stores[1]]


def _assert_same_training(on, off) -> None:
    (st_on, _, host_on, p_on), (st_off, _, host_off, p_off) = on, off
    assert sum(s.selection_changed for s in st_on) > 0  # columns did move
    assert [s.loss for s in st_on] == [s.loss for s in st_off]
    assert all(torch.equal(a, b) for a, b in zip(p_on, p_off, strict=True))
    for name, arrays in host_on.items():
        assert all(torch.equal(a, b) for a, b in zip(arrays, host_off[name], strict=True)), name


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state", ["exact", "compact"])
@pytest.mark.parametrize("store", ["off", "q8"])
def test_without_clipping_off_and_q8_train_what_the_store_trains_bit_for_bit(store, state,
                                                                            bf16):  # fmt: skip
    on, other = _on_and_off(state, bf16, stores=("on", store))
    _assert_same_training(on, other)
    held_on, held = on[1], other[1]
    # the store is gone (q8 without clipping: nothing to correct, no copy); the ring took
    # its place, a few buckets long
    assert held_on["step_pieces"] > 0 and "step_pieces" not in held
    assert 0 < held["link"] < held_on["step_pieces"]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("store", ["off", "q8"])
def test_with_clipping_that_never_bites_off_and_q8_are_the_store_bit_for_bit(store, bf16):
    on, other = _on_and_off("compact", bf16, clip=1e9, stores=("on", store))
    assert all(s.grad_norm < 1e9 for s in on[0])
    _assert_same_training(on, other)
    if store == "q8":  # the 8-bit copies: 1 byte an element and 4 per 256, in the place of
        # the store's 2 (the compact state's bf16 link); after 3 steps (the 10 steps' last
        # re-selection dropped them)
        model, e = _engine("compact", bf16, "q8", clip=1e9)
        with e:
            train_engine(e, model, gpt2_batches(3, seed=3))
            held = e.accel.host_held()["step_pieces"]
            n = sum(w.compact_numel for w in e.zweights)
            blocks = sum(i8_num_blocks(pc.numel) for w in e.zweights for pc in w.pieces)
        assert held == n + 4 * blocks
        assert held < on[1]["step_pieces"] / 1.9


def _host_step_sums(store: str, monkeypatch) -> list[torch.Tensor]:
    """Each host step's mean window sum as its kernel reads it (after the adds queued
    before it: ``before``), clipped, over 6 steps of 2-step windows clipped at every step."""
    got = []
    real = window_room.run_host_tasks

    def read(t) -> torch.Tensor:  # the sum, with the q8 store's folded correction
        g = t.grad.reshape(-1).float()
        if t.correction is not None:
            c = t.correction
            g = corrected_sum_reference(g, c["corr_codes"], c["corr_scales"],
                                        c["corr_starts"], c["corr_delta"])  # fmt: skip
        return g * t.grad_scale

    def spy(tasks, kernels, lr, hp, nt, job, before):
        if before is not None:
            before()
        got.append(torch.cat([read(t) for t in tasks]))
        return real(tasks, kernels, lr, hp, nt, job, before)

    monkeypatch.setattr(window_room, "run_host_tasks", spy)
    model, e = _engine("exact", False, store, clip=0.05, select_interval=100)
    with e:
        train_engine(e, model, gpt2_batches(6, seed=3))
        e.impl.drain()
        assert e.impl.resolved()["host_clipping"] == {"on": "step", "off": "window",
                                                      "q8": "step-q8"}[store]  # fmt: skip
    return got


@pytest.mark.parametrize("state", ["exact", "compact"])
@pytest.mark.parametrize("kernel", ["native", "reference"])
def test_q8_window_ends_fold_their_last_correction_into_the_cpu_adam(kernel, state,
                                                                     monkeypatch):  # fmt: skip
    """Each window's last q8 correction goes into the host step's CPU Adam
    (``Q8StepStore.flush(fold=True)``) instead of a pass over the sum: the same weights,
    bit for bit, as with the passes, over 10 steps with clipping at every step and
    re-selections (both host states, native and reference kernels)."""
    from zenflow.engine.zenflow.step_q8 import Q8StepStore

    def train(fold: bool):
        if not fold:
            monkeypatch.setattr(Q8StepStore, "can_fold", property(lambda self: False))
        model = tiny_gpt2()
        cfg = make_config(ZF, clip=0.05, bf16={"enabled": False},
                          zfctl={"host_state": state, "step_store": "q8"})  # fmt: skip
        e = ZenFlowEngine(model, cfg, accelerator="sim", sim_strict=True, host_kernel=kernel)
        with e:
            train_engine(e, model, gpt2_batches(10, seed=3))
            e.impl.drain()
            store = e.impl.q8_store
            counts = (store.folded, store.passes, store.corrected)
        monkeypatch.undo()
        return [p.detach().clone() for p in model.parameters()], counts

    folded, (n_fold, passes_fold, total) = train(True)
    plain, (n_none, passes, total_plain) = train(False)
    assert n_fold > 0 and n_none == 0 and passes == passes_fold + n_fold
    assert total == total_plain
    for a, b in zip(folded, plain, strict=True):
        assert torch.equal(a, b)


def test_with_clipping_q8_sums_what_per_step_clipping_sums(monkeypatch):
    """The first two windows (steps 1-2 and 3-4: no host result has reached the device
    yet, so every run has the same gradients but for the last bits of the norm): q8's window
    sums are the store's within the copies' rounding times the coefficient's change (0.3%
    here, the coefficient moving by 40-70% between steps); the store-free rule's are
    10-35% off."""
    on = _host_step_sums("on", monkeypatch)
    q8 = _host_step_sums("q8", monkeypatch)
    off = _host_step_sums("off", monkeypatch)
    for k in range(2):
        rel_q8 = (q8[k] - on[k]).norm() / on[k].norm()
        rel_off = (off[k] - on[k]).norm() / on[k].norm()
        assert 0 < rel_q8 < 0.006, (k, rel_q8)
        assert rel_off > 10 * rel_q8, (k, rel_off, rel_q8)


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x.float(), y.float(), rtol=1e-4, atol=2e-5)
               for x, y in zip(a, b, strict=True))  # fmt: skip


def test_with_clipping_and_one_step_windows_off_is_per_step_clipping():
    """A window of one step: its smallest coefficient is the step's own, applied by the host
    step to the unclipped sum where the store's add applied it to the piece (the same
    product, g * c rounded once). Not bit for bit: without the store the step's norm is
    summed from the pieces' norms, not the whole gradients', so its last bits (and the
    coefficient's) may differ, and Adam carries that to a few 1e-6 (fp32 weights: a bf16
    model's would show it as whole bf16 steps)."""
    on, off = _on_and_off("exact", False, clip=0.05, sums=False, update_interval=1)
    assert all(s.grad_norm > 0.05 for s in on[0])  # every step is clipped
    assert [s.selection_changed for s in on[0]] == [s.selection_changed for s in off[0]]
    assert _close(on[3], off[3])
    for name, arrays in on[2].items():
        assert _close(arrays, off[2][name]), name
    # and the unclipped run is not that close: the host step did scale
    unclipped = _on_and_off("exact", False, clip=0.0, sums=False, update_interval=1)[1]
    assert not _close(off[3], unclipped[3])


@pytest.mark.parametrize("state,bf16", [("exact", False), ("compact", True)])
def test_with_clipping_each_host_step_takes_its_windows_smallest_coefficient(
    monkeypatch, state, bf16
):
    """Windows of 2 steps: every host step's scale is min(coef over the window) / 2, the
    coefficients from the steps' own norms as the engine clips them."""
    scales = []
    real = window_room.run_host_tasks

    def spy(tasks, kernels, lr, hp, nt, job, before):
        scales.append((job.window_start, job.submit_step, {t.grad_scale for t in tasks}))
        return real(tasks, kernels, lr, hp, nt, job, before)

    monkeypatch.setattr(window_room, "run_host_tasks", spy)
    model, e = _engine(state, bf16, "off", clip=0.05)
    with e:
        stats = train_engine(e, model, gpt2_batches(10, seed=3))
        e.impl.drain()
        assert e.impl.resolved()["host_clipping"] == "window"  # the run header says so
    coef = {s.step: clip_coefficient(0.05, s.grad_norm, torch.device("cpu"))[0] for s in stats}
    assert len(set(coef.values())) > 3  # the coefficients differ from step to step
    assert len(scales) >= 4
    for start, end, got in scales:
        window = [coef[t] for t in range(start, end + 1)]
        assert got == {min(window) / len(window)}, (start, end, window)


def test_off_holds_what_the_layout_says():
    """The layout without the store: the same host bytes the engine accounts for."""
    model, e = _engine("compact", True, "off")
    with e:
        train_engine(e, model, gpt2_batches(3))
        held = e.accel.host_held()
    s_on = layout.Settings(topk_ratio=0.1, host_state="compact", overlap_step=True)
    s_off = layout.Settings(topk_ratio=0.1, host_state="compact", overlap_step=True,
                            step_store="off")  # fmt: skip
    assert s_off.adds_on_arrival and not s_on.adds_on_arrival

    def items(s):
        census = census_of(tiny_gpt2(), name="tiny", source="test")
        return {i.what: i.bytes for i in layout.layout(census, "zenflow", s)
                if i.side == "host"}  # fmt: skip

    on, off = items(s_on), items(s_off)
    assert any(w.startswith("step store") for w in on)
    assert not any(w.startswith("step store") for w in off)
    assert any(w.startswith("device->host staging ring") for w in off)
    assert "step_pieces" not in held and held["link"] > 0


def test_q8_holds_what_the_layout_says():
    """With clipping, the 8-bit copies: the layout's N + 4 ceil(N/256) bytes, less than the
    store it replaces; the engine's blocks start at each piece's first element, so it holds
    at most 4 bytes a piece more."""
    model, e = _engine("exact", False, "q8", clip=1.0)
    with e:
        train_engine(e, model, gpt2_batches(3))
        held = e.accel.host_held()
        pieces = sum(len(w.pieces) for w in e.zweights)
    census = census_of(tiny_gpt2(), name="tiny", source="test")

    def items(store):
        s = layout.Settings(topk_ratio=0.1, overlap_step=True, bf16=False, step_store=store)
        return {i.what: i for i in layout.layout(census, "zenflow", s) if i.side == "host"}

    q8, on = items("q8"), items("on")
    copies = next(i for w, i in q8.items() if w.startswith("step store: 8-bit copies"))
    store = next(i for w, i in on.items() if w.startswith("step store:"))
    assert not copies.pinned and store.pinned
    assert copies.bytes <= held["step_pieces"] <= copies.bytes + 4 * pieces
    assert copies.bytes < store.bytes / 3.5  # fp32 pieces: 4 bytes an element in the store
    assert any(w.startswith("device->host staging ring") for w in q8)


def test_a_reselection_drops_q8s_copies_and_the_next_window_makes_them_again(monkeypatch):
    """A re-selection follows a window end whose CPU Adam took the last correction in, and
    lays out new pieces: the 8-bit copies are gone before it (its transients do not stand
    beside them: the estimate's re-selection phase counts the steady state without them),
    and a later window's second step makes them again for the new pieces, every weight's
    in one pair of arrays."""
    from zenflow.engine.zenflow.handover import Handover
    from zenflow.engine.zenflow.step_q8 import Q8StepStore

    held_at: dict[str, list[int]] = {"release": [], "select": []}

    def spy(cls, name):
        method = getattr(cls, name)

        def held(self, *args, **kwargs):
            held_at[name].append(self.m.e.accel.host_held().get("step_pieces", 0))
            return method(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, held)

    spy(Q8StepStore, "release")
    spy(Handover, "select")
    model, e = _engine("compact", False, "q8", clip=0.05)
    with e:
        train_engine(e, model, gpt2_batches(8, seed=3))
        after = e.accel.host_held().get("step_pieces", 0)
        n = sum(w.compact_numel for w in e.zweights)
        # every weight's copies in one pair of arrays: freed whole (not heap holes)
        storages = {codes.untyped_storage().data_ptr() for w in e.zweights
                    for codes, _ in w.q8_plan[1].values()}  # fmt: skip
        selections = list(e.impl.handover.selection_steps)
    assert len(held_at["release"]) >= 1 and selections[-1] <= 6, selections
    assert all(b >= n for b in held_at["release"]), (held_at, n)  # the copies, made
    releases = len(held_at["release"])  # each right before a re-selection, which holds none
    assert held_at["select"][-releases:] == [0] * releases
    assert after >= n and len(storages) == 1  # made again for the new pieces


@pytest.mark.parametrize("store", ["off", "q8"])
def test_a_non_finite_step_is_skipped_and_the_host_stays_finite(store):
    model, e = _engine("exact", False, store, clip=0.05 if store == "q8" else 0.0)
    bad_step = 6  # mid-window, after the first selection and a re-selection's window
    step = {"t": 0}
    weight = dict(model.named_parameters())["transformer.h.0.mlp.c_fc.weight"]

    def poison(g):
        if step["t"] == bad_step:
            g = g.clone()
            g.view(-1)[:7] = float("inf")  # whatever columns these are: some cross
        return g

    weight.register_hook(poison)
    with e:
        for t, batch in enumerate(gpt2_batches(10, seed=3), start=1):
            step["t"] = t
            with e.autocast():
                loss = loss_of(model, batch)
            loss.backward()
            st = e.step(loss)
            e.zero_grad()
            assert st.skipped == (t == bad_step), t
        e.impl.drain()
        assert e.skipped_steps == 1 and e.global_step == 9
        for w in e.zweights:
            for t in (w.host.master, w.host.exp_avg, w.host.exp_avg_sq, *w.acc):
                assert torch.isfinite(t).all(), w.spec.name
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _raw(**over):
    raw = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                              "zenflow": {"topk_ratio": 0.1}},
        "zfctl": {"step_store": "off"},
    }  # fmt: skip
    raw.update(over)
    return raw


def test_the_config_takes_off_with_clipping_and_refuses_host_summed_micro_batches():
    assert load_config(_raw()).engine.step_store == "off"
    with pytest.raises(ConfigError) as err:
        load_config(_raw(gradient_clipping=0, gradient_accumulation_steps=2))
    assert 'zfctl.grad_accumulation "device"' in str(err.value)
    assert load_config(_raw(zfctl={"step_store": "q8"})).engine.step_store == "q8"
    with pytest.raises(ConfigError, match="zfctl.step_store = 'q8'"):
        load_config(_raw(gradient_accumulation_steps=2, zfctl={"step_store": "q8"}))
    ok = load_config(
        _raw(
            gradient_clipping=0,
            gradient_accumulation_steps=2,
            zfctl={"step_store": "off", "grad_accumulation": "device"},
        )
    )
    assert ok.engine.step_store == "off"
    with pytest.raises(ConfigError, match="step_store"):
        load_config(_raw(gradient_clipping=0, zfctl={"step_store": "maybe"}))


def test_the_default_step_store_is_auto_and_runs_the_store():
    """zfctl.step_store "auto" (the default): taken with micro-batches summed on the host
    (nothing to change there); the engine runs it as the store ("on") unless the memory
    check changed it before the run (zfctl finetune: tests/cli/test_estimate_cmd.py): the
    same weights as "on", bit for bit, with clipping that bites."""
    assert load_config(_raw(zfctl={})).engine.step_store == "auto"
    assert load_config(_raw(zfctl={}, gradient_accumulation_steps=2)).engine.step_store == "auto"
    finals = {}
    for store in ("auto", "on"):
        model, e = _engine("exact", False, store, clip=0.05)
        with e:
            train_engine(e, model, gpt2_batches(6, seed=3))
            e.impl.drain()
            assert e.step_store == "on" and e.impl.q8_store is None
            assert e.impl.resolved()["step_store"] == "on"
            assert e.impl.resolved()["host_clipping"] == "step"
        finals[store] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(finals["auto"], finals["on"], strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_mid_window_keeps_the_windows_smallest_coefficient():
    """Saved one step into a window (steps 5-6), the coefficient of step 5 is part of the
    state: a resumed run that lost it would scale the window by step 6's alone (the whole
    resume, bit for bit, is ``test_resume``'s "sim-store-off-clipped")."""
    model, e = _engine("exact", False, "off", clip=0.05)
    with e:
        train_engine(e, model, gpt2_batches(5, seed=3))
        assert e.impl.window_len == 1 and e.impl.window_coef < 1.0
        saved, coef = e.state_dict(), e.impl.window_coef
        model2, e2 = _engine("exact", False, "off", clip=0.05)
        with e2:
            model2.load_state_dict(model.state_dict())
            e2.load_state_dict(saved)
            assert e2.impl.window_len == 1 and e2.impl.window_coef == coef
