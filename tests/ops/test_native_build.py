"""The native build is private to its checkout and interruptible (issue 31, items 7 and 8).

- Two checkouts of the same sources build in two folders (torch's ``build.ninja`` names the
  sources' absolute paths, so a shared folder made them rebuild over each other), and a
  second load of one checkout loads its finished build without building again.
- Ctrl-C during a build: the terminal sends SIGINT to zfctl's process group. The compiler
  runs in another session, so it never sees that SIGINT. Under the run loop's handler (the
  first Ctrl-C only asks for a stop at the next step boundary) the build simply completes:
  before, ninja got the signal and the run died with "Building the native CPU Adam op
  failed". With Python's default handler zfctl gets a ``KeyboardInterrupt`` (not a build
  error), stops the build in order (ninja stops its compilers), leaves no outputs or lock
  behind, and the next build works.

Both use tiny stand-in sources (one function each, no headers: about a second to compile)
in scratch folders. The interrupted build uses a compiler wrapper that, when compiling,
announces itself and waits for a "go" file, so the interrupt lands mid-compile whatever
the machine's speed; nothing here depends on elapsed time.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zenflow.ops import loader

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")
REPO = Path(loader.__file__).resolve().parents[2]


def _tiny_tree(root: Path) -> Path:
    """A csrc folder with the loader's file names, each a trivial translation unit."""
    root.mkdir(parents=True)
    for name in loader.SOURCE_FILES:
        (root / name).write_text(f"int zenflow_build_test_{Path(name).stem}() {{ return 1; }}\n")
    for name in loader.HEADER_FILES:
        (root / name).write_text("#pragma once\n")
    return root


def test_each_checkout_builds_in_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("ZENFLOW_BUILD_DIR", str(tmp_path / "build"))
    trees = [_tiny_tree(tmp_path / side / "csrc") for side in ("a", "b")]  # same text
    folders = []
    for tree in trees:
        monkeypatch.setattr(loader, "csrc_dir", lambda tree=tree: tree)
        folder = loader.build_dir()
        assert loader._build(folder) == "built"
        folders.append(folder)
    assert folders[0] != folders[1]
    for folder, tree, other in zip(folders, trees, trees[::-1], strict=True):
        ninja = (folder / "build.ninja").read_text()
        assert str(tree) in ninja and str(other) not in ninja
        assert loader.build_complete(folder)

    # Loading checkout a again (as a second process would) loads its build: no rebuild.
    def no_rebuild(*args, **kwargs):
        raise AssertionError("a finished build was built again")

    monkeypatch.setattr(loader, "csrc_dir", lambda: trees[0])
    monkeypatch.setattr(loader, "_run_build_process", no_rebuild)
    library = folders[0] / f"{loader.EXTENSION_NAME}.so"
    before = library.stat().st_mtime_ns
    assert loader.build_dir() == folders[0]
    assert loader._build(folders[0]) == "cached"
    assert library.stat().st_mtime_ns == before


_LOAD = """
import signal, sys
from pathlib import Path
from zenflow.ops import loader
loader.csrc_dir = lambda: Path(sys.argv[1])
requests = []
if sys.argv[2] == "graceful":  # as zfctl's run loop: a first Ctrl-C asks for a stop later
    signal.signal(signal.SIGINT, lambda *_: requests.append("stop requested"))
try:
    loader.load_native()
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    sys.exit(130)
except BaseException as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    sys.exit(1)
# The stand-in library has no simd_path for native_status(); the state says enough.
print("loaded", loader._state["state"], *requests, flush=True)
"""

# A C++ compiler that, when compiling (-c) before the go file exists, says so and waits
# for it, recording a SIGINT or SIGTERM that reaches it. Otherwise the real compiler.
_WRAPPER = """#!/bin/sh
case " $* " in
  *" -c "*)
    if [ ! -e "{flags}/go" ]; then
      trap 'touch "{flags}/got-sigint"; exit 130' INT
      trap 'touch "{flags}/got-sigterm"; exit 143' TERM
      touch "{flags}/started"
      while [ ! -e "{flags}/go" ]; do sleep 0.05; done
    fi ;;
esac
exec "{cxx}" "$@"
"""


def _start_load(tree: Path, env: dict[str, str], sigint: str = "default") -> subprocess.Popen:
    # start_new_session: the script leads its own process group, like a terminal's job.
    return subprocess.Popen(
        [sys.executable, "-c", _LOAD, str(tree), sigint],
        cwd=REPO,  # `python -c` imports zenflow from the working folder first: this checkout
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, limit_s: float = 600) -> None:
    """Until ``path`` exists; fails if ``proc`` ends first (``limit_s`` only bounds a hang)."""
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the build ended before compiling: {proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no compile started within {limit_s} s")
        time.sleep(0.05)


def _running(program: Path) -> list[int]:
    """Processes (not zombies: the container's init may never reap an orphan) whose command
    line names ``program``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue  # ended while we looked
        if state != "Z" and str(program).encode() in cmdline:
            found.append(int(stat.parent.name))
    return found


def _blocking_build(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, str]]:
    """flags folder, tiny tree, build root and the environment of a build whose compiles
    wait for ``flags / "go"``."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = tmp_path / "flags"
    flags.mkdir()
    wrapper = tmp_path / "blocking-c++"
    wrapper.write_text(_WRAPPER.format(flags=flags, cxx=cxx))
    wrapper.chmod(0o755)
    root = tmp_path / "build"
    env = dict(os.environ, CXX=str(wrapper), ZENFLOW_BUILD_DIR=str(root), MAX_JOBS="2")
    env.pop("ZENFLOW_OPS", None)
    return flags, _tiny_tree(tmp_path / "csrc"), root, env


def test_ctrl_c_asking_for_a_stop_does_not_break_the_build(tmp_path):
    flags, tree, _, env = _blocking_build(tmp_path)
    proc = _start_load(tree, env, sigint="graceful")
    try:
        _wait_for(flags / "started", proc)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        (flags / "go").write_text("")
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert (proc.returncode, out.strip()) == (0, "loaded built stop requested"), out
    assert not (flags / "got-sigint").exists(), "the compiler was in the terminal's group"


@pytest.mark.usefixtures("terminal_sigint")  # the test's Ctrl-C reaches the job
def test_ctrl_c_during_build_is_an_interruption_and_a_rebuild_works(tmp_path):
    flags, tree, root, env = _blocking_build(tmp_path)
    proc = _start_load(tree, env)
    try:
        _wait_for(flags / "started", proc)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        out, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert (proc.returncode, out.strip()) == (130, "KeyboardInterrupt"), out
    assert not (flags / "got-sigint").exists(), "the compiler was in the terminal's group"
    # stopped, not left waiting for the go file (which a killed zfctl would have done)
    assert _running(tmp_path / "blocking-c++") == [], "a compiler was left running"
    (folder,) = root.iterdir()
    left = sorted(p.name for p in folder.iterdir())
    assert left == [loader.GUARD_FILE_NAME, loader.BUILD_LOG_NAME], left  # no outputs, no lock
    assert "interrupted" in (folder / loader.BUILD_LOG_NAME).read_text()

    (flags / "go").write_text("")
    rebuilt = _start_load(tree, env)
    assert rebuilt.communicate(timeout=600)[0].strip() == "loaded built"
    assert loader.build_complete(folder)
    again = _start_load(tree, env)
    assert again.communicate(timeout=600)[0].strip() == "loaded cached"
