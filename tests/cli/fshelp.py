"""Run a Python script in a private mount namespace on a size-limited (or read-only) tmpfs.

``unshare --mount`` (as root) or ``unshare --user --map-root-user --mount`` (unprivileged
user namespaces) gives the script a tmpfs no one else sees, gone when it exits. Where
neither works (a container without CAP_SYS_ADMIN or user namespaces), the test is skipped
with the reason, never silently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# sh: mount the tmpfs on $1 with options $2, then run the rest; 77 = could not mount.
_MOUNT_THEN_RUN = 'mount -t tmpfs -o "$2" zfctl-test "$1" || exit 77; shift 2; exec "$@"'
_NAMESPACES = (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"])


def run_on_tmpfs(mountpoint: Path, options: str, script: Path, *args: str, timeout=600):
    """Run ``python script mountpoint *args`` with a tmpfs mounted on ``mountpoint``;
    returns the CompletedProcess (output captured). Skips the test when no namespace can
    mount one here."""
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` here: cannot mount a size-limited tmpfs for a real full disk")
    mountpoint.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    reasons = []
    for ns in _NAMESPACES:
        cmd = [*ns, "sh", "-c", _MOUNT_THEN_RUN, "sh", str(mountpoint), options,
               sys.executable, str(script), str(mountpoint), *args]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if r.returncode not in (77,) and "unshare failed" not in r.stderr:
            return r
        reasons.append(f"{' '.join(ns)}: {r.stderr.strip()[-200:]}")
    pytest.skip("cannot mount a tmpfs in a private namespace here (" + "; ".join(reasons) + ")")
