"""zenflow.config: the DeepSpeed config contract (ZENFLOW.md section 3) and the LR schedules.

``schema`` holds the frozen dataclasses and ``ConfigError``; ``rules`` the checks (``readers``:
typed readers that collect problems; ``zenflow_block``: the zenflow block and ZeRO section;
``training_sections``: optimizer, scheduler, batch sizes);
``loader`` reading, overrides and ``load_config``; ``lr_schedule`` DeepSpeed's schedules.
``architectures``: the built-in model shapes by name (`zfctl estimate` and `zfctl finetune`).
"""

from zenflow.config.architectures import (
    ARCHITECTURES,
    Architecture,
    architecture,
    architecture_names,
)
from zenflow.config.loader import apply_overrides, load_config, parse_set_args, replace_zenflow
from zenflow.config.lr_schedule import lr_at
from zenflow.config.schema import (
    ENGINE_FIELD_DOCS,
    FIELD_DOCS,
    Config,
    ConfigError,
    ConfigProblem,
    EngineOptions,
    LogDirConfig,
    MonitorConfig,
    OptimizerConfig,
    SchedulerConfig,
    WandbConfig,
    ZenFlowConfig,
)

__all__ = [
    "ARCHITECTURES",
    "ENGINE_FIELD_DOCS",
    "FIELD_DOCS",
    "Architecture",
    "Config",
    "ConfigError",
    "ConfigProblem",
    "EngineOptions",
    "LogDirConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "WandbConfig",
    "ZenFlowConfig",
    "apply_overrides",
    "architecture",
    "architecture_names",
    "load_config",
    "lr_at",
    "parse_set_args",
    "replace_zenflow",
]
