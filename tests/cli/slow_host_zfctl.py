"""`zfctl` with every ZenFlow host step slowed down by ZFCTL_TEST_SLOW_HOST_S seconds (its
arithmetic unchanged): a checkpoint taken while a host step is in flight then waits for it
long enough for a test to deliver signals in the middle of the save. Run as a script;
``slow_host_steps`` is also what the in-process signal tests patch with."""

import os
import time

from zenflow.engine import host


def slow_host_steps(seconds: float, patch=setattr) -> None:
    """Make every host step sleep ``seconds`` first; ``patch``: how to replace
    ``HostWorker.submit`` (pytest's ``monkeypatch.setattr`` undoes it after a test)."""
    real = host.HostWorker.submit

    def submit(self, job, fn):
        def slow():
            time.sleep(seconds)
            fn()

        return real(self, job, slow)

    patch(host.HostWorker, "submit", submit)


if __name__ == "__main__":
    slow_host_steps(float(os.environ.get("ZFCTL_TEST_SLOW_HOST_S", "1.0")))
    from zfctl.app import main  # after the patch, like `python -m zfctl`

    main()
