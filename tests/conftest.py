"""Shared fixtures: offline hub, GLUE data directory, a tiny randomly initialised GPT-2, a
folder of someone else's files (a model folder)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

# huggingface_hub reads HF_HUB_OFFLINE once, at import: set it before anything imports it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

SHARED_GLUE = Path("/work/shared/data/glue")

# The tiny model every trainer/CLI test can afford: the real GPT-2 vocabulary (so the real
# tokenizer's ids fit), 2 layers, width 32. About 1.7M parameters, almost all embeddings.
TINY_GPT2 = dict(
    n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=50257, num_labels=2,
    pad_token_id=50256, bos_token_id=50256, eos_token_id=50256,
)  # fmt: skip


@pytest.fixture(autouse=True)
def _hf_offline(monkeypatch):
    """Every test runs offline: no test may reach the Hugging Face hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture
def terminal_sigint():
    """The processes this test starts take SIGINT as a terminal's job does. A suite started
    as a background job by a shell without job control (``pytest ... &`` in a script, some
    CI runners) inherits SIGINT ignored, and an ignored signal stays ignored through fork
    and exec. zfctl's --nproc launcher leaves an ignored SIGINT alone, as Python itself
    does, so a test's Ctrl-C would never reach it. While the test runs this process catches
    SIGINT instead, and a caught signal is reset to its default action in a new program:
    what a terminal's job has."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(scope="session")
def glue_dir() -> Path:
    """GLUE root (holding sst2/train.tsv): $GLUE_DIR, else the shared copy; skip if absent."""
    env = os.environ.get("GLUE_DIR")
    root = Path(env) if env else SHARED_GLUE
    if not (root / "sst2" / "train.tsv").is_file():
        origin = "GLUE_DIR" if env else f"default {SHARED_GLUE}"
        pytest.skip(
            f"GLUE SST-2 data not found at {root}/sst2/train.tsv ({origin}); set GLUE_DIR to "
            "a GLUE directory to run this test"
        )
    return root


def _saved_gpt2(d: Path, **overrides) -> Path:
    """A randomly initialised GPT2ForSequenceClassification (TINY_GPT2 with ``overrides``)
    and the GPT-2 tokenizer, saved in ``d``."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from zenflow.train.models import packaged_gpt2_tokenizer

    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(**{**TINY_GPT2, **overrides}))
    model.save_pretrained(d)
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    """A saved, randomly initialised tiny GPT2ForSequenceClassification + GPT-2 tokenizer."""
    return _saved_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def wide_mlp_gpt2_dir(tmp_path_factory) -> Path:
    """The tiny GPT-2 with 4 layers of a 16384-wide MLP (5.9M params): many ZenFlow weights,
    none dominant, so that 2 bytes per non-selected element (the early phase's return
    images) outweigh 4 bytes per element of the largest weight (the first selection)."""
    return _saved_gpt2(tmp_path_factory.mktemp("wide-mlp-gpt2"), n_layer=4, n_inner=16384)


@pytest.fixture
def cli(monkeypatch):
    """``cli(*args)`` runs ``zfctl *args`` in-process; a wide terminal so Rich does not wrap."""
    from typer.testing import CliRunner

    from zfctl.app import app

    monkeypatch.setenv("COLUMNS", "200")
    runner = CliRunner()

    def invoke(*args, input: str | None = None):
        return runner.invoke(app, [str(a) for a in args], input=input)

    return invoke


class ForeignFolder:
    """A folder of someone else's files; ``unchanged()``: every entry (hidden ones
    included) is still there with the same bytes, and nothing was added."""

    def __init__(self, path: Path):
        self.path = path
        self.before = self.listing()

    def listing(self) -> dict:
        out = {}
        for root, dirs, names in os.walk(self.path):
            for n in dirs:
                out[os.path.relpath(os.path.join(root, n), self.path)] = "dir"
            for n in names:
                p = Path(root, n)
                out[str(p.relative_to(self.path))] = p.read_bytes()
        return out

    def unchanged(self) -> bool:
        return self.listing() == self.before


@pytest.fixture
def model_folder(tmp_path) -> ForeignFolder:
    """A Hugging Face model folder: its own config.json (no zfctl run), weights, tokenizer
    files, and even a file with a run's name (metrics.jsonl)."""
    path = tmp_path / "my-model"
    path.mkdir()
    hf_config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2}
    (path / "config.json").write_text(json.dumps(hf_config))
    (path / "model.safetensors").write_bytes(bytes(range(256)))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).write_text("{}")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    return ForeignFolder(path)
