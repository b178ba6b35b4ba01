"""The native op releases the GIL while it runs, so the engine's worker thread can overlap it.

A worker thread raises a flag, wakes the main thread and runs the op; the main thread reads
the flag as soon as it holds the GIL again. The switch interval is set far beyond the test
(1000 s), so the worker never gives the GIL up on a timer: the main thread can only run
while the op runs if the op released the GIL (it sees the flag up), and otherwise only once
the worker has lowered it. The verdict is what the main thread saw, never how long anything
took: a loaded machine makes it slower, not different. A negative control runs the same
check on a call known to hold the GIL (libc's usleep through ctypes.PyDLL), proving the
check can tell the two apart. (It replaced a comparison of counting rates, which a loaded
machine's scheduler could tip either way.)
"""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest
import torch

from zenflow.ops import adamw_step_

NUMEL = 2**24  # 64 MB per fp32 tensor: tens of ms per call
CALLS = 4  # the main thread gets CALLS chances to take the GIL while the op runs


def _ran_without_the_gil(run_once, calls: int) -> bool:
    """True when the main thread ran while ``run_once`` was running in another thread."""
    in_op = [False]
    started = threading.Event()

    def worker():
        in_op[0] = True
        started.set()
        for _ in range(calls):
            run_once()
        in_op[0] = False

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # no timed hand-over: only a released GIL lets us in
    try:
        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        started.wait()  # releases the GIL; returns once we hold it again
        seen = in_op[0]
        thread.join()
    finally:
        sys.setswitchinterval(old_interval)
    return seen


def test_negative_control_detects_a_held_gil():
    usleep = ctypes.PyDLL(None).usleep  # PyDLL keeps the GIL held during the call
    assert not _ran_without_the_gil(lambda: usleep(50_000), calls=CALLS)


@pytest.mark.parametrize(
    ("grad_dtype", "col_inner"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 1), (torch.float32, 4096)],
    ids=["fp32", "bf16", "per-column-inner-1", "per-column-inner-4096"],
)
def test_native_op_releases_the_gil(native, grad_dtype, col_inner):
    columns = {}
    if col_inner is not None:  # per-column step counts, 4096 columns of different counts
        columns = dict(col_steps=torch.arange(1, 4097), col_inner=col_inner)
    param = torch.randn(NUMEL)
    grad = torch.randn(NUMEL).to(grad_dtype)
    exp_avg, exp_avg_sq = torch.zeros(NUMEL), torch.zeros(NUMEL)
    initial = param[:1024].clone()
    step = [0]

    def run_once():
        step[0] += 1
        # One OpenMP thread: the other core stays free for the counting thread.
        adamw_step_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step[0],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            num_threads=1,
            **columns,
        )

    # The op runs in a thread of its own, as in the engine's background worker.
    assert _ran_without_the_gil(run_once, CALLS)
    assert not torch.equal(param[:1024], initial)  # the op really ran
