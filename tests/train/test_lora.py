"""--engine lora (zenflow.train.lora): adapters on every attention and MLP projection, only
they and the head train, the merged export equals the adapter model, resume is exact, and
the zfctl.lora block is read like the other zfctl options."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from trainhelp import assert_same_params, losses, make_spec

from zenflow.config import ConfigError, load_config
from zenflow.config.schema import LoraOptions
from zenflow.errors import CheckpointError
from zenflow.hardware.census import resolve_census
from zenflow.hardware.layout import Settings, layout
from zenflow.train import runs
from zenflow.train.events import RunStarted
from zenflow.train.lora import (
    TrainableWeights,
    lora_counts,
    lora_linear_shapes,
    merged_for_export,
    wrap_lora,
)
from zenflow.train.trainer import run_finetune


def _tiny(family: str):
    """A tiny model of each family the project trains, seeded: (model, objective)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                            pad_token_id=0, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return tf.GPT2ForSequenceClassification(cfg), "classification"
    if family == "bert":
        cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                            intermediate_size=64, vocab_size=64)  # fmt: skip
        return tf.BertForSequenceClassification(cfg), "classification"
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, vocab_size=64,
                         pad_token_id=0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return tf.LlamaForCausalLM(cfg), "causal-lm"


# Each family's attention and MLP projections: every one must carry an adapter.
PROJECTIONS = {
    "gpt2": {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"},
    "bert": {
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    },  # fmt: skip
    "llama": {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    },  # fmt: skip
}


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_adapters_on_every_attention_and_mlp_projection_only(family):
    model, objective = _tiny(family)
    shapes, head = lora_linear_shapes(model)  # the estimate's census, before peft
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = wrap_lora(model, LoraOptions(rank=4, alpha=8), objective, seed=1)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in wrapped.named_parameters() if ".lora_A." in n}
    for layer in range(2):  # every projection of every block
        for proj in PROJECTIONS[family]:
            assert any(a.endswith(f".{layer}.{proj}") for a in adapted), (proj, sorted(adapted))
    # never the output layer: the LM head, or the classification head (trained whole)
    assert not any(a.endswith(("lm_head", "score", "classifier")) for a in adapted)
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert all(".lora_" in n or ".modules_to_save." in n for n in trainable), trainable
    assert any(".modules_to_save." in n for n in trainable) == (objective == "classification")
    # the estimate's count is peft's, element for element
    counts = lora_counts(wrapped)
    assert counts.adapters == sum(4 * (i + o) for i, o in shapes) and counts.head == head
    assert counts.modules == len(shapes) == len(adapted)
    assert counts.base == sum(p.numel() for p in before.values())
    # lora_B starts at zero: the wrapped model is the base model, and its weights are intact
    for n, p in wrapped.get_base_model().named_parameters():
        key = n.replace(".base_layer", "").replace(".original_module", "")
        if ".lora_" not in n and ".modules_to_save." not in n:
            assert torch.equal(p, before[key]), n


def test_adapter_init_is_seeded_and_leaves_the_global_rng_alone():
    a = wrap_lora(_tiny("bert")[0], LoraOptions(), "classification", seed=3)
    b = wrap_lora(_tiny("bert")[0], LoraOptions(), "classification", seed=3)
    model = _tiny("bert")[0]
    before = torch.get_rng_state()
    c = wrap_lora(model, LoraOptions(), "classification", seed=4)
    assert torch.equal(torch.get_rng_state(), before)
    name = next(n for n, _ in a.named_parameters() if ".lora_A." in n)
    pa, pb, pc = (dict(m.named_parameters())[name] for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_merged_export_computes_what_the_adapter_model_does():
    model, _ = _tiny("gpt2")
    wrapped = wrap_lora(model, LoraOptions(rank=4, alpha=16), "classification", seed=1)
    with torch.no_grad():  # trained adapters: B no longer zero, the head moved
        for p in wrapped.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    wrapped.eval()
    ids = torch.randint(1, 64, (3, 12))
    with torch.no_grad():
        want = wrapped(input_ids=ids).logits
        merged = merged_for_export(wrapped)
        got = merged(input_ids=ids).logits
    assert type(merged).__name__ == "GPT2ForSequenceClassification"
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert not torch.equal(want, _tiny("gpt2")[0].eval()(input_ids=ids).logits)  # it moved
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- runs


def test_a_run_trains_adapters_only_and_exports_a_merged_model(tiny_gpt2_dir, sample_dir,
                                                               tmp_path):  # fmt: skip
    """The checkpoint holds the adapters and head only; model/ is plain transformers and
    gives the adapter model's logits; every weight outside the adapted projections and the
    head is the base's, untouched."""
    from transformers import AutoModelForSequenceClassification

    from zenflow.train.models import resolve_model

    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path, engine_mode="lora", max_steps=4)
    events = []
    s = run_finetune(spec, events.append)
    run_dir = s["run_dir"]
    assert s["status"] == "finished" and s["engine_mode"] == "lora"
    lora = s["config"]["engine_resolved"]["lora"]
    assert lora["rank"] == 8 and lora["alpha"] == 8.0 and lora["targets"] == "all-linear"
    base = resolve_model(str(tiny_gpt2_dir), task_num_labels=2, seed=spec.seed).model
    assert s["params"] == lora["base_params"] == sum(p.numel() for p in base.parameters())
    state = torch.load(runs.latest_checkpoint(run_dir), weights_only=True)["model"]
    assert set(state) == {"trainable", "base_digest"}
    assert all(".lora_" in n or ".modules_to_save." in n for n in state["trainable"])
    assert sum(t.numel() for t in state["trainable"].values()) == lora["trainable_params"]
    header = next(e.header for e in events if isinstance(e, RunStarted))
    assert any(n.startswith("LoRA (peft") and "all-linear" in n for n in header["notes"])
    # zfctl estimate's lora layout is what the engine held: the frozen base, the adapters
    # and the head's copy in the training dtype, their gradients and fp32 AdamW moments
    census = resolve_census(str(tiny_gpt2_dir))
    assert census.lora_params(8) == lora["trainable_params"]
    items = layout(census, "lora", Settings(bf16=False, cpu_device=True, stream_grads=False))
    held = sum(i.bytes for i in items if i.side == "device" and i.category != "activations")
    assert s["device_peak_bytes_per_param"] * s["params"] == pytest.approx(held, rel=1e-4)
    assert not [i for i in items if i.side == "host"]  # nothing of the optimizer on the host

    adapter = wrap_lora(base, LoraOptions(), "classification", seed=spec.seed)
    TrainableWeights(adapter).load_state_dict(state)
    exported = AutoModelForSequenceClassification.from_pretrained(f"{run_dir}/model").eval()
    ids = torch.randint(0, 50000, (4, 16))
    with torch.no_grad():
        want = adapter.eval()(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    original = dict(resolve_model(str(tiny_gpt2_dir), task_num_labels=2,
                                  seed=spec.seed).model.named_parameters())  # fmt: skip
    for n, p in exported.named_parameters():
        changed = not torch.equal(p, original[n])
        adapted = n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) or n.startswith(
            "score."
        )
        assert changed == adapted, n  # trained: every adapted weight; frozen: all the rest


@pytest.fixture(scope="module")
def straight_lora(tiny_gpt2_dir, sample_dir, tmp_path_factory):
    """An uninterrupted 6-step LoRA run with bf16, two micro-batches per step and
    activation checkpointing (computed once)."""
    spec = make_spec(tiny_gpt2_dir, sample_dir, tmp_path_factory.mktemp("straight-lora"),
                     gas=2, engine_mode="lora", max_steps=6, micro_batch=2,
                     gradient_checkpointing=True,
                     config=_bf16_config())  # fmt: skip
    s = run_finetune(spec)
    return spec, losses(s["run_dir"]), _trainable(s["run_dir"])


def _bf16_config() -> dict:
    from trainhelp import CONFIG

    return {**CONFIG, "bf16": {"enabled": True}}


def _trainable(run_dir) -> dict:
    return torch.load(runs.latest_checkpoint(run_dir), weights_only=True)["model"]["trainable"]


def test_resume_is_exact(straight_lora, tmp_path):
    spec, want_losses, want = straight_lora
    assert len(want_losses) == 6 and len(set(want_losses)) == 6  # a real trajectory
    first = run_finetune(dataclasses.replace(spec, runs_root=tmp_path, max_steps=3))
    second = run_finetune(dataclasses.replace(spec, runs_root=tmp_path, max_steps=6,
                                              resume=first["run_dir"]))  # fmt: skip
    assert second["steps"] == 6 and losses(second["run_dir"]) == want_losses  # bit for bit
    assert_same_params(_trainable(second["run_dir"]), want)
    assert all(t.dtype == torch.bfloat16 for t in want.values())  # trained in bf16
    cfg = runs.run_config(second["run_dir"])
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["run"]["gradient_checkpointing"]


def test_resume_refuses_other_base_weights(tiny_gpt2_dir, sample_dir, tmp_path):
    """The base is not in the checkpoint: loaded again at resume, it must be the one the
    adapters were trained on (its digest is kept in the checkpoint)."""
    from transformers import AutoModelForSequenceClassification

    model_dir = tmp_path / "model-copy"
    shutil.copytree(tiny_gpt2_dir, model_dir)
    spec = make_spec(model_dir, sample_dir, tmp_path / "runs", engine_mode="lora", max_steps=2)
    first = run_finetune(spec)
    m = AutoModelForSequenceClassification.from_pretrained(model_dir)
    with torch.no_grad():
        m.transformer.h[1].mlp.c_fc.weight[0, 0] += 0.5  # one weight of the frozen base
    m.save_pretrained(model_dir)
    with pytest.raises(CheckpointError, match="frozen base weights differ"):
        run_finetune(dataclasses.replace(spec, max_steps=4, resume=first["run_dir"]))


def test_weights_view_refuses_a_checkpoint_of_another_rank():
    a = wrap_lora(_tiny("bert")[0], LoraOptions(rank=4), "classification", seed=1)
    b = wrap_lora(_tiny("bert")[0], LoraOptions(rank=8), "classification", seed=1)
    with pytest.raises(RuntimeError, match="another shape"):
        TrainableWeights(b).load_state_dict(TrainableWeights(a).state_dict())
    view = TrainableWeights(a)
    state = view.state_dict()
    state["trainable"].pop(next(iter(state["trainable"])))
    with pytest.raises(RuntimeError, match="missing"):
        view.load_state_dict(state)


# ---------------------------------------------------------------------------- config


def test_the_lora_block_defaults_are_peft_s():
    from peft import LoraConfig

    peft_default = LoraConfig()
    assert load_config({}).engine.lora == LoraOptions()
    assert (LoraOptions().rank, LoraOptions().alpha, LoraOptions().dropout) == (
        peft_default.r, peft_default.lora_alpha, peft_default.lora_dropout)  # fmt: skip
    cfg = load_config({"zfctl": {"lora": {"rank": 16, "alpha": 32, "dropout": 0.1}}})
    assert cfg.engine.lora == LoraOptions(16, 32.0, 0.1)
    assert load_config(cfg.to_json_dict()) == cfg  # written back and read again


def test_the_lora_block_problems_name_their_keys():
    with pytest.raises(ConfigError) as err:
        load_config({"zfctl": {"lora": {"rnak": 4, "rank": 0, "alpha": -1, "dropout": 1}}})
    assert {p.path for p in err.value.problems} == {
        "zfctl.lora.rnak",
        "zfctl.lora.rank",
        "zfctl.lora.alpha",
        "zfctl.lora.dropout",
    }
    assert 'did you mean "rank"' in str(err.value)
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config({"zfctl": {"lora": 8}})
