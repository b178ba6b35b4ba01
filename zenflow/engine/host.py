"""Host side: fp32 state, the CPU Adam kernels, the background worker and the accumulator.

Two host threads serve the training thread (ZENFLOW.md 2b):

- the **accumulator** adds each gradient piece, as it arrives from the device, into a
  window's fp32 sum kept in the compact layout of the weight's non-selected columns
  (``zenflow.engine.copies``): a contiguous multiply-add on the host's cores (the native
  ``accumulate_``, threaded), in order. A step's pieces arrive during backward, before the
  step's clipping coefficient is known: each waits on its step's ``StepGate``, set by the
  training thread once the step's norm is read, and is scaled by the coefficient as it is
  added (or dropped, when the step is skipped);
- the **worker** runs the host Adam step of a finished window (the native op, which
  releases the GIL, over the non-selected columns only, writing the bf16 image that goes
  back to the device in the same pass); at most one host step is in flight, enforced here.

Hand-offs are function calls on threads (no pickling, no processes). Every thread that
may touch the device binds to it first (``Accelerator.bind_thread``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

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
    """The host's ops: the full-shape CPU Adam, its compact-layout twin, the accumulate."""

    full: HostKernel
    compact: HostKernel
    accumulate: Callable[..., float]
    name: str


def resolve_kernel(host_kernel: str | HostKernel) -> HostKernels:
    """The CPU AdamW ops to run on the host and a name for them.

    "native" is ``zenflow.ops.adamw_step_`` / ``adamw_compact_step_`` / ``accumulate_``
    (GIL-free SIMD ops; when they cannot be built the plain references are used and the
    name says so). "reference" forces the plain PyTorch ops. A callable (tests) is used as
    the full-shape kernel, with its compact twin built from it.
    """
    from zenflow import ops

    if callable(host_kernel):
        return HostKernels(
            host_kernel, compact_from_full(host_kernel), ops.accumulate_reference_,
            getattr(host_kernel, "__name__", "custom"),
        )  # fmt: skip
    if host_kernel == "reference":
        return HostKernels(
            ops.adamw_step_reference_, ops.adamw_compact_step_reference_,
            ops.accumulate_reference_, "reference",
        )  # fmt: skip
    if host_kernel == "native":
        if getattr(ops, "adamw_step_", None) is None:
            return HostKernels(
                ops.adamw_step_reference_, ops.adamw_compact_step_reference_,
                ops.accumulate_reference_, "reference (native op not available)",
            )  # fmt: skip
        return HostKernels(ops.adamw_step_, ops.adamw_compact_step_, ops.accumulate_, "native")
    raise ValueError(
        f"host_kernel={host_kernel!r} is not allowed: use 'native', 'reference' or a callable."
    )


class ColumnSteps:
    """Per-column Adam step counts of one side of a weight (int64 tensor) plus the common
    value while every column has the same count (then the fast scalar path applies).

    Columns carry their count across a hand-over together with their moments, so bias
    correction stays right: the device counts steps, the host counts windows.
    """

    def __init__(self, counts: torch.Tensor, uniform: int | None):
        self.counts = counts
        self.uniform = uniform

    @classmethod
    def zeros(cls, n: int, device) -> ColumnSteps:
        return cls(torch.zeros(n, dtype=torch.int64, device=device), 0)

    def increment(self) -> None:
        self.counts += 1
        if self.uniform is not None:
            self.uniform += 1

    def recheck(self) -> None:
        """Recompute ``uniform`` after the counts were edited by index (one sync)."""
        if self.counts.numel() == 0:
            self.uniform = 0
            return
        lo, hi = int(self.counts.min()), int(self.counts.max())
        self.uniform = lo if lo == hi else None

    def max(self) -> int:
        return self.uniform if self.uniform is not None else int(self.counts.max())


@dataclass
class HostState:
    """fp32 master and Adam moments of one parameter, full shape, in host memory.

    ``steps`` counts the host Adam steps absorbed, per column for a ZenFlow weight
    (``ColumnSteps``), or as one int for a dense/offloaded parameter.
    """

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: ColumnSteps | int = 0


@dataclass
class HostTask:
    """One parameter's share of a host step, then ``after()``.

    Full shape (``index`` None): ``kernel(master, grad, ...)`` over every element, ``grad``
    the parameter's gradient or window sum, ``param_bf16`` an optional bf16 image.
    Compact (``index`` given): the compact kernel over the columns ``index`` (along
    ``column_dim``) from ``grad`` in the compact layout, ``param_bf16`` the compact image.
    """

    state: HostState
    grad: torch.Tensor
    grad_scale: float  # 1 / window length (the kernel averages the sum in the same pass),
    # or the step's clipping coefficient for a whole gradient
    col_inner: int = 1  # full shape: layout of per-column steps (see zenflow.ops.adamw_step_)
    param_bf16: torch.Tensor | None = None  # optional bf16 image written in the same pass
    after: Callable[[], None] | None = None
    index: torch.Tensor | None = None  # compact: the columns updated (host, int64, sorted)
    column_dim: int = 1


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
                st.master, t.grad, st.exp_avg, st.exp_avg_sq, t.index, t.column_dim, step=step,
                image=t.param_bf16, grad_scale=t.grad_scale, col_steps=per_column, **common,
            )  # fmt: skip
        else:
            kw = {} if per_column is None else {"col_steps": per_column, "col_inner": t.col_inner}
            kernels.full(st.master, t.grad, st.exp_avg, st.exp_avg_sq, step=step,
                         param_bf16=t.param_bf16, grad_scale=t.grad_scale, **common,
                         **kw)  # fmt: skip
        if t.after is not None:
            t.after()
    if job is not None:
        job.finished_at = time.perf_counter()


def _reraise(exc: BaseException):
    """Re-raise a worker's exception in the caller: same type and message, chained to the
    original (which carries the worker's traceback)."""
    try:
        again = type(exc)(*exc.args)
    except Exception:  # exotic constructor: re-raise the original object
        raise exc from None
    raise again from exc


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


class StepGate:
    """One step's clipping coefficient and skip decision, set by the training thread once
    the step's norm is known. The accumulator waits on it before it adds that step's
    pieces into a window sum (they arrive during backward, before the norm exists)."""

    __slots__ = ("_set", "coef", "skip")

    def __init__(self) -> None:
        self._set = threading.Event()
        self.coef = 1.0
        self.skip = False

    def set(self, coef: float, skip: bool) -> None:
        self.coef = float(coef)
        self.skip = bool(skip)
        self._set.set()

    def wait(self) -> None:
        self._set.wait()

    def is_set(self) -> bool:
        return self._set.is_set()


class Accumulator:
    """A thread adding gradient pieces into fp32 sums (compact layout), in order.

    ``add(event, src, dst, gate, overwrite, release, stat, wait)``: wait for the copy
    ``event`` (and ``wait``: the host step reading ``dst``), then for ``gate`` (None: no
    coefficient, e.g. a micro-batch into its step's sum), then
    ``dst = coef * src`` (``overwrite``) or ``dst += coef * src``, in fp32, on ``threads``
    host threads; then ``release()`` (the staging buffer back to its pool). A skipped step's
    pieces are dropped. ``stat``: a key under which the sum of squares of ``dst`` after the
    add is totalled (``sums``: a step's host-side share of the global norm). ``call(fn)``
    runs ``fn`` in order; ``fence()`` returns an event set once everything queued before it
    has run. A failure is kept and re-raised by ``check()`` / the fence's waiters.
    """

    def __init__(self, accumulate, threads: int = 1, bind: Callable[[], None] | None = None):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._accumulate = accumulate
        self.threads = max(1, int(threads))
        self._bind = bind
        self.error: BaseException | None = None
        self.sums: dict = {}
        self.busy_s = 0.0  # time spent adding (throughput figures)
        self.elements = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="zenflow-accum", daemon=True)
        self._thread.start()

    def add(self, event, src, dst, gate, overwrite, release, stat=None, wait=None) -> None:
        """Queue an add; ``wait``: an event to wait for before ``dst`` is written (the host
        step still reading the window sum)."""
        self._q.put(("add", event, src, dst, gate, overwrite, release, stat, wait))

    def call(self, fn: Callable[[], None]) -> None:
        self._q.put(("call", fn))

    def fence(self) -> threading.Event:
        done = threading.Event()
        self._q.put(("fence", done))
        return done

    def _run(self) -> None:
        if self._bind is not None:
            self._bind()
        torch.set_num_threads(self.threads)
        while True:
            item = self._q.get()
            if item is None:
                return
            kind = item[0]
            if kind == "fence":
                item[1].set()
                continue
            if kind == "call":
                try:
                    if self.error is None:
                        item[1]()
                except BaseException as e:  # kept; the training thread re-raises it
                    self.error = e
                continue
            _, event, src, dst, gate, overwrite, release, stat, wait = item
            try:
                if self.error is None:
                    event.synchronize()
                    if wait is not None:
                        wait.wait()
                    scale = 1.0
                    if gate is not None:
                        gate.wait()
                        scale = gate.coef
                    if gate is None or not gate.skip:
                        t0 = time.perf_counter()
                        sq = self._accumulate(dst, src, scale, overwrite, stat is not None,
                                              self.threads)  # fmt: skip
                        self.busy_s += time.perf_counter() - t0
                        self.elements += dst.numel()
                        if stat is not None:
                            self.sums[stat] = self.sums.get(stat, 0.0) + sq
            except BaseException as e:  # kept; the training thread re-raises it
                self.error = e
            finally:
                if release is not None:
                    release()

    def check(self) -> None:
        if self.error is not None:
            _reraise(self.error)

    def squares(self, buffers: dict) -> float:
        """The step's host share of the squared norm: the squares totalled in-line by adds
        (``stat`` keys ("sq", name)) plus those of ``buffers`` (name -> fp32 tensor, totalled
        here, after the adds queued before), in float64. Waits for the accumulator; the
        in-line totals are consumed."""
        for name, buf in buffers.items():
            key = ("sq", name)

            def total(buf=buf, key=key):
                self.sums[key] = float(buf.double().square().sum())

            self.call(total)
        self.drain()
        keys = [k for k in self.sums if isinstance(k, tuple) and k[0] == "sq"]
        return sum(self.sums.pop(k) for k in keys)

    def drain(self) -> None:
        """Block until every queued item has run (then ``check``). After close() there is
        nothing left to add."""
        if not self._closed:
            self.fence().wait()
        self.check()

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self._q.put(None)
            self._thread.join(timeout=60)
