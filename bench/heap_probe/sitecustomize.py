"""The C heap's free bytes at a process's peak RSS (bench/host_memory.py ``--heap``).

Put this directory on a child's PYTHONPATH with ``ZF_HEAP_PROBE_OUT`` set to a path: a
daemon thread samples, every ``ZF_HEAP_PROBE_MS`` (2) milliseconds, the process's RSS
(``/proc/self/statm``) and glibc's ``mallinfo2()``; at exit it writes JSON to that path:

- ``rss_peak``: the largest RSS sampled (a sampler can miss a short peak: compare it with
  ``/usr/bin/time -v``'s maximum);
- ``free_at_peak``: glibc's free bytes in its arenas at that sample, less the top chunk
  (``fordblks - keepcost``: freed memory the heap keeps, resident, that no tensor holds);
- ``live_peak``: the largest RSS less those free bytes over the samples (what the
  process's live allocations, its code and its mappings held at most);
- ``samples``, and ``pid``.

Only the first process that loads it measures: it sets ``ZF_HEAP_PROBE_PID``, and the
Python processes it starts (which inherit ``PYTHONPATH``) see another pid there and stay
out. Owns nothing of zfctl: it measures the process it runs in, and touches nothing else.
Does nothing without ``ZF_HEAP_PROBE_OUT`` or off glibc.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import threading
import time

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
           "uordblks", "fordblks", "keepcost")  # fmt: skip


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _start(out: str) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return
    page = os.sysconf("SC_PAGE_SIZE")
    every = float(os.environ.get("ZF_HEAP_PROBE_MS", "2")) / 1e3
    state = {"rss_peak": 0, "free_at_peak": 0, "live_peak": 0, "samples": 0,
             "pid": os.getpid()}  # fmt: skip
    lock = threading.Lock()

    def sample() -> None:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
        info = libc.mallinfo2()
        free = max(0, info.fordblks - info.keepcost)
        with lock:
            state["samples"] += 1
            if rss > state["rss_peak"]:
                state["rss_peak"], state["free_at_peak"] = rss, free
            state["live_peak"] = max(state["live_peak"], rss - free)

    def loop() -> None:
        while True:
            sample()
            time.sleep(every)

    def write() -> None:
        sample()
        with lock, open(out, "w") as f:
            json.dump(state, f)

    threading.Thread(target=loop, name="heap-probe", daemon=True).start()
    atexit.register(write)


if os.environ.get("ZF_HEAP_PROBE_OUT") and os.environ.setdefault(
    "ZF_HEAP_PROBE_PID", str(os.getpid())
) == str(os.getpid()):
    _start(os.environ["ZF_HEAP_PROBE_OUT"])
