"""zenflow.hardware: what the machine has and can do, and what tune-hw decides from it.

``probes`` (CPU, memory, accelerator: parsers of /proc and /sys), ``measure`` (timed
measurements of the training work), ``tuning`` (``choose`` and ``run_tune``).
"""
