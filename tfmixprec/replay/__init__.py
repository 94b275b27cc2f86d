"""Replaying a batch outside the step, with one engine (`engine`): why a step overflowed
(`diagnosis`) and which layers must compute in float32 (`calibration`).

What it offers, by module (each module's `__all__`).
"""

from tfmixprec.replay.calibration import CalibrationReport, LayerCalibration, calibrate
from tfmixprec.replay.diagnosis import (
    Float8Quantized,
    Float8Replay,
    LayerReplay,
    OverflowDiagnosis,
    explain_overflow,
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
