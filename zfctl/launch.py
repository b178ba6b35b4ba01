"""`zfctl finetune --nproc N`: start torch.distributed.run (torchrun) with N copies of the
same command on this machine, and report how it ended in zfctl's terms.

Every rank runs ``python -m zfctl finetune <the same arguments>``; torchrun sets RANK,
WORLD_SIZE, LOCAL_RANK and the rendezvous (127.0.0.1, a free port). Rank 0 draws the
dashboard on this terminal (its stdout is ours); the other ranks print nothing but their
own error, if any. torchrun's own report of a failed rank (a traceback of the launcher,
not of zfctl) is replaced by one line naming the rank and its exit code, and zfctl exits
with that rank's code (2 for bad input, 130/143 after an interrupt).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

from zfctl.errors import err_console

_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_RANK = re.compile(r"\brank\s*:\s*(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_nproc(args: list[str]) -> list[str]:
    """``args`` minus ``--nproc N`` / ``--nproc=N``: the ranks know their number from
    torchrun, and torchrun itself would take ``--nproc`` for its own ``--nproc-per-node``."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def torchrun_command(nproc: int, args: list[str], port: int) -> list[str]:
    """The torchrun command line running ``zfctl <args>`` on ``nproc`` ranks here."""
    args = without_nproc(args)
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "zfctl", *args,
    ]  # fmt: skip


def launch(nproc: int, args: list[str]) -> int:
    """Run ``zfctl <args>`` on ``nproc`` local ranks; returns the exit code to use."""
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    # torchrun warns and sets 1 when this is unset; each rank gets its share instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    proc = subprocess.Popen(
        torchrun_command(nproc, args, free_port()), env=env, stderr=subprocess.PIPE, text=True
    )
    console = err_console()
    launcher_report = False
    codes: list[int] = []
    ranks: list[int] = []
    for line in proc.stderr:
        # torchrun's report of a failed rank: a traceback of the launcher itself, then a
        # summary with "rank: N" and "exitcode: N" lines; keep the numbers, drop the text
        if line.startswith("Traceback (most recent call last)") or "ChildFailedError" in line:
            launcher_report = True
        if launcher_report or line.startswith(("W1", "E1", "I1")) and "torch" in line:
            codes += [int(c) for c in _EXITCODE.findall(line)]
            ranks += [int(r) for r in _RANK.findall(line)]
            continue
        sys.stderr.write(line)
    rc = proc.wait()
    if rc == 0:
        return 0
    code = next((c for c in codes if c > 0), 1)
    rank = ranks[0] if ranks else "?"
    console.print(
        f"[red]data-parallel run failed: rank {rank} exited with code {code}[/] (its message "
        "is above)."
    )
    return code
