"""Stop requests: Ctrl-C (SIGINT) and SIGTERM end a run at a step boundary, checkpointed.

The first SIGINT or SIGTERM only sets ``requested`` (and remembers which signal it was);
the run loop checks it at each step boundary, saves a checkpoint there and stops. A second
SIGINT raises ``KeyboardInterrupt`` at once (the user insists).

SIGTERM is what cluster schedulers send a grace period before SIGKILL (Slurm's KillWait
and Kubernetes' terminationGracePeriodSeconds are both 30 s by default), so waiting for the
boundary must not take unbounded time: SIGTERM also arms a timer of ``TERM_GRACE_S``. If the
boundary has not been reached when it fires (a long step, a long evaluation), the run is
interrupted there, as by a second Ctrl-C: the trainer then saves the checkpoint of the
last step boundary. The timer never interrupts the engine's optimizer step (``critical``),
whose state may be half-updated; it fires again shortly after that step ends.

Handlers can only be installed in the main thread; elsewhere ``StopRequests`` does nothing
(a run in a worker thread is stopped by raising KeyboardInterrupt from its event callback).
"""

from __future__ import annotations

import signal
import threading

# Seconds from SIGTERM to an immediate stop; leaves ~10 s of a 30 s grace for the write.
TERM_GRACE_S = 20.0
# When the grace timer fires inside the engine's step, try again after this long.
_RETRY_S = 0.2
# Exit status of a process stopped by each signal (128 + signal number, shell convention).
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class StopRequests:
    """Context manager holding the SIGINT/SIGTERM handlers for the run loop."""

    def __init__(self, term_grace_s: float | None = None):
        self.requested: str | None = None  # "SIGINT" or "SIGTERM" once asked to stop
        self.critical = False  # True while the engine's step runs (never interrupted by timer)
        self._grace = TERM_GRACE_S if term_grace_s is None else term_grace_s
        self._old: dict[int, object] = {}
        self._installed = False

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in (
                (signal.SIGINT, self._on_sigint),
                (signal.SIGTERM, self._on_sigterm),
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

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = "SIGINT"

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested != "SIGTERM":  # also after a Ctrl-C: the scheduler's clock runs
            self.requested = "SIGTERM"
            signal.setitimer(signal.ITIMER_REAL, max(self._grace, 1e-3))
        # A repeated SIGTERM changes nothing: the grace timer already bounds the wait.

    def _on_grace_over(self, signum, frame) -> None:
        if self.critical:
            signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
            return
        raise KeyboardInterrupt
