"""Plain PyTorch definition of the compact host state's 8-bit Adam moments (csrc/q8_ops.cpp).

The two code formats, built from their formulas as value tables; quantisation as a search
for the nearest table value; dequantisation as a table lookup; and the 8-bit Adam step as
"dequantise, run ``adamw_step_reference_``, requantise". Readable and slow: the native
kernel's bit arithmetic must equal it (tests/ops/test_q8_ops.py).

Formats (one fp32 scale per block of ``Q8_BLOCK`` = 256 elements of the flat tensor; the last
block may be partial and its scale covers its own elements only):

- ``"m"`` (exp_avg): byte ``sign << 7 | c`` with ``c`` in 0..127, ``e = c >> 3``,
  ``f = c & 7``;
- ``"u"`` (u = sqrt(exp_avg_sq)): byte ``c`` in 0..255, ``e = c >> 4``, ``f = c & 15``;

``value(c) = f / 2^k * 2^-14`` if ``e == 0`` else ``(1 + f / 2^k) * 2^(e - 15)`` (k = 3, 4).
A block's scale is ``absmax / QMAX`` (fp32; QMAX = the largest value, 1.875 resp. 1.9375), 0
for an all-zero block (whose codes are all 0). An element's code is the one whose value is
nearest to ``|x| / scale`` (fp32), ties to the even code, the largest code for anything
beyond it; it decodes to ``value(code) * scale`` (fp32) with the sign for ``"m"``. A negative
``"m"`` value that rounds to code 0 is stored as 0x00 (never 0x80); a non-zero ``"u"`` value
never gets code 0 (it gets code 1); ``"u"`` encodes ``|x|``. Non-finite values are not
specified (the engine never passes them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from zenflow.ops.reference import adamw_step_reference_, corrected_sum_reference

Q8_BLOCK = 256
FORMATS = ("m", "u")
_MANT_BITS = {"m": 3, "u": 4}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"q8 format must be 'm' (exp_avg) or 'u' (sqrt(exp_avg_sq)), got {fmt!r}")


@functools.cache
def q8_values(fmt: str) -> torch.Tensor:
    """The magnitude of every code of format ``fmt`` (fp32, ascending): 128 for ``"m"``
    (codes 0..127), 256 for ``"u"``, from ``value(c)`` above (computed in float64; every
    value is exact in fp32)."""
    _check_format(fmt)
    mant = _MANT_BITS[fmt]
    codes = torch.arange(2 ** (4 + mant), dtype=torch.int64)
    e, f = codes >> mant, codes & (2**mant - 1)
    frac = f.double() / 2**mant
    normal = (1.0 + frac) * torch.pow(2.0, (e - 15).double())
    return torch.where(e == 0, frac * 2.0**-14, normal).float()


def q8_qmax(fmt: str) -> float:
    """The largest value of format ``fmt``: 1.875 (``"m"``), 1.9375 (``"u"``)."""
    return float(q8_values(fmt)[-1])


def q8_num_blocks(numel: int) -> int:
    """Scales of a tensor of ``numel`` elements: ``ceil(numel / Q8_BLOCK)``."""
    return -(-numel // Q8_BLOCK)


def nearest_code(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """The code (int64) whose value is nearest to each ``q >= 0`` (fp32): found by a search
    in the sorted table, the two neighbours' distances compared in fp32, ties to the even
    code, the largest code beyond the table."""
    table = q8_values(fmt)
    last = table.numel() - 1
    hi = torch.searchsorted(table, q).clamp(max=last)  # first value >= q (or the last)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = q - table[lo], table[hi] - q
    even = torch.where(hi % 2 == 0, hi, lo)
    code = torch.where(d_hi < d_lo, hi, torch.where(d_lo < d_hi, lo, even))
    return torch.where(q >= table[last], torch.full_like(code, last), code)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """The flat fp32 ``x`` zero-padded to whole blocks, as ``[blocks, Q8_BLOCK]``."""
    flat = x.reshape(-1)
    padded = torch.zeros(q8_num_blocks(flat.numel()) * Q8_BLOCK, dtype=torch.float32)
    padded[: flat.numel()] = flat
    return padded.view(-1, Q8_BLOCK)


def _per_element(scales: torch.Tensor, numel: int) -> torch.Tensor:
    """Each block's scale repeated over its elements (a dense tensor, so every division and
    product below is an element-wise fp32 operation)."""
    return scales.repeat_interleave(Q8_BLOCK)[:numel].contiguous()


def quantize_q8_reference_(
    src: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    fmt: str,
    num_threads: int = 0,
) -> None:
    """Codes (uint8, ``numel``) and block scales (fp32, ``ceil(numel / 256)``) of the fp32
    ``src`` in format ``fmt``, written into ``codes`` and ``scales``. ``num_threads`` is
    accepted for signature parity and ignored."""
    del num_threads
    _check_format(fmt)
    x = src.reshape(-1).float()
    numel = x.numel()
    absmax = _blocks(x.abs()).amax(dim=1)
    scale = absmax / torch.full_like(absmax, q8_qmax(fmt))
    per_element = _per_element(scale, numel)
    zero_block = per_element == 0
    q = torch.where(zero_block, 0.0, x.abs() / torch.where(zero_block, 1.0, per_element))
    code = nearest_code(q, fmt)
    if fmt == "m":
        code = torch.where((x < 0) & (code != 0), code | 0x80, code)
    else:
        code = torch.where((x != 0) & (code == 0), 1, code)
    codes.copy_(code.to(torch.uint8).view(codes.shape))
    scales.copy_(scale.view(scales.shape))


def dequantize_q8_reference_(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dst: torch.Tensor,
    *,
    fmt: str,
    num_threads: int = 0,
) -> None:
    """``dst`` (fp32) = ``value(code) * scale`` of its block, negated where an ``"m"`` code has
    its sign bit: a table lookup and one fp32 multiply per element."""
    del num_threads
    _check_format(fmt)
    c = codes.reshape(-1).long()
    magnitude = c & 0x7F if fmt == "m" else c
    value = q8_values(fmt)[magnitude] * _per_element(scales.reshape(-1), c.numel())
    if fmt == "m":
        value = torch.where(c >= 0x80, -value, value)
    dst.copy_(value.view(dst.shape))


def adamw_q8_step_reference_(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_scales: torch.Tensor,
    u_codes: torch.Tensor,
    u_scales: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    image: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    adamw_mode: bool = True,
    num_threads: int = 0,
    col_steps: torch.Tensor | None = None,
    col_inner: int = 1,
    corr_codes: torch.Tensor | None = None,
    corr_scales: torch.Tensor | None = None,
    corr_starts: torch.Tensor | None = None,
    corr_delta: float = 0.0,
    adam_step: Callable[..., None] | None = None,
) -> None:
    """The native ``adamw_q8_step_`` in plain PyTorch: dequantise ``m`` and ``v = u * u``
    (fp32), run the fp32 Adam step on them (element-wise, so one call over all blocks is the
    same as one per block), take ``u = sqrt(v)`` (correctly rounded) and quantise ``m`` and
    ``u`` again with new block scales. ``image`` (bf16) receives the updated param;
    ``col_steps`` / ``col_inner`` as in ``adamw_step_reference_``.

    ``adam_step`` is the fp32 step to run (default ``adamw_step_reference_``). The native
    kernel runs ``adamw_step_``'s instructions, which may differ from the reference by an
    ulp; passing the native ``adamw_step_`` here isolates the 8-bit part, which must then
    agree bit for bit. ``corr_*``: the q8 step store's correction, as ``adamw_step_``'s
    (``corrected_sum_reference``, in ``grad``'s dtype), then the step.
    """
    del num_threads
    if corr_codes is not None:
        grad = corrected_sum_reference(grad, corr_codes, corr_scales, corr_starts, corr_delta)
    numel = param.numel()
    m, u = torch.empty(numel), torch.empty(numel)
    dequantize_q8_reference_(m_codes, m_scales, m, fmt="m")
    dequantize_q8_reference_(u_codes, u_scales, u, fmt="u")
    v = u * u
    (adam_step or adamw_step_reference_)(
        param.view(-1), grad.reshape(-1), m, v, step=step, lr=lr, beta1=beta1, beta2=beta2,
        eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, adamw_mode=adamw_mode,
        param_bf16=None if image is None else image.view(-1), col_steps=col_steps,
        col_inner=col_inner,
    )  # fmt: skip
    quantize_q8_reference_(m, m_codes, m_scales, fmt="m")
    quantize_q8_reference_(sqrt_rounded(v), u_codes, u_scales, fmt="u")


def sqrt_rounded(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (what the native kernel's sqrt gives).

    torch's fp32 ``sqrt`` may be an ulp off (its vectorised CPU kernel is not correctly
    rounded); the float64 square root of an fp32 value rounded once to fp32 is correctly
    rounded, since 53 >= 2 * 24 + 2 bits make the double rounding innocuous.
    """
    return x.double().sqrt_().float()  # in place on the float64 copy: one temporary


SQRT_CHUNK = 1 << 20  # elements per float64 temporary of ``sqrt_rounded_`` (8 MiB)


def sqrt_rounded_(
    x: torch.Tensor, chunk: int | None = None, buf: torch.Tensor | None = None
) -> torch.Tensor:
    """``sqrt_rounded`` in place on a contiguous fp32 ``x``, ``chunk`` elements at a time:
    the same values, with one float64 buffer of a chunk (default ``SQRT_CHUNK``), reused
    for every chunk, instead of the whole tensor's (a 131M-element moment: 1 GB of float64
    and a 0.5 GB result otherwise) or one per chunk (many 8 MiB blocks freed in turn: they
    fragment the C heap between the host's other allocations). ``buf``: a float64 buffer to
    use instead (its size is the chunk; a selection's, ``MomentScratch``, lent to every
    weight). Returns ``x``."""
    if not x.is_contiguous():
        raise ValueError("sqrt_rounded_ needs a contiguous tensor")
    flat = x.view(-1)
    if buf is not None:
        if buf.dtype != torch.float64 or buf.dim() != 1 or not buf.numel():
            raise ValueError("sqrt_rounded_'s buf must be a non-empty 1-D float64 tensor")
    else:
        buf = torch.empty(min(chunk or SQRT_CHUNK, flat.numel()), dtype=torch.float64)
    for part in flat.split(buf.numel() or 1):
        wide = buf[: part.numel()]
        part.copy_(wide.copy_(part).sqrt_())  # float64 -> fp32: rounded once, as .float()
    return x
