"""A plain, single-threaded reference of the whole ZenFlow schedule, for tests.

It keeps every tensor FULL-size (device moments included: only the selected columns of
them mean anything), runs the "asynchronous" host step immediately and simply delays
copying its result to the weights, which is what overlap means for the values:

- the host step of the window ending at step e is applied at the end of the next window
  (overlap) or at e itself (no overlap); staleness of non-selected columns <= 2S / S;
- at a reselection (only at a window end) everything pending is applied first, the
  current window's host step is applied immediately, then ownership moves by index
  with the moments AND the per-column step counts carried across (the device counts
  steps, the host counts windows; bias correction uses each column's own count);
- warm-up steps update everything: matrices by the host AdamW, the rest on the device;
  a window's host step updates the non-selected columns only (the host's state), each
  with its own count (one scalar count when they agree);
- the auto update interval votes per weight (accumulated non-selected mass per column >=
  mean per-step selected mass per column) and ends the window at auto_ratio, bound 1..64;
- a host step's lr is the lr (``window_lr`` "last") or, with "sum", the lr times the
  window's steps, summed step by step as the engine sums the lrs of the window's steps;
  with "sqrt", that sum over sqrt(n) and AdamW's weight decay times sqrt(n) (their
  product, the window's decay, is the sum's);
- re-selection is due ``select_every`` steps after the last selection, or with
  ``select_schedule`` "doubling" S, 2S, 4S, ... steps after it (S the update interval, 1
  with "auto"; the n-th re-selection waits S * 2**(n-1)), capped at ``select_every``.

It deliberately shares no code with the engine except the host CPU AdamW kernel
(``host_kernel``, default the ops reference) and the column-score definition.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from zenflow.ops import (
    adamw_q8_step_reference_,
    adamw_step_reference_,
    dequantize_q8_reference_,
    q8_num_blocks,
    quantize_q8_reference_,
)
from zenflow.ops.q8_reference import sqrt_rounded


def _device_adamw(p, g, m, v, step, lr, b1, b2, eps, wd, adamw_mode=True, dim=None):
    """torch.optim.AdamW's single-tensor arithmetic, in place. ``step``: an int, or with
    ``dim`` an int64 tensor of per-column counts along ``dim`` (fp32 factors from float64)."""
    if wd != 0.0:
        if adamw_mode:
            p.mul_(1 - lr * wd)
        else:
            g = g.add(p, alpha=wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    if dim is None:
        bc1 = 1 - b1**step
        bc2_sqrt = (1 - b2**step) ** 0.5
        p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-lr / bc1)
        return
    t = step.to(torch.float64)
    shape = [1] * p.dim()
    shape[dim] = -1
    neg_step_size = (-lr / (1 - torch.full_like(t, b1).pow(t))).float().view(shape)
    bc2_sqrt = torch.sqrt(1 - torch.full_like(t, b2).pow(t)).float().view(shape)
    p.add_(m / (v.sqrt() / bc2_sqrt).add_(eps) * neg_step_size)


def _uniform(counts: torch.Tensor) -> int | None:
    lo, hi = int(counts.min()), int(counts.max())
    return lo if lo == hi else None


def _cols(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    return t.index_select(dim, idx)


def _set_cols(t: torch.Tensor, dim: int, idx: torch.Tensor, val: torch.Tensor) -> None:
    t.index_copy_(dim, idx, val)


def run_reference(
    params: list[torch.Tensor],
    column_dims: list[int | None],
    grad_fn: Callable[[int, list[torch.Tensor]], list[torch.Tensor]],
    attempts: int,
    *,
    lr: float,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    topk_ratio: float,
    update_interval: int | None,
    select_every: int,
    overlap: bool,
    warmup_rounds: int = 0,
    auto_ratio: float = 0.99,
    clip: float = 0.0,
    window_lr: str = "last",
    select_schedule: str = "fixed",
    host_kernel=adamw_step_reference_,
    losses: list[float] | None = None,
    host_state: str = "exact",
    bf16_link: bool = True,
    early_steps: int = 0,
    early_windows: str = "ramp",
    early_overlap: bool = True,
) -> dict:
    """Run ``attempts`` step attempts; ``grad_fn(i, params)`` gives attempt i's gradients
    (0-based) for the current weights. Returns the per-step weights and the window log.

    ``host_state`` "compact": the host's moments of the non-selected columns are kept in 8
    bits (``zenflow.ops.q8_reference``: exp_avg and sqrt(exp_avg_sq), a scale per 256
    elements of the compact layout, the selection's non-selected columns in order); a host
    step is ``adamw_q8_step_reference_`` (``host_kernel`` its fp32 step); whenever columns
    move, the moments are dequantised (v = u * u), moved in fp32 and quantised again for the
    new layout. With ``bf16_link`` (a separate device) the pieces cross the link in bf16
    before they are clipped and the window sum is kept in bf16; without it (the CPU device)
    the window sum is fp32, where autograd writes.

    The early schedule (``zfctl.early``): over the ``early_steps`` steps after warm-up, a
    window ending at early step e (1-based) is min(S, 2^floor(log2(S e / early_steps)))
    steps long with ``early_windows`` "ramp" (S with "fixed"), and its host step is applied
    at its own end when ``early_overlap`` is false."""
    b1, b2 = betas
    compact = host_state == "compact"
    Q: dict[int, list[torch.Tensor]] = {}  # compact: 8-bit moments of the non-selected columns
    P = [p.detach().clone().float() for p in params]
    zf = [i for i, cd in enumerate(column_dims) if cd is not None]
    dense = [i for i, cd in enumerate(column_dims) if cd is None]
    M = {i: P[i].clone() for i in zf}  # host master
    mh = {i: torch.zeros_like(P[i]) for i in zf}
    vh = {i: torch.zeros_like(P[i]) for i in zf}
    # per-column step counts of ZenFlow weights: host (windows) and device (steps)
    thc = {i: torch.zeros(P[i].shape[column_dims[i]], dtype=torch.int64) for i in zf}
    tdc = {i: torch.zeros(P[i].shape[column_dims[i]], dtype=torch.int64) for i in zf}
    md = {i: torch.zeros_like(P[i]) for i in range(len(P))}  # device moments (full size)
    vd = {i: torch.zeros_like(P[i]) for i in range(len(P))}
    td = dict.fromkeys(dense, 0)
    # window gradient sum (non-selected cols): bf16 for the compact state over the link
    sum_dtype = torch.bfloat16 if compact and bf16_link else torch.float32
    A = {i: torch.zeros(P[i].shape, dtype=sum_dtype) for i in zf}
    sel: dict[int, torch.Tensor] = {}
    sel_mass = dict.fromkeys(zf, 0.0)
    nonsel_mass = dict.fromkeys(zf, 0.0)
    n = 0  # steps in the current window
    lr_sum = 0.0  # the lrs of its steps (window_lr "sum": the host step's lr)
    window_start = warmup_rounds + 1
    pending = False
    last_select = 0
    reselections = 0  # after the first selection (the doubling schedule's gap)
    t = 0
    history, windows, applied, selected_at = [], [], [], []

    def k_of(i):
        n_cols = P[i].shape[column_dims[i]]
        return max(1, min(n_cols, math.ceil(topk_ratio * n_cols - 1e-9)))

    def nonsel_of(i):
        mask = torch.ones(P[i].shape[column_dims[i]], dtype=torch.bool)
        mask[sel[i]] = False
        return mask.nonzero().flatten()

    def scores(i, g):
        g = g.float()
        return (g * g).sum(dim=1 - column_dims[i])

    def host_step(i, grad, scale, lr=lr, wd=weight_decay, cols=None):
        """The host AdamW of weight i: every column (warm-up, ``cols`` None), or a window's
        step over the non-selected columns ``cols`` only (the host's compact state; the
        selected columns' host values are never read), each with its own count."""
        d = column_dims[i]
        if cols is None:
            x, g, m, v = M[i], grad, mh[i], vh[i]
            thc[i] += 1
            counts = thc[i]
        elif len(cols) == 0:
            return
        else:
            x, g, m, v = (_cols(t, d, cols) for t in (M[i], grad, mh[i], vh[i]))
            thc[i][cols] += 1
            counts = thc[i][cols]
        u = _uniform(counts)
        kw = {}
        if u is None:  # element j of the flat param is in column (j // inner) % n_cols
            inner = 1 if d == P[i].dim() - 1 else P[i].shape[-1]
            kw = {"col_steps": counts.contiguous(), "col_inner": inner}
        step = u if u is not None else int(counts.max())
        if compact and cols is not None:  # 8-bit moments, in place in Q[i]
            adamw_q8_step_reference_(
                x.view(-1), g.contiguous().view(-1), *Q[i], step=step, lr=lr, beta1=b1,
                beta2=b2, eps=eps, weight_decay=wd, grad_scale=scale, adam_step=host_kernel,
                **kw,
            )  # fmt: skip
            _set_cols(M[i], d, cols, x)
            return
        host_kernel(
            x, g.contiguous(), m, v, step=step, lr=lr,
            beta1=b1, beta2=b2, eps=eps, weight_decay=wd, grad_scale=scale, **kw,
        )  # fmt: skip
        if cols is not None:
            for dst, src in ((M[i], x), (mh[i], m), (vh[i], v)):
                _set_cols(dst, d, cols, src)

    def apply_host(i):
        d, ns = column_dims[i], nonsel_of(i)
        _set_cols(P[i], d, ns, _cols(M[i], d, ns))

    def q8_to_full(i):
        """Compact: the 8-bit moments of the non-selected columns into mh/vh (fp32)."""
        if i not in Q:
            return
        d, ns = column_dims[i], nonsel_of(i)
        shape = list(P[i].shape)
        shape[d] = len(ns)
        m, u = torch.empty(shape), torch.empty(shape)
        dequantize_q8_reference_(Q[i][0], Q[i][1], m, fmt="m")
        dequantize_q8_reference_(Q[i][2], Q[i][3], u, fmt="u")
        _set_cols(mh[i], d, ns, m)
        _set_cols(vh[i], d, ns, u * u)

    def full_to_q8(i):
        """Compact: mh/vh of the (new) non-selected columns quantised into Q[i]."""
        d, ns = column_dims[i], nonsel_of(i)
        m = _cols(mh[i], d, ns).contiguous()
        u = sqrt_rounded(_cols(vh[i], d, ns).contiguous())
        blocks = q8_num_blocks(m.numel())
        Q[i] = [torch.empty(m.numel(), dtype=torch.uint8), torch.empty(blocks),
                torch.empty(m.numel(), dtype=torch.uint8), torch.empty(blocks)]  # fmt: skip
        quantize_q8_reference_(m, Q[i][0], Q[i][1], fmt="m")
        quantize_q8_reference_(u, Q[i][2], Q[i][3], fmt="u")

    def select(grads):
        for i in zf:
            if compact:
                q8_to_full(i)
            d = column_dims[i]
            s = scores(i, grads[i])
            order = torch.sort(s, descending=True, stable=True).indices[: k_of(i)]
            new = torch.sort(order).values
            old = sel.get(i, torch.empty(0, dtype=torch.long))
            leaving = old[~torch.isin(old, new)]
            entering = new[~torch.isin(new, old)]
            for dst, src in ((M[i], P[i]), (mh[i], md[i]), (vh[i], vd[i])):
                _set_cols(dst, d, leaving, _cols(src, d, leaving))
            thc[i][leaving] = tdc[i][leaving]
            for dst, src in ((P[i], M[i]), (md[i], mh[i]), (vd[i], vh[i])):
                _set_cols(dst, d, entering, _cols(src, d, entering))
            tdc[i][entering] = thc[i][entering]
            sel[i] = new
            if compact:
                full_to_q8(i)

    for attempt in range(attempts):
        grads = [g.detach().clone().float() for g in grad_fn(attempt, [p.clone() for p in P])]
        loss = None if losses is None else losses[attempt]
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0
        )
        if (loss is not None and not math.isfinite(loss)) or not math.isfinite(float(total)):
            history.append([p.clone() for p in P])
            continue  # skipped: nothing changes
        raw, coef = grads, None  # compact over the link: pieces cross before the clipping
        if clip > 0:
            coef = torch.clamp(clip / (total + 1e-6), max=1.0)
            grads = [g * coef for g in grads]
        t += 1
        for i in dense:
            td[i] += 1
            _device_adamw(P[i], grads[i], md[i], vd[i], td[i], lr, b1, b2, eps, weight_decay)
        if t <= warmup_rounds:
            for i in zf:
                host_step(i, grads[i], 1.0)
                P[i].copy_(M[i])
            window_start = t + 1
            history.append([p.clone() for p in P])
            continue
        if not sel:
            select(grads)
            last_select = t
            selected_at.append(t)
        for i in zf:
            d = column_dims[i]
            c = sel[i]
            tdc[i][c] += 1
            p_c, m_c, v_c = _cols(P[i], d, c), _cols(md[i], d, c), _cols(vd[i], d, c)
            g_c = _cols(grads[i], d, c)
            u = _uniform(tdc[i][c])
            if u is not None:
                _device_adamw(p_c, g_c, m_c, v_c, u, lr, b1, b2, eps, weight_decay)
            else:
                _device_adamw(p_c, g_c, m_c, v_c, tdc[i][c], lr, b1, b2, eps, weight_decay, dim=d)
            for dst, src in ((P[i], p_c), (md[i], m_c), (vd[i], v_c)):
                _set_cols(dst, d, c, src)
            ns = nonsel_of(i)
            if sum_dtype == torch.bfloat16:  # each piece in bf16, clipped, summed in bf16
                x = _cols(raw[i], d, ns).to(torch.bfloat16).float()
                if coef is not None:
                    x = x * coef
                _set_cols(A[i], d, ns, (_cols(A[i], d, ns).float() + x).to(torch.bfloat16))
            else:
                _set_cols(A[i], d, ns, _cols(A[i], d, ns) + _cols(grads[i], d, ns))
            if update_interval is None:
                s = scores(i, grads[i])
                sel_mass[i] += float(s[c].sum()) / len(c)
                if len(ns):
                    nonsel_mass[i] += float(s[ns].sum()) / len(ns)
        n += 1
        lr_sum += lr
        early = 0 < t - warmup_rounds <= early_steps
        interval = update_interval
        if early and early_windows == "ramp":
            x = update_interval * (t - warmup_rounds) // early_steps
            interval = min(update_interval, 2 ** math.floor(math.log2(x))) if x >= 1 else 1
        if interval is not None:
            ends = n >= interval
        elif n >= 64 or not zf:
            ends = True
        else:
            votes = sum(
                1 for i in zf if len(sel[i]) == P[i].shape[column_dims[i]]
                or nonsel_mass[i] >= sel_mass[i] / n
            )  # fmt: skip
            ends = votes / len(zf) >= auto_ratio
        if ends:
            gap = select_every
            if select_schedule == "doubling":
                gap = min(select_every, (update_interval or 1) * 2**reselections)
            reselect = t - last_select >= gap
            if pending:  # the previous window's host result reaches the weights now
                for i in zf:
                    apply_host(i)
                applied.append(t)
                pending = False
            root = math.sqrt(n)
            win_lr, win_wd = {"last": (lr, weight_decay), "sum": (lr_sum, weight_decay),
                              "sqrt": (lr_sum / root, weight_decay * root)}[window_lr]  # fmt: skip
            for i in zf:
                host_step(i, A[i], 1.0 / n, win_lr, win_wd, cols=nonsel_of(i))
                A[i].zero_()
                sel_mass[i] = nonsel_mass[i] = 0.0
            if overlap and not (early and not early_overlap) and not reselect:
                pending = True
            else:
                for i in zf:
                    apply_host(i)
                applied.append(t)
            windows.append((window_start, t, n))
            n = 0
            lr_sum = 0.0
            window_start = t + 1
            if reselect:
                select(grads)
                last_select = t
                reselections += 1
                selected_at.append(t)
        history.append([p.clone() for p in P])
    return {"history": history, "windows": windows, "applied": applied, "params": P,
            "selected_at": selected_at}  # fmt: skip
