"""tfmixprec: safe, visible and fast mixed-precision training for Keras 3 on TensorFlow."""

from tfmixprec._version import __version__
from tfmixprec.optimizer import LossScaleOptimizer

__all__ = [
    "LossScaleOptimizer",
    "__version__",
]
