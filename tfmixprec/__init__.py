"""tfmixprec: safe, visible and fast mixed-precision training for Keras 3 on TensorFlow.

The package is laid out by concern (docs/ARCHITECTURE.md): `scaling`, `precision`, `replay`,
`fit`, `checks` and `tools`, over the private `_keras` and `_common`. The public API is what
this module imports, one name per line.
"""

import sys

import _tfmixprec_args

_tfmixprec_args.import_tensorflow_quietly()  # first: TensorFlow without its start-up lines

from tfmixprec._moved import install

from tfmixprec.precision import cpu_bfloat16
from tfmixprec.precision import cpu_float16
from tfmixprec.tools import datasets
from tfmixprec.precision import float8
from tfmixprec.tools import testing
from tfmixprec.tools import zoo
from tfmixprec._version import __version__
from tfmixprec.checks import AuditReport
from tfmixprec.checks import Finding
from tfmixprec.checks import LayerDtypes
from tfmixprec.scaling import LayerOverflows
from tfmixprec.scaling import OverflowReport
from tfmixprec.scaling import overflow_report
from tfmixprec.checks import audit
from tfmixprec.replay import CalibrationReport
from tfmixprec.replay import LayerCalibration
from tfmixprec.replay import calibrate
from tfmixprec.fit import LossScaleMonitor
from tfmixprec.fit import OverflowGuard
from tfmixprec.replay import Float8Quantized
from tfmixprec.replay import Float8Replay
from tfmixprec.replay import LayerReplay
from tfmixprec.replay import OverflowDiagnosis
from tfmixprec.replay import explain_overflow
from tfmixprec.checks import DoctorReport
from tfmixprec.checks import doctor
from tfmixprec.precision import Float8Change
from tfmixprec.precision import Float8LayerStats
from tfmixprec.fit import Float8Monitor
from tfmixprec.precision import Float8Recipe
from tfmixprec.precision import Float8Tensor
from tfmixprec.precision import Float8TensorStats
from tfmixprec.precision import float8_layers
from tfmixprec.precision import float8_stats
from tfmixprec.fit import GradientRangeMonitor
from tfmixprec.scaling import GradientRangeStats
from tfmixprec.scaling import gradient_range_stats
from tfmixprec.precision import GPUInfo
from tfmixprec.precision import HardwareInfo
from tfmixprec.precision import detect_hardware
from tfmixprec.scaling import LossScaleConfig
from tfmixprec.scaling import LossScaleOptimizer
from tfmixprec.fit import KeptBatch
from tfmixprec.fit import OverflowBatches
from tfmixprec.precision import PolicyChange
from tfmixprec.precision import PolicyChoice
from tfmixprec.precision import choose_policy
from tfmixprec.precision import float32_outputs
from tfmixprec.precision import policy_scope
from tfmixprec.precision import set_policy
from tfmixprec.fit import PrecisionRepair
from tfmixprec.fit import Repair
from tfmixprec.scaling import guard_state
from tfmixprec.fit import TensorBoard
from tfmixprec.fit import dashboard_layout
from tfmixprec.fit import MixedPrecisionFunctional
from tfmixprec.fit import MixedPrecisionMixin
from tfmixprec.fit import MixedPrecisionModel
from tfmixprec.fit import compute_unscaled_gradients
from tfmixprec.fit import make_train_step

__all__ = [
    "AuditReport",
    "CalibrationReport",
    "DoctorReport",
    "Finding",
    "Float8Change",
    "Float8LayerStats",
    "Float8Monitor",
    "Float8Quantized",
    "Float8Recipe",
    "Float8Replay",
    "Float8Tensor",
    "Float8TensorStats",
    "GPUInfo",
    "GradientRangeMonitor",
    "GradientRangeStats",
    "HardwareInfo",
    "KeptBatch",
    "LayerCalibration",
    "LayerDtypes",
    "LayerOverflows",
    "LayerReplay",
    "LossScaleConfig",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "MixedPrecisionFunctional",
    "MixedPrecisionMixin",
    "MixedPrecisionModel",
    "OverflowBatches",
    "OverflowDiagnosis",
    "OverflowGuard",
    "OverflowReport",
    "PolicyChange",
    "PolicyChoice",
    "PrecisionRepair",
    "Repair",
    "TensorBoard",
    "__version__",
    "audit",
    "calibrate",
    "choose_policy",
    "compute_unscaled_gradients",
    "cpu_bfloat16",
    "cpu_float16",
    "dashboard_layout",
    "datasets",
    "detect_hardware",
    "doctor",
    "explain_overflow",
    "float32_outputs",
    "float8",
    "float8_layers",
    "float8_stats",
    "gradient_range_stats",
    "guard_state",
    "make_train_step",
    "overflow_report",
    "policy_scope",
    "set_policy",
    "testing",
    "zoo",
]

# The module paths of 0.4.0 (`tfmixprec.loss_scale`, ...), where every module sat in this
# folder, still import: each is the module that now holds its code (`tfmixprec._moved`).
install(sys.modules[__name__])
del install, sys
