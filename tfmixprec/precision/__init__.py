"""Choosing and routing precisions: dtype policies and the hardware they are chosen for,
the CPU routes around slow float16 and bfloat16 kernels, and float8 (which layers, and
the in-step counters of what quantizing does, and the one recipe and statistics type they
read).

What it offers, by module (each module's `__all__`).
"""

from tfmixprec.precision import cpu_bfloat16, cpu_float16, float8
from tfmixprec.precision.float8 import (
    Float8Change,
    float8_layers,
    float8_stats,
    quantization_counts,
)
from tfmixprec.precision.float8_recipe import (
    Float8LayerStats,
    Float8Recipe,
    Float8Tensor,
    Float8TensorStats,
)
from tfmixprec.precision.hardware import GPUInfo, HardwareInfo, detect_hardware
from tfmixprec.precision.policy import (
    PolicyChange,
    PolicyChoice,
    choose_policy,
    float32_outputs,
    policy_scope,
    set_policy,
)

__all__ = [
    "GPUInfo",
    "HardwareInfo",
    "detect_hardware",
    "cpu_float16",
    "cpu_bfloat16",
    "PolicyChoice",
    "PolicyChange",
    "choose_policy",
    "set_policy",
    "policy_scope",
    "float32_outputs",
    "float8",
    "Float8Change",
    "Float8LayerStats",
    "Float8Recipe",
    "Float8Tensor",
    "Float8TensorStats",
    "float8_layers",
    "float8_stats",
    "quantization_counts",
]
