"""The simulated accelerator's device memory pool (``csrc/sim_pool.cpp``), from Python.

On ``sim`` the device's tensors are CPU tensors. Without a pool of their own they share
glibc's heap with the host state, and their churn leaves free heap in the process's RSS
that on a GPU would be device memory. The pool is torch's CPU allocator once installed;
each thread allocates from the heap (mode 0, the default) or from the pool (mode 1), as
``mode`` sets it. Only ``SimAccelerator`` uses this (its ``device_scope`` and
``host_scope``); the native library is built on first use as for the kernels, and with
``ZENFLOW_OPS=reference``, ``ZENFLOW_SIM_POOL=off`` or without a built native library
there is no pool (``install`` returns False, ``why_not`` says why, and the simulated
device's description says so).

``stats()`` keys: ``resident`` (bytes the pool holds in RSS: a block counts the largest
request it served, page-rounded), ``resident_peak``, ``in_use`` (bytes asked for by live
tensors), ``reserved`` (address space mapped), ``mappings``, ``served`` (allocations
served), ``opened`` (simulated devices open), ``in_use_peak`` (the most bytes in use:
CUDA's max_memory_allocated).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from zenflow.ops.loader import NativeBuildError, load_native, ops_mode, sim_pool_enabled

HOST, DEVICE = 0, 1
_STAT_KEYS = ("resident", "resident_peak", "in_use", "reserved", "mappings", "served",
              "opened", "in_use_peak")  # fmt: skip

_local = threading.local()  # this thread's mode as last set here (skips no-op calls)
_installed: list[bool] = []
_why: list[str] = []
_install_lock = threading.Lock()


def install() -> bool:
    """Install the pool as torch's CPU allocator (once per process) -> whether it is.
    False with ``ZENFLOW_OPS=reference`` (no native library), with ``ZENFLOW_SIM_POOL=off``,
    when the native library cannot be built (no compiler), or when another allocator of
    higher priority was installed first."""
    with _install_lock:
        return _install()


def _install() -> bool:
    if _installed:
        return _installed[0]
    if ops_mode() == "reference" or not sim_pool_enabled():
        return False
    try:
        load_native()
    except NativeBuildError as exc:  # no compiler: sim runs on, and says so (why_not)
        _why.append(f"the native library is not built ({str(exc).splitlines()[0]})")
        _installed.append(False)
        return False
    _installed.append(bool(torch.ops.zenflow.sim_pool_install()))
    if not _installed[0]:
        _why.append("another CPU allocator of higher priority is installed")
    return _installed[0]


def why_not() -> str:
    """Why the pool is not installed ("" when it is, or before ``install``)."""
    if _installed and _installed[0]:
        return ""
    if ops_mode() == "reference":
        return "ZENFLOW_OPS=reference"
    if not sim_pool_enabled():
        return "ZENFLOW_SIM_POOL=off"
    return _why[0] if _why else ""


def _set(mode: int) -> int:
    old = int(torch.ops.zenflow.sim_pool_mode(mode))
    _local.mode = mode
    return old


@contextlib.contextmanager
def mode(value: int) -> Iterator[None]:
    """This thread allocates in ``value`` (HOST or DEVICE) inside; the mode it had after.
    A no-op while the pool is not installed."""
    if getattr(_local, "mode", HOST) == value or not (_installed and _installed[0]):
        yield
        return
    old = _set(value)
    try:
        yield
    finally:
        _set(old)


def open_device() -> None:
    """A simulated device opened: freed device blocks are cached while any is open."""
    torch.ops.zenflow.sim_pool_open(1)


def close_device() -> None:
    """A simulated device closed; the last one's close gives the cache back."""
    torch.ops.zenflow.sim_pool_open(-1)


def stats() -> dict[str, int]:
    return dict(zip(_STAT_KEYS, (int(x) for x in torch.ops.zenflow.sim_pool_stats()),
                    strict=True))  # fmt: skip


def owns(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage was allocated from the pool (False before it is installed)."""
    if not (_installed and _installed[0]):
        return False
    return bool(torch.ops.zenflow.sim_pool_owns(t.untyped_storage().data_ptr()))


def reset_peak() -> None:
    torch.ops.zenflow.sim_pool_reset_peak()
