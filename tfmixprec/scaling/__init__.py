"""Loss scaling: the state machine (`loss_scale`), the unscaling contract, the optimizer,
gradient accumulation, the skipped-step state guard, the overflow attribution, the
optimizer's state in saved files, and where gradients fall against float16's range.

What it offers, by module (each module's `__all__`).
"""

from tfmixprec.scaling.attribution import LayerOverflows, OverflowReport, overflow_report
from tfmixprec.scaling.gradient_range import GradientRangeStats, gradient_range_stats
from tfmixprec.scaling.loss_scale import LossScaleConfig
from tfmixprec.scaling.optimizer import LossScaleOptimizer
from tfmixprec.scaling.state_guard import guard_state

__all__ = [
    "LossScaleConfig",
    "GradientRangeStats",
    "gradient_range_stats",
    "LayerOverflows",
    "OverflowReport",
    "overflow_report",
    "LossScaleOptimizer",
    "guard_state",
]
