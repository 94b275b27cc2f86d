"""float16 at float32 speed on CPUs: route around TensorFlow's slow float16 CPU kernels.

float16 on a CPU is not slow; some of TensorFlow's float16 CPU kernels are. Measured with
TensorFlow 2.21 (benchmarks/RESULTS.md, 2b) on three 2-core machines: a Sapphire Rapids Xeon
(AVX512_FP16, AMX), an AMD EPYC with AVX512_BF16 but no AVX512_FP16, and an AMD EPYC Zen 3
(no AVX-512 at all):

- `Conv2DBackpropFilter` (the convolution filter gradient) in float16 is about 600x slower
  than float32 on the Xeon and the AVX512_BF16 EPYC (6.3 s vs 10.8 ms), 2.5x on the Zen 3.
  The fix: float16 convolution layers compute their convolution in float32 (inputs and
  kernel cast up, output cast back to float16), so forward, input gradient and filter
  gradient all run float32 kernels.
- grappler's remapper fuses MatMul + BiasAdd into `_FusedMatMul`, whose float16 CPU kernel
  was about 200x slower than float32 on the Xeon (a `Dense` forward: 265 ms; unfused float16:
  1.4 ms); on the EPYCs it is not. The fix: the remapper off once a float16 policy or
  model meets a machine without a GPU
  (`tf.config.optimizer.set_experimental_options({"remapping": False})`, process-wide, as
  the policy is); measured not to slow float32 or bfloat16 models.
- Without AVX512_FP16 float16 matmuls fall back to slower kernels: 1.1-1.5x float32 for a
  plain or transposed matmul, 3x for attention's batched einsum (Zen 3). The fix: float16
  `Dense` and `EinsumDense` layers compute their product in float32 the same way
  (`python benchmarks/cpu_kernels.py` times each kernel and its float32 route).

With all three, float16 trains within 1.2x of float32's step time on the Zen 3: a 4x2048 MLP
1.00x, a CNN 1.15x, a Transformer block 0.96x (plain Keras float16: 0.10x, 0.29x and 0.90x
of float32's throughput, even at batch 16).

In each case the layer's output, its variables and its saved file are unchanged, the values
agree within float16 rounding, and an overflow past float16's range is still `inf`. All are
on by default where they help (a float16 policy and no GPU) and never on a GPU; `enable` /
`disable` switch them.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._layers import iter_layers
from tfmixprec.hardware import HardwareInfo, detect_hardware

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
_WRAPPED = "_tfmixprec_float32_product"


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


def _float32_product_call(layer: Any, inputs: Any, training: Any = None) -> Any:
    """`Dense.call` / `EinsumDense.call` with the product in float32.

    The kernel is read in float16 first, so its gradient passes a float16 cast and overflows
    where a float16 product's would; bias and activation stay in float16, as in Keras.
    """
    kernel = tf.cast(keras.ops.cast(layer.kernel, layer.compute_dtype), tf.float32)
    inputs = tf.cast(inputs, tf.float32)
    if isinstance(layer, keras.layers.EinsumDense):
        x = tf.einsum(layer.equation, inputs, kernel)
    else:
        x = keras.ops.matmul(inputs, kernel)
    x = tf.cast(x, layer.compute_dtype)
    if layer.bias is not None:
        x = keras.ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


def _float32_read(layer: Any, variable: Any) -> tf.Tensor:
    """A kernel read in the compute dtype, then cast to float32: its gradient passes a
    float16 cast and overflows where a float16 product's would."""
    return tf.cast(keras.ops.cast(variable, layer.compute_dtype), tf.float32)


def _convolution_in_float32(layer: Any, inputs: tf.Tensor) -> tf.Tensor:
    """The convolution of `layer`'s own `call` (Keras's `Conv1D`, transposed, depthwise and
    separable convolutions call `keras.ops` directly, not `convolution_op`), in float32."""
    ops, common = keras.ops, dict(padding=layer.padding, data_format=layer.data_format)
    if isinstance(layer, keras.layers.SeparableConv1D | keras.layers.SeparableConv2D):
        depthwise = _float32_read(layer, layer.depthwise_kernel)
        pointwise = _float32_read(layer, layer.pointwise_kernel)
        return ops.separable_conv(
            inputs, depthwise, pointwise, layer.strides, dilation_rate=layer.dilation_rate, **common
        )
    kernel = _float32_read(layer, layer.kernel)
    if isinstance(layer, keras.layers.DepthwiseConv1D | keras.layers.DepthwiseConv2D):
        return ops.depthwise_conv(
            inputs, kernel, layer.strides, dilation_rate=layer.dilation_rate, **common
        )
    if "Transpose" in type(layer).__name__:
        return ops.conv_transpose(
            inputs,
            kernel,
            list(layer.strides),
            output_padding=layer.output_padding,
            dilation_rate=layer.dilation_rate,
            **common,
        )
    if layer.padding == "causal":  # Conv1D: pad the past, as Keras's own call does
        left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
        axis = 1 if layer.data_format == "channels_last" else 2
        inputs = ops.pad(inputs, [(left, 0) if i == axis else (0, 0) for i in range(3)])
        common["padding"] = "valid"
    return ops.conv(
        inputs, kernel, list(layer.strides), dilation_rate=layer.dilation_rate, **common
    )


def _float32_convolution_call(layer: Any, inputs: Any) -> Any:
    """A convolution layer's `call` (one that does not use `convolution_op`) with the
    convolution in float32; bias and activation in float16, as in Keras."""
    x = tf.cast(_convolution_in_float32(layer, tf.cast(inputs, tf.float32)), layer.compute_dtype)
    if layer.bias is not None:
        channels = (layer.bias.shape[0],)
        shape = (1,) * (layer.rank + 1) + channels
        if layer.data_format != "channels_last":
            shape = (1,) + channels + (1,) * layer.rank
        x = keras.ops.add(x, keras.ops.reshape(layer.bias, shape))
    if layer.activation is not None:
        x = layer.activation(x)
    return x


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


def _float32_method(layer: Any) -> tuple[str, Any] | None:
    if getattr(layer, "quantization_mode", None) is not None:
        return None
    call = type(layer).call
    if call is keras.layers.Conv2D.call:  # Keras's base convolution: through convolution_op
        return "convolution_op", _float32_convolution
    if any(call is cls.call for cls in _CONVOLUTION_CALLS):
        return "call", _float32_convolution_call
    if any(call is cls.call for cls in _PRODUCT_CLASSES):
        return "call", _float32_product_call
    return None


def _product_layers(model: keras.Model) -> list[Any]:
    return [
        layer
        for layer in [model, *iter_layers(model)]  # a single layer works too
        if layer.compute_dtype == "float16" and _float32_method(layer) is not None
    ]


def float16_product_layers(model: keras.Model) -> dict[str, bool]:
    """The float16 layers whose product `fast_float16_layers` computes in float32:
    `{layer name: True if it already does}` (whatever the hardware)."""
    return {layer.name: bool(getattr(layer, _WRAPPED, False)) for layer in _product_layers(model)}


def fast_float16_layers(model: keras.Model, hardware: HardwareInfo | None = None) -> list[str]:
    """Makes the float16 convolution, `Dense` and `EinsumDense` layers of `model` compute
    their products in float32, on CPUs only.

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
    if not _STATE["enabled"] or not _on_cpu_only(hardware):
        return []
    layers = _product_layers(model)
    for layer in layers:
        if not getattr(layer, _WRAPPED, False):
            name, method = _float32_method(layer)
            # An instance attribute: the class, saved configs and other models are untouched.
            setattr(layer, name, types.MethodType(method, layer))
            setattr(layer, _WRAPPED, True)
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
    tfmixprec, say); after it, the remapper and this module's switches are as they were."""
    remapping = _remapping()
    saved = dict(_STATE)
    try:
        yield
    finally:
        if _remapping() != remapping:
            tf.config.optimizer.set_experimental_options({"remapping": remapping})
        _STATE.clear()
        _STATE.update(saved)


def _remapping() -> bool:
    """Whether grappler's remapper is on (TensorFlow's default when it was never set)."""
    return bool(tf.config.optimizer.get_experimental_options().get("remapping", True))


def status() -> dict[str, Any]:
    """What is on now: `{"enabled", "applies", "remapper_off"}`."""
    return {
        "enabled": _STATE["enabled"],
        "applies": applies(),
        "remapper_off": _STATE["remapper_was"] is not None,
    }
