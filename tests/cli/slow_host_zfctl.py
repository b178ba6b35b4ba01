"""`zfctl` with every ZenFlow host step slowed down by ZFCTL_TEST_SLOW_HOST_S seconds (its
arithmetic unchanged): a checkpoint taken while a host step is in flight then waits for it
long enough for a test to deliver signals in the middle of the save. Run as a script."""

import os
import time

from zenflow.engine import host

_real_submit = host.HostWorker.submit
_delay = float(os.environ.get("ZFCTL_TEST_SLOW_HOST_S", "1.0"))


def _slow_submit(self, job, fn):
    def slow():
        time.sleep(_delay)
        fn()

    return _real_submit(self, job, slow)


host.HostWorker.submit = _slow_submit

from zfctl.app import main  # noqa: E402  (after the patch, like `python -m zfctl`)

main()
