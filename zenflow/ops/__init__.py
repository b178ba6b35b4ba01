"""Native CPU Adam ops and their plain reference.

Public API (other modules and external checks build on these names):

- ``adamw_step_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
  weight_decay, param_bf16=None, grad_scale=1.0, adamw_mode=True, num_threads=0,
  col_steps=None, col_inner=1)``:
  one in-place AdamW step with the native SIMD kernel (built on first use; routed to the
  reference when ``ZENFLOW_OPS=reference``).
- ``adamw_step_reference_(...)``: the same step in plain PyTorch, same signature.
- ``adamw_compact_step_`` / ``accumulate_``: the host side of the non-selected columns in
  the compact layout (fp32 state; ``accumulate_`` also sums into a bf16 ``dst``).
- ``adamw_q8_step_``, ``quantize_q8_``, ``dequantize_q8_``: the compact host state with
  8-bit block-wise moments (formats in ``zenflow.ops.q8_reference``; ``Q8_BLOCK`` elements
  per scale, ``q8_num_blocks(numel)`` scales per tensor).
- ``accumulate_keep_i8_``, ``add_dequantized_i8_``: the q8 step store's add with its 8-bit
  linear copy of the piece, and the correction from that copy (``I8_BLOCK`` elements per
  scale, ``i8_num_blocks(numel)`` scales; ``dequantized_i8_reference`` decodes a copy).
- ``gather_columns_(out, src, index, dim, num_threads=0)``: ``out = src.index_select(dim,
  index)`` for contiguous CPU tensors, on the threads (the host's column gathers).
- ``*_reference_``: each op in plain PyTorch, same signature; ``ZENFLOW_OPS=reference``
  routes every op to it.
- ``load_native()``, ``native_status()``, ``simd_path()``, ``NativeBuildError``: see
  ``zenflow.ops.loader``.

``step`` is the 1-based step number used for bias correction. ``grad_scale`` multiplies
the gradient before use (pass 1/S to average a window's gradient *sum* without a
separate pass). ``adamw_mode=False`` gives classic Adam with L2 weight decay.

Per-column step counts: ZenFlow hands columns of a 2-D weight between the device and the
host with their moments, so each column keeps its own step count. ``col_steps`` (int64,
1-D, contiguous, CPU, C >= 1 entries, each >= 1) gives it: element ``i`` of the flattened
param takes its bias correction from ``col_steps[(i // col_inner) % C]``, and ``step`` is
then only checked, not used (pass e.g. the largest count). ``numel`` must be a multiple of
``C * col_inner``. An ``nn.Linear`` weight ``[out, in]`` (columns along dim 1) is
``col_inner=1, C=in``; a transformers ``Conv1D`` weight ``[in, out]`` (columns along dim 0)
is ``col_inner=out, C=in``. ``col_inner`` is ignored without ``col_steps``.
Importing this package builds nothing.
"""

from __future__ import annotations

import torch

from zenflow.ops.loader import NativeBuildError, load_native, native_status, ops_mode, simd_path
from zenflow.ops.q8_reference import (
    Q8_BLOCK,
    adamw_q8_step_reference_,
    dequantize_q8_reference_,
    q8_num_blocks,
    q8_values,
    quantize_q8_reference_,
)
from zenflow.ops.reference import (
    I8_BLOCK,
    accumulate_keep_i8_reference_,
    accumulate_reference_,
    adamw_compact_step_reference_,
    adamw_step_reference_,
    add_dequantized_i8_reference_,
    compact_merge_reference_,
    dequantized_i8_reference,
    gather_columns_reference_,
    i8_num_blocks,
)

__all__ = [
    "I8_BLOCK",
    "NativeBuildError",
    "Q8_BLOCK",
    "accumulate_",
    "accumulate_keep_i8_",
    "accumulate_keep_i8_reference_",
    "accumulate_reference_",
    "add_dequantized_i8_",
    "add_dequantized_i8_reference_",
    "adamw_compact_step_",
    "adamw_compact_step_reference_",
    "adamw_q8_step_",
    "adamw_q8_step_reference_",
    "adamw_step_",
    "adamw_step_reference_",
    "compact_merge_",
    "compact_merge_reference_",
    "gather_columns_",
    "gather_columns_reference_",
    "dequantize_q8_",
    "dequantize_q8_reference_",
    "dequantized_i8_reference",
    "i8_num_blocks",
    "load_native",
    "native_status",
    "q8_num_blocks",
    "q8_values",
    "quantize_q8_",
    "quantize_q8_reference_",
    "simd_path",
]


def adamw_step_(
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
    """One in-place Adam(W) step on contiguous CPU tensors with the native kernel.

    ``param``, ``exp_avg`` and ``exp_avg_sq`` are fp32 and updated in place; ``grad`` is
    fp32 or bf16 and read only; ``param_bf16`` (optional, bf16, same numel) receives the
    updated param rounded to bf16 in the same pass. ``num_threads > 0`` sets the OpenMP
    team size for this call (0 = OpenMP default); results do not depend on it.

    ``col_steps`` (optional, int64, 1-D, contiguous, CPU, C >= 1 entries, each >= 1) gives
    every column its own 1-based bias-correction step: element ``i`` of the flattened param
    belongs to column ``(i // col_inner) % C``, and ``step`` is not used for bias
    correction (it must still be >= 1; pass e.g. the largest count). ``numel`` must be a
    multiple of ``C * col_inner``. ``nn.Linear`` weight ``[out, in]``: ``col_inner=1``,
    ``C=in``; ``Conv1D`` weight ``[in, out]``: ``col_inner=out``, ``C=in``. With every entry
    equal to ``step`` the result is bit-identical to the call without ``col_steps``.

    ``corr_codes`` / ``corr_scales`` / ``corr_starts`` / ``corr_delta`` (zfctl.step_store
    "q8": a window's last correction, taken in as the sum is read): the step reads ``grad +
    corr_delta * `` the decoded 8-bit copy (``accumulate_keep_i8_``'s, one per piece, the
    pieces starting at ``corr_starts[:-1]``, ``corr_starts[-1] == numel``), each product
    and sum rounded to fp32 as ``add_dequantized_i8_`` stores them: bit for bit that pass
    over each piece of ``grad`` followed by this step, without writing ``grad``. fp32
    ``grad`` only.

    Releases the GIL while it runs. Raises ``RuntimeError`` starting with
    ``zenflow::adamw_step_`` and naming the bad argument for a tensor that is not
    contiguous, not on the CPU, of the wrong dtype or size, and for a bad ``col_steps``,
    ``col_inner`` or correction.
    """
    if ops_mode() == "reference":
        adamw_step_reference_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            param_bf16=param_bf16,
            grad_scale=grad_scale,
            adamw_mode=adamw_mode,
            num_threads=num_threads,
            col_steps=col_steps,
            col_inner=col_inner,
            corr_codes=corr_codes,
            corr_scales=corr_scales,
            corr_starts=corr_starts,
            corr_delta=corr_delta,
        )
        return
    load_native()
    torch.ops.zenflow.adamw_step_.default(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param_bf16,
        int(step),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        float(grad_scale),
        bool(adamw_mode),
        int(num_threads),
        col_steps,
        int(col_inner),
        corr_codes,
        corr_scales,
        corr_starts,
        float(corr_delta),
    )


def adamw_compact_step_(
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
    """One in-place Adam(W) step of the columns ``index`` of a 2-D fp32 weight's host state
    (``param``, ``exp_avg``, ``exp_avg_sq``: full shape, contiguous) from a gradient in the
    compact layout ``W.index_select(column_dim, index)`` (fp32 or bf16, contiguous).

    ``index``: int64, sorted, distinct column ids along ``column_dim``; the other columns
    are not read or written. ``image`` (optional, bf16, compact layout) receives the updated
    columns rounded to bf16 in the same pass (what goes back to the device). ``col_steps``
    (optional, int64, one entry per column id) gives each column its 1-based count;
    otherwise ``step`` is every column's. Same arithmetic as ``adamw_step_`` (bit-identical
    on those elements, for any ``num_threads``); raises ``RuntimeError`` starting with
    ``zenflow::adamw_compact_step_`` for a bad argument.
    """
    if ops_mode() == "reference":
        adamw_compact_step_reference_(
            param, grad, exp_avg, exp_avg_sq, index, column_dim, step=step, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, image=image,
            grad_scale=grad_scale, adamw_mode=adamw_mode, col_steps=col_steps,
        )  # fmt: skip
        return
    load_native()
    torch.ops.zenflow.adamw_compact_step_.default(
        param, grad, exp_avg, exp_avg_sq, index, int(column_dim), image, int(step), float(lr),
        float(beta1), float(beta2), float(eps), float(weight_decay), float(grad_scale),
        bool(adamw_mode), int(num_threads), col_steps,
    )  # fmt: skip


def accumulate_(
    dst: torch.Tensor,
    src: torch.Tensor,
    scale: float = 1.0,
    overwrite: bool = False,
    sumsq: bool = False,
    num_threads: int = 0,
) -> float:
    """``dst = scale * src`` (``overwrite``) or ``dst += scale * src`` (the product rounded
    to fp32 first, as clipping a gradient and then summing it), in place on
    contiguous CPU tensors (``dst`` fp32 or bf16, ``src`` fp32 or bf16, same numel), on
    ``num_threads`` threads (0 = OpenMP default; the result does not depend on it). A bf16
    ``dst`` is summed in fp32 and stored rounded to nearest even:
    ``bf16(float(dst) + fp32(scale * src))``. Returns the sum of squares of ``dst``
    afterwards (float64, of the stored values) when ``sumsq``, else 0.0. Releases the GIL
    while it runs."""
    if ops_mode() == "reference":
        return accumulate_reference_(dst, src, scale, overwrite, sumsq)
    load_native()
    return float(
        torch.ops.zenflow.accumulate_.default(
            dst, src, float(scale), bool(overwrite), bool(sumsq), int(num_threads)
        )
    )


def accumulate_keep_i8_(
    dst: torch.Tensor,
    src: torch.Tensor,
    scale: float,
    codes: torch.Tensor,
    scales: torch.Tensor,
    num_threads: int = 0,
    prev_mul: float = 1.0,
    prev_delta: float = 0.0,
) -> None:
    """``dst += scale * src`` (``accumulate_``'s add) and, in the same pass, ``src``'s 8-bit
    copy: ``codes`` (int8 ``[N]``), ``scales`` (fp32 ``[ceil(N/256)]``; per block absmax /
    127, the codes ``x * 127 / absmax`` rounded to even). Before the add, the previous
    step's correction of ``dst`` where asked: ``dst *= prev_mul`` (``!= 1``), or ``dst +=
    prev_delta * `` the copy ``codes``/``scales`` held before this call (``!= 0``), bit for
    bit that correction as its own pass. ``dst`` fp32 or bf16, ``src`` fp32 or bf16,
    contiguous. Bit for bit ``accumulate_keep_i8_reference_``; the result does not depend on
    ``num_threads``. Releases the GIL while it runs."""
    if ops_mode() == "reference":
        accumulate_keep_i8_reference_(dst, src, scale, codes, scales, 0, prev_mul, prev_delta)
        return
    load_native()
    torch.ops.zenflow.accumulate_keep_i8_.default(dst, src, float(scale), codes, scales,
                                                  int(num_threads), float(prev_mul),
                                                  float(prev_delta))  # fmt: skip


def add_dequantized_i8_(
    dst: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scale: float,
    num_threads: int = 0,
) -> None:  # fmt: skip
    """``dst += scale * decoded copy`` (the copy ``accumulate_keep_i8_`` made; the product
    rounded to fp32 first). Bit for bit ``add_dequantized_i8_reference_``."""
    if ops_mode() == "reference":
        add_dequantized_i8_reference_(dst, codes, scales, scale)
        return
    load_native()
    torch.ops.zenflow.add_dequantized_i8_.default(dst, codes, scales, float(scale),
                                                  int(num_threads))  # fmt: skip


def adamw_q8_step_(
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
) -> None:
    """One in-place Adam(W) step with 8-bit block-wise moments, on contiguous CPU tensors.

    ``param`` fp32 ``[N]`` (updated); ``grad`` fp32 or bf16 ``[N]`` (read, times
    ``grad_scale``); ``m_codes`` uint8 ``[N]`` + ``m_scales`` fp32 ``[ceil(N/256)]``: exp_avg
    in the ``"m"`` format; ``u_codes`` + ``u_scales``: ``u = sqrt(exp_avg_sq)`` in the
    ``"u"`` format (all four updated); ``image`` (optional, bf16 ``[N]``) receives the
    updated param rounded to bf16. Per 256-element block: dequantise ``m`` and ``v = u*u``,
    run ``adamw_step_``'s exact fp32 element arithmetic, requantise ``m`` and
    ``u = sqrt(v)`` with the block's new scales. ``step``, the hyper-parameters,
    ``col_steps`` and ``col_inner`` mean what they mean for ``adamw_step_``; results do not
    depend on ``num_threads``. ``corr_*``: a q8 step store's last correction taken in as
    the step reads ``grad`` (fp32 or bf16: the corrected value rounded to its dtype, as the
    pass stores it), as ``adamw_step_``'s. Non-finite values are not supported (the engine
    skips such steps). Releases the GIL; raises ``RuntimeError`` starting with
    ``zenflow::adamw_q8_step_`` naming a bad argument.
    """
    if ops_mode() == "reference":
        adamw_q8_step_reference_(
            param, grad, m_codes, m_scales, u_codes, u_scales, step=step, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, image=image, grad_scale=grad_scale,
            adamw_mode=adamw_mode, col_steps=col_steps, col_inner=col_inner,
            corr_codes=corr_codes, corr_scales=corr_scales, corr_starts=corr_starts,
            corr_delta=corr_delta,
        )  # fmt: skip
        return
    load_native()
    torch.ops.zenflow.adamw_q8_step_.default(
        param, grad, m_codes, m_scales, u_codes, u_scales, image, int(step), float(lr),
        float(beta1), float(beta2), float(eps), float(weight_decay), float(grad_scale),
        bool(adamw_mode), int(num_threads), col_steps, int(col_inner), corr_codes,
        corr_scales, corr_starts, float(corr_delta),
    )  # fmt: skip


def _is_signed(fmt: str) -> bool:
    if fmt not in ("m", "u"):
        raise ValueError(f"q8 format must be 'm' (exp_avg) or 'u' (sqrt(exp_avg_sq)), got {fmt!r}")
    return fmt == "m"


def quantize_q8_(
    src: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    fmt: str,
    num_threads: int = 0,
) -> None:
    """Quantise the fp32 ``src`` (contiguous, ``N`` elements) into ``codes`` (uint8 ``[N]``)
    and ``scales`` (fp32 ``[ceil(N/256)]``), in place, in format ``fmt``: ``"m"`` (exp_avg,
    signed) or ``"u"`` (sqrt(exp_avg_sq), unsigned; encodes ``|x|``). Bit for bit
    ``quantize_q8_reference_``; results do not depend on ``num_threads``."""
    is_signed = _is_signed(fmt)
    if ops_mode() == "reference":
        quantize_q8_reference_(src, codes, scales, fmt=fmt)
        return
    load_native()
    torch.ops.zenflow.quantize_q8_.default(src, codes, scales, is_signed, int(num_threads))


def dequantize_q8_(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dst: torch.Tensor,
    *,
    fmt: str,
    num_threads: int = 0,
) -> None:
    """Write ``value(code) * scale`` of each element (signed for ``fmt="m"``) into the fp32
    ``dst`` (contiguous, ``N`` elements) from ``codes`` (uint8 ``[N]``) and ``scales`` (fp32
    ``[ceil(N/256)]``). Bit for bit ``dequantize_q8_reference_``."""
    is_signed = _is_signed(fmt)
    if ops_mode() == "reference":
        dequantize_q8_reference_(codes, scales, dst, fmt=fmt)
        return
    load_native()
    torch.ops.zenflow.dequantize_q8_.default(codes, scales, dst, is_signed, int(num_threads))


def compact_merge_(
    data: torch.Tensor,
    drop: torch.Tensor,
    insert_at: torch.Tensor,
    values: torch.Tensor,
    column_dim: int,
    num_threads: int = 0,
) -> None:
    """A hand-over's re-layout of one compact host array (``[rows, n]`` for ``column_dim`` 1,
    ``[n, inner]`` for 0; contiguous, any dtype), in place: the columns at the old positions
    ``drop`` leave, the staying ones keep their order, and ``values`` (the joining columns
    in the same layout, ``insert_at``'s order) take the new positions ``insert_at``. ``drop``
    and ``insert_at``: int64, sorted, distinct, as many of each. No new array: runs of
    staying columns are moved with memmove (rows on ``num_threads`` threads). Raises
    ``RuntimeError`` starting with ``zenflow::compact_merge_`` for a bad argument."""
    if ops_mode() == "reference":
        compact_merge_reference_(data, drop, insert_at, values, column_dim)
        return
    load_native()
    torch.ops.zenflow.compact_merge_.default(
        data, drop, insert_at, values, int(column_dim), int(num_threads)
    )


def gather_columns_(
    out: torch.Tensor,
    src: torch.Tensor,
    index: torch.Tensor,
    dim: int,
    num_threads: int = 0,
) -> None:
    """``out = src.index_select(dim, index)`` (contiguous CPU tensors of one dtype, any;
    ``index`` int64, any order, repeats allowed; ``out`` shaped as the result, not
    overlapping ``src``), on ``num_threads`` threads: memcpys of runs of consecutive ids,
    one per run and slice. Raises ``RuntimeError`` starting with ``zenflow::gather_columns_``
    for a bad argument."""
    if ops_mode() == "reference":
        gather_columns_reference_(out, src, index, dim)
        return
    load_native()
    torch.ops.zenflow.gather_columns_.default(out, src, index, int(dim), int(num_threads))
