"""Replaying a batch outside the step, with one engine (`engine`): why a step overflowed
(`diagnosis`) and which layers must compute in float32 (`calibration`).

What it offers, by module (each module's `__all__`).
"""

from tfmixprec.replay.calibration import calibrate
from tfmixprec.replay.calibration_report import CalibrationReport, LayerCalibration
from tfmixprec.replay.diagnosis import explain_overflow
from tfmixprec.replay.diagnosis_report import (
    Float8Quantized,
    Float8Replay,
    LayerReplay,
    OverflowDiagnosis,
)

__all__ = [
    "Float8Quantized",
    "Float8Replay",
    "LayerReplay",
    "OverflowDiagnosis",
    "explain_overflow",
    "CalibrationReport",
    "LayerCalibration",
    "calibrate",
]
