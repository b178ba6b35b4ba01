"""`zfctl env`: print the environment for a bug report.

``collect_env(hw_path)`` gathers plain data (versions, device, CPU, native-op status,
offline settings, the latest tune-hw choices); ``env`` prints it as JSON or renders it with
Rich. Nothing here compiles the native op unless ``--build`` asks for it, and torch is
imported inside the functions, so ``zfctl --help`` stays light. env is diagnostics: what it
cannot read becomes a line under "problems", never a crash, and it exits 0.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from zenflow import jsonout
from zfctl import __version__
from zfctl.env_render import (
    CPU_FLAGS,
    DEEPSPEED_NOTE,
    DEEPSPEED_PIN,
    ENV_VARS,
    NOT_INSTALLED,
    PACKAGES,
    render,
)

NO_CUDA = "cpu (no CUDA device: the device is the CPU itself)"
DEFAULT_HW = Path("hw.json")


# --------------------------------------------------------------------------------------
# Gathering (plain data)


def collect_env(hw_path: Path = DEFAULT_HW) -> dict[str, Any]:
    """Everything ``zfctl env`` shows, as a JSON-able dict. Builds nothing.

    Keys: ``versions`` (distribution -> version or "not installed", plus python,
    python_executable, platform), ``device``, ``cpu``, ``native`` (``zenflow.ops
    .native_status()`` plus build-log and lock details), ``environment`` (offline and build
    variables, None when unset), ``hw`` (the tune-hw result at ``hw_path``) and ``problems``
    (sentences for what looks wrong). A section that fails to gather holds only
    ``gather_error`` (and a line in ``problems``).
    """
    problems: list[str] = []
    info: dict[str, Any] = {}
    for key, gather in (
        ("versions", collect_versions),
        ("device", collect_device),
        ("cpu", collect_cpu),
        ("native", collect_native),
        ("environment", collect_environment),
    ):
        try:
            info[key] = gather(problems)
        except Exception as exc:  # diagnostics: report the failure, show the other sections
            info[key] = {"gather_error": f"{type(exc).__name__}: {exc}"}
            problems.append(f"could not gather {key}: {type(exc).__name__}: {exc}")
    info["hw"] = read_hw(Path(hw_path), problems)
    info["problems"] = problems
    return info


def collect_versions(problems: list[str]) -> dict[str, str]:
    """Python, zfctl and each of PACKAGES via importlib.metadata; flags the deepspeed pin."""
    from importlib import metadata

    out = {
        "python": " ".join(sys.version.split()),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "zfctl": __version__,
    }
    for dist in PACKAGES:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = NOT_INSTALLED
    missing = [d for d in PACKAGES if out[d] == NOT_INSTALLED]
    if missing:
        problems.append(
            f"{', '.join(missing)} not installed (zfctl dependencies); run scripts/setup.sh "
            "or `pip install -e .`"
        )
    ds = out["deepspeed"]
    if ds != NOT_INSTALLED and ds != DEEPSPEED_PIN:
        problems.append(
            f"deepspeed {ds} is installed; {DEEPSPEED_NOTE}. Reinstall with "
            f"`pip install deepspeed=={DEEPSPEED_PIN}`."
        )
    return out


def collect_device(problems: list[str]) -> dict[str, Any]:
    """CUDA devices (or the CPU-as-device line), torch threads and CPU capability."""
    import torch

    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {
        "cuda_available": cuda,
        "device": "cuda" if cuda else NO_CUDA,
        "cuda_version": torch.version.cuda,
        "cuda_devices": [],
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "os_cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "parallel_info": [
            line.strip() for line in torch.__config__.parallel_info().splitlines() if line.strip()
        ],
    }
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out["cuda_devices"].append({"name": props.name, "memory_bytes": props.total_memory})
    return out


def collect_cpu(problems: list[str]) -> dict[str, Any]:
    """Model, cores, flags of interest and memory, from zenflow.hardware.probes."""
    from zenflow.hardware import probes as hw

    probe = hw.probe_cpu()
    cpuinfo = Path("/proc/cpuinfo")
    flags: set[str] = set()
    if cpuinfo.is_file():  # absent off Linux: the flags stay unknown (None)
        flags = hw.parse_cpuinfo(cpuinfo.read_text())["flags"]
    have = {**hw.simd_support(flags), "f16c": "f16c" in flags}  # amx: any amx_* flag
    out: dict[str, Any] = {
        "model": probe.model,
        "logical_cores": probe.logical_cores,
        "physical_cores": probe.physical_cores,
        "usable_cores": probe.usable_cores,
        "numa_nodes": probe.numa_nodes,
        "flags": {f: have[f] if flags else None for f in CPU_FLAGS},
        "memory_total_bytes": None,
        "memory_available_bytes": None,
    }
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        mem = hw.parse_meminfo(meminfo.read_text())
        out["memory_total_bytes"] = mem["total_bytes"]
        out["memory_available_bytes"] = mem["available_bytes"]
    return out


def collect_native(problems: list[str]) -> dict[str, Any]:
    """``zenflow.ops.native_status()`` plus the last build log, lock and compiler. No build."""
    from zenflow.ops import loader

    out = dict(loader.native_status())
    cxx = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension invokes
    out["compiler"] = {"command": cxx, "path": shutil.which(cxx)}
    out["build_log"] = None
    out["lock_age_s"] = None
    out["build_running"] = False
    if out["build_dir"]:
        directory = Path(out["build_dir"])
        log = directory / loader.BUILD_LOG_NAME
        if log.is_file():
            lines = log.read_text(errors="replace").splitlines()
            out["build_log"] = {"path": str(log), "first_line": lines[0] if lines else ""}
            if lines and "failed" in lines[0] and out["state"] != "failed":
                problems.append(
                    f"the last native build failed; the compiler output is in {log} "
                    "(ZENFLOW_OPS=reference runs with the PyTorch reference instead)"
                )
        lock = directory / loader.LOCK_FILE_NAME
        try:
            out["lock_age_s"] = round(time.time() - lock.stat().st_mtime, 1)
        except FileNotFoundError:
            pass
        # A lock with no live guard holder is a killed build's; the next build clears it.
        out["build_running"] = loader.build_running(directory)
    if out["state"] == "failed" or (out["error"] and out["state"] == "not-built"):
        problems.append(f"native CPU Adam: {out['error']}")
    if out["compiler"]["path"] is None and not _native_ready(out):
        problems.append(
            f"no C++ compiler `{cxx}` on PATH: the native CPU Adam cannot be built (install "
            "g++, or set ZENFLOW_OPS=reference)"
        )
    return out


def _native_ready(native: dict) -> bool:
    return native.get("state") in ("built", "cached") or bool(native.get("cached_library"))


def collect_environment(problems: list[str]) -> dict[str, Any]:
    """The offline and build variables (None when unset) and whether GLUE SST-2 is there."""
    out: dict[str, Any] = {name: os.environ.get(name) for name in ENV_VARS}
    glue = out["GLUE_DIR"]
    out["glue_sst2_train"] = None
    if glue:
        train = Path(glue).expanduser() / "sst2" / "train.tsv"
        out["glue_sst2_train"] = {"path": str(train), "exists": train.is_file()}
    return out


def read_hw(path: Path, problems: list[str]) -> dict[str, Any]:
    """The tune-hw result at ``path``: its choices and their reasons, or why there are none."""
    out: dict[str, Any] = {"path": str(path), "present": False, "message": None}
    if not path.exists():
        rerun = "`zfctl tune-hw`" if path == DEFAULT_HW else f"`zfctl tune-hw --output {path}`"
        where = "" if path == DEFAULT_HW else f" at {path}"
        out["message"] = f"no hw.json{where} (run {rerun})"
        return out
    out["present"] = True
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        return _hw_problem(
            out,
            problems,
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "rerun `zfctl tune-hw` to rewrite it",
        )
    except (OSError, UnicodeDecodeError) as exc:
        return _hw_problem(out, problems, f"cannot read {path}: {exc}")
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), dict):
        return _hw_problem(
            out,
            problems,
            f"{path} has no 'choices' object, so it is not a `zfctl tune-hw` result; rerun "
            "`zfctl tune-hw` to rewrite it",
        )
    reasons = doc.get("reasons")
    out.update({
        "date": doc.get("date"),
        "settings": doc.get("settings"),
        "choices": doc["choices"],
        "reasons": reasons if isinstance(reasons, dict) else {},
        "memory_verdict": (doc.get("memory_check") or {}).get("verdict"),
        "versions": doc.get("versions"),
        "notes": [],
    })  # fmt: skip
    measured = (doc.get("versions") or {}).get("torch")
    if measured:
        from importlib import metadata

        try:
            now = metadata.version("torch")
        except metadata.PackageNotFoundError:
            now = NOT_INSTALLED
        if measured != now:
            out["notes"].append(
                f"measured with torch {measured}, torch {now} is installed now: rerun "
                "`zfctl tune-hw` for current figures"
            )
    return out


def _hw_problem(out: dict, problems: list[str], message: str) -> dict:
    out["message"] = message
    problems.append(message)
    return out


# --------------------------------------------------------------------------------------
# The command


def env(
    hw: Annotated[
        Path, typer.Option("--hw", help="The `zfctl tune-hw` result to show (its hw.json).")
    ] = DEFAULT_HW,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON document on stdout, nothing else.")
    ] = False,
    build: Annotated[
        bool,
        typer.Option(
            "--build",
            help="Build (or load) the native CPU Adam now; a first build takes about a minute. "
            "Without it env only reports the build status.",
        ),
    ] = False,
) -> None:
    """Print versions, device, CPU, native-op status and offline settings for a bug report."""
    attempt = build_native(Console(stderr=True, highlight=False, emoji=False)) if build else None
    info = collect_env(hw)
    if attempt is not None:
        info["native"]["build_attempt"] = attempt
        if not attempt["ok"]:
            info["problems"].append(f"native CPU Adam: {attempt['error']}")
    if json_output:
        typer.echo(jsonout.dumps(info, indent=2))
        return

    render(Console(highlight=False, emoji=False), info)


def build_native(err: Console) -> dict[str, Any]:
    """Build or load the native op now; {"ok", "seconds", "state"} or {"ok": False, "error"}."""
    from zenflow import ops

    status = ops.native_status()
    if not _native_ready(status):
        err.print("[dim]env: building the native CPU Adam (about a minute on first build)…[/dim]")
    started = time.perf_counter()
    try:
        ops.load_native()
    except ops.NativeBuildError as exc:
        return {"ok": False, "error": str(exc)}
    seconds = round(time.perf_counter() - started, 1)
    return {"ok": True, "seconds": seconds, "state": ops.native_status()["state"]}
