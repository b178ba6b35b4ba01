"""Shared helpers of the CUDA tier (tests/cuda): the skip rule, configs, models that live on
the GPU, training loops that move every batch there, comparisons that say how far apart two
models are, and ``record`` for the numbers a GPU run should leave behind.

Named ``cudahelp``, not ``conftest``: tests/engine imports its own helpers as ``conftest``
and a second module of that name would shadow them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# cuBLAS keeps a workspace per (handle, stream) and may pick a different GEMM algorithm for
# another workspace size; a fixed configuration (read when cuBLAS starts, so set before any
# GEMM) keeps two runs of one model in one process bit-comparable. 8 chunks of 4096 KiB.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = (
    f"needs a CUDA device: torch {torch.__version__} (CUDA build: "
    f"{torch.version.cuda or 'none'}) sees none, torch.cuda.is_available() is False"
)
# ZFCTL_CUDA_TIER_DEVICE=sim rehearses the tier's logic on a machine without a GPU: the
# simulated separate device, strict (copy destinations poisoned until their copy completed),
# stands in for cuda, and the tests that read torch.cuda's own counters or need a GPU skip.
# A rehearsal is not a GPU run; scripts/gpu_check.sh never sets it.
REHEARSE = os.environ.get("ZFCTL_CUDA_TIER_DEVICE", "") == "sim"
ACCEL = "sim" if REHEARSE else "cuda"
# Every module of the tier: ``pytestmark = CUDA_TIER``.
CUDA_TIER = [pytest.mark.cuda, pytest.mark.skipif(not (HAS_CUDA or REHEARSE), reason=NO_CUDA)]
# Tests that need the real device (its allocator, NCCL, the CLI on --device cuda).
REAL_CUDA = pytest.mark.skipif(
    not HAS_CUDA or REHEARSE,
    reason=NO_CUDA if not HAS_CUDA else "a sim rehearsal (ZFCTL_CUDA_TIER_DEVICE=sim)",
)

MIB = 2**20


def _engine_helpers():
    """tests/engine's helpers (configs, the MLP, the AdamW hyper-parameters), loaded from
    their file under another module name: the tier uses the engine tests' own."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "zenflow_engine_test_helpers"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "engine" / "conftest.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_engine = _engine_helpers()
LR, BETAS, EPS, WD = _engine.LR, _engine.BETAS, _engine.EPS, _engine.WD
make_config = _engine.make_config  # AdamW, ZeRO-2 offload, the zenflow block when given
MLP = _engine.MLP  # two ZenFlow-sized Linear layers, a LayerNorm and a head


def dev() -> torch.device:
    """Where models and batches live: the current CUDA device (a rehearsal: the CPU)."""
    if ACCEL == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def engine_kw(**kw) -> dict:
    """ZenFlowEngine keywords of the tier: the accelerator (cuda), the reference host
    kernel unless ``host_kernel`` says otherwise (the native op has its own case)."""
    return {"accelerator": ACCEL, "sim_strict": REHEARSE, "host_kernel": "reference", **kw}


def mlp(seed: int = 0) -> MLP:
    """The MLP on the GPU, initialised on the CPU first (the same weights on any device)."""
    torch.manual_seed(seed)
    return MLP().to(dev())


def mlp_batches(n: int, seed: int = 1, bs: int = 8, d_in: int = 64, d_out: int = 10):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(bs, d_in, generator=g)
        y = torch.randint(0, d_out, (bs,), generator=g)
        out.append((x.to(dev()), y.to(dev())))
    return out


def tiny_gpt2(seed: int = 0, vocab: int = 96):
    """A 2-layer GPT-2 LM (width 64) on the GPU, no dropout. Eager attention: the fused
    attention kernels' backward may sum with atomics (run-to-run differences that Adam
    would amplify in the comparisons); matmul + softmax is deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).float().to(dev())


def gpt2_batches(n: int, seed: int = 1, vocab: int = 96, bs: int = 2, seq: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (bs, seq), generator=g).to(dev()) for _ in range(n)]


def loss_of(model, batch):
    if isinstance(batch, tuple):
        return model(*batch)
    return model(input_ids=batch, labels=batch).loss


def micro(batch, gas: int, m: int):
    """Micro-batch ``m`` of ``gas`` equal slices of a batch."""
    if isinstance(batch, tuple):
        n = batch[0].shape[0] // gas
        return tuple(t[m * n : (m + 1) * n] for t in batch)
    n = batch.shape[0] // gas
    return batch[m * n : (m + 1) * n]


def train_engine(engine, model, batches, gas: int = 1):
    """One ``engine.step`` per batch, each after ``gas`` backward passes of loss / gas."""
    stats = []
    for b in batches:
        losses = []
        for m in range(gas):
            with engine.autocast():
                loss = loss_of(model, micro(b, gas, m)) / gas
            engine.backward(loss)
            losses.append(loss.detach())
        stats.append(engine.step(torch.stack(losses).sum()))
        engine.zero_grad()
    return stats


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's CPU thread count meanwhile: a reference run on the CPU (a sim rehearsal) must
    use the engine's training threads, which set the CPU kernels' reduction order."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_adamw(model, batches, clip: float = 0.0, lr: float = LR, fused: bool = False,
                threads: int | None = None):  # fmt: skip
    """torch.optim.AdamW on the GPU: single-tensor (``foreach=False``) or ``fused``;
    ``threads``: the engine's training threads (see ``torch_threads``)."""
    with torch_threads(threads):
        _train_adamw(model, batches, clip, lr, fused)


def _train_adamw(model, batches, clip: float, lr: float, fused: bool) -> None:
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WD,
        **({"fused": True} if fused else {"foreach": False}),
    )  # fmt: skip
    for b in batches:
        loss_of(model, b).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def train_mixed_precision_adamw(model, batches, fused: bool = False, threads: int | None = None):
    """Textbook mixed precision: a bf16 model under bf16 autocast, fp32 master copies
    updated by torch's AdamW from the bf16 gradients and cast back after each step.
    Returns the masters."""
    with torch_threads(threads):
        return _train_mixed_precision_adamw(model, batches, fused)


def _train_mixed_precision_adamw(model, batches, fused: bool):
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    model.bfloat16()
    opt = torch.optim.AdamW(
        masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
        **({"fused": True} if fused else {"foreach": False}),
    )  # fmt: skip
    for b in batches:
        with torch.autocast(dev().type, dtype=torch.bfloat16):
            loss = loss_of(model, b)
        loss.backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
    return masters


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """How far apart two sets of named tensors are: the largest absolute difference, where,
    and whether every tensor is bit-identical."""
    worst, where, bitwise = 0.0, "", True
    for n in a:
        x, y = a[n].detach(), b[n].detach()
        if not torch.equal(x, y):
            bitwise = False
            d = (x.float() - y.float()).abs().max().item()
            if d >= worst:
                worst, where = d, n
    return {"max_abs_diff": worst, "worst": where, "bitwise": bitwise}


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close(a: dict, b: dict, atol: float, rtol: float, what: str) -> dict:
    """Element-wise ``|a - b| <= atol + rtol * |b|`` for every tensor; returns ``diff``."""
    d = diff(a, b)
    for n in a:
        torch.testing.assert_close(
            a[n].float(), b[n].float(), atol=atol, rtol=rtol,
            msg=lambda m, n=n: f"{what}: {n}: {m} ({d})",
        )  # fmt: skip
    return d


def assert_moved(after: dict, before: dict) -> None:
    """Every parameter trained: a step that did nothing would pass the comparisons."""
    for n, p in after.items():
        assert torch.isfinite(p).all(), f"{n} is not finite"
        assert not torch.equal(p, before[n]), f"{n} did not move"


def record(test: str, **values) -> None:
    """Print measured numbers as one JSON line and, when ``GPU_CHECK_RECORD`` names a file
    (``scripts/gpu_check.sh`` sets it), append them there for the run's summary."""
    line = json.dumps({"test": test, "time": time.time(), **values}, default=str)
    print(f"gpu-record: {line}")
    path = os.environ.get("GPU_CHECK_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
