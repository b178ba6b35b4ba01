"""The per-weight state of the ZenFlow schedule: ``ZfWeight`` (what one ZenFlow weight holds,
on the device and on the host) and ``StepPlan`` (how the current step routes gradients).

Owns the buffers and their layout; the rooms beside it (route, device step, window, image
return, hand-over, warm-up) decide when they are written. Must not touch the engine's
schedule, the copy pipeline or the worker: nothing here moves data or starts work.

Per ZenFlow weight W ([out, in] for nn.Linear, columns along ``cd``), k selected columns:

| where | what |
|---|---|
| device | W in the training dtype (the model's own tensor); its gradient only while backward |
|        | computes it: each gradient is routed as soon as it is final and freed |
| device | selected columns: the step's gradient (training dtype), fp32 master slice (bf16    |
|        | only: fp32 W is its own master), exp_avg, exp_avg_sq, int64 step count per column |
| host   | fp32 master, exp_avg, exp_avg_sq of the whole weight, step count per column       |
| host   | fp32 window sum of the non-selected columns, compact (2 slots with overlap)       |
| host   | pinned: staging for one step's pieces and the image of the non-selected columns   |
|        | in the training dtype (what goes back to the device), both compact                |

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


class ZfWeight:
    """Engine-owned state of one ZenFlow weight (never glued onto the Parameter).

    ``mode``: the ZenFlowMode being built; its engine and its settings (``zero_copy``,
    ``bucket_elems``, ``slots``, ``host_gas``) decide which buffers exist."""

    def __init__(self, spec: ParamSpec, k: int, mode, master_init,
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
        # per-column layout for the native op: element i is in column (i // inner) % n_cols
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
        self.host: HostState | None = None
        self.acc: list[torch.Tensor] = []  # window sums: compact flat (full shape zero-copy)
        self.fresh: list[bool] = []  # a slot's next add overwrites it (window start)
        self.image: torch.Tensor | None = None  # compact flat, training dtype
        self.step_buf: torch.Tensor | None = None  # a step's micro-batch sum (host gas)
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
        self.sums = self.link = self.stage = None
        if not owned:
            return
        self._host_buffers(mode, master_init)
        self.fresh = [True] * mode.slots

    def _device_buffers(self, mode) -> None:
        """The selected columns' optimizer state and gradient buffer on the device."""
        accel = mode.e.accel
        shape_k = self.shape_k
        # selected columns, compact along cd (position i holds column sel[i])
        self.master_sel = None if self.fp32_weight else accel.zeros(shape_k, torch.float32,
                                                                    "optimizer")  # fmt: skip
        self.exp_avg_dev = accel.zeros(shape_k, torch.float32, "optimizer")
        self.exp_avg_sq_dev = accel.zeros(shape_k, torch.float32, "optimizer")
        self.steps_dev = ColumnSteps(accel.zeros((self.k,), torch.int64, "optimizer"), 0)
        # the step's gradient of the selected columns (compact, training dtype)
        self.grad_sel = None
        if not mode.zero_copy:
            self.grad_sel = accel.zeros(shape_k, self.spec.param.dtype, "grads")

    def _step_fields(self) -> None:
        """Per step: device scalars of this weight's streamed gradient and its flags."""
        self.sq_ns: torch.Tensor | None = None  # squared norm of the non-selected part
        self.scores_ns: torch.Tensor | None = None  # column scores of the non-selected part
        self.scores_full: torch.Tensor | None = None  # first selection: all columns (host)
        self.norm_whole: torch.Tensor | None = None  # whole-gradient step: its norm
        self.contrib = 0  # gradients routed this step
        self.stat_done = False  # host gas: the step sum's squares were totalled in-line
        self.sel_reduced = False  # data parallel: the selected gradient's all-reduce started
        self.scores_sel: torch.Tensor | None = None  # column scores of the selected part

    def start_step(self) -> None:
        """A new step: nothing of it routed yet."""
        self.contrib = 0
        self.stat_done = False
        self.sel_reduced = False
        self.sq_ns = None
        self.scores_ns = None
        self.scores_sel = None
        self.norm_whole = None

    def _host_buffers(self, mode, master_init) -> None:
        """The owner's host state (fp32 master and moments, per-column counts), its window
        sums and its pinned link buffer (image and staging)."""
        accel = mode.e.accel
        p = self.spec.param
        pin, dtype = mode.e.pin_link, mode.e.dtype
        master = accel.host_empty(p.shape, torch.float32, False, "host_state")
        master.copy_(master_init)  # the initial fp32 weights: not a step, not counted
        self.host = HostState(
            master,
            accel.host_zeros(p.shape, torch.float32, False, "host_state"),
            accel.host_zeros(p.shape, torch.float32, False, "host_state"),
            ColumnSteps.zeros(self.n_cols, "cpu"),
        )
        if mode.zero_copy:  # summed where autograd writes (host memory already)
            self.acc = [accel.zeros(p.shape, torch.float32, "optimizer")
                        for _ in range(mode.slots)]  # fmt: skip
            return
        n = self.compact_numel
        # fp32 window sum (and with micro-batches summed on the host, the step's sum
        # right after it: one buffer, so a whole-gradient step can land in both)
        sums = accel.host_empty((2 * n if mode.host_gas else n,), torch.float32, False,
                                "window_sums")  # fmt: skip
        self.acc = [sums[:n]]
        if mode.host_gas:
            self.step_buf = sums[n:]
        self.sums = sums
        # pinned, in the training dtype: the image of the updated columns (host->device)
        # and the staging of a step's pieces (device->host), one buffer
        self.link = accel.host_empty((2 * n,), dtype, pin, "link")
        self.image = self.link[:n]
        self.stage = self.link[n:]

    def set_selection(self, sel_dev: torch.Tensor) -> None:
        self.sel_dev = sel_dev
        self.sel_host = sel_dev.cpu()
        self.nonsel_dev = complement(sel_dev, self.n_cols)
        self.nonsel_host = self.nonsel_dev.cpu()

    def compact_shape(self) -> tuple[int, ...]:
        shape = list(self.spec.param.shape)
        shape[self.cd] = self.n_nonsel
        return tuple(shape)

    def grad(self) -> torch.Tensor:
        g = self.spec.param.grad
        if g is None:  # unused this step: a zero gradient (keeps the schedule uniform)
            return torch.zeros_like(self.spec.param)
        return g.detach()

    def pack_image(self) -> None:
        """Host: the non-selected columns of the master in the training dtype, compact (an
        fp32 weight's image; a bf16 image is written by the Adam pass itself)."""
        cols = self.host.master.index_select(self.cd, self.nonsel_host)
        self.image.view(self.compact_shape()).copy_(cols)
