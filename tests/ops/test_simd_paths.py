"""Every vector body of the native op, not only the one -march=native picks here.

The kernel has three bodies (AVX-512, AVX2+FMA, scalar) chosen by compiler macros. A build
with ``-march=native`` exercises one of them; this test builds the others with
``ZENFLOW_NATIVE_MARCH`` (an older x86-64 level) into a scratch cache and reruns the
element-wise comparison files against the reference on each (the scalar-step file, the
per-column file, the compact host ops, the 8-bit moment codes and the 8-bit step, the q8
step store's ops and the Adam's folded correction), in a
fresh process (one process can load only one library that registers the zenflow op
namespace). A level the CPU cannot run is skipped, with the reason.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from zenflow.hardware.probes import parse_cpuinfo

HERE = Path(__file__).resolve().parent
NATIVE_TESTS = [
    HERE / "test_cpu_adam_native.py",
    HERE / "test_cpu_adam_columns.py",
    HERE / "test_host_ops.py",
    HERE / "test_q8_codec.py",
    HERE / "test_q8_step.py",
    HERE / "test_step_i8_ops.py",
    HERE / "test_adam_q8_fold.py",
]
# x86-64 micro-architecture levels (GCC >= 11): v3 has AVX2+FMA and no AVX-512; the
# baseline has only SSE2, so neither vector body compiles.
LEVELS = [("x86-64-v3", "avx2", {"avx2", "fma", "bmi2", "movbe"}), ("x86-64", "scalar", set())]


def _cpu_flags() -> set[str]:
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())["flags"]
    except OSError:
        return set()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels only")
@pytest.mark.parametrize(("march", "path", "needs"), LEVELS, ids=[lv[1] for lv in LEVELS])
def test_simd_path_matches_the_reference(march, path, needs, tmp_path):
    missing = needs - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)} for -march={march}")
    env = dict(
        os.environ,
        ZENFLOW_NATIVE_MARCH=march,
        ZENFLOW_EXPECT_SIMD=path,
        ZENFLOW_BUILD_DIR=str(tmp_path / "build"),
    )
    env.pop("ZENFLOW_OPS", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, NATIVE_TESTS)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "skipped" not in result.stdout, tail
    log = next((tmp_path / "build").glob("*/build.log")).read_text()
    assert f"-march={march}" in log, log
