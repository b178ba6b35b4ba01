"""Builds and loads the native CPU Adam op (csrc/cpu_adam.cpp) on first use.

This is the one place that reads environment variables for native-build settings:

- ``ZENFLOW_OPS=reference`` routes every ``zenflow.ops.adamw_step_`` call to the plain
  PyTorch reference (for debugging, or where no compiler is available).
- ``ZENFLOW_BUILD_DIR`` overrides the build cache root (default ``~/.cache/zenflow/build``).

The build lives in ``<root>/<key>``, where the key hashes the source text, the torch
version, the compiler flags and the CPU's SIMD capability, so a cache copied to another
machine (or a home directory shared between machines) never loads a kernel built for
instructions the CPU lacks. Nothing is built at import time.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import torch

from zenflow.errors import UserInputError

EXTENSION_NAME = "zenflow_cpu_adam"
SOURCE_FILES = ("cpu_adam.cpp",)
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# torch.utils.cpp_extension holds this file while ninja runs; a killed build leaves it.
LOCK_FILE_NAME = "lock"
# A healthy build takes about a minute; a lock this old belongs to a dead build.
STALE_LOCK_SECONDS = 300.0
BUILD_LOG_NAME = "build.log"
# /proc/cpuinfo flags that change what -march=native emits for this kernel.
_SIMD_FLAG_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "amx", "bmi")


class NativeBuildError(UserInputError):
    """The native op could not be built or loaded; the message says where to look."""


_lock = threading.Lock()
_state: dict[str, Any] = {"state": "not-built", "error": None}


def ops_mode() -> str:
    """``"reference"`` when ``ZENFLOW_OPS=reference``, else ``"native"``."""
    value = os.environ.get("ZENFLOW_OPS", "").strip().lower()
    return "reference" if value == "reference" else "native"


def build_root() -> Path:
    """``$ZENFLOW_BUILD_DIR`` if set, else ``~/.cache/zenflow/build``."""
    override = os.environ.get("ZENFLOW_BUILD_DIR")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "zenflow" / "build"


def csrc_dir() -> Path:
    """The ``csrc/`` folder of the source checkout (zenflow is installed editable)."""
    path = Path(__file__).resolve().parents[2] / "csrc"
    missing = [name for name in SOURCE_FILES if not (path / name).is_file()]
    if missing:
        raise NativeBuildError(
            f"The native op sources {', '.join(missing)} are missing from {path}. The native "
            "CPU Adam builds from a source checkout installed with `pip install -e .`; "
            "reinstall that way, or set ZENFLOW_OPS=reference to use the PyTorch reference."
        )
    return path


def cpu_capability() -> str:
    """The CPU's SIMD level as torch sees it plus the relevant /proc/cpuinfo flags."""
    parts = [platform.machine(), torch.backends.cpu.get_cpu_capability()]
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = sorted(
                {f for f in line.split(":", 1)[1].split() if f.startswith(_SIMD_FLAG_PREFIXES)}
            )
            parts.append(" ".join(flags))
            break
    return "|".join(parts)


def cache_key(source_text: str, torch_version: str, flags: tuple[str, ...], capability: str) -> str:
    """A short hex digest of everything that makes one build differ from another."""
    digest = hashlib.sha256()
    for part in (source_text, torch_version, " ".join(flags), capability):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _sources() -> list[Path]:
    root = csrc_dir()
    return [root / name for name in SOURCE_FILES]


def current_key() -> str:
    """The cache key of this checkout's sources on this CPU with this torch."""
    text = "".join(path.read_text() for path in _sources())
    return cache_key(text, torch.__version__, CFLAGS + LDFLAGS, cpu_capability())


def build_dir() -> Path:
    """Where this checkout's build lives: ``build_root() / current_key()``."""
    return build_root() / current_key()


def check_build_lock(directory: Path, stale_after: float = STALE_LOCK_SECONDS) -> None:
    """Wait for a live build in ``directory``; raise at once if its lock is stale.

    torch's cpp_extension waits forever on a lock left by a killed build. Here a lock older
    than ``stale_after`` seconds is reported with the command that clears it, and a younger
    one (another process building now) is waited on only until it would become stale.
    """
    lock = directory / LOCK_FILE_NAME
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= stale_after:
            raise NativeBuildError(
                f"A stale build lock {lock} ({age:.0f} s old) is left by a build that was "
                f"killed. If no other zenflow build is running, remove it with `rm {lock}` "
                "and retry, or set ZENFLOW_OPS=reference to skip the native op."
            )
        time.sleep(min(1.0, stale_after - age))


def _build(directory: Path) -> None:
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    check_build_lock(directory)
    log_path = directory / BUILD_LOG_NAME
    library = directory / f"{EXTENSION_NAME}.so"
    cached = library.is_file()
    started = time.perf_counter()
    try:
        # verbose=False: on failure cpp_extension puts ninja's full output (the compiler's
        # messages) into the exception text, which goes to the log below.
        cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(path) for path in _sources()],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:
        log_path.write_text(f"zenflow native build failed\n{exc}\n")
        raise NativeBuildError(
            f"Building the native CPU Adam op failed ({type(exc).__name__}); the compiler "
            f"output is in {log_path}. Set ZENFLOW_OPS=reference to run with the PyTorch "
            "reference instead."
        ) from exc
    if not cached:
        log_path.write_text(
            f"zenflow native build ok in {time.perf_counter() - started:.1f} s\n"
            f"flags: {' '.join(CFLAGS + LDFLAGS)}\ncapability: {cpu_capability()}\n"
        )
    _state["state"] = "cached" if cached else "built"


def load_native() -> None:
    """Build (first use) and load the native op; afterwards ``torch.ops.zenflow`` has it.

    Thread-safe and idempotent. Raises ``NativeBuildError`` naming the compiler log and the
    ``ZENFLOW_OPS=reference`` fallback when the build fails; a failure is remembered so later
    calls fail fast with the same error.
    """
    if _state["state"] in ("built", "cached"):
        return
    with _lock:
        if _state["state"] in ("built", "cached"):
            return
        if _state["state"] == "failed":
            raise NativeBuildError(_state["error"])
        try:
            directory = build_dir()
            _state["build_dir"] = str(directory)
            _build(directory)
        except NativeBuildError as exc:
            _state["state"] = "failed"
            _state["error"] = str(exc)
            raise


def native_status() -> dict[str, Any]:
    """Plain data for ``zfctl env``: state, build dir, key, CPU capability, error, ops mode.

    ``state`` is ``not-built`` (not loaded in this process yet), ``built`` (compiled in this
    process), ``cached`` (loaded from an earlier build) or ``failed``. Builds nothing.
    """
    status: dict[str, Any] = {
        "state": _state["state"],
        "ops": ops_mode(),
        "build_dir": None,
        "key": None,
        "cpu_capability": cpu_capability(),
        "error": _state["error"],
    }
    try:
        status["key"] = current_key()
        status["build_dir"] = str(build_root() / status["key"])
    except NativeBuildError as exc:
        status["error"] = status["error"] or str(exc)
    if status["state"] == "not-built" and status["build_dir"]:
        status["cached_library"] = (Path(status["build_dir"]) / f"{EXTENSION_NAME}.so").is_file()
    return status


def _reset_for_tests() -> None:
    """Forget a remembered failure (tests only); a loaded library stays loaded."""
    if _state["state"] == "failed":
        _state["state"] = "not-built"
        _state["error"] = None
