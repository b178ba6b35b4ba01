"""Host side: counted copies, host fp32 state, the CPU Adam kernel and the background worker.

Every byte that crosses between device and host goes through :class:`Traffic.copy_`, which
counts it (ZENFLOW.md section 4: traffic is counted at each copy, never estimated).
When the device is the CPU itself the copy is still a real memory copy and still counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

HostKernel = Callable[..., None]


def resolve_kernel(host_kernel: str | HostKernel) -> tuple[HostKernel, str]:
    """The CPU AdamW op to run on the host and a name for it.

    "native" is ``zenflow.ops.adamw_step_`` (GIL-free SIMD op); until that op exists (or
    when it cannot be built) the plain reference is used and the name says so.
    "reference" forces the plain PyTorch op (debugging). A callable is used as is (tests).
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


class Traffic:
    """Byte and time counters for device<->host copies of the current step."""

    def __init__(self) -> None:
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.transfer_s = 0.0

    def reset(self) -> None:
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.transfer_s = 0.0

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> torch.Tensor:
        """``dst.copy_(src)``, counting ``src``'s bytes as ``direction`` ("d2h"/"h2d").

        Non-blocking only from/to pinned host memory on CUDA; callers synchronise
        (:meth:`sync`) before the host reads what a d2h copy wrote.
        """
        t0 = time.perf_counter()
        non_blocking = dst.is_cuda != src.is_cuda and (dst.is_pinned() or src.is_pinned())
        dst.copy_(src, non_blocking=non_blocking)
        nbytes = src.numel() * src.element_size()
        if direction == "d2h":
            self.d2h_bytes += nbytes
        elif direction == "h2d":
            self.h2d_bytes += nbytes
        else:
            raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
        self.transfer_s += time.perf_counter() - t0
        return dst

    def to_host(self, src: torch.Tensor, pin: bool) -> torch.Tensor:
        """A new host tensor holding ``src`` (counted d2h)."""
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
        return self.copy_(dst, src, "d2h")

    def to_device(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A new device tensor holding host ``src`` (counted h2d)."""
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)
        return self.copy_(dst, src, "h2d")

    def sync(self, device: torch.device) -> None:
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        self.transfer_s += time.perf_counter() - t0


def host_empty(shape, pin: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, pin_memory=pin)


def host_zeros(shape, pin: bool) -> torch.Tensor:
    return host_empty(shape, pin).zero_()


@dataclass
class HostState:
    """fp32 master and Adam moments of one parameter, full shape, in host memory.

    ``step`` counts the host Adam steps absorbed by this master (warm-up steps and window
    steps); it is the bias-correction step of the next host update minus one.
    """

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0


@dataclass
class HostTask:
    """One parameter's share of a host step: ``kernel(master, grad_sum, ...)``."""

    state: HostState
    grad: torch.Tensor  # host fp32, full shape, the window's gradient sum
    step: int  # bias-correction step for this update
    grad_scale: float  # 1 / window length: the kernel averages the sum in the same pass


@dataclass
class HostJob:
    """A host step (all ZenFlow weights of one window), submitted or finished.

    ``applied`` tracks whether its result has been copied to the device yet. The times
    (perf_counter seconds) and the thread ident instrument overlap in tests.
    """

    window_start: int  # first global step whose gradient is in this update
    submit_step: int  # global step at whose end it was submitted
    future: Future | None = None
    started_at: float | None = None
    finished_at: float | None = None
    thread_id: int | None = None
    applied_step: int | None = None
    buffer_slot: int = 0  # accumulator buffer the job reads (double buffering)
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
) -> None:
    """Run the CPU AdamW kernel over every task (in place on the host state)."""
    if job is not None:
        job.started_at = time.perf_counter()
        job.thread_id = threading.get_ident()
    for t in tasks:
        kernel(
            t.state.master,
            t.grad,
            t.state.exp_avg,
            t.state.exp_avg_sq,
            step=t.step,
            lr=lr,
            beta1=hp.beta1,
            beta2=hp.beta2,
            eps=hp.eps,
            weight_decay=hp.weight_decay,
            grad_scale=t.grad_scale,
            adamw_mode=hp.adamw_mode,
            num_threads=num_threads,
        )
    if job is not None:
        job.finished_at = time.perf_counter()


class HostWorker:
    """One background thread running host steps; at most one job in flight.

    The hand-off is a function call on a thread (no pickling, no process): the native
    kernel releases the GIL, so the training thread keeps running the next window's
    forward/backward meanwhile. An exception raised in the worker is kept in the job's
    future and re-raised in the training thread by :meth:`wait`.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenflow-host")
        self.in_flight = 0
        self.max_in_flight = 0

    def submit(self, job: HostJob, fn: Callable[[], None]) -> None:
        if self.in_flight:
            # Enforced, not assumed: DeepSpeed could end up with two host steps in flight.
            raise RuntimeError("zenflow: a host step was submitted while another is in flight")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        job.future = self._pool.submit(fn)

    def wait(self, job: HostJob) -> None:
        """Block until ``job`` finished; re-raise its exception (same type and message,
        chained to the original with the worker's traceback)."""
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
            try:
                again = type(exc)(*exc.args)
            except Exception:  # exotic constructor: re-raise the original object
                raise exc from None
            raise again from exc

    def close(self) -> None:
        self._pool.shutdown(wait=True)
