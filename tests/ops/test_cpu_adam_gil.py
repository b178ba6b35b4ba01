"""The native op releases the GIL while it runs, so the engine's worker thread can overlap it.

A Python thread counts as fast as it can while another thread runs the op. If the op held
the GIL, the counter could only advance in the gaps between calls (about one switch
interval each), far less than it advances while the op runs with the GIL released. A
negative control runs the same measurement on a call known to hold the GIL (libc's usleep
through ctypes.PyDLL), proving the measurement can tell the two apart.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest
import torch

from zenflow.ops import adamw_step_

NUMEL = 2**24  # 64 MB per fp32 tensor: tens of ms per call, far above a switch interval
CALLS = 4


def _count_during(run_once, calls: int) -> tuple[float, float]:
    """(counter increments per second of run_once, free counting rate), same conditions."""
    counter = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counter[0] += 1

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)  # a held GIL leaks at most ~1 ms of counting per call
    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    try:
        # Free rate: this thread sleeps (GIL released) while the counter runs alone.
        start_count, start = counter[0], time.perf_counter()
        time.sleep(0.2)
        free_rate = (counter[0] - start_count) / (time.perf_counter() - start)

        advanced, busy = 0, 0.0
        for _ in range(calls):
            before, start = counter[0], time.perf_counter()
            run_once()
            busy += time.perf_counter() - start
            advanced += counter[0] - before
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old_interval)
    return advanced / busy, free_rate


def test_negative_control_detects_a_held_gil():
    usleep = ctypes.PyDLL(None).usleep  # PyDLL keeps the GIL held during the call
    during, free = _count_during(lambda: usleep(50_000), calls=CALLS)
    assert during < 0.25 * free, (during, free)


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

    holder: dict[str, tuple[float, float]] = {}
    # The op runs in a thread of its own, as in the engine's background worker.
    worker = threading.Thread(target=lambda: holder.update(r=_count_during(run_once, CALLS)))
    worker.start()
    worker.join()
    during, free = holder["r"]
    assert not torch.equal(param[:1024], initial)  # the op really ran
    assert during > 0.25 * free, (during, free)
