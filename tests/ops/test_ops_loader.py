"""The native-op loader: cache key, build guard and killed builds, failures, ZENFLOW_OPS
routing. (One build folder per checkout and Ctrl-C during a build: test_native_build.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import zenflow.ops
from zenflow.ops import NativeBuildError, adamw_step_, adamw_step_reference_, loader

FLAGS = ("-O3", "-march=native", "-fopenmp")


def test_cache_key_depends_on_every_input():
    cpu = "x86_64|AVX2|avx avx2 fma"
    base = loader.cache_key("src", "2.13.0", FLAGS, cpu, "/a/csrc")
    assert base == loader.cache_key("src", "2.13.0", FLAGS, cpu, "/a/csrc")
    variants = [
        loader.cache_key("src", "2.13.0", FLAGS, "x86_64|AVX512|avx avx2 avx512f fma", "/a/csrc"),
        loader.cache_key("src", "2.13.0", FLAGS, "x86_64|DEFAULT|", "/a/csrc"),
        loader.cache_key("src2", "2.13.0", FLAGS, cpu, "/a/csrc"),
        loader.cache_key("src", "2.14.0", FLAGS, cpu, "/a/csrc"),
        loader.cache_key("src", "2.13.0", ("-O2",), cpu, "/a/csrc"),
        loader.cache_key("src", "2.13.0", FLAGS, cpu, "/b/csrc"),  # another checkout
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_cpu_capability_names_torch_level():
    assert torch.backends.cpu.get_cpu_capability() in loader.cpu_capability()


def test_build_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ZENFLOW_BUILD_DIR", str(tmp_path))
    assert loader.build_dir() == tmp_path / loader.current_key()
    monkeypatch.delenv("ZENFLOW_BUILD_DIR")
    assert loader.build_dir().parent == Path.home() / ".cache" / "zenflow" / "build"


def test_guard_clears_a_dead_builds_lock(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    assert not loader.build_running(tmp_path)
    with loader.exclusive_build(tmp_path):
        assert not lock.exists()
        lock.write_text("")  # what torch's cpp_extension does while it builds
    assert lock.exists()  # the guard never touches a lock it does not know to be dead


_HOLD_GUARD = """
import sys, time
from pathlib import Path
from zenflow.ops import loader
directory = Path(sys.argv[1])
with loader.exclusive_build(directory):
    (directory / "lock").write_text("")
    print("held", flush=True)
    time.sleep(120)
"""


def test_guard_waits_for_a_live_build_then_takes_over_from_a_killed_one(tmp_path):
    """The real failure: a build killed mid-way must not block the next one forever."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_GUARD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert loader.build_running(tmp_path)
        entered = threading.Event()
        lock_seen_inside: list[bool] = []

        def enter():
            with loader.exclusive_build(tmp_path):
                lock_seen_inside.append((tmp_path / "lock").exists())
                entered.set()

        waiter = threading.Thread(target=enter, daemon=True)
        waiter.start()
        assert not entered.wait(0.5), "entered while another process was building"
        assert (tmp_path / "lock").exists()
        holder.kill()  # SIGKILL: no clean-up runs, the lock file stays behind
        holder.wait(timeout=300)  # a guard only (as below): a wait this long is a hang
        assert entered.wait(300), "a killed build's lock blocked the next build (hung 300 s)"
        waiter.join(300)
        assert lock_seen_inside == [False]
        assert not loader.build_running(tmp_path)
    finally:
        holder.kill()
        holder.wait(timeout=10)
        holder.stdout.close()


def _run_python(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **env_extra)
    env.pop("ZENFLOW_OPS", None)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


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
    real = loader.csrc_dir()
    for name in loader.SOURCE_FILES + loader.HEADER_FILES:
        (src / name).write_text((real / name).read_text())
    (src / "cpu_adam.cpp").write_text("#error zenflow test: deliberately broken source\n")
    monkeypatch.setattr(loader, "csrc_dir", lambda: src)
    monkeypatch.delitem(loader._state, "cleared_lock", raising=False)  # restored after
    build = tmp_path / "build"
    build.mkdir()
    (build / "lock").write_text("")  # left by a killed build: cleared, not waited on
    with pytest.raises(NativeBuildError) as info:
        loader._build(build)
    assert loader._state["cleared_lock"] == str(build / "lock")  # and reported
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


def test_openmp_runtimes_are_read_from_the_maps():
    maps = (
        "7f00-7f01 r-xp 00000000 08:01 1 /venv/torch/lib/libgomp.so.1\n"
        "7f01-7f02 r--p 00001000 08:01 1 /venv/torch/lib/libgomp.so.1\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/libiomp5.so\n"
        "7f03-7f04 r-xp 00000000 08:01 3 /usr/lib/libgompish.txt\n"
        "7f04-7f05 rw-p 00000000 00:00 0\n"
        "7f05-7f06 r-xp 00000000 08:01 4 /usr/lib/libc.so.6\n"
    )
    assert loader.openmp_runtimes(maps) == ["/usr/lib/libiomp5.so", "/venv/torch/lib/libgomp.so.1"]
    assert loader.openmp_runtimes("") == []


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_the_native_op_shares_torchs_openmp_runtime():
    """The native kernels and torch's ops run on ONE OpenMP runtime (torch's libgomp), so
    their waiting threads do not spin against a second pool (issue 28 item 6)."""
    code = (
        "import torch\n"
        "from zenflow.ops import loader\n"
        "before = loader.openmp_runtimes()\n"
        "loader.load_native()\n"
        "print(len(before), '|'.join(loader.openmp_runtimes()))\n"
    )
    env = {"ZENFLOW_BUILD_DIR": os.environ.get("ZENFLOW_BUILD_DIR", str(loader.build_root()))}
    result = _run_python(code, env)
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.split()
    assert int(before) <= 1
    assert len(after.split("|")) == 1, after


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
