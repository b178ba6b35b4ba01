"""Stop requests: Ctrl-C (SIGINT) and SIGTERM end a run at a step boundary, checkpointed.

The first SIGINT or SIGTERM only sets ``requested`` (and remembers which signal it was);
the run loop checks it at each step boundary, saves a checkpoint there and stops.

What a further signal does depends on where the run is:

- in an *interruptible* phase (forward, evaluation, writing the final model: work that is
  discarded or redone on resume and changes no engine state), a second SIGINT interrupts
  at once (``KeyboardInterrupt``: the user insists): the run saves the checkpoint of the
  last step boundary and stops;
- in a *protected* phase (``protect()``: backward, whose hooks stream gradient pieces into
  the host accumulator; the engine's optimizer step; capturing and writing a checkpoint,
  whose in-flight host step must finish first) and once the stop itself has begun
  (``stopping``), it is ignored: the handler says "already stopping: finishing checkpoint
  N (kill -9 to abort)" through ``notify`` and the protected work completes. Any mix of
  signals therefore ends with a complete checkpoint of one step boundary, or with the
  previous one kept (checkpoints are written to a temporary file and renamed).

SIGTERM is what cluster schedulers send a grace period before SIGKILL (Slurm's KillWait
and Kubernetes' terminationGracePeriodSeconds are both 30 s by default), so waiting for the
boundary must not take unbounded time: SIGTERM also arms a timer of ``TERM_GRACE_S``. If the
boundary has not been reached when it fires (a long forward, a long evaluation), the run is
interrupted there, as by a second Ctrl-C. The timer never interrupts a protected phase; it
fires again shortly after that phase ends (and not at all once the stop has begun).

Data parallel (``agreed=True``): the ranks stop together at an agreed step boundary
(``zenflow.train.parallel.agree_stop``; ``agree`` takes the agreed signal, so a SIGTERM to
one rank gives every rank the exit status 143). A rank must never leave a step alone: the
others would wait in a collective with it (or meet it in a different one). So a further
signal is only acknowledged, whatever the phase, and SIGTERM arms no grace timer; the run
stops at the next boundary, and kill -9 (or a scheduler's SIGKILL after its grace) aborts it
with the last complete checkpoint kept.

``notify(message)`` runs inside the signal handler, so it must be safe there: the CLI
writes the line with one ``os.write`` to stderr (a buffered stream may be in the middle of
a write the handler interrupted). Every notice is also kept in ``notices``.

Handlers can only be installed in the main thread; elsewhere ``StopRequests`` does nothing
(a run in a worker thread is stopped by raising KeyboardInterrupt from its event callback).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable

# Seconds from SIGTERM to an immediate stop; leaves ~10 s of a 30 s grace for the write.
TERM_GRACE_S = 20.0
# When the grace timer fires inside a protected phase, try again after this long.
_RETRY_S = 0.2
# Exit status of a process stopped by each signal (128 + signal number, shell convention).
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}
_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class StopRequests:
    """Context manager holding the SIGINT/SIGTERM handlers for the run loop."""

    def __init__(
        self,
        term_grace_s: float | None = None,
        notify: Callable[[str], None] | None = None,
        agreed: bool = False,
    ):
        self.requested: str | None = None  # "SIGINT" or "SIGTERM" once asked to stop
        self.stopping: int | None = None  # the step whose checkpoint the stop is finishing
        self.notices: list[str] = []
        self._protected = 0  # depth of protect() blocks
        self._what = ""  # what the innermost protected block is finishing (for notices)
        self._grace = TERM_GRACE_S if term_grace_s is None else term_grace_s
        self._notify = notify
        self._agreed = agreed  # data parallel: every stop is at an agreed boundary
        self._old: dict[int, object] = {}
        self._installed = False

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in (
                (signal.SIGINT, self._on_signal),
                (signal.SIGTERM, self._on_signal),
                (signal.SIGALRM, self._on_grace_over),
            ):
                self._old[sig] = signal.signal(sig, handler)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, old in self._old.items():
                signal.signal(sig, old)
            self._installed = False

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.requested or "SIGINT", 130)

    @property
    def protected(self) -> bool:
        return self._protected > 0

    @contextlib.contextmanager
    def protect(self, what: str):
        """No signal interrupts the block; ``what`` ("step 12, then checkpoint 12",
        "checkpoint 12") is what a repeated signal's notice says the run is finishing."""
        outer = self._what
        self._protected += 1
        self._what = what
        try:
            yield
        finally:
            self._protected -= 1
            self._what = outer

    def agree(self, name: str) -> None:
        """The stop the ranks agreed on (data parallel): its signal decides the exit status;
        a SIGTERM this rank got stays (its status is 143 whatever the others got)."""
        if self.requested != "SIGTERM":
            self.requested = name

    def begin_stop(self, step: int) -> None:
        """The stop has begun: the checkpoint of ``step`` is written next; from now on
        every signal is only acknowledged, and the grace timer is off."""
        self.stopping = step
        if self._installed:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def _say(self, message: str) -> None:
        self.notices.append(message)
        if self._notify is not None:
            self._notify(message)

    def _on_signal(self, signum, frame) -> None:
        name = _NAMES.get(signum, str(signum))
        first = self.requested is None
        if self._agreed:  # a rank never stops alone
            self.requested = "SIGTERM" if name == "SIGTERM" else (self.requested or name)
            if not first:
                self._say(self._agreed_notice())
            return
        if name == "SIGTERM" and self.requested != "SIGTERM" and self.stopping is None:
            # also after a Ctrl-C: the scheduler's clock runs from its SIGTERM
            signal.setitimer(signal.ITIMER_REAL, max(self._grace, 1e-3))
        if first:
            self.requested = name
            return
        if name == "SIGTERM":  # a scheduler is ending the job: exit status 143
            self.requested = name
        if self.stopping is not None:
            self._say(f"already stopping: finishing checkpoint {self.stopping} (kill -9 to abort)")
        elif self.protected:
            self._say(f"already stopping: finishing {self._what} (kill -9 to abort)")
        elif name == "SIGINT":
            self._say("stopping now: the step in progress is discarded (kill -9 to abort)")
            raise KeyboardInterrupt
        else:
            self._say(
                "already stopping at the next step boundary, within the grace period "
                "(kill -9 to abort)"
            )

    def _agreed_notice(self) -> str:
        if self.stopping is not None:
            return f"already stopping: finishing checkpoint {self.stopping} (kill -9 to abort)"
        if self.protected:
            return f"already stopping: finishing {self._what} (kill -9 to abort)"
        return (
            "already stopping at the next step boundary: the ranks of a data-parallel job "
            "stop together (kill -9 to abort)"
        )

    def _on_grace_over(self, signum, frame) -> None:
        if self.stopping is not None:
            return
        if self.protected:
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
            return
        raise KeyboardInterrupt
