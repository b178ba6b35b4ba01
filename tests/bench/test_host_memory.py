"""bench/host_memory.py's heap probe: the C heap's free bytes at a process's peak RSS, read
from a real child process whose heap is left with a known amount of freed, resident memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import host_memory as hm

# 400 blocks of 64 KiB (below glibc's 128 KiB mmap threshold: they come from the heap), every
# other one freed: half of them are free and resident, held between live neighbours, so
# the heap cannot trim them. Then 16 MiB more, written (above the threshold: a mapping of
# its own, outside the heap's free bytes), so that the peak RSS comes after the frees
# whenever the sampler runs; then a wait long enough for several samples.
CHILD = """
import ctypes, time
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(65536) for _ in range(400)]
for b in blocks:
    ctypes.memset(b, 1, 65536)
for b in blocks[::2]:
    libc.free(b)
time.sleep(0.05)
late = b"\\x01" * (16 << 20)
time.sleep(0.3)
"""


def run_child(tmp_path: Path, code: str) -> dict:
    env = dict(os.environ) | hm.probe_env(tmp_path)
    env.pop("ZF_HEAP_PROBE_PID", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    return json.loads((tmp_path / "heap_probe.json").read_text())


def test_the_probe_sees_the_freed_memory_the_heap_keeps(tmp_path):
    out = run_child(tmp_path, CHILD)
    freed = 200 * 65536
    assert out["samples"] >= 10
    # the freed blocks, give or take glibc's chunk headers and the interpreter's own
    assert freed * 0.9 <= out["free_at_peak"] <= freed * 1.5
    assert out["live_peak"] <= out["rss_peak"]
    assert out["rss_peak"] - out["free_at_peak"] <= out["live_peak"]


def test_the_live_peak_is_the_rss_less_the_free_heap_less_the_device(tmp_path):
    (tmp_path / "heap_probe.json").write_text(
        json.dumps({"rss_peak": 10, "free_at_peak": 3, "live_peak": 8, "samples": 5})
    )
    assert hm.heap_figures(tmp_path, device_peak=2) == {
        "probe_rss_peak": 10, "free_at_peak": 3, "live_host_peak": 6}  # fmt: skip
    rows = [
        {"model": "a", "state": "exact", "params": 100, "probe_rss_peak": 1, "free_at_peak": 0,
         "live_host_peak": 1000},
        {"model": "b", "state": "exact", "params": 300, "probe_rss_peak": 1, "free_at_peak": 0,
         "live_host_peak": 4000},
    ]  # fmt: skip
    assert "| exact | 15.00 B/param |" in hm.heap_table(rows)


def test_only_the_first_process_measures(tmp_path):
    # the child starts a Python grandchild, which inherits PYTHONPATH and the variables:
    # the grandchild runs no sampler, and the file is the child's
    grandchild = "import threading; print('heap-probe' in [t.name for t in threading.enumerate()])"
    code = ("import os, subprocess, sys; "
            f"g = subprocess.run([sys.executable, '-c', {grandchild!r}], check=True, "
            "capture_output=True, text=True); print(g.stdout.strip(), os.getpid())")  # fmt: skip
    env = dict(os.environ) | hm.probe_env(tmp_path)
    env.pop("ZF_HEAP_PROBE_PID", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, timeout=60)  # fmt: skip
    sampled, pid = r.stdout.split()
    assert sampled == "False"
    assert json.loads((tmp_path / "heap_probe.json").read_text())["pid"] == int(pid)


def test_without_its_variable_the_probe_does_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ZF_HEAP_PROBE_OUT"}
    env["PYTHONPATH"] = str(hm.PROBE)
    code = "import sys, threading; print([t.name for t in threading.enumerate()])"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, timeout=60)  # fmt: skip
    assert "heap-probe" not in r.stdout
    with pytest.raises(FileNotFoundError):
        hm.heap_figures(tmp_path, device_peak=0)
