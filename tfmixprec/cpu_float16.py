"""float16 at float32 speed on CPUs: route around TensorFlow's two slow float16 CPU kernels.

Measured on a 2-core Sapphire Rapids Xeon (TensorFlow 2.21, oneDNN, AVX512_FP16), float16 on
a CPU is not slow; two kernels are (benchmarks/RESULTS.md, 2b; on an AMD EPYC without
AVX512_FP16 the convolution kernel is slow too, the fused MatMul is not, and plain float16
matmul is somewhat slower than float32):

- grappler's remapper fuses MatMul + BiasAdd into `_FusedMatMul`, whose float16 CPU kernel is
  about 200x slower than float32 (a `Dense` forward: 265 ms; unfused float16: 1.4 ms). The
  fix: the remapper off once a float16 policy or model meets a machine without a GPU
  (`tf.config.optimizer.set_experimental_options({"remapping": False})`, process-wide, as
  the policy is); measured not to slow float32 or bfloat16 models here.
- `Conv2DBackpropFilter` in float16 is about 600x slower (6.3 s vs 10.8 ms). The fix: float16
  convolution layers compute their convolution in float32 (inputs and kernel cast up, output
  cast back to float16), so forward, input gradient and filter gradient all run float32
  kernels; the layer's output and its variables are unchanged, the values agree within
  float16 rounding.

Both are on by default where they help (a float16 policy and no GPU) and never on a GPU;
`enable` / `disable` switch them.
"""

from __future__ import annotations

import types
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._keras_compat import all_sublayers
from tfmixprec.hardware import HardwareInfo, detect_hardware

__all__ = [
    "applies",
    "disable",
    "enable",
    "fast_float16_convolutions",
    "route_around_fused_matmul",
    "status",
]

_STATE = {"enabled": True, "remapper_was": None}  # process-wide TF config, like the policy
_WRAPPED = "_tfmixprec_float32_convolution"


def _on_cpu_only(hardware: HardwareInfo | None) -> bool:
    hardware = detect_hardware() if hardware is None else hardware
    return not hardware.gpus and not hardware.tpus


def applies(policy: Any = None, hardware: HardwareInfo | None = None) -> bool:
    """True where the workarounds help: enabled, a float16 compute dtype, no GPU or TPU.

    Args:
        policy: `keras.DTypePolicy` or its name; the global policy when `None`.
        hardware: `HardwareInfo`; detected when `None`.
    """
    policy = keras.config.dtype_policy() if policy is None else keras.DTypePolicy(policy)
    return _STATE["enabled"] and policy.compute_dtype == "float16" and _on_cpu_only(hardware)


def route_around_fused_matmul(policy: Any = None, hardware: HardwareInfo | None = None) -> bool:
    """Turns grappler's remapper off if `applies(policy)`; it stays off (for every model in
    the process, which measured no slower in float32 and bfloat16) until `disable()`.

    Functions traced and run before this keep the fused kernel: call it (or
    `tfmixprec.set_policy`, `MixedPrecisionModel.compile`) before the first step.

    Returns:
        True if the remapper is off because of tfmixprec.
    """
    if applies(policy, hardware) and _STATE["remapper_was"] is None:
        options = tf.config.optimizer.get_experimental_options()
        _STATE["remapper_was"] = options.get("remapping", True)
        tf.config.optimizer.set_experimental_options({"remapping": False})
    return _STATE["remapper_was"] is not None


def _float32_convolution(layer: Any, inputs: Any, kernel: Any) -> Any:
    original = type(layer).convolution_op
    result = original(layer, tf.cast(inputs, tf.float32), tf.cast(kernel, tf.float32))
    return tf.cast(result, layer.compute_dtype)


def fast_float16_convolutions(
    model: keras.Model, hardware: HardwareInfo | None = None
) -> list[str]:
    """Makes the float16 convolution layers of `model` convolve in float32, on CPUs only.

    Nothing changes on a machine with a GPU, with the workarounds disabled, or for layers
    that do not compute in float16. Calling it twice changes nothing more.

    Args:
        model: `keras.Model`. The model (its nested layers included).
        hardware: `HardwareInfo`; detected when `None`.

    Returns:
        The names of the layers that now convolve in float32.

    Example:

    >>> tfmixprec.cpu_float16.fast_float16_convolutions(model)
    []
    """
    if not _STATE["enabled"] or not _on_cpu_only(hardware):
        return []
    changed = []
    for layer in all_sublayers(model):
        if not hasattr(type(layer), "convolution_op") or layer.compute_dtype != "float16":
            continue
        if not getattr(layer, _WRAPPED, False):
            # An instance attribute: the class, saved configs and other models are untouched.
            layer.convolution_op = types.MethodType(_float32_convolution, layer)
            setattr(layer, _WRAPPED, True)
        changed.append(layer.name)
    return changed


def enable() -> None:
    """Turns the CPU float16 workarounds on (the default; they act where `applies()`)."""
    _STATE["enabled"] = True
    route_around_fused_matmul()


def disable() -> None:
    """Turns them off: the remapper back as it was, no new float32 convolutions (layers
    already changed keep convolving in float32)."""
    _STATE["enabled"] = False
    if _STATE["remapper_was"] is not None:
        tf.config.optimizer.set_experimental_options({"remapping": _STATE["remapper_was"]})
        _STATE["remapper_was"] = None


def status() -> dict[str, Any]:
    """What is on now: `{"enabled", "applies", "remapper_off"}`."""
    return {
        "enabled": _STATE["enabled"],
        "applies": applies(),
        "remapper_off": _STATE["remapper_was"] is not None,
    }
