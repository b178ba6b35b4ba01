"""zenflow.hardware: what the machine has and can do, and what tune-hw decides from it.

``probes`` (CPU, memory, accelerator: parsers of /proc and /sys), ``measure`` (timed
measurements of the training work), ``topk`` (topk_ratio's memory and time bounds),
``tuning`` (``choose``), ``tune_run`` (``run_tune``: the whole tune-hw run).
"""
