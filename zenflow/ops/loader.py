"""Builds and loads the native CPU Adam ops (csrc/*.cpp) on first use.

This is the one place that reads environment variables for native-build settings:

- ``ZENFLOW_OPS=reference`` routes every ``zenflow.ops`` op call to the plain
  PyTorch reference (for debugging, or where no compiler is available).
- ``ZENFLOW_BUILD_DIR`` overrides the build cache root (default ``~/.cache/zenflow/build``).
- ``ZENFLOW_SIM_POOL=off`` leaves the simulated accelerator's device tensors in glibc's heap
  (no device pool, ``zenflow.ops.sim_pool``): the memory model before the pool, to compare.
- ``ZENFLOW_NATIVE_MARCH`` overrides ``-march=native`` (``x86-64-v3`` builds the AVX2 path
  on an AVX-512 machine, ``x86-64`` the scalar one), so every SIMD path can be checked here.

The build lives in ``<root>/<key>``, where the key hashes the source text, the absolute
source folder, the torch version, the compiler flags and the CPU's SIMD capability: a cache
copied to another machine (or a home directory shared between machines) never loads a
kernel built for instructions the CPU lacks, and two checkouts of one version get two
folders (torch's ``build.ninja`` names the sources' absolute paths, so a shared folder made
each checkout rebuild over the other's). Nothing is built at import time.

The compiler runs in a child process in its own session: a Ctrl-C at the terminal reaches
zfctl only, never the compiler mid-write. The build is then stopped in order (ninja stops
its compilers and removes their partial outputs), the folder's outputs are removed, and the
``KeyboardInterrupt`` propagates: an interrupted build is an interruption, not a build
failure, and the next build starts afresh. A folder counts as built only once the build
finished and wrote ``build.done`` (the library's size and time); a later load of the same
checkout then loads the library directly, without running the build again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zenflow.errors import UserInputError

try:
    import fcntl  # the build guard's flock; POSIX only
except ImportError:  # pragma: no cover - not POSIX: builds run unguarded
    fcntl = None

EXTENSION_NAME = "zenflow_cpu_adam"
SOURCE_FILES = ("cpu_adam.cpp", "host_ops.cpp", "q8_ops.cpp", "sim_pool.cpp")
# Included by the sources: part of the cache key, not compiled on their own.
HEADER_FILES = ("adam_kernel.h", "q8_codec.h")
LDFLAGS = ("-fopenmp",)
# torch.utils.cpp_extension holds this file while ninja runs; a killed build leaves it, and
# torch then waits on it forever.
LOCK_FILE_NAME = "lock"
# Every zenflow build holds an flock on this file; the kernel drops it when the holder dies.
GUARD_FILE_NAME = "build.flock"
BUILD_LOG_NAME = "build.log"
# Written when a build finished: "<size> <mtime_ns>" of the library it left. A folder
# without it (or whose library is not that file) holds no finished build.
BUILT_MARKER_NAME = "build.done"
# How long an interrupted build may take to stop in order before it is killed.
STOP_TIMEOUT_S = 60.0
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


def sim_pool_enabled() -> bool:
    """False when ``ZENFLOW_SIM_POOL=off`` (or 0, false, no)."""
    value = os.environ.get("ZENFLOW_SIM_POOL", "").strip().lower()
    return value not in ("off", "0", "false", "no")


def compile_flags() -> tuple[str, ...]:
    """``-O3 -march=<ZENFLOW_NATIVE_MARCH or native> -fopenmp``."""
    march = os.environ.get("ZENFLOW_NATIVE_MARCH", "").strip() or "native"
    return ("-O3", f"-march={march}", "-fopenmp")


def build_root() -> Path:
    """``$ZENFLOW_BUILD_DIR`` if set, else ``~/.cache/zenflow/build``."""
    override = os.environ.get("ZENFLOW_BUILD_DIR")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "zenflow" / "build"


def csrc_dir() -> Path:
    """The ``csrc/`` folder of the source checkout (zenflow is installed editable)."""
    path = Path(__file__).resolve().parents[2] / "csrc"
    missing = [name for name in SOURCE_FILES + HEADER_FILES if not (path / name).is_file()]
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


def cache_key(
    source_text: str,
    torch_version: str,
    flags: tuple[str, ...],
    capability: str,
    source_dir: str,
) -> str:
    """A short hex digest of everything that makes one build differ from another.

    ``source_dir`` is the absolute ``csrc`` folder: every checkout builds in its own folder.
    """
    digest = hashlib.sha256()
    for part in (source_text, torch_version, " ".join(flags), capability, source_dir):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _sources() -> list[Path]:
    root = csrc_dir()
    return [root / name for name in SOURCE_FILES]


def current_key() -> str:
    """The cache key of this checkout's sources on this CPU with this torch."""
    root = csrc_dir()
    text = "".join((root / name).read_text() for name in SOURCE_FILES + HEADER_FILES)
    flags = compile_flags() + LDFLAGS
    return cache_key(text, torch.__version__, flags, cpu_capability(), str(root))


def build_dir() -> Path:
    """Where this checkout's build lives: ``build_root() / current_key()``."""
    return build_root() / current_key()


@contextlib.contextmanager
def exclusive_build(directory: Path) -> Iterator[bool]:
    """Hold the right to build in ``directory``; clear a killed build's lock first.

    torch's cpp_extension marks a build with a plain ``lock`` file and waits forever on one
    left by a killed build. Every zenflow build (ours and the DeepSpeed ops we build) runs
    inside this guard, which holds an ``flock`` on ``build.flock`` in the same folder. The
    kernel releases an flock when its holder dies, so once it is ours no other guarded build
    is alive, and a ``lock`` file still there is a dead build's: it is removed, and the
    context value says so (True) for the caller to report. A live build in another process
    is waited for. POSIX only; elsewhere the guard does nothing.
    """
    with _guard(directory) as (cleared, _fd):
        yield cleared


@contextlib.contextmanager
def _guard(directory: Path) -> Iterator[tuple[bool, int | None]]:
    """``exclusive_build`` that also yields the guard's file descriptor (None when not
    POSIX): a build process that inherits it keeps the flock held while it lives, even if
    this process is killed first."""
    directory.mkdir(parents=True, exist_ok=True)
    if fcntl is None:  # pragma: no cover - not POSIX
        yield False, None
        return
    with open(directory / GUARD_FILE_NAME, "a+") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            lock = directory / LOCK_FILE_NAME
            cleared = lock.exists()
            lock.unlink(missing_ok=True)
            yield cleared, guard.fileno()
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def build_running(directory: Path) -> bool:
    """True while another process holds ``directory``'s build guard (a build is running)."""
    if fcntl is None:  # pragma: no cover - not POSIX
        return False
    try:
        guard = open(directory / GUARD_FILE_NAME, "rb")
    except FileNotFoundError:
        return False
    with guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(guard, fcntl.LOCK_UN)
        return False


def load_deepspeed_op(builder_name: str) -> Any:
    """JIT-build (first use) and load one of DeepSpeed's ops, guarded like our own build.

    ``builder_name`` is an op builder class name of the current DeepSpeed accelerator
    (``"CPUAdamBuilder"``, ``"ShareMemCommBuilder"``). The build goes to
    ``<build_root>/deepspeed/<op>`` instead of torch's shared default, so only guarded
    builds ever write there. DeepSpeed keeps the loaded module, so a later
    ``deepspeed.initialize`` or ``DeepSpeedCPUAdam`` in this process reuses it.
    """
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None:
        raise NativeBuildError(
            f"DeepSpeed's {get_accelerator().device_name()} accelerator has no {builder_name}."
        )
    # One folder per Python environment: DeepSpeed's sources live in its site-packages, so
    # two virtualenvs sharing a folder would rebuild over each other every time.
    env_key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    root = build_root() / "deepspeed" / env_key
    # DeepSpeed's jit_load takes no folder, and its ZenFlow optimizer process (spawned, so a
    # fresh interpreter) loads the op again from whatever TORCH_EXTENSIONS_DIR says then. The
    # setting stays for the life of this process: restoring it once sent that child to
    # torch's shared default folder, where a lock left by another environment's killed build
    # made it wait 600 s and fail.
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    with exclusive_build(root / builder.NAME):
        return builder.load(verbose=False)


def _build(directory: Path) -> str:
    """Build in ``directory`` unless a finished build is there, then load the library.

    Returns ``"built"`` or ``"cached"``. Raises ``NativeBuildError`` (compiler log named)
    when the build or the load fails; a ``KeyboardInterrupt`` during the build stops it,
    removes its outputs and propagates.
    """
    log_path = directory / BUILD_LOG_NAME
    started = time.perf_counter()
    with _guard(directory) as (cleared, guard_fd):
        if cleared:
            _state["cleared_lock"] = str(directory / LOCK_FILE_NAME)
        cached = build_complete(directory)
        if not cached:
            (directory / BUILT_MARKER_NAME).unlink(missing_ok=True)
            _run_build_process(directory, log_path, guard_fd)
            _write_marker(directory)
            log_path.write_text(
                f"zenflow native build ok in {time.perf_counter() - started:.1f} s\n"
                f"flags: {' '.join(compile_flags() + LDFLAGS)}\ncapability: {cpu_capability()}\n"
                + (f"cleared {_state['cleared_lock']}, left by a killed build\n" if cleared else "")
            )
        _load_library(directory)
    return "cached" if cached else "built"


def _library(directory: Path) -> Path:
    return directory / f"{EXTENSION_NAME}.so"


def _library_stamp(directory: Path) -> str:
    info = _library(directory).stat()
    return f"{info.st_size} {info.st_mtime_ns}\n"


def build_complete(directory: Path) -> bool:
    """True when ``directory`` holds a finished build: its ``build.done`` names the library
    that is there (an interrupted or failed build leaves none)."""
    try:
        return (directory / BUILT_MARKER_NAME).read_text() == _library_stamp(directory)
    except OSError:
        return False


def _write_marker(directory: Path) -> None:
    partial = directory / (BUILT_MARKER_NAME + ".partial")
    partial.write_text(_library_stamp(directory))
    partial.replace(directory / BUILT_MARKER_NAME)


def _load_library(directory: Path) -> None:
    library = _library(directory)
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        (directory / BUILT_MARKER_NAME).unlink(missing_ok=True)  # rebuild next time
        raise NativeBuildError(
            f"Loading the native CPU Adam op {library} failed ({exc}); the next run rebuilds "
            "it. Set ZENFLOW_OPS=reference to run with the PyTorch reference instead."
        ) from exc


# Runs torch's JIT build in a child process that leads its own session, so the terminal's
# SIGINT (sent to zfctl's process group) never reaches ninja or the compiler. The parent
# stops an interrupted build with SIGTERM to this session: ninja (in it) passes the signal
# on to its compilers, waits for them and removes their partial outputs, while this
# process only notes the signal and waits for ninja, so torch's lock file is released.
_BUILD_SCRIPT = """
import json, signal, sys
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
spec = json.loads(sys.argv[1])
from torch.utils import cpp_extension
if stop:
    sys.exit(143)
try:
    cpp_extension.load(**spec)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    sys.exit(143 if stop else 1)
sys.exit(143 if stop else 0)
"""


def _run_build_process(directory: Path, log_path: Path, guard_fd: int | None) -> None:
    spec = dict(
        name=EXTENSION_NAME,
        sources=[str(path) for path in _sources()],
        extra_cflags=list(compile_flags()),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        is_python_module=False,
        # verbose=False: on failure cpp_extension puts ninja's full output (the compiler's
        # messages) into the exception text, which the child prints into the log.
        verbose=False,
    )
    child = None
    with open(log_path, "w") as log:
        try:
            child = subprocess.Popen(
                [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # The build inherits the guard: if this process is killed, the flock stays
                # held until the build ends, so no other build starts over it.
                pass_fds=() if guard_fd is None else (guard_fd,),
            )
            returncode = child.wait()
        except BaseException:  # KeyboardInterrupt (or anything else): stop, clean, re-raise
            if child is not None:
                _stop_build(child)
            _remove_outputs(directory, log_path)
            raise
    if returncode != 0:
        output = log_path.read_text(errors="replace")
        log_path.write_text(f"zenflow native build failed (exit {returncode})\n{output}")
        raise NativeBuildError(
            f"Building the native CPU Adam op failed; the compiler output is in {log_path}. "
            "Set ZENFLOW_OPS=reference to run with the PyTorch reference instead."
        )


def _stop_build(child: subprocess.Popen) -> None:
    """SIGTERM the build's process group, then wait until no live process is left in the
    build's session: the Python leader dies at once, ninja (in the group) kills its compilers
    (each in a process group of its own, still in the session) and waits for them, and a
    compiler's shell may outlive ninja by a moment. SIGKILL to every process of the session
    after ``STOP_TIMEOUT_S``. A second Ctrl-C does not cut the wait short: leaving the
    compilers running would leave outputs behind."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    killed = False
    while True:
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=0.1)
            alive = _session_processes(child.pid)
            if child.returncode is not None and not alive:
                return
            if time.monotonic() >= deadline:
                if killed:
                    return  # SIGKILLed: what is still listed no longer runs
                for pid in alive or [child.pid]:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                killed = True
            time.sleep(0.05)
        except KeyboardInterrupt:
            continue


def _session_processes(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``. Reads /proc on Linux (an orphan
    is reaped by init, which in a container may never happen, so "listed" is not "alive");
    elsewhere, the session leader's process group as the kernel sees it."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(sid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [sid]
    alive = []
    for stat in proc.glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid pgrp session ..."
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _remove_outputs(directory: Path, log_path: Path) -> None:
    """Remove what an interrupted build may have left: objects, the library, ninja's files,
    torch's lock, the marker. The next build in ``directory`` starts afresh."""
    for path in directory.iterdir():
        ninja_file = path.name in ("build.ninja", ".ninja_log", ".ninja_deps")
        marker = path.name.startswith(BUILT_MARKER_NAME)
        if path.suffix in (".o", ".so") or ninja_file or marker or path.name == LOCK_FILE_NAME:
            path.unlink(missing_ok=True)
    log_path.write_text("zenflow native build interrupted; the next build starts afresh\n")


def load_native() -> None:
    """Build (first use) and load the native op; afterwards ``torch.ops.zenflow`` has it.

    Thread-safe and idempotent. Raises ``NativeBuildError`` naming the compiler log and the
    ``ZENFLOW_OPS=reference`` fallback when the build fails; a failure is remembered so later
    calls fail fast with the same error. A ``KeyboardInterrupt`` during the build propagates
    (nothing is remembered: the next call builds again).
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
            _state["state"] = _build(directory)
        except NativeBuildError as exc:
            _state["state"] = "failed"
            _state["error"] = str(exc)
            raise


def simd_path() -> str:
    """Which vector body the native op was compiled with: ``avx512``, ``avx2`` or ``scalar``.

    Builds or loads the op first (it is the compiled library that knows).
    """
    load_native()
    return str(torch.ops.zenflow.simd_path())


_OPENMP_NAMES = ("libgomp", "libiomp", "libomp")


def openmp_runtimes(maps: str | None = None) -> list[str]:
    """The OpenMP runtimes mapped into this process (``/proc/self/maps``; ``maps`` replaces
    its text), by path. The native op links ``libgomp.so.1``; loaded after torch, whose
    wheel ships a ``libgomp.so.1`` of its own, the loader resolves it to that copy: ONE
    runtime, whose waiting threads the native kernels and torch's ops share (issue 28
    item 6). Two here mean two thread pools spinning against each other. Empty off Linux."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    found = set()
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if Path(path).name.startswith(_OPENMP_NAMES) and ".so" in Path(path).name:
            found.add(path)
    return sorted(found)


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
        "flags": " ".join(compile_flags()),
        # The vector body the loaded build compiled: "avx512", "avx2" or "scalar".
        "simd_path": simd_path() if _state["state"] in ("built", "cached") else None,
        "error": _state["error"],
        # A lock file of a killed build that this process's build found and removed.
        "cleared_lock": _state.get("cleared_lock"),
        # The OpenMP runtimes in this process (one where the loaded op shares torch's)
        "openmp_runtimes": ", ".join(openmp_runtimes()) or None,
    }
    try:
        status["key"] = current_key()
        status["build_dir"] = str(build_root() / status["key"])
    except NativeBuildError as exc:
        status["error"] = status["error"] or str(exc)
    if status["state"] == "not-built" and status["build_dir"]:
        status["cached_library"] = build_complete(Path(status["build_dir"]))
    return status


def _reset_for_tests() -> None:
    """Forget a remembered failure (tests only); a loaded library stays loaded."""
    if _state["state"] == "failed":
        _state["state"] = "not-built"
        _state["error"] = None
