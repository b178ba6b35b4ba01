"""Host side: fp32 state, the CPU Adam kernel, the background worker and the accumulator.

Two host threads serve the training thread (ZENFLOW.md 2b):

- the **accumulator** adds each non-selected gradient piece, as it arrives from the device,
  into the window's fp32 sum (in order, one piece at a time), so the training thread never
  does host arithmetic per step;
- the **worker** runs the host Adam step of a finished window (the native op, which
  releases the GIL) and prepares what goes back to the device; at most one host step is in
  flight, enforced here.

Hand-offs are function calls on threads (no pickling, no processes).
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


def resolve_kernel(host_kernel: str | HostKernel) -> tuple[HostKernel, str]:
    """The CPU AdamW op to run on the host and a name for it.

    "native" is ``zenflow.ops.adamw_step_`` (GIL-free SIMD op; when it cannot be built the
    plain reference is used and the name says so). "reference" forces the plain PyTorch op.
    A callable is used as is (tests).
    """
    from zenflow import ops

    if callable(host_kernel):
        return host_kernel, getattr(host_kernel, "__name__", "custom")
    if host_kernel == "reference":
        return ops.adamw_step_reference_, "reference"
    if host_kernel == "native":
        native = getattr(ops, "adamw_step_", None)
        if native is None:
            return ops.adamw_step_reference_, "reference (native op not available)"
        return native, "native"
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
    """One parameter's share of a host step: ``kernel(master, grad_sum, ...)``, then
    ``after()`` (pack the result for the device, clear the accumulator)."""

    state: HostState
    grad: torch.Tensor  # host, full shape: the window's gradient sum (fp32) or a gradient
    grad_scale: float  # 1 / window length: the kernel averages the sum in the same pass
    col_inner: int = 1  # layout of per-column steps (see zenflow.ops.adamw_step_)
    param_bf16: torch.Tensor | None = None  # optional bf16 image written in the same pass
    after: Callable[[], None] | None = None


@dataclass
class HostJob:
    """A host step (all ZenFlow weights of one window), submitted or finished.

    ``applied_step`` says when its result reached the device. Times (perf_counter seconds)
    and the thread ident instrument overlap in tests.
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

    def done(self) -> bool:
        return self.future is None or self.future.done()


def run_host_tasks(
    tasks: list[HostTask],
    kernel: HostKernel,
    lr: float,
    hp,
    num_threads: int,
    job: HostJob | None = None,
    before: Callable[[], None] | None = None,
) -> None:
    """Run the CPU AdamW kernel over every task (in place on the host state).

    Each task's step count is its state's count after this update: the kernel gets the
    scalar while all columns agree and the per-column counts otherwise. ``before`` runs
    first (the worker waits there for the window's last gradient piece).
    """
    if job is not None:
        job.started_at = time.perf_counter()
        job.thread_id = threading.get_ident()
    if before is not None:
        before()
    for t in tasks:
        st = t.state
        kw = {}
        if isinstance(st.steps, ColumnSteps):
            st.steps.increment()
            step = st.steps.max()
            if st.steps.uniform is None:
                kw = {"col_steps": st.steps.counts, "col_inner": t.col_inner}
        else:
            st.steps += 1
            step = st.steps
        kernel(
            st.master,
            t.grad,
            st.exp_avg,
            st.exp_avg_sq,
            step=step,
            lr=lr,
            beta1=hp.beta1,
            beta2=hp.beta2,
            eps=hp.eps,
            weight_decay=hp.weight_decay,
            param_bf16=t.param_bf16,
            grad_scale=t.grad_scale,
            adamw_mode=hp.adamw_mode,
            num_threads=num_threads,
            **kw,
        )
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

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenflow-host")
        self.in_flight = 0
        self.max_in_flight = 0

    def submit(self, job: HostJob, fn: Callable[[], None]) -> None:
        if self.in_flight:
            raise RuntimeError("zenflow: a host step was submitted while another is in flight")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        job.future = self._pool.submit(fn)

    def wait(self, job: HostJob) -> None:
        """Block until ``job`` finished; re-raise its exception."""
        fut = job.future
        if fut is None:
            return
        try:
            exc = fut.exception()
        finally:
            if self.in_flight:
                self.in_flight -= 1
            job.future = None
        if exc is not None:
            _reraise(exc)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Accumulator:
    """A thread adding device->host gradient pieces into fp32 window sums, in order.

    ``add(event, staged, acc, dim, index, release)``: wait for the piece's copy event, then
    ``acc.index_add_(dim, index, staged)`` in fp32 (``acc``: the piece's view of the window
    sum, see ``zenflow.engine.copies.Piece``), then ``release()`` (the staging buffer back to the
    staging pool). ``fence()`` returns an event set once every piece queued before it has
    been added: the worker waits on it before the window's host step reads the sums.
    A failure is kept and re-raised by ``check()`` / ``fence().wait`` callers.
    """

    def __init__(self, num_threads: int = 1) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._num_threads = num_threads
        self.error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="zenflow-accum", daemon=True)
        self._thread.start()

    def add(self, event, staged, acc, dim, index, release) -> None:
        self._q.put(("add", event, staged, acc, dim, index, release))

    def fence(self) -> threading.Event:
        done = threading.Event()
        self._q.put(("fence", done))
        return done

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        while True:
            item = self._q.get()
            if item is None:
                return
            if item[0] == "fence":
                item[1].set()
                continue
            _, event, staged, acc, dim, index, release = item
            try:
                if self.error is None:
                    event.synchronize()
                    acc.index_add_(dim, index, staged.float())
            except BaseException as e:  # kept; the training thread re-raises it
                self.error = e
            finally:
                release()

    def check(self) -> None:
        if self.error is not None:
            _reraise(self.error)

    def drain(self) -> None:
        """Block until every queued piece has been added (then ``check``). After close()
        there is nothing left to add."""
        if not self._closed:
            self.fence().wait()
        self.check()

    def close(self) -> None:
        """Add what is queued, then stop the thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self._q.put(None)
            self._thread.join(timeout=60)
