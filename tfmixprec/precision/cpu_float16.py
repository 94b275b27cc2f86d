"""float16 at float32 speed on CPUs: route around TensorFlow's slow float16 CPU kernels.

Some of TensorFlow's float16 CPU kernels are many times slower than float32 (the figures,
per machine: benchmarks/RESULTS.md, 2b, and `python benchmarks/cpu_kernels.py`). Four
workarounds, on by default where a float16 policy meets a machine without a GPU or TPU:

- float16 convolution layers compute their convolution in float32 (inputs and kernel cast
  up, the output cast back), so the forward pass and both gradients run float32 kernels;
- grappler's remapper is turned off (process-wide, as the policy is), so MatMul + BiasAdd is
  not fused into `_FusedMatMul`, whose float16 CPU kernel is slow on some CPUs;
- float16 `Dense` and `EinsumDense` layers compute their product in float32 the same way;
- float16 `MultiHeadAttention` layers (KerasHub's attention too) with dropout compute their
  score and value products in float32: in float16 they run Eigen's einsum, not oneDNN's (199
  ms of op time on a GPT-2 step, against 145 in float32; benchmarks/RESULTS.md, 11). Without
  dropout Keras takes `dot_product_attention`, which has no float16 cast of the scores to
  keep an overflow visible, so that path stays in float16.

A layer's output, variables and saved file are unchanged; values agree within float16
rounding, and an overflow past float16's range is still `inf`. `enable` / `disable` switch
them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.layers import all_layers
from tfmixprec._keras.kernels import (
    float32_attention,
    float32_convolution_call,
    float32_product_call,
)
from tfmixprec._keras.settings import optimizer_options, restore_optimizer_options
from tfmixprec.precision.cpu_route import cpu_only, route, route_of
from tfmixprec.precision.hardware import HardwareInfo

__all__ = [
    "applies",
    "disable",
    "enable",
    "fast_float16_layers",
    "float16_product_layers",
    "route_around_fused_matmul",
    "status",
]

_STATE = {"enabled": True, "remapper_was": None}  # process-wide TF config, like the policy
ROUTE = "float32 product"  # the route these layers take (`_cpu_route.route_of`)


def applies(policy: Any = None, hardware: HardwareInfo | None = None) -> bool:
    """True where the workarounds help: enabled, a float16 compute dtype, no GPU or TPU.

    Args:
        policy: `keras.DTypePolicy` or its name; the global policy when `None`.
        hardware: `HardwareInfo`; detected when `None`.
    """
    policy = keras.config.dtype_policy() if policy is None else keras.DTypePolicy(policy)
    return _STATE["enabled"] and policy.compute_dtype == "float16" and cpu_only(hardware)


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


# What each workaround replaces, on which layers (measured reasons in the module docstring).
# A subclass that overrides `call` keeps its own (the replacement re-implements Keras's).
_PRODUCT_CLASSES = (keras.layers.Dense, keras.layers.EinsumDense)
# Convolutions whose `call` runs `keras.ops` itself (Keras's own `call`, not overridden).
_CONVOLUTION_CALLS = (
    keras.layers.Conv1D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)


_ATTENTION = keras.layers.MultiHeadAttention._compute_attention


def _float32_method(layer: Any) -> tuple[str, Any] | None:
    if getattr(layer, "quantization_mode", None) is not None:
        return None
    call = type(layer).call
    if call is keras.layers.Conv2D.call:  # Keras's base convolution: through convolution_op
        return "convolution_op", _float32_convolution
    if any(call is cls.call for cls in _CONVOLUTION_CALLS):
        return "call", float32_convolution_call
    if any(call is cls.call for cls in _PRODUCT_CLASSES):
        return "call", float32_product_call
    if getattr(type(layer), "_compute_attention", None) is _ATTENTION:  # KerasHub's too
        return "_compute_attention", float32_attention
    return None


def _product_layers(model: keras.Model) -> list[Any]:
    return [
        layer
        for layer in all_layers(model)  # a single layer works too
        if layer.compute_dtype == "float16" and _float32_method(layer) is not None
    ]


def float16_product_layers(model: keras.Model) -> dict[str, bool]:
    """The float16 layers whose product `fast_float16_layers` computes in float32:
    `{layer name: True if it already does}` (whatever the hardware)."""
    return {layer.name: route_of(layer) == ROUTE for layer in _product_layers(model)}


def fast_float16_layers(model: keras.Model, hardware: HardwareInfo | None = None) -> list[str]:
    """Makes the float16 convolution, `Dense`, `EinsumDense` and `MultiHeadAttention` layers
    of `model` compute their products in float32, on CPUs only.

    Inputs and kernel are cast up and the product cast back to float16: the layer's output,
    its variables and its saved file are unchanged, the values agree within float16
    rounding, and an overflow past float16's range still shows as `inf` (in the output and,
    for the kernel's gradient, at its float16 cast). Nothing changes on a machine with a GPU,
    with the workarounds disabled, or for layers that do not compute in float16 (or are
    quantized, or subclass `Dense` with their own `call`). Calling it twice changes nothing
    more.

    Args:
        model: `keras.Model` or `keras.Layer`. The model (its nested layers included).
        hardware: `HardwareInfo`; detected when `None`.

    Returns:
        The names of the layers that now compute in float32.

    Example:

    >>> tfmixprec.cpu_float16.fast_float16_layers(model)
    []
    """
    if not _STATE["enabled"] or not cpu_only(hardware):
        return []
    layers = _product_layers(model)
    for layer in layers:
        route(layer, ROUTE, *_float32_method(layer))
    return [layer.name for layer in layers]


def enable() -> None:
    """Turns the CPU float16 workarounds on (the default; they act where `applies()`)."""
    _STATE["enabled"] = True
    route_around_fused_matmul()


def disable() -> None:
    """Turns them off: the remapper back as it was, no new float32 products (layers
    already changed keep computing in float32)."""
    _STATE["enabled"] = False
    if _STATE["remapper_was"] is not None:
        tf.config.optimizer.set_experimental_options({"remapping": _STATE["remapper_was"]})
        _STATE["remapper_was"] = None


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Within the block, this module may turn the remapper off (a model file compiled through
    tfmixprec, say); after it, grappler's options and this module's switches are as they
    were: an option never set is unset again, not set to its default."""
    options = optimizer_options()
    saved = dict(_STATE)
    try:
        yield
    finally:
        restore_optimizer_options(options)
        _STATE.clear()
        _STATE.update(saved)


def status() -> dict[str, Any]:
    """What is on now: `{"enabled", "applies", "remapper_off"}`."""
    return {
        "enabled": _STATE["enabled"],
        "applies": applies(),
        "remapper_off": _STATE["remapper_was"] is not None,
    }
