"""What tfmixprec adds to `fit`: the train step and model classes, adoption of Keras's
optimizer, the callbacks' shared reader and hooks, the overflow batches kept in the
step, the callbacks, TensorBoard, repair during `fit`, the gradient and float8 monitors.

What it offers, by module (each module's `__all__`).
"""

from tfmixprec.fit.callbacks import LossScaleMonitor, OverflowGuard
from tfmixprec.fit.float8_monitor import Float8Monitor
from tfmixprec.fit.gradient_monitor import GradientRangeMonitor
from tfmixprec.fit.layout import dashboard_layout
from tfmixprec.fit.overflow_batches import KeptBatch, OverflowBatches
from tfmixprec.fit.repair import PrecisionRepair, Repair
from tfmixprec.fit.tensorboard import TensorBoard
from tfmixprec.fit.training import (
    MixedPrecisionFunctional,
    MixedPrecisionMixin,
    MixedPrecisionModel,
    compute_unscaled_gradients,
    make_train_step,
)

__all__ = [
    "KeptBatch",
    "OverflowBatches",
    "MixedPrecisionMixin",
    "MixedPrecisionModel",
    "MixedPrecisionFunctional",
    "compute_unscaled_gradients",
    "make_train_step",
    "LossScaleMonitor",
    "OverflowGuard",
    "GradientRangeMonitor",
    "Float8Monitor",
    "PrecisionRepair",
    "Repair",
    "TensorBoard",
    "dashboard_layout",
]
