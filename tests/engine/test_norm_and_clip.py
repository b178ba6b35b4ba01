"""A gradient's norm and its clipping on the device, each against its plain reference:

- ``zenflow.engine.distributed.grad_norm``: on a CPU-memory device a large bf16/fp16 tensor
  is taken in chunks of ``NORM_CHUNK`` (no whole fp32 copy), bit for bit the norm of the
  chunks' fp32 norms, and close to the float64 norm; anything else is torch's one call;
- ``zenflow.engine.global_norm.clip_in_place``: one foreach multiplication for every
  remaining gradient, each multiplied in fp32 and rounded once to its dtype, element-wise.
"""

from __future__ import annotations

import math

import pytest
import torch

from zenflow.engine.distributed import NORM_CHUNK, grad_norm
from zenflow.engine.global_norm import clip_coefficient, clip_in_place


def _chunked_reference(t: torch.Tensor) -> torch.Tensor:
    """The plain definition: the fp32 norm of each chunk (converted whole), then theirs."""
    flat = t.reshape(-1).float()
    parts = [torch.linalg.vector_norm(flat[i : i + NORM_CHUNK], 2.0)
             for i in range(0, flat.numel(), NORM_CHUNK)]  # fmt: skip
    return torch.linalg.vector_norm(torch.stack(parts), 2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_large_low_precision_norm_is_the_norm_of_its_chunks(dtype):
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(3 * NORM_CHUNK + 17, generator=g) * 3.0).to(dtype).view(-1, 1)
    got = grad_norm(t)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert torch.equal(got, _chunked_reference(t))
    # no further from the float64 norm than torch's one call (3e-6 to 1.1e-5 of it against
    # 4e-6 to 8e-4, 0.8M to 16M elements in bf16 and fp16, on the project's CPU box)
    exact = t.double().norm().item()
    whole = torch.linalg.vector_norm(t, 2.0, dtype=torch.float32).item()
    assert abs(got.item() - exact) <= abs(whole - exact), (got.item(), whole, exact)
    assert math.isclose(got.item(), exact, rel_tol=3e-5), (got.item(), exact)
    out = torch.empty((), dtype=torch.float32)
    assert grad_norm(t, out=out) is out and torch.equal(out, got)


def test_small_and_fp32_norms_are_torchs_one_call():
    g = torch.Generator().manual_seed(2)
    small = torch.randn(NORM_CHUNK, generator=g).to(torch.bfloat16)
    big32 = torch.randn(2 * NORM_CHUNK + 5, generator=g)
    for t in (small, big32):
        assert torch.equal(grad_norm(t), torch.linalg.vector_norm(t, 2.0, dtype=torch.float32))
    strided = torch.randn(1024, 600, generator=g).to(torch.bfloat16).t()  # not contiguous
    want = torch.linalg.vector_norm(strided, 2.0, dtype=torch.float32)
    assert torch.equal(grad_norm(strided), want)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_chunk_makes_the_norm_non_finite(bad):
    t = torch.ones(2 * NORM_CHUNK + 3, dtype=torch.bfloat16)
    t[NORM_CHUNK + 7] = bad
    got = grad_norm(t).item()
    assert math.isinf(got) if bad == float("inf") else math.isnan(got), got


def _grads(seed: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor | None] = []
    for dtype, n in ((torch.bfloat16, 4099), (torch.float32, 37), (torch.float16, 5),
                     (torch.bfloat16, 0), (torch.float32, 70000)):  # fmt: skip
        out.append((torch.randn(n, generator=g) * 7.0).to(dtype))
        out.append(None)  # a parameter without a gradient this step
    return out


def test_every_gradient_is_scaled_in_fp32_and_rounded_once():
    coef, coef_t = clip_coefficient(1.0, 3.7, torch.device("cpu"))
    assert coef < 1.0 and coef_t is not None and coef_t.dtype == torch.float32
    grads = _grads(0)
    want = [None if g is None else (g.float() * coef_t).to(g.dtype) for g in grads]
    one_by_one = [None if g is None else g.clone().mul_(coef_t) for g in grads]
    clip_in_place(grads, coef_t)
    for got, ref, plain in zip(grads, want, one_by_one, strict=True):
        if ref is None:
            assert got is None
            continue
        assert got.dtype == ref.dtype
        assert torch.equal(got, ref)
        assert torch.equal(got, plain)


def test_no_gradient_left_is_nothing_to_do():
    clip_in_place([None, None], torch.full((), 0.5))
    clip_in_place([], torch.full((), 0.5))
