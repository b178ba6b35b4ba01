"""Streamed pieces: their size changes no value, their places in the host buffers are made
once per buffer, and the per-weight step bookkeeping runs as foreach calls.

- A run whose copy buckets are small (many pieces per weight) trains the same weights, bit
  for bit, as one with the engine's default buckets (one piece per weight here), with the
  step store, without it, and with micro-batches summed on the host; with clipping too
  where the step store holds the pieces (one rank: the step's norm is each whole
  gradient's, taken in its hook). (Not with clipping and no store: each piece's norm is
  taken for its own non-finite check, and the non-selected share's norm is the norm of
  those, so the boundaries round the coefficient differently in its last bits.)
- Each weight's piece views of its window sum and step store are made at its first routed
  step and reused after; the engine's release drops them (no view keeps a buffer alive).
- ``ColumnSteps.increment_all`` is ``increment`` on each, in one foreach call.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_batches, make_config, tiny_gpt2, train_engine

from zenflow import ZenFlowEngine
from zenflow.engine.host import ColumnSteps

ZF = {"topk_ratio": 0.1, "update_interval": 2, "overlap_step": True,
      "select_strategy": "step", "select_interval": 4}  # fmt: skip


def _run(bucket_elems, *, clip=1.0, store="on", gas=1, steps=9):
    model = tiny_gpt2()
    extra = {"gradient_accumulation_steps": gas} if gas > 1 else {}
    zfctl = {"step_store": store}
    if gas > 1:
        zfctl["grad_accumulation"] = "host"
    cfg = make_config(ZF, clip=clip, bf16={"enabled": True}, zfctl=zfctl, **extra)
    engine = ZenFlowEngine(model, cfg, accelerator="sim", sim_strict=True,
                           host_kernel="reference", bucket_elems=bucket_elems)  # fmt: skip
    with engine:
        batches = gpt2_batches(steps * gas)
        if gas == 1:
            train_engine(engine, model, batches)
        else:
            for i in range(0, len(batches), gas):
                for b in batches[i : i + gas]:
                    with engine.autocast():
                        loss = model(input_ids=b, labels=b).loss
                    engine.backward(loss)
                engine.step(loss)
                engine.zero_grad()
        pieces = sum(len(w.pieces) for w in engine.zweights)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights, pieces, len(engine.zweights)


@pytest.mark.parametrize("case", [
    {"clip": 0.0}, {"clip": 1.0}, {"clip": 0.0, "store": "off"}, {"gas": 2},
], ids=["store", "store clipped", "no store", "host micro-batch sums"])  # fmt: skip
def test_the_piece_size_changes_no_value(case):
    small, many, n_weights = _run(64, **case)
    whole, few, _ = _run(None, **case)
    assert many > 2 * few and many > n_weights  # several pieces per weight
    for name, t in whole.items():
        assert torch.equal(small[name], t), name


def test_piece_views_are_made_once_per_buffer_and_dropped_at_release():
    model = tiny_gpt2()
    cfg = make_config(ZF, clip=1.0, bf16={"enabled": True})
    engine = ZenFlowEngine(model, cfg, accelerator="sim", host_kernel="reference",
                           bucket_elems=64)  # fmt: skip
    with engine:
        train_engine(engine, model, gpt2_batches(4))
        w = max(engine.zweights, key=lambda w: len(w.pieces))
        assert len(w.pieces) > 1
        made = {k: (buf, list(views)) for k, (buf, views) in w._views.items()}
        assert id(w.acc[0]) in made and id(w.store) in made
        for buf, views in made.values():
            assert [v.data_ptr() for v in views] == [p.of(buf).data_ptr() for p in w.pieces]
            assert [v.shape for v in views] == [p.shape for p in w.pieces]
        train_engine(engine, model, gpt2_batches(3, seed=2))
        for k, (_, views) in made.items():  # the same view objects, not new slices
            assert all(a is b for a, b in zip(w._views[k][1], views, strict=True))
        engine.release_host_state()  # the trainer's, before the final save
        assert all(not w._views for w in engine.zweights)


def test_increment_all_is_increment_on_each():
    a = ColumnSteps(torch.tensor([3, 3, 3]), 3, torch.tensor([3, 3, 3]))
    b = ColumnSteps(torch.tensor([1, 4]), None, torch.tensor([1, 4]))
    a2 = ColumnSteps(torch.tensor([3, 3, 3]), 3, torch.tensor([3, 3, 3]))
    b2 = ColumnSteps(torch.tensor([1, 4]), None, torch.tensor([1, 4]))
    ColumnSteps.increment_all([a, b])
    ColumnSteps.increment_all([a, b])
    for s in (a2, b2, a2, b2):
        s.increment()
    for x, y in ((a, a2), (b, b2)):
        assert torch.equal(x.counts, y.counts) and torch.equal(x.mirror, y.mirror)
        assert x.uniform == y.uniform
    assert a.uniform == 5 and b.uniform is None and torch.equal(b.counts, torch.tensor([3, 6]))
    ColumnSteps.increment_all([])  # nothing to do
