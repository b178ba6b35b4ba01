"""Plain PyTorch reference of the CPU Adam step: readable, slow, the yardstick."""

from __future__ import annotations

import math

import torch

_OP = "adamw_step_reference_"


def adamw_step_reference_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    param_bf16: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    adamw_mode: bool = True,
    num_threads: int = 0,
    col_steps: torch.Tensor | None = None,
    col_inner: int = 1,
    corr_codes: torch.Tensor | None = None,
    corr_scales: torch.Tensor | None = None,
    corr_starts: torch.Tensor | None = None,
    corr_delta: float = 0.0,
) -> None:
    """One in-place Adam(W) step, the same arithmetic as torch.optim.AdamW's loop.

    AdamW (``adamw_mode=True``): ``p *= 1 - lr*wd`` (decoupled decay); Adam: ``g += wd*p``.
    Then ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``,
    ``p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``. ``num_threads`` is accepted
    for signature parity with the native op and ignored.

    ``col_steps`` (int64, 1-D, contiguous, CPU, C >= 1 entries, each >= 1) replaces ``t``
    per column: element ``i`` of the flattened param uses ``col_steps[(i // col_inner) % C]``
    (``step`` is then not used for bias correction). The per-column constants
    ``lr/(1-b1^t)`` and ``sqrt(1-b2^t)`` are computed in float64 and cast to float32, as the
    native op does. Raises ``ValueError`` naming the argument for a bad ``col_steps`` or
    ``col_inner``.
    """
    del num_threads
    if col_inner < 1:
        raise ValueError(f"{_OP}: col_inner must be >= 1 (elements per run), got {col_inner}")
    if col_steps is not None:
        check_col_steps(param, col_steps, col_inner)
    if corr_codes is not None:  # the q8 correction: its pass over a copy of the sum
        if grad.dtype != torch.float32:
            raise ValueError(f"{_OP}: a correction needs an fp32 grad, got {grad.dtype}")
        grad = corrected_sum_reference(grad, corr_codes, corr_scales, corr_starts, corr_delta)
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    if weight_decay != 0.0:
        if adamw_mode:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    if col_steps is None:
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    else:
        # Columns as a middle dimension: [rows, C, col_inner] over the flat param, and the
        # per-column constants as [C, 1], which broadcasts over rows and each run.
        num_cols = col_steps.numel()
        shape = (-1, num_cols, col_inner)
        t = col_steps.to(torch.float64)
        bias_correction1 = 1.0 - torch.pow(beta1, t)
        bias_correction2 = 1.0 - torch.pow(beta2, t)
        step_size = (-lr / bias_correction1).float().view(num_cols, 1)
        bias_correction2_sqrt = bias_correction2.sqrt().float().view(num_cols, 1)
        denom = (exp_avg_sq.view(shape).sqrt() / bias_correction2_sqrt).add_(eps)
        param.view(shape).add_(step_size * (exp_avg.view(shape) / denom))
    if param_bf16 is not None:
        param_bf16.copy_(param)


def corrected_sum_reference(grad: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                            starts: torch.Tensor, delta: float) -> torch.Tensor:  # fmt: skip
    """The Adam ops' correction in plain PyTorch: a copy of the window sum ``grad`` (fp32 or
    bf16, kept) with ``add_dequantized_i8_reference_`` over each piece (``starts``: the
    pieces' first elements, then numel; each piece's scales after the one before's)."""
    out = grad.reshape(-1).clone()
    bounds = [int(x) for x in starts]
    if bounds[0] != 0 or bounds[-1] != out.numel():
        raise ValueError(f"{_OP}: corr_starts must begin at 0 and end at numel")
    b = 0
    for a, z in zip(bounds[:-1], bounds[1:], strict=True):
        nb = i8_num_blocks(z - a)
        add_dequantized_i8_reference_(out[a:z], codes[a:z], scales[b : b + nb], delta)
        b += nb
    return out.view_as(grad)


def check_col_steps(param: torch.Tensor, col_steps: torch.Tensor, col_inner: int) -> None:
    """Raise ``ValueError`` naming the argument unless ``col_steps`` fits ``param``.

    The same rules as the native op: int64, 1-D, contiguous, on the CPU, at least one
    column, every entry >= 1, and ``param.numel()`` a multiple of ``C * col_inner``.
    """
    if col_steps.device.type != "cpu":
        raise ValueError(f"{_OP}: col_steps must be on the CPU, got {col_steps.device}")
    if col_steps.dtype != torch.int64:
        raise ValueError(f"{_OP}: col_steps must be int64, got {col_steps.dtype}")
    if col_steps.dim() != 1:
        raise ValueError(
            f"{_OP}: col_steps must be 1-D (one step per column), got {col_steps.dim()} dims"
        )
    if not col_steps.is_contiguous():
        raise ValueError(f"{_OP}: col_steps must be contiguous, got strides {col_steps.stride()}")
    num_cols = col_steps.numel()
    if num_cols < 1:
        raise ValueError(f"{_OP}: col_steps must have at least one column, got 0")
    if param.numel() % (num_cols * col_inner) != 0:
        raise ValueError(
            f"{_OP}: param has {param.numel()} elements, not a multiple of "
            f"col_steps.numel() * col_inner = {num_cols} * {col_inner}"
        )
    if not param.is_contiguous():
        raise ValueError(f"{_OP}: param must be contiguous to be viewed by column")
    smallest = int(col_steps.min())
    if smallest < 1:
        column = int(col_steps.argmin())
        raise ValueError(
            f"{_OP}: col_steps must be >= 1 (1-based, for bias correction), got {smallest} "
            f"at column {column}"
        )


def adamw_compact_step_reference_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    index: torch.Tensor,
    column_dim: int,
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
) -> None:
    """The native ``adamw_compact_step_`` in plain PyTorch: gather the columns ``index`` of
    the 2-D fp32 ``param``/moments along ``column_dim`` (the compact layout of ``grad``),
    run ``adamw_step_reference_`` on them, scatter them back. ``image`` (bf16, compact)
    receives the updated columns; the other columns are not touched. ``col_steps``: one
    count per column id (``param.shape[column_dim]`` entries)."""
    del num_threads
    if param.dim() != 2 or column_dim not in (0, 1):
        raise ValueError("adamw_compact_step_reference_: param must be 2-D, column_dim 0 or 1")
    cols = [t.index_select(column_dim, index) for t in (param, exp_avg, exp_avg_sq)]
    kw = {}
    if col_steps is not None:
        inner = 1 if column_dim == 1 else param.shape[1]
        kw = {"col_steps": col_steps[index].contiguous(), "col_inner": inner}
    adamw_step_reference_(
        cols[0], grad.reshape(cols[0].shape), cols[1], cols[2], step=step, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
        adamw_mode=adamw_mode, **kw,
    )  # fmt: skip
    for full, part in zip((param, exp_avg, exp_avg_sq), cols, strict=True):
        full.index_copy_(column_dim, index, part)
    if image is not None:
        image.copy_(cols[0].reshape(image.shape))


def accumulate_reference_(
    dst: torch.Tensor,
    src: torch.Tensor,
    scale: float,
    overwrite: bool,
    sumsq: bool = False,
    num_threads: int = 0,
) -> float:
    """The native ``accumulate_`` in plain PyTorch: ``dst = scale * src`` (overwrite) or
    ``dst += scale * src`` with the product rounded to fp32 first; returns the sum of
    squares of ``dst`` afterwards (float64) when ``sumsq``, else 0. A bf16 ``dst`` gets the
    fp32 result ``float(dst) + fp32(scale * src)`` (resp. the product) rounded to nearest
    even, and the sum of squares is over the stored bf16 values. Bit for bit the native
    op's ``dst``."""
    del num_threads
    x = src.reshape(dst.shape).float()
    if scale != 1.0:
        x = x * torch.tensor(scale, dtype=torch.float32)
    if dst.dtype == torch.bfloat16:
        dst.copy_(x if overwrite else dst.float() + x)
    elif overwrite:
        dst.copy_(x)
    else:
        dst.add_(x)
    return float(dst.double().square().sum()) if sumsq else 0.0


I8_BLOCK = 256  # elements per scale of a step store's 8-bit copy (zfctl.step_store "q8")


def i8_num_blocks(numel: int) -> int:
    """Scales of an 8-bit copy of ``numel`` elements: ``ceil(numel / I8_BLOCK)``."""
    return -(-numel // I8_BLOCK)


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """The flat fp32 ``flat`` zero-padded to whole blocks, as ``[blocks, I8_BLOCK]``."""
    padded = torch.zeros(i8_num_blocks(flat.numel()) * I8_BLOCK, dtype=torch.float32)
    padded[: flat.numel()] = flat
    return padded.view(-1, I8_BLOCK)


def accumulate_keep_i8_reference_(
    dst: torch.Tensor,
    src: torch.Tensor,
    scale: float,
    codes: torch.Tensor,
    scales: torch.Tensor,
    num_threads: int = 0,
    prev_mul: float = 1.0,
    prev_delta: float = 0.0,
) -> None:
    """The native ``accumulate_keep_i8_`` in plain PyTorch: the previous step's correction
    where asked (``add_dequantized_i8_reference_`` from the copy held, or ``dst * prev_mul``
    in fp32, stored in ``dst``'s dtype), then ``accumulate_reference_``'s add (not an
    overwrite), and ``src``'s 8-bit copy: per block of 256, ``s = absmax / 127`` (fp32, 0
    for an all-zero block), ``code = round_half_even(x * (127 / absmax))`` clamped to
    -127..127 (int8). Bit for bit the native op."""
    if prev_delta != 0.0:
        add_dequantized_i8_reference_(dst, codes, scales, prev_delta)
    elif prev_mul != 1.0:
        dst.copy_(dst.float() * torch.tensor(prev_mul, dtype=torch.float32))
    flat = src.reshape(-1).float()
    x = _blocks(flat)
    absmax = x.abs().amax(dim=1)
    nonzero = absmax > 0
    inv = torch.where(nonzero, torch.full_like(absmax, 127.0).div(absmax), 0.0)
    q = torch.round(x * inv[:, None]).clamp_(-127.0, 127.0)
    codes.copy_(q.reshape(-1)[: flat.numel()].to(torch.int8))
    scales.copy_(absmax.div(torch.tensor(127.0, dtype=torch.float32)))
    accumulate_reference_(dst, src, scale, False)


def dequantized_i8_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An 8-bit copy decoded: fp32 ``code * s`` of its block, flat."""
    n = codes.numel()
    per = scales.repeat_interleave(I8_BLOCK)[:n]
    return codes.reshape(-1).float() * per


def add_dequantized_i8_reference_(
    dst: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scale: float,
    num_threads: int = 0,
) -> None:  # fmt: skip
    """The native ``add_dequantized_i8_`` in plain PyTorch: ``dst += fp32(scale * fp32(code *
    s))`` (a bf16 ``dst`` as ``accumulate_reference_``). Bit for bit the native op."""
    del num_threads
    accumulate_reference_(dst, dequantized_i8_reference(codes, scales), scale, False)


def compact_merge_reference_(
    data: torch.Tensor,
    drop: torch.Tensor,
    insert_at: torch.Tensor,
    values: torch.Tensor,
    column_dim: int,
    num_threads: int = 0,
) -> None:
    """The native ``compact_merge_`` in plain PyTorch: the staying columns of ``data`` (all
    but the old positions ``drop``) gathered, in order, into every position but
    ``insert_at``, and ``values`` scattered into ``insert_at``; the result written back into
    ``data``. Bit for bit the native op (it only moves values)."""
    del num_threads
    n = data.shape[column_dim]
    keep = torch.ones(n, dtype=torch.bool)
    keep[drop] = False
    stay = torch.ones(n, dtype=torch.bool)
    stay[insert_at] = False
    new = torch.empty_like(data)
    new.index_copy_(column_dim, stay.nonzero().flatten(),
                    data.index_select(column_dim, keep.nonzero().flatten()))  # fmt: skip
    if insert_at.numel():
        new.index_copy_(column_dim, insert_at, values)
    data.copy_(new)


def gather_columns_reference_(
    out: torch.Tensor,
    src: torch.Tensor,
    index: torch.Tensor,
    dim: int,
    num_threads: int = 0,
) -> None:
    """The native ``gather_columns_`` in plain PyTorch: ``torch.index_select`` into ``out``."""
    del num_threads
    torch.index_select(src, dim, index, out=out)
