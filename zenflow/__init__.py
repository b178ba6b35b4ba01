"""zenflow: the ZenFlow training engine (stall-free offloading of the optimizer state).

Public names are imported lazily, so ``import zenflow`` stays light and pulls in no CLI
packages (typer, rich, zfctl).
"""

from __future__ import annotations

__all__ = ["ZenFlowEngine", "load_config", "ConfigError", "StepStats"]

_LAZY = {
    "ZenFlowEngine": "zenflow.engine",
    "load_config": "zenflow.config",
    "ConfigError": "zenflow.config",
    "StepStats": "zenflow.engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zenflow' has no attribute {name!r}")
