"""tfmixprec: safe, visible and fast mixed-precision training for Keras 3 on TensorFlow."""

from tfmixprec import cpu_bfloat16, cpu_float16
from tfmixprec import datasets
from tfmixprec import float8
from tfmixprec import testing
from tfmixprec import zoo
from tfmixprec._version import __version__
from tfmixprec.audit import AuditReport
from tfmixprec.audit import Finding
from tfmixprec.audit import LayerDtypes
from tfmixprec.attribution import LayerOverflows
from tfmixprec.attribution import OverflowReport
from tfmixprec.attribution import overflow_report
from tfmixprec.audit import audit
from tfmixprec.calibration import CalibrationReport
from tfmixprec.calibration import LayerCalibration
from tfmixprec.calibration import calibrate
from tfmixprec.callbacks import LossScaleMonitor
from tfmixprec.callbacks import OverflowGuard
from tfmixprec.diagnosis import Float8Quantized
from tfmixprec.diagnosis import Float8Replay
from tfmixprec.diagnosis import LayerReplay
from tfmixprec.diagnosis import OverflowDiagnosis
from tfmixprec.diagnosis import explain_overflow
from tfmixprec.doctor import DoctorReport
from tfmixprec.doctor import doctor
from tfmixprec.float8 import Float8Change
from tfmixprec.float8 import Float8LayerStats
from tfmixprec.float8 import Float8Monitor
from tfmixprec.float8 import Float8TensorStats
from tfmixprec.float8 import float8_layers
from tfmixprec.float8 import float8_stats
from tfmixprec.gradient_range import GradientRangeMonitor
from tfmixprec.gradient_range import GradientRangeStats
from tfmixprec.gradient_range import gradient_range_stats
from tfmixprec.hardware import GPUInfo
from tfmixprec.hardware import HardwareInfo
from tfmixprec.hardware import detect_hardware
from tfmixprec.loss_scale import LossScaleConfig
from tfmixprec.optimizer import LossScaleOptimizer
from tfmixprec.overflow_batches import KeptBatch
from tfmixprec.overflow_batches import OverflowBatches
from tfmixprec.policy import PolicyChange
from tfmixprec.policy import PolicyChoice
from tfmixprec.policy import choose_policy
from tfmixprec.policy import float32_outputs
from tfmixprec.policy import policy_scope
from tfmixprec.policy import set_policy
from tfmixprec.repair import PrecisionRepair
from tfmixprec.repair import Repair
from tfmixprec.state_guard import guard_state
from tfmixprec.tensorboard import TensorBoard
from tfmixprec.tensorboard import dashboard_layout
from tfmixprec.training import MixedPrecisionFunctional
from tfmixprec.training import MixedPrecisionMixin
from tfmixprec.training import MixedPrecisionModel
from tfmixprec.training import compute_unscaled_gradients
from tfmixprec.training import make_train_step

__all__ = [
    "AuditReport",
    "CalibrationReport",
    "DoctorReport",
    "Finding",
    "Float8Change",
    "Float8LayerStats",
    "Float8Monitor",
    "Float8Quantized",
    "Float8Replay",
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
