"""``zfctl.step_store`` "off": without clipping, each streamed piece is added into its window
sum as it arrives (through the staging ring), and no step store exists.

- With no non-finite step it trains the same weights as the store, bit for bit, in both
  host states and both training dtypes: the same adds, in the same order, by 1.0.
- Its host holds no step store, only the ring, and the estimate's layout says the same.
- A non-finite step is still skipped on the device; on the host its non-finite piece is
  zeroed before it crosses, so the window sums and the host state stay finite and the run
  goes on.
- The config refuses it with clipping on, and with micro-batches summed on the host.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_batches, loss_of, make_config, tiny_gpt2, train_engine

from zenflow import ZenFlowEngine
from zenflow.config import ConfigError, load_config
from zenflow.hardware import layout
from zenflow.hardware.census import census_of

ZF = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True,
      "select_strategy": "step", "select_interval": 4}  # fmt: skip


def _engine(state: str, bf16: bool, store: str, clip: float = 0.0):
    model = tiny_gpt2()
    cfg = make_config(ZF, clip=clip, bf16={"enabled": bf16},
                      zfctl={"host_state": state, "step_store": store})  # fmt: skip
    return model, ZenFlowEngine(model, cfg, accelerator="sim", sim_strict=True,
                                host_kernel="reference")  # fmt: skip


def _host_arrays(e) -> dict[str, list[torch.Tensor]]:
    out = {}
    for w in e.zweights:
        h = w.host
        fields = [h.master, h.steps.counts]
        fields += [h.m_codes, h.m_scales, h.u_codes, h.u_scales] if hasattr(h, "m_codes") \
            else [h.exp_avg, h.exp_avg_sq]  # fmt: skip
        out[w.spec.name] = [t.clone() for t in fields] + [a.clone() for a in w.acc]
    return out


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("state", ["exact", "compact"])
def test_off_trains_what_the_store_trains_bit_for_bit(state, bf16):
    runs = {}
    for store in ("on", "off"):
        model, e = _engine(state, bf16, store)
        with e:
            stats = train_engine(e, model, gpt2_batches(10, seed=3))  # re-selections at 4, 8
            e.impl.drain()
            held = e.accel.host_held()
            host = _host_arrays(e)
            params = [p.detach().clone() for p in model.parameters()]
        runs[store] = (stats, held, host, params)
    (st_on, held_on, host_on, p_on), (st_off, held_off, host_off, p_off) = runs["on"], \
        runs["off"]  # fmt: skip
    assert sum(s.selection_changed for s in st_on) > 0  # columns did move
    assert [s.loss for s in st_on] == [s.loss for s in st_off]
    assert all(torch.equal(a, b) for a, b in zip(p_on, p_off, strict=True))
    for name, arrays in host_on.items():
        assert all(torch.equal(a, b) for a, b in zip(arrays, host_off[name], strict=True)), name
    # the store is gone; the ring took its place, a few buckets long
    assert held_on["step_pieces"] > 0 and "step_pieces" not in held_off
    assert 0 < held_off["link"] < held_on["step_pieces"]


def test_off_holds_what_the_layout_says():
    """The layout without the store: the same host bytes the engine accounts for."""
    model, e = _engine("compact", True, "off")
    with e:
        train_engine(e, model, gpt2_batches(3))
        held = e.accel.host_held()
    s_on = layout.Settings(topk_ratio=0.1, host_state="compact", overlap_step=True)
    s_off = layout.Settings(topk_ratio=0.1, host_state="compact", overlap_step=True,
                            step_store="off")  # fmt: skip
    assert s_off.store_free and not s_on.store_free

    def items(s):
        census = census_of(tiny_gpt2(), name="tiny", source="test")
        return {i.what: i.bytes for i in layout.layout(census, "zenflow", s)
                if i.side == "host"}  # fmt: skip

    on, off = items(s_on), items(s_off)
    assert any(w.startswith("step store") for w in on)
    assert not any(w.startswith("step store") for w in off)
    assert any(w.startswith("device->host staging ring") for w in off)
    assert "step_pieces" not in held and held["link"] > 0


def test_a_non_finite_step_is_skipped_and_the_host_stays_finite():
    model, e = _engine("exact", False, "off")
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


def test_the_config_refuses_off_with_clipping_or_host_summed_micro_batches():
    with pytest.raises(ConfigError) as err:
        load_config(_raw())
    text = str(err.value)
    assert "zfctl.step_store" in text and "gradient_clipping 0" in text
    with pytest.raises(ConfigError) as err:
        load_config(_raw(gradient_clipping=0, gradient_accumulation_steps=2))
    assert 'zfctl.grad_accumulation "device"' in str(err.value)
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
