"""The ZenFlow schedule as rooms with one job each (ZENFLOW.md section 2).

``mode`` (``ZenFlowMode``: the shared state and the order of a step), ``state`` (per weight:
``ZfWeight``; ``StepPlan``), ``route`` (the gradient route: pieces, scores, norms, landing),
``device_step`` (AdamW of the selected columns), ``window`` (accumulation, the host job, the
auto interval), ``image_return`` (host results back into the weights, overlap), ``handover``
(selection and hand-over), ``warmup`` (warm-up and the first selection). Exports the names
the engine uses; must not hold any code of its own.
"""

from zenflow.engine.zenflow.mode import ZenFlowMode
from zenflow.engine.zenflow.state import StepPlan, ZfWeight
from zenflow.engine.zenflow.window import AUTO_INTERVAL_MAX

__all__ = ["AUTO_INTERVAL_MAX", "StepPlan", "ZenFlowMode", "ZfWeight"]
