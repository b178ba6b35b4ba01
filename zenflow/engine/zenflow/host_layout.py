"""The host state of one ZenFlow weight, in the compact layout of its non-selected columns.

The host keeps ONLY the columns the device does not update: for a weight W with columns
along ``cd`` and the sorted non-selected columns ``nonsel`` (n = n_cols - k of them, the
same n at every selection), every host array is ``W.index_select(cd, nonsel)``:
``[rows, n]`` for columns along dim 1 (nn.Linear), ``[n, other]`` along dim 0 (Conv1D,
embeddings); position j holds column ``nonsel[j]``. That is the fp32 master, the two
moments, the per-column step counts (n entries, same order) and the window sum (the pieces'
layout, ``zenflow.engine.copies``).

Before the first selection a weight has no selection, so no compact state: its host side is
what warm-up needs (the full-shape fp32 state, ``full_state``) or nothing at all (the
initial values are the masters taken at set-up, or, for an fp32 weight on a separate device,
read from the device weight when the compact state is made).

Owns the creation of these arrays (``first_compact``), their re-layout at a hand-over
(``relayout``: in place, the staying columns moved in runs to close and open the gaps, the
leaving columns' values from the device written into them, one weight at a time), the
entering columns' host values (``entering``) and the read of columns by id
(``host_columns``, tests). Must not touch the device state of the selected columns, the
window's job or the gradient route: the hand-over (``handover``) decides when these run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zenflow.engine.host import ColumnSteps, HostState
from zenflow.engine.zenflow.q8_state import Q8HostState


@dataclass
class SelectionPlan:
    """A hand-over of one weight, on the host: the old and new non-selected columns (sorted
    int64), the columns entering the device (sorted) and their positions in the old compact
    arrays, and the columns leaving it (sorted, with their positions in the new ones)."""

    old_nonsel: torch.Tensor | None  # None: the weight had no selection (first selection)
    new_sel: torch.Tensor
    new_nonsel: torch.Tensor
    in_cols: torch.Tensor
    out_cols: torch.Tensor

    @classmethod
    def make(cls, old_sel: torch.Tensor | None, new_sel: torch.Tensor, n_cols: int):
        mask = torch.ones(n_cols, dtype=torch.bool)
        mask[new_sel] = False
        new_nonsel = mask.nonzero().flatten()
        if old_sel is None:
            return cls(None, new_sel, new_nonsel, new_sel, new_sel[:0])
        old_mask = torch.ones(n_cols, dtype=torch.bool)
        old_mask[old_sel] = False
        old_nonsel = old_mask.nonzero().flatten()
        in_cols = new_sel[torch.isin(new_sel, old_nonsel)]
        out_cols = old_sel[~torch.isin(old_sel, new_sel)]
        return cls(old_nonsel, new_sel, new_nonsel, in_cols, out_cols)


def compact_shape(w, n: int | None = None) -> tuple[int, ...]:
    """The compact layout's shape for ``n`` columns (default: the non-selected count)."""
    shape = list(w.spec.param.shape)
    shape[w.cd] = w.n_nonsel if n is None else n
    return tuple(shape)


def _positions(nonsel: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Positions of the columns ``cols`` (each in the sorted ``nonsel``) in the compact
    layout of ``nonsel``."""
    return torch.searchsorted(nonsel, cols)


def _on_host(mode_arg: int):
    """Run the function with its new tensors in host memory (sim: glibc's heap, not the
    device pool), also when the step's device work calls it. ``mode_arg``: the position of
    the mode among its arguments."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with args[mode_arg].e.accel.host_scope():
                return fn(*args, **kwargs)

        return run

    return wrap


# ---------------------------------------------------------------------- before a selection
def counts(accel, n: int) -> ColumnSteps:
    """``n`` per-column step counts on the host (accounted), uninitialised."""
    return ColumnSteps(accel.host_empty((n,), torch.int64, False, "host_state"), None)


def new_full(w, accel) -> HostState:
    """Uninitialised full-shape fp32 host arrays (warm-up's state), counts zero."""
    p = w.spec.param
    steps = counts(accel, w.n_cols)
    steps.counts.zero_()
    steps.uniform = 0
    return HostState(
        accel.host_empty(p.shape, torch.float32, False, "host_state"),
        accel.host_empty(p.shape, torch.float32, False, "host_state"),
        accel.host_empty(p.shape, torch.float32, False, "host_state"),
        steps,
    )


def full_state(w, accel) -> HostState:
    """The full-shape fp32 host state warm-up steps update (master, moments, one count per
    column), from the masters taken at set-up or, without them, from the device weight."""
    st = new_full(w, accel)
    if w.init_master is not None:
        st.master.copy_(w.init_master)  # the initial fp32 weights: not a step, not counted
        w.init_master = None
    else:
        st.master.copy_(accel.to_host(w.spec.param.detach()))
    st.exp_avg.zero_()
    st.exp_avg_sq.zero_()
    return st


@_on_host(0)
def gather(
    mode, src: torch.Tensor, cd: int, index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``src.index_select(cd, index)`` (into ``out`` when given) on the host threads: the
    kernels' ``gather`` (the native ``gather_columns_``: runs of consecutive ids copied
    whole, rows in parallel; torch's index_select along dim 1 is one thread, element by
    element, and made a GPU box's first selection take ~19 s for a 1B model)."""
    if out is None:
        shape = list(src.shape)
        shape[cd] = int(index.numel())
        out = torch.empty(shape, dtype=src.dtype)
    mode.kernels.gather(out, src.contiguous(), index, cd, num_threads=mode.e.host_threads)
    return out


@_on_host(1)
def entering(w, mode, cols: torch.Tensor) -> dict:
    """The host values of the columns ``cols`` (sorted, not selected now) that enter the
    device: master (fp32, or None where the device weight itself holds it: an fp32 weight
    before its first selection), moments and counts, from whatever the host holds."""
    host, cd = w.host, w.cd
    take = functools.partial(gather, mode, cd=cd)
    if w.host_layout == "compact":
        pos = _positions(w.nonsel_host, cols)
        exp_avg, exp_avg_sq = moments(host, mode.handover.scratch)
        return {
            "master": take(host.master, index=pos),
            "exp_avg": take(exp_avg, index=pos),
            "exp_avg_sq": take(exp_avg_sq, index=pos),
            "counts": host.steps.counts[pos],
        }
    shape = compact_shape(w, int(cols.numel()))
    if w.host_layout == "full":  # warm-up's state
        return {
            "master": take(host.master, index=cols),
            "exp_avg": take(host.exp_avg, index=cols),
            "exp_avg_sq": take(host.exp_avg_sq, index=cols),
            "counts": host.steps.counts[cols],
        }
    master = None if w.init_master is None else take(w.init_master, index=cols)
    return {
        "master": master,
        "exp_avg": torch.zeros(shape, dtype=torch.float32),
        "exp_avg_sq": torch.zeros(shape, dtype=torch.float32),
        "counts": torch.zeros(int(cols.numel()), dtype=torch.int64),
    }


# ---------------------------------------------------------------------- the compact state
def moments(host, scratch=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) of a compact host state as fp32 arrays: the arrays themselves
    (exact), or dequantised copies (8-bit moments, ``q8_state``; in ``scratch``'s arrays
    while a selection holds them)."""
    if hasattr(host, "moments_fp32"):
        return host.moments_fp32(scratch)
    return host.exp_avg, host.exp_avg_sq


def new_compact(w, mode) -> HostState | Q8HostState:
    """Uninitialised compact arrays of ``mode.host_state`` (the master pinned where the
    backend pins: the device reads it directly when a host step's result goes back)."""
    accel, shape, pin = mode.e.accel, compact_shape(w), mode.e.pin_link
    if mode.host_state == "compact":
        return Q8HostState.empty(accel, shape, w.n_nonsel, pin, mode.kernels)
    return HostState(
        accel.host_empty(shape, torch.float32, pin, "host_state"),
        accel.host_empty(shape, torch.float32, False, "host_state"),
        accel.host_empty(shape, torch.float32, False, "host_state"),
        counts(accel, w.n_nonsel),
    )


def _moment_targets(new, shape, scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 arrays to fill with the new layout's moments: the new arrays themselves
    (exact), or temporaries quantised by ``_commit`` (8-bit: ``scratch``'s while the
    selection holds them, else arrays accounted while they live)."""
    if hasattr(new, "set_moments"):
        return new.fp32_pair(shape, scratch)
    return new.exp_avg, new.exp_avg_sq


def _commit(new, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, scratch) -> None:
    if hasattr(new, "set_moments"):
        new.set_moments(exp_avg, exp_avg_sq, scratch)


@_on_host(1)
def first_compact(w, mode, plan: SelectionPlan) -> None:
    """The compact state at the first selection, from the warm-up state, the masters taken
    at set-up, or the device weight (an fp32 weight without masters: its non-selected
    columns read from the device), then the full-shape source is dropped."""
    cd, ns = w.cd, plan.new_nonsel
    new = new_compact(w, mode)
    m, v = _moment_targets(new, compact_shape(w), mode.handover.scratch)
    if w.host_layout == "full":
        old = w.host
        gather(mode, old.master, cd, ns, out=new.master)
        gather(mode, old.exp_avg, cd, ns, out=m)
        gather(mode, old.exp_avg_sq, cd, ns, out=v)
        new.steps.counts.copy_(old.steps.counts[ns])
    else:
        if w.init_master is not None:
            gather(mode, w.init_master, cd, ns, out=new.master)
        else:
            mode.handover.read_columns(w, new.master)
        m.zero_()
        v.zero_()
        new.steps.counts.zero_()
    _commit(new, m, v, mode.handover.scratch)
    new.steps.recheck()
    w.host = new
    w.host_layout = "compact"
    w.init_master = None


@_on_host(1)
def relayout(w, mode, plan: SelectionPlan, leaving: dict | None) -> None:
    """A hand-over's re-layout of ``w``'s compact arrays, in place: the columns entering the
    device leave them, the staying ones keep their order, and the columns leaving the
    device (``leaving``: fp32 master and moments in the compact layout of
    ``plan.out_cols``, their counts) take their places (``kernels.merge``, the native
    ``compact_merge_``: memmoves of runs of staying columns, no new array, so a pinned master
    is not registered again). 8-bit moments are dequantised, merged as fp32 and quantised
    again into the same codes (``q8_state``)."""
    drop = _positions(plan.old_nonsel, plan.in_cols)  # entering the device: old positions
    ins = _positions(plan.new_nonsel, plan.out_cols)  # leaving it: new positions
    if not ins.numel():
        return
    cd, host, e = w.cd, w.host, mode.e
    merge = functools.partial(mode.kernels.merge, num_threads=e.host_threads)
    joining = list(compact_shape(w))
    joining[cd] = int(ins.numel())

    def into(dst: torch.Tensor, name: str) -> None:
        merge(dst.view(compact_shape(w)), drop, ins,
              leaving[name].reshape(joining).contiguous(), cd)  # fmt: skip

    into(host.master, "master")
    if hasattr(host, "set_moments"):
        m, v = moments(host, mode.handover.scratch)
        into(m, "exp_avg")
        into(v, "exp_avg_sq")
        host.set_moments(m, v, mode.handover.scratch)
        del m, v
    else:
        into(host.exp_avg, "exp_avg")
        into(host.exp_avg_sq, "exp_avg_sq")
    merge(host.steps.counts.view(-1, 1), drop, ins,
          leaving["counts"].reshape(-1, 1).contiguous(), 0)  # fmt: skip
    host.steps.recheck()


def host_columns(w, name: str, cols) -> torch.Tensor:
    """The host values of the non-selected columns ``cols`` (ids) of field ``name``
    ("master", "exp_avg", "exp_avg_sq" or "counts"), whatever the layout (tests)."""
    cols = torch.as_tensor(cols, dtype=torch.int64).reshape(-1)
    if w.host_layout == "compact":
        if torch.isin(cols, w.sel_host).any():
            raise ValueError(f"{w.spec.name}: columns {cols.tolist()} include selected ones")
        cols = _positions(w.nonsel_host, cols)
    if name == "counts":
        return w.host.steps.counts[cols]
    if name == "master":
        return w.host.master.index_select(w.cd, cols)
    exp_avg, exp_avg_sq = moments(w.host) if w.host_layout == "compact" else \
        (w.host.exp_avg, w.host.exp_avg_sq)  # fmt: skip
    return (exp_avg if name == "exp_avg" else exp_avg_sq).index_select(w.cd, cols)
