"""zenflow.engine: the ZenFlow optimizer step and everything it owns.

``schedule`` (``ZenFlowEngine``: the step schedule), ``selection`` (column scores, top-k,
hand-over), ``device_adam`` (AdamW on the device), ``host`` (host state, counted copies,
the background worker), ``checkpoint`` (engine state), ``stats`` (the per-step record),
``reference_schedule`` (the plain single-threaded reference the tests compare against).

Public names load lazily: ``zenflow.engine.stats`` (plain data, no torch) can be imported by
the CLI without pulling in torch.
"""

from __future__ import annotations

__all__ = ["MODES", "TIMING_FIELDS", "EngineError", "StepStats", "ZenFlowEngine"]

_LAZY = {
    "MODES": "zenflow.engine.schedule",
    "ZenFlowEngine": "zenflow.engine.schedule",
    "TIMING_FIELDS": "zenflow.engine.stats",
    "StepStats": "zenflow.engine.stats",
    "EngineError": "zenflow.errors",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zenflow.engine' has no attribute {name!r}")
