"""Which axis of a 2-D weight holds its ZenFlow columns (input features), by the modules that
use it, and what that means for an embedding's selection."""

from __future__ import annotations

import torch
from conftest import make_config

from zenflow import ZenFlowEngine
from zenflow.engine.selection import classify_params


class _Model(torch.nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(300, 16)
        self.proj = torch.nn.Linear(16, 24)
        self.head = torch.nn.Linear(24, 300, bias=False)
        if tie:  # an output projection sharing the embedding (GPT-2's LM head)
            self.head = torch.nn.Linear(16, 300, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        if self.head.weight is self.emb.weight:
            return self.head(h)
        return self.head(torch.relu(self.proj(h)))


def _axes(model) -> dict[str, int | None]:
    return {s.name: s.column_dim for s in classify_params(model, min_numel=1)}


def test_axes_by_module():
    axes = _axes(_Model(tie=False))
    assert axes["emb.weight"] == 0  # [num_embeddings, dim]: a token is an input feature
    assert axes["proj.weight"] == 1 and axes["head.weight"] == 1  # Linear: [out, in]
    assert axes["proj.bias"] is None


def test_tied_embedding_follows_its_projection():
    axes = _axes(_Model(tie=True))
    assert "head.weight" not in axes  # one parameter, listed once
    assert axes["emb.weight"] == 1  # the LM head's matmul view: [vocab, dim] = [out, in]


def test_conv1d_is_in_out():
    from transformers.pytorch_utils import Conv1D

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = Conv1D(24, 16)  # weight [in 16, out 24]

    assert _axes(M())["c.weight"] == 0


def test_an_embeddings_selection_takes_the_tokens_the_batch_saw():
    """Scored by rows, the embedding's gradient lives only on the tokens looked up; with
    topk covering them, the selected columns are exactly those tokens, so the device
    update carries all of the embedding's gradient."""
    torch.manual_seed(0)
    model = _Model(tie=False)
    ids = torch.tensor([[3, 17, 42, 99, 17, 250]])
    cfg = make_config({"topk_ratio": 0.02, "update_interval": 2})  # ceil(0.02*300) = 6 rows
    with ZenFlowEngine(model, cfg, accelerator="cpu", min_numel=1) as engine:
        loss = model(ids).logsumexp(-1).mean()
        engine.backward(loss)
        engine.step(loss)
        emb = next(w for w in engine.impl.zweights if w.spec.name == "emb.weight")
        selected = set(emb.sel_dev.tolist())
    assert {3, 17, 42, 99, 250} <= selected and len(selected) == 6
