"""Host side: fp32 state, the CPU Adam kernels and the background worker.

Two host threads serve the training thread (ZENFLOW.md 2b):

- the **accumulator** (``zenflow.engine.accumulator``, re-exported here) adds each gradient
  piece, as it arrives from the device, into a window's sum kept in the compact layout of
  the weight's non-selected columns (``zenflow.engine.copies``), scaled by its step's
  clipping coefficient once the step's ``StepGate`` is set (or dropped, when the step is
  skipped);
- the **worker** runs the host Adam step of a finished window (the native op, which
  releases the GIL, one contiguous call per weight over its compact host state of the
  non-selected columns); at most one host step is in flight, enforced here.

Hand-offs are function calls on threads (no pickling, no processes). Every thread that
may touch the device binds to it first (``Accelerator.bind_thread``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

# the accumulator thread and the step gate live in their own module; importable from here
from zenflow.engine.accumulator import Accumulator, FixedGate, StepGate
from zenflow.engine.accumulator import reraise as _reraise

__all__ = ["Accumulator", "ColumnSteps", "HostJob", "HostKernels", "HostState", "HostTask",
           "HostWorker", "FixedGate", "StepGate", "resolve_kernel", "run_host_tasks"]  # fmt: skip

HostKernel = Callable[..., None]


def compact_from_full(kernel: HostKernel) -> HostKernel:
    """A compact-layout step (``zenflow.ops.adamw_compact_step_``'s signature) built from a
    full-shape kernel (``adamw_step_``'s): gather the columns, step, scatter back. Used for
    the reference and for kernels tests pass in."""

    def compact(param, grad, exp_avg, exp_avg_sq, index, column_dim, *, step, lr, beta1, beta2,
                eps, weight_decay, image=None, grad_scale=1.0, adamw_mode=True,
                num_threads=0, col_steps=None):  # fmt: skip
        cols = [t.index_select(column_dim, index) for t in (param, exp_avg, exp_avg_sq)]
        kw = {}
        if col_steps is not None:
            inner = 1 if column_dim == 1 else param.shape[1]
            kw = {"col_steps": col_steps[index].contiguous(), "col_inner": inner}
        kernel(
            cols[0], grad.reshape(cols[0].shape), cols[1], cols[2], step=step, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            grad_scale=grad_scale, adamw_mode=adamw_mode, num_threads=num_threads, **kw,
        )  # fmt: skip
        for full, part in zip((param, exp_avg, exp_avg_sq), cols, strict=True):
            full.index_copy_(column_dim, index, part)
        if image is not None:
            image.copy_(cols[0].reshape(image.shape))

    return compact


@dataclass(frozen=True)
class HostKernels:
    """The host's ops: the CPU Adam (contiguous), its compact-layout twin (kept for other
    callers: the zenflow mode runs the contiguous op over its compact state), the
    accumulate, and the compact host state's 8-bit ops: the Adam step with 8-bit moments
    and the (de)quantisation of moments (``zenflow.ops``)."""

    full: HostKernel
    compact: HostKernel
    accumulate: Callable[..., float]
    name: str
    q8: HostKernel | None = None
    quantize: Callable[..., None] | None = None
    dequantize: Callable[..., None] | None = None
    merge: Callable[..., None] | None = None  # a hand-over's in-place re-layout
    gather: Callable[..., None] | None = None  # the host's column gathers (index_select)
    keep_i8: Callable[..., None] | None = None  # the q8 step store's add and 8-bit copy
    add_i8: Callable[..., None] | None = None  # ... and its correction from the copy


def resolve_kernel(host_kernel: str | HostKernel) -> HostKernels:
    """The CPU AdamW ops to run on the host and a name for them.

    "native" is ``zenflow.ops.adamw_step_`` / ``adamw_compact_step_`` / ``accumulate_``,
    the hand-over's ``compact_merge_``, the host's column gathers ``gather_columns_`` and
    the 8-bit ``adamw_q8_step_`` / ``quantize_q8_`` / ``dequantize_q8_`` (GIL-free SIMD
    ops; when they cannot be built the plain references are used and the name says so).
    "reference" forces the plain PyTorch ops. A callable (tests) is used as the full-shape
    kernel, with its compact twin built from it and the 8-bit step running it between the
    reference's dequantisation and quantisation.
    """
    from zenflow import ops

    ref_q8 = (ops.quantize_q8_reference_, ops.dequantize_q8_reference_)
    ref_i8 = (ops.accumulate_keep_i8_reference_, ops.add_dequantized_i8_reference_)
    if callable(host_kernel):
        return HostKernels(
            host_kernel, compact_from_full(host_kernel), ops.accumulate_reference_,
            getattr(host_kernel, "__name__", "custom"),
            functools.partial(ops.adamw_q8_step_reference_, adam_step=host_kernel), *ref_q8,
            ops.compact_merge_reference_, ops.gather_columns_reference_, *ref_i8,
        )  # fmt: skip
    reference = HostKernels(
        ops.adamw_step_reference_, ops.adamw_compact_step_reference_,
        ops.accumulate_reference_, "reference", ops.adamw_q8_step_reference_, *ref_q8,
        ops.compact_merge_reference_, ops.gather_columns_reference_, *ref_i8,
    )  # fmt: skip
    if host_kernel == "reference":
        return reference
    if host_kernel == "native":
        if getattr(ops, "adamw_step_", None) is None:
            return dataclasses.replace(reference, name="reference (native op not available)")
        return HostKernels(ops.adamw_step_, ops.adamw_compact_step_, ops.accumulate_, "native",
                           ops.adamw_q8_step_, ops.quantize_q8_, ops.dequantize_q8_,
                           ops.compact_merge_, ops.gather_columns_, ops.accumulate_keep_i8_,
                           ops.add_dequantized_i8_)  # fmt: skip
    raise ValueError(
        f"host_kernel={host_kernel!r} is not allowed: use 'native', 'reference' or a callable."
    )


class ColumnSteps:
    """Per-column Adam step counts of one side of a weight (int64 tensor) plus the common
    value while every column has the same count (then the fast scalar path applies).

    Columns carry their count across a hand-over together with their moments, so bias
    correction stays right: the device counts steps, the host counts windows.

    ``mirror``: for device counts, the same counts in host memory, so that ``recheck`` does
    not wait for the device; None: not kept. It is held as the counts at the last edit by
    index plus the increments since (every column takes each increment), so a step adds
    to an int, not to a host tensor.
    """

    def __init__(self, counts: torch.Tensor, uniform: int | None,
                 mirror: torch.Tensor | None = None):  # fmt: skip
        self.counts = counts
        self.uniform = uniform
        self._mirror = mirror  # the counts when set
        self._bumps = 0  # increments since

    @property
    def mirror(self) -> torch.Tensor | None:
        return None if self._mirror is None else self._mirror + self._bumps

    @mirror.setter
    def mirror(self, counts: torch.Tensor | None) -> None:
        self._mirror, self._bumps = counts, 0

    @classmethod
    def zeros(cls, n: int, device) -> ColumnSteps:
        return cls(torch.zeros(n, dtype=torch.int64, device=device), 0)

    def increment(self) -> None:
        self.counts += 1
        self._note_increment()

    def _note_increment(self) -> None:
        self._bumps += 1
        if self.uniform is not None:
            self.uniform += 1

    @staticmethod
    def increment_all(steps: list[ColumnSteps]) -> None:
        """``increment`` every one of ``steps``: their counts in one foreach call (one
        launch on a GPU instead of one per weight)."""
        if not steps:
            return
        torch._foreach_add_([s.counts for s in steps], 1)
        for s in steps:
            s._note_increment()

    def recheck(self) -> None:
        """Recompute ``uniform`` after the counts were edited by index (from the mirror, or
        one sync)."""
        if self.counts.numel() == 0:
            self.uniform = 0
            return
        if self._mirror is None:
            lo, hi = int(self.counts.min()), int(self.counts.max())
        else:  # every column took the same increments since the mirror was set
            lo, hi = (int(self._mirror.min()) + self._bumps, int(self._mirror.max()) + self._bumps)
        self.uniform = lo if lo == hi else None

    def max(self) -> int:
        return self.uniform if self.uniform is not None else int(self.counts.max())


@dataclass
class HostState:
    """fp32 master and Adam moments of one parameter in host memory: a whole parameter
    (offload, warm-up), or a ZenFlow weight's non-selected columns in the compact layout
    (``zenflow.engine.zenflow.host_layout``).

    ``steps`` counts the host Adam steps absorbed, per column for a ZenFlow weight
    (``ColumnSteps``), or as one int for a dense/offloaded parameter.
    """

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: ColumnSteps | int = 0

    def moment_tensors(self) -> dict[str, torch.Tensor]:
        """The moments as named tensors (what a checkpoint saves)."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_moments(self, saved: dict) -> None:
        """The moments from ``moment_tensors``' names in ``saved``."""
        self.exp_avg.copy_(saved["exp_avg"].view(self.exp_avg.shape))
        self.exp_avg_sq.copy_(saved["exp_avg_sq"].view(self.exp_avg_sq.shape))


@dataclass
class HostTask:
    """One parameter's share of a host step, then ``after()``.

    Contiguous (``index`` None): ``kernel(master, grad, ...)`` over every element of the
    state (a whole parameter, or a ZenFlow weight's compact non-selected columns), ``grad``
    the gradient or window sum in the same layout (or a function making it when the task
    runs), ``param_bf16`` an optional bf16 image.
    Compact (``index`` given): the compact kernel over the columns ``index`` (along
    ``column_dim``) from ``grad`` in the compact layout, ``param_bf16`` the compact image.
    """

    state: HostState
    grad: torch.Tensor | Callable[[], torch.Tensor]  # or made when the task runs
    grad_scale: float  # 1 / window length (the kernel averages the sum in the same pass),
    # or the step's clipping coefficient for a whole gradient
    col_inner: int = 1  # full shape: layout of per-column steps (see zenflow.ops.adamw_step_)
    param_bf16: torch.Tensor | None = None  # optional bf16 image written in the same pass
    after: Callable[[], None] | None = None
    index: torch.Tensor | None = None  # compact: the columns updated (host, int64, sorted)
    column_dim: int = 1
    # zfctl.step_store "q8": the window's last correction, taken in as the kernel reads
    # ``grad`` (its corr_* arguments: codes, scales, piece starts, delta; contiguous only)
    correction: dict | None = None


@dataclass
class HostJob:
    """A host step (all ZenFlow weights of one window), submitted or finished.

    ``applied_step`` says when its result reached the device. Times (perf_counter seconds)
    and the thread ident instrument overlap in tests. ``copies``: the events of the
    host-to-device copies that read this job's images; the next job waits for them before
    it writes the images again.
    """

    window_start: int  # first global step whose gradient is in this update
    submit_step: int  # global step at whose end it was submitted
    future: Future | None = None
    started_at: float | None = None
    finished_at: float | None = None
    thread_id: int | None = None
    applied_step: int | None = None
    buffer_slot: int = 0  # accumulator slot the job reads (double buffering)
    meta: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)

    def done(self) -> bool:
        return self.future is None or self.future.done()


def run_host_tasks(
    tasks: list[HostTask],
    kernels: HostKernels,
    lr: float,
    hp,
    num_threads: int,
    job: HostJob | None = None,
    before: Callable[[], None] | None = None,
) -> None:
    """Run the CPU AdamW kernels over every task (in place on the host state).

    Each task's step count is its state's count after this update: the kernel gets the
    scalar while all columns agree and the per-column counts otherwise. ``before`` runs
    first (the worker waits there for the window's last gradient piece, and for the copies
    that still read the images it is about to write).
    """
    if job is not None:
        job.started_at = time.perf_counter()
        job.thread_id = threading.get_ident()
    if before is not None:
        before()
    common = dict(lr=lr, beta1=hp.beta1, beta2=hp.beta2, eps=hp.eps,
                  weight_decay=hp.weight_decay, adamw_mode=hp.adamw_mode,
                  num_threads=num_threads)  # fmt: skip
    for t in tasks:
        st = t.state
        grad = t.grad() if callable(t.grad) else t.grad
        per_column = None
        if isinstance(st.steps, ColumnSteps):
            st.steps.increment()
            step = st.steps.max()
            if st.steps.uniform is None:
                per_column = st.steps.counts
        else:
            st.steps += 1
            step = st.steps
        if t.index is not None:
            kernels.compact(
                st.master, grad, st.exp_avg, st.exp_avg_sq, t.index, t.column_dim, step=step,
                image=t.param_bf16, grad_scale=t.grad_scale, col_steps=per_column, **common,
            )  # fmt: skip
        else:
            kw = {} if per_column is None else {"col_steps": per_column, "col_inner": t.col_inner}
            if t.correction is not None:  # the q8 store's last (Q8StepStore.flush's fold)
                kw.update(t.correction)
            if hasattr(st, "step"):  # the compact host state: 8-bit moments, its own op
                st.step(grad, step=step, grad_scale=t.grad_scale, image=t.param_bf16,
                        **common, **kw)  # fmt: skip
            else:
                kernels.full(st.master, grad, st.exp_avg, st.exp_avg_sq, step=step,
                             param_bf16=t.param_bf16, grad_scale=t.grad_scale, **common,
                             **kw)  # fmt: skip
        if t.after is not None:
            t.after()
    if job is not None:
        job.finished_at = time.perf_counter()


class HostWorker:
    """One background thread running host steps; at most one job in flight (enforced:
    DeepSpeed could end up with two host steps in flight)."""

    def __init__(self, bind: Callable[[], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenflow-host",
                                        initializer=bind)  # fmt: skip
        self.in_flight = 0
        self.max_in_flight = 0

    def submit(self, job: HostJob, fn: Callable[[], None]) -> None:
        if self.in_flight:
            raise RuntimeError("zenflow: a host step was submitted while another is in flight")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        job.future = self._pool.submit(fn)

    def wait(self, job: HostJob) -> None:
        """Block until ``job`` finished; re-raise its exception. A wait cut short (a
        KeyboardInterrupt in the training thread) leaves the job in flight, so the next
        wait (a checkpoint's drain) still waits for it: the host state is read only once
        the host step has written all of it."""
        fut = job.future
        if fut is None:
            return
        exc = fut.exception()  # returns only once the job finished
        if self.in_flight:
            self.in_flight -= 1
        job.future = None
        if exc is not None:
            _reraise(exc)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
