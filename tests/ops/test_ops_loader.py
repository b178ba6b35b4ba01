"""The native-op loader: cache key, stale build lock, failures, ZENFLOW_OPS routing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import zenflow.ops
from zenflow.ops import NativeBuildError, adamw_step_, adamw_step_reference_, loader

FLAGS = ("-O3", "-march=native", "-fopenmp")


def test_cache_key_depends_on_every_input():
    base = loader.cache_key("src", "2.13.0", FLAGS, "x86_64|AVX2|avx avx2 fma")
    assert base == loader.cache_key("src", "2.13.0", FLAGS, "x86_64|AVX2|avx avx2 fma")
    variants = [
        loader.cache_key("src", "2.13.0", FLAGS, "x86_64|AVX512|avx avx2 avx512f fma"),
        loader.cache_key("src", "2.13.0", FLAGS, "x86_64|DEFAULT|"),
        loader.cache_key("src2", "2.13.0", FLAGS, "x86_64|AVX2|avx avx2 fma"),
        loader.cache_key("src", "2.14.0", FLAGS, "x86_64|AVX2|avx avx2 fma"),
        loader.cache_key("src", "2.13.0", ("-O2",), "x86_64|AVX2|avx avx2 fma"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_cpu_capability_names_torch_level():
    assert torch.backends.cpu.get_cpu_capability() in loader.cpu_capability()


def test_build_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ZENFLOW_BUILD_DIR", str(tmp_path))
    assert loader.build_dir() == tmp_path / loader.current_key()
    monkeypatch.delenv("ZENFLOW_BUILD_DIR")
    assert loader.build_dir().parent == Path.home() / ".cache" / "zenflow" / "build"


def test_stale_lock_raises_with_path_and_fix(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.raises(NativeBuildError) as info:
        loader.check_build_lock(tmp_path)
    assert str(lock) in str(info.value)
    assert f"rm {lock}" in str(info.value)
    assert "ZENFLOW_OPS=reference" in str(info.value)


def test_live_lock_is_waited_on_until_released(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    threading.Timer(0.3, lock.unlink).start()
    start = time.perf_counter()
    loader.check_build_lock(tmp_path, stale_after=30.0)
    assert 0.2 < time.perf_counter() - start < 5.0


def test_live_lock_that_outlives_the_limit_raises(tmp_path):
    (tmp_path / "lock").write_text("")
    with pytest.raises(NativeBuildError, match="stale build lock"):
        loader.check_build_lock(tmp_path, stale_after=0.5)


def _run_python(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **env_extra)
    env.pop("ZENFLOW_OPS", None)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_load_native_reports_stale_lock_instead_of_waiting(tmp_path):
    """End to end in a fresh process: a killed build's lock is reported, nothing built."""
    key_dir = tmp_path / loader.current_key()
    key_dir.mkdir()
    lock = key_dir / "lock"
    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    code = (
        "from zenflow.ops import load_native, native_status\n"
        "try:\n    load_native()\nexcept Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "print(native_status()['state'])\n"
    )
    result = _run_python(code, {"ZENFLOW_BUILD_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "NativeBuildError" in result.stdout
    assert f"rm {lock}" in result.stdout
    assert result.stdout.strip().endswith("failed")
    assert sorted(p.name for p in key_dir.iterdir()) == ["lock"]


def test_import_builds_nothing(tmp_path):
    code = (
        "import zenflow.ops, torch\n"
        "s = zenflow.ops.native_status()\n"
        "print(s['state'], s['build_dir'], hasattr(torch.ops.zenflow, 'adamw_step_'))\n"
    )
    result = _run_python(code, {"ZENFLOW_BUILD_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    state, build_dir, has_op = result.stdout.split()
    assert (state, has_op) == ("not-built", "False")
    assert build_dir.startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_failed_build_names_log_and_fallback(tmp_path, monkeypatch):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "cpu_adam.cpp").write_text("#error zenflow test: deliberately broken source\n")
    monkeypatch.setattr(loader, "csrc_dir", lambda: src)
    build = tmp_path / "build"
    with pytest.raises(NativeBuildError) as info:
        loader._build(build)
    log = build / loader.BUILD_LOG_NAME
    assert str(log) in str(info.value)
    assert "ZENFLOW_OPS=reference" in str(info.value)
    assert "deliberately broken source" in log.read_text()


def test_missing_csrc_is_a_clear_error(monkeypatch, tmp_path):
    fake_module = tmp_path / "a" / "zenflow" / "ops" / "loader.py"
    monkeypatch.setattr(loader, "__file__", str(fake_module))
    with pytest.raises(NativeBuildError, match="pip install -e"):
        loader.csrc_dir()


def test_native_status_is_plain_data():
    status = loader.native_status()
    assert status["state"] in {"not-built", "built", "cached", "failed"}
    assert set(status) >= {"state", "build_dir", "key", "cpu_capability", "error", "ops"}
    assert all(isinstance(v, (str, bool, type(None))) for v in status.values())


def test_reference_mode_routes_to_reference(monkeypatch):
    def no_native():
        raise AssertionError("ZENFLOW_OPS=reference must not touch the native op")

    monkeypatch.setenv("ZENFLOW_OPS", "reference")
    monkeypatch.setattr(zenflow.ops, "load_native", no_native)
    gen = torch.Generator().manual_seed(3)
    param, grad = torch.randn(100, generator=gen), torch.randn(100, generator=gen)
    twin, initial = param.clone(), param.clone()
    m, v, m2, v2 = (torch.zeros(100) for _ in range(4))
    kw = dict(
        step=1,
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        grad_scale=0.5,
        adamw_mode=False,
    )
    adamw_step_(param, grad, m, v, **kw)
    adamw_step_reference_(twin, grad, m2, v2, **kw)
    assert not torch.equal(param, initial)
    assert torch.equal(param, twin) and torch.equal(m, m2) and torch.equal(v, v2)
    assert loader.native_status()["ops"] == "reference"
