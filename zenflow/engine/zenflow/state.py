"""The per-weight state of the ZenFlow schedule: ``ZfWeight`` (what one ZenFlow weight holds,
on the device and on the host) and ``StepPlan`` (how the current step routes gradients).

Owns the buffers and their layout; the rooms beside it (route, device step, window, image
return, hand-over, warm-up) decide when they are written, ``host_layout`` makes and
re-lays the host arrays. Must not touch the engine's schedule, the copy pipeline or the
worker: nothing here moves data or starts work.

Per ZenFlow weight W ([out, in] for nn.Linear, columns along ``cd``), k selected columns,
n = n_cols - k non-selected ones:

| where | what |
|---|---|
| device | W in the training dtype (the model's own tensor); its gradient only while backward |
|        | computes it: each gradient is routed as soon as it is final and freed |
| device | selected columns: the step's gradient (training dtype), fp32 master slice (bf16    |
|        | only: fp32 W is its own master), exp_avg, exp_avg_sq, int64 step count per column |
| host   | the non-selected columns only, compact (``host_layout``): fp32 master (pinned where |
|        | the backend pins), exp_avg, exp_avg_sq, int64 count per column                    |
| host   | the window sum of the non-selected columns, compact (CPU device: full shape, where |
|        | autograd writes, 2 slots with overlap)                                           |
| host   | the step store: one step's pieces in the link's dtype (pinned where the backend   |
|        | pins: the device copies them there), their adds waiting for the step's gate       |
|        | (none with ``zfctl.step_store`` "off": each piece is added as it arrives, and the |
|        | window's host step clips the sum by its steps' smallest coefficient; "q8": an    |
|        | 8-bit copy of each piece, not pinned, that corrects the sum: ``step_q8``)         |

Before the first selection the host holds warm-up's full-shape state, or only the masters
taken at set-up (``init_master``; none for an fp32 weight on a separate device: the device
weight holds its values).

Step counts: the device counts steps, the host counts windows; each column keeps its own
count and carries it across a hand-over with its moments, so bias correction stays right
(the native op takes per-column counts). A host step uses lr(t) of the window's last step
t and, per column, its host count + 1.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from zenflow.engine.copies import plan_chunks, plan_pieces
from zenflow.engine.host import ColumnSteps, HostJob, HostState, StepGate
from zenflow.engine.selection import ParamSpec, complement

_SET = threading.Event()  # "no host step reads this sum": an event that is always set
_SET.set()


@dataclass
class StepPlan:
    """How the current step routes gradients (made before its first gradient is routed)."""

    t: int
    whole: bool  # warm-up or first selection: whole gradients to the host
    score: bool  # a re-selection may follow this step: column scores of the gradient
    gate: StepGate
    slot: int
    # the in-flight host step whose result this step applies at its end (a window end with
    # overlap): its non-selected columns go back during this step's backward instead
    apply: HostJob | None = None
    first: bool = False  # the first selection is made in the hooks (``Handover``)


class ZfWeight:
    """Engine-owned state of one ZenFlow weight (never glued onto the Parameter).

    ``mode``: the ZenFlowMode being built; its engine and its settings (``zero_copy``,
    ``bucket_elems``, ``slots``, ``host_gas``, ``warmup_rounds``) decide which buffers
    exist. ``init_master``: the fp32 initial values taken at set-up (the tensor itself, held
    until the first selection), or None (an fp32 weight: the device weight holds them)."""

    def __init__(self, spec: ParamSpec, k: int, mode, init_master,
                 owner: int = 0, owned: bool = True):  # fmt: skip
        p = spec.param
        self.spec = spec
        self.cd = spec.column_dim
        self.n_cols = spec.n_cols
        self.k = k
        self.rows = p.numel() // self.n_cols
        self.n_nonsel = self.n_cols - k
        self.compact_numel = self.rows * self.n_nonsel
        # data parallel: the rank holding this weight's host state (every rank: one rank)
        self.owner = owner
        self.owned = owned
        # per-column layout for the native op: element i is in column (i // inner) % C; the
        # same for the full shape and the compact one (C = n_cols or n)
        self.col_inner = 1 if self.cd == p.dim() - 1 else p.shape[-1]
        self.sel_dev: torch.Tensor | None = None
        self.sel_host: torch.Tensor | None = None
        self.nonsel_dev: torch.Tensor | None = None
        self.nonsel_host: torch.Tensor | None = None
        shape_k = list(p.shape)
        shape_k[self.cd] = k
        self.shape_k = tuple(shape_k)
        self.fp32_weight = p.dtype == torch.float32
        self._device_buffers(mode)
        self.pieces = []
        if not mode.zero_copy:
            self.pieces = plan_pieces(tuple(p.shape), self.cd, self.n_nonsel, mode.bucket_elems)
        self.chunks = plan_chunks(p.numel(), mode.bucket_elems)
        self._piece_norms(mode.e.accel if owned and not mode.whole_norms else None)
        # the host state: "none" (the masters taken at set-up, or the device weight), "full"
        # (warm-up's full-shape state) or "compact" (after the first selection)
        self.host: HostState | None = None
        self.host_layout = "none"
        self.init_master = init_master if owned else None
        # the host holds a master before the first selection (masters taken at set-up, or
        # warm-up's full state): the same on every rank
        self.host_master_at_start = init_master is not None or mode.warmup_rounds > 0
        self.acc: list[torch.Tensor] = []  # window sums: compact flat (full shape zero-copy)
        self.fresh: list[bool] = []  # a slot's next add overwrites it (window start)
        self.step_buf: torch.Tensor | None = None  # a step's micro-batch sum (host gas)
        self.store: torch.Tensor | None = None  # a step's pieces until its gate (link dtype)
        self._views: dict[int, tuple] = {}  # id(buffer) -> (buffer, each piece's view)
        self._step_fields()
        self.position = 0  # index among the mode's weights
        # auto update interval statistics of the current window (python floats)
        self.sel_mass_sum = 0.0  # sum over steps of (selected mass / k)
        self.nonsel_mass_acc = 0.0  # sum over steps of (non-selected mass / (n - k))
        # Set once no host step reads this weight's window sum: with overlap the next
        # window's first piece of this weight waits for it (one window sum, not two). A new
        # event per host step, taken by each add when it is queued: an add queued before
        # the host step was made never waits for that step.
        self.free = _SET
        if not owned:
            return
        self.fresh = [True] * mode.slots
        if mode.zero_copy:  # summed where autograd writes (host memory already)
            self.acc = [mode.e.accel.zeros(p.shape, torch.float32, "optimizer")
                        for _ in range(mode.slots)]  # fmt: skip

    def _piece_norms(self, accel) -> None:
        """Each piece's L2 norm this step (fp32, on the device; ``accel`` not None: the
        owner's, where pieces take their own norms, ``ZenFlowMode.whole_norms`` false): one
        launch each, and their norm once per weight at the step's end (``ns_norm``); a 0-d
        view per piece, made once."""
        self.piece_norms: torch.Tensor | None = None
        self.norm_slots: list = [None] * len(self.pieces)
        if accel is not None and self.pieces:
            self.piece_norms = accel.zeros((len(self.pieces),), torch.float32, "grads")
            self.norm_slots = list(self.piece_norms.unbind())

    def _device_buffers(self, mode) -> None:
        """The selected columns' optimizer state and gradient buffer on the device."""
        accel = mode.e.accel
        shape_k = self.shape_k
        # selected columns, compact along cd (position i holds column sel[i])
        self.master_sel = None if self.fp32_weight else accel.zeros(shape_k, torch.float32,
                                                                    "optimizer")  # fmt: skip
        self.exp_avg_dev = accel.zeros(shape_k, torch.float32, "optimizer")
        self.exp_avg_sq_dev = accel.zeros(shape_k, torch.float32, "optimizer")
        self.steps_dev = ColumnSteps(accel.zeros((self.k,), torch.int64, "optimizer"), 0,
                                     torch.zeros(self.k, dtype=torch.int64))  # fmt: skip
        # the step's gradient of the selected columns (compact, training dtype)
        self.grad_sel = None
        if not mode.zero_copy:
            self.grad_sel = accel.zeros(shape_k, self.spec.param.dtype, "grads")

    def _step_fields(self) -> None:
        """Per step: device scalars of this weight's streamed gradient and its flags."""
        self.norms_routed = False  # the pieces' norms were written this step
        self.scores_ns: torch.Tensor | None = None  # column scores of the non-selected part
        self.norm_whole: torch.Tensor | None = None  # the whole gradient's norm, if taken
        self.contrib = 0  # gradients routed this step
        self.stat_done = False  # host gas: the step sum's squares were totalled in-line
        self.sel_reduced = False  # data parallel: the selected gradient's all-reduce started
        self.scores_sel: torch.Tensor | None = None  # column scores of the selected part
        self.scores_first: torch.Tensor | None = None  # first selection in the hook: scores

    def start_step(self) -> None:
        """A new step: nothing of it routed yet."""
        self.contrib = 0
        self.stat_done = False
        self.sel_reduced = False
        self.norms_routed = False
        self.scores_ns = None
        self.scores_sel = None
        self.scores_first = None
        self.norm_whole = None

    def window_buffers(self, mode) -> None:
        """The owner's window sum and the step's pieces (the step store while the step's
        gate is not set; with micro-batches summed on the host, their fp32 step sum), all
        compact: made with the compact state (the first selection)."""
        if mode.zero_copy or self.acc:
            return
        accel = mode.e.accel
        n = self.compact_numel
        # separate allocations: a checkpoint saves each, and a view would drag its storage
        self.acc = [accel.host_empty((n,), mode.sum_dtype, False, "window_sums")]
        if mode.host_gas:
            self.step_buf = accel.host_empty((n,), torch.float32, False, "window_sums")
        elif not mode.adds_on_arrival:
            # pinned: the pieces land here from the device, and their adds wait here for
            # the step's gate (accumulator.land)
            self.store = accel.host_empty((n,), mode.link_dtype, mode.e.pin_link,
                                          "step_pieces")  # fmt: skip

    def ns_norm(self) -> torch.Tensor | None:
        """The L2 norm of this step's non-selected gradient (an fp32 device scalar, the norm
        of its pieces' norms), or None where no piece was routed."""
        if not self.norms_routed:
            return None
        return torch.linalg.vector_norm(self.piece_norms, 2.0)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each piece's view of ``buf``, a flat buffer of this weight in the compact layout
        (window sum, step store, micro-batch sum), made once per buffer: a step's route
        slices nothing per piece. ``drop_views`` forgets them (the buffers' release)."""
        hit = self._views.get(id(buf))
        if hit is None or hit[0] is not buf:
            hit = (buf, [pc.of(buf) for pc in self.pieces])
            self._views[id(buf)] = hit
        return hit[1]

    def drop_views(self) -> None:
        self._views.clear()

    def set_selection(self, sel_dev: torch.Tensor, sel_host: torch.Tensor | None = None,
                      nonsel_dev: torch.Tensor | None = None,
                      nonsel_host: torch.Tensor | None = None) -> None:  # fmt: skip
        """The selected columns (sorted, on the device and the host) and the rest; the
        parts not given are derived (on the device: a wait for it)."""
        self.sel_dev = sel_dev
        self.sel_host = sel_dev.cpu() if sel_host is None else sel_host
        self.nonsel_dev = complement(sel_dev, self.n_cols) if nonsel_dev is None else nonsel_dev
        self.nonsel_host = complement(self.sel_host, self.n_cols) if nonsel_host is None \
            else nonsel_host  # fmt: skip

    def clear_selection(self) -> None:
        self.sel_dev = self.sel_host = self.nonsel_dev = self.nonsel_host = None

    def compact_shape(self) -> tuple[int, ...]:
        shape = list(self.spec.param.shape)
        shape[self.cd] = self.n_nonsel
        return tuple(shape)

    def grad(self) -> torch.Tensor:
        g = self.spec.param.grad
        if g is None:  # unused this step: a zero gradient (keeps the schedule uniform)
            return torch.zeros_like(self.spec.param)
        return g.detach()
