"""`zfctl finetune --nproc N`: N ranks of the same command on this machine, started, stopped
and reported like one run.

Owns the ranks' processes: their environment (what torchrun sets: RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the signals they get, the wait for
every one of them, and the job's exit code and closing line. Must not touch the run itself
(each rank runs ``python -m zfctl <the same arguments>``; ``zenflow.train.parallel`` joins
the group and agrees every stop) nor the ranks' output: they write to this process's
stdout and stderr directly, so no pipe of ours can close before their last line.

The ranks are started here rather than through ``torch.distributed.run``, whose agent
stands between a signal and the ranks: it signals them again on its own SIGINT/SIGTERM
(a rank then gets two and stops mid-step), SIGKILLs them 30 s later (a large checkpoint
takes longer), SIGTERMs the others as soon as one rank ends (cutting rank 0's last lines),
and reports a rank killed by a signal only as text. Multi-node jobs still use torchrun.

Stopping (docs/RELIABILITY.md, "Data parallelism: stops and crashes"):

- every rank is a session of its own, so a terminal's Ctrl-C reaches this process alone;
  each SIGINT or SIGTERM this process gets (from a terminal, a supervisor, Kubernetes) is
  forwarded once to every rank: each rank gets the one signal a single run would get, the
  ranks agree on the step boundary, checkpoint and exit 130 / 143, and this process waits
  for all of them (rank 0 releases the run's lock when it ends) and exits with that code;
- on Linux every rank dies with this process (``PR_SET_PDEATHSIG``: SIGKILL), so kill -9 of
  this PID aborts the whole job, as the ranks' "kill -9 to abort" notice promises, and no
  rank is left behind; the checkpoints already written are whole (temp file, rename).

A rank that fails (an error exit, or killed by a signal this process did not send: the
kernel's out-of-memory killer sends SIGKILL) ends the job: the others normally end by
themselves at their next collective (rank 0 names the last complete checkpoint); any still
running ``RANK_EXIT_GRACE_S`` later get SIGTERM, and SIGKILL ``TERM_KILL_GRACE_S`` after
that (a rank blocked inside a collective runs no Python signal handler). The closing line
names the first rank that failed and how; the exit code is that rank's, or 128 + the signal
number for a rank killed by a signal (137 for SIGKILL: what a shell reports when a single
run is killed the same way, so a supervisor's out-of-memory rule matches both).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from rich.markup import escape

from zfctl.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, err_console

# After a rank failed: the others end by themselves once their next collective fails; a
# rank that has not ended this long after gets SIGTERM.
RANK_EXIT_GRACE_S = 5.0
# After that SIGTERM: a rank still running is blocked (in a collective, or a hung native
# call) and gets SIGKILL. Long enough for a save already under way to finish.
TERM_KILL_GRACE_S = 60.0
# Exit statuses of a rank that stopped on a forwarded signal (zenflow.train.signals).
STOP_CODES = {EXIT_INTERRUPTED: signal.SIGINT, EXIT_TERMINATED: signal.SIGTERM}
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_nproc(args: list[str]) -> list[str]:
    """``args`` minus ``--nproc N`` / ``--nproc=N``: the ranks know their number from
    WORLD_SIZE, and would otherwise start ranks of their own."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def rank_env(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """Rank ``rank``'s environment: torchrun's variables for one node of ``nproc`` ranks."""
    env = dict(base)
    # each rank gets its share of the cores (torch would otherwise use all of them, N times)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))  # fmt: skip
    return env


def _die_with_launcher():
    """A ``preexec_fn`` (Linux): the rank gets SIGKILL when this process ends, however it
    ends. None where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher:  # it ended before the prctl: end with it
            os._exit(1)

    return preexec


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class Ending:
    """How one rank ended: its Popen return code (``-N``: killed by signal N)."""

    rank: int
    status: int
    sent: set[int] = field(default_factory=set)  # the signals this process sent it

    @property
    def killed_by(self) -> int | None:
        """The signal that killed it, when this process did not send that signal."""
        if self.status < 0 and -self.status not in self.sent:
            return -self.status
        return None

    @property
    def stop_signal(self) -> int | None:
        """SIGINT / SIGTERM when the rank ended on a stop signal it was sent."""
        if self.status in STOP_CODES:
            return STOP_CODES[self.status]
        if -self.status in self.sent and -self.status in STOP_CODES.values():
            return -self.status
        if self.status > 0:  # an error exit after this process asked it to stop: e.g. a
            # rank interrupted while Python started up ("init_import_site" failed, exit 1)
            asked = [s for s in (signal.SIGTERM, signal.SIGINT) if s in self.sent]
            return asked[0] if asked else None
        return None


def killed_message(ending: Ending) -> str:
    """The closing line for a rank killed by a signal this process did not send."""
    sig = signal_name(ending.killed_by)
    why = {
        "SIGKILL": "often the kernel's out-of-memory killer: `dmesg` or `journalctl -k` "
        "says so; lower --micro-batch or --seq-len, or use fewer --nproc",
        "SIGSEGV": "a crash in native code: a bug, please report it",
        "SIGABRT": "a crash in native code: a bug, please report it",
        "SIGBUS": "a crash in native code, or a file it had mapped was truncated",
    }.get(sig, "sent by something outside zfctl")
    return (
        f"rank {ending.rank} was killed by {sig} ({why}): the data-parallel job stopped and "
        "its other ranks ended. Checkpoints written before are whole; rank 0's message "
        "above names the last one and the command that continues from it."
    )


class Job:
    """The ranks of one ``--nproc`` job: start, forward signals, wait, decide the code."""

    def __init__(self, nproc: int, args: list[str]):
        self.nproc = nproc
        self.argv = [sys.executable, "-m", "zfctl", *without_nproc(args)]
        self.procs: list[subprocess.Popen] = []
        self.sent: list[set[int]] = [set() for _ in range(nproc)]
        self.received: list[int] = []  # the stop signals this process got, in order
        self.endings: list[Ending] = []  # in the order the ranks ended
        self._ended: queue.Queue[tuple[int, int]] = queue.Queue()

    # -- signals: forwarded once to every running rank
    def _send(self, rank: int, signum: int, group: bool = False) -> None:
        proc = self.procs[rank]
        if proc.returncode is not None:
            return
        self.sent[rank].add(signum)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:  # the rank and what it started (a compiler): its own session
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)

    def _on_signal(self, signum, frame) -> None:
        self.received.append(signum)
        for rank in range(len(self.procs)):
            self._send(rank, signum)

    # -- start and wait
    def _start(self) -> None:
        env, port, preexec = dict(os.environ), free_port(), _die_with_launcher()
        for rank in range(self.nproc):
            if self.received:  # stopped while starting: the rest would wait for nothing
                break
            proc = subprocess.Popen(
                self.argv, env=rank_env(env, rank, self.nproc, port),
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec,
            )  # fmt: skip
            self.procs.append(proc)
            threading.Thread(target=self._reap, args=(rank, proc), daemon=True).start()
            for signum in dict.fromkeys(self.received):  # a signal while it was starting
                self._send(rank, signum)

    def _reap(self, rank: int, proc: subprocess.Popen) -> None:
        self._ended.put((rank, proc.wait()))  # one thread per rank: the order they end in

    def _wait(self) -> None:
        """Until every rank has ended; after a failure, the others are ended too."""
        deadline, escalation = None, [signal.SIGTERM, signal.SIGKILL]
        while len(self.endings) < len(self.procs):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rank, status = self._ended.get(timeout=timeout)
            except queue.Empty:
                sig = escalation.pop(0) if escalation else signal.SIGKILL
                for r in range(len(self.procs)):
                    self._send(r, sig, group=sig == signal.SIGKILL)
                deadline = time.monotonic() + TERM_KILL_GRACE_S
                continue
            ending = Ending(rank, status, self.sent[rank])
            self.endings.append(ending)
            failed = status != 0 and ending.stop_signal is None
            if failed and deadline is None:
                deadline = time.monotonic() + RANK_EXIT_GRACE_S

    def run(self) -> int:
        # a signal this process ignores (SIGINT in a background job) stays ignored, by the
        # ranks too (they inherit it)
        handled = [
            s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) != signal.SIG_IGN
        ]
        old = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            self._start()
            self._wait()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        return self.outcome()

    # -- the job's exit code and closing line
    def root_failure(self) -> Ending | None:
        """The rank whose end ended the job, if it failed: the first to end with an error or
        killed by a signal this process did not send. What ends after it is its consequence
        (a lost peer, an abort at exit), and so is an error exit after a rank stopped on a
        signal (its peer left mid-collective); a rank killed after a stop is not."""
        stopped = False
        for e in self.endings:
            if e.status == 0:
                continue
            if e.stop_signal is not None:
                stopped = True
            elif e.killed_by is not None or not stopped:
                return e
        return None

    def outcome(self) -> int:
        """0 when every rank finished; the stop's code when they stopped on a signal; else
        the failure, said in one line (its own message, if any, is above)."""
        root = self.root_failure()
        if root is None:
            stops = {e.stop_signal for e in self.endings} - {None}
            if len(self.procs) < self.nproc:  # stopped before every rank had started
                stops |= set(self.received)
            if not stops:  # every rank finished (a signal after the last step changes nothing)
                return 0
            sigterm = signal.SIGTERM in stops | set(self.received)
            return EXIT_TERMINATED if sigterm else EXIT_INTERRUPTED
        console = err_console()
        if root.killed_by is not None:
            console.print(f"[bold red]error:[/] [red]{escape(killed_message(root))}[/]")
            return 128 + root.killed_by
        console.print(
            f"[red]data-parallel run failed: rank {root.rank} exited with code "
            f"{root.status}[/] (its message is above)."
        )
        return root.status


def launch(nproc: int, args: list[str]) -> int:
    """Run ``zfctl <args>`` on ``nproc`` local ranks; returns the exit code to use."""
    return Job(nproc, args).run()
