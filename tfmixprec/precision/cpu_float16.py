"""float16 at float32 speed on CPUs: route around the float16 CPU kernels slow on this CPU.

Some of TensorFlow's float16 CPU kernels are many times slower than float32, and which ones
depends on the CPU (the figures, per CPU family: benchmarks/RESULTS.md, 2b and 16; `python
benchmarks/cpu_kernels.py` times them on yours). Where a float16 policy meets a machine
without a GPU or TPU:

- grappler's remapper is turned off (process-wide, as the policy is), on every CPU: it fuses
  MatMul + BiasAdd into `_FusedMatMul`, whose float16 kernel ran about 1000x float32 on a
  Sapphire Rapids Xeon. It stays off for the process (`route_around_fused_matmul`);
- the layers a route in `ROUTES` serves compute in float32 on the CPUs the route was
  measured to help on (`routes_on`): float16 convolutions (every CPU measured), `Dense` and
  `EinsumDense` products (CPUs without AVX512_FP16: with it, a plain float16 `MatMul` runs at
  float32's speed and native float16 trained faster than this route), and the score and value
  products of `MultiHeadAttention` with dropout (Eigen's einsum in float16; measured on CPUs
  without AVX512_FP16, kept where unmeasured). Without dropout Keras takes
  `dot_product_attention`, which has no float16 cast of the scores to keep an overflow
  visible, so that path stays in float16.

A routed layer's output, variables and saved file are unchanged; values agree within float16
rounding, and an overflow past float16's range is still `inf`. `enable` / `disable` switch
the routes for what comes next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.layers import all_layers, compute_dtype_of
from tfmixprec._keras.fit import trace_again
from tfmixprec._keras.kernels import (
    ATTENTION_METHOD,
    computes_kerass_attention,
    float32_attention,
    float32_convolution_call,
    float32_product_call,
)
from tfmixprec._keras.settings import optimizer_options, restore_optimizer_options
from tfmixprec.precision.cpu_route import Route, cpu_only, route, route_of, served
from tfmixprec.precision.hardware import HardwareInfo, detect_hardware

__all__ = [
    "ATTENTION",
    "CONVOLUTIONS",
    "PRODUCTS",
    "ROUTES",
    "applies",
    "disable",
    "enable",
    "fast_float16_layers",
    "float16_product_layers",
    "remapper_off",
    "route_around_fused_matmul",
    "routes_on",
    "served_layers",
    "status",
]

_STATE = {"enabled": True}  # process-wide, like the policy and grappler's options


def applies(policy: Any = None, hardware: HardwareInfo | None = None) -> bool:
    """True where the routes act: enabled, a float16 compute dtype, no GPU or TPU.

    Args:
        policy: `keras.DTypePolicy` or its name, or a model or layer (float16 when any of its
            layers computes in float16); the global policy when `None` (read, not set).
        hardware: `HardwareInfo`; detected when `None`.
    """
    return (
        _STATE["enabled"]
        and compute_dtype_of(policy, "float16") == "float16"
        and cpu_only(hardware)
    )


def route_around_fused_matmul(policy: Any = None, hardware: HardwareInfo | None = None) -> bool:
    """Turns grappler's remapper off if `applies(policy)`, on every CPU: its fused float16
    MatMul + BiasAdd (`_FusedMatMul`) ran about 1000x float32 on a Sapphire Rapids Xeon.

    It stays off for every model in the process, `disable()` included: TensorFlow reads the
    option on every call of a function, not once per trace, so turning it back on would send
    the float16 models already running here to the fused kernel at their next step. Off, it
    measured no slower in float32 and bfloat16 (benchmarks/RESULTS.md, 2b). Functions traced
    before this call run unfused from their next call.

    The option is read each time, not remembered: a remapper turned back on by hand (once no
    float16 model runs) is turned off again by the next float16 policy here.

    Returns:
        True if the remapper is off in this process now.
    """
    if applies(policy, hardware) and not remapper_off():
        tf.config.optimizer.set_experimental_options({"remapping": False})
    return remapper_off()


def remapper_off() -> bool:
    """True if grappler's remapper is off in this process (set off, by tfmixprec or by
    hand), read from the options set, without setting any."""
    return optimizer_options().get("remapping", True) is False


def _float32_convolution(layer: Any, inputs: Any, kernel: Any) -> Any:
    original = type(layer).convolution_op
    result = original(layer, tf.cast(inputs, tf.float32), tf.cast(kernel, tf.float32))
    return tf.cast(result, layer.compute_dtype)


# Which layers each route serves. A subclass that overrides `call` keeps its own (the
# replacement re-implements Keras's); a quantized layer is left alone.
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


def _convolution(layer: Any) -> tuple[str, Any] | None:
    call = type(layer).call
    if call is keras.layers.Conv2D.call:  # Keras's base convolution: through convolution_op
        return "convolution_op", _float32_convolution
    if any(call is cls.call for cls in _CONVOLUTION_CALLS):
        return "call", float32_convolution_call
    return None


def _product(layer: Any) -> tuple[str, Any] | None:
    if any(type(layer).call is cls.call for cls in _PRODUCT_CLASSES):
        return "call", float32_product_call
    return None


def _attention(layer: Any) -> tuple[str, Any] | None:
    if computes_kerass_attention(layer):  # KerasHub's too
        return ATTENTION_METHOD, float32_attention
    return None


CONVOLUTIONS = Route(
    "float32 convolution",
    "float16 convolution gradients are slow on every CPU measured (Conv2DBackpropFilter about "
    "600x float32 on a Sapphire Rapids Xeon, 10x on an AMD EPYC with AVX512_BF16, 2.5x on one "
    "without AVX-512; two Conv2D trained 4.9-6.2x faster through float32 on that EPYC)",
    _convolution,
    lambda hardware: True,
)
PRODUCTS = Route(
    "float32 product",
    "without AVX512_FP16, float16 matmuls run Eigen's kernels, not oneDNN's (a 4 x Dense(1024) "
    "MLP trained 1.05-1.39x faster through float32 than in native float16 on an AMD EPYC with "
    "AVX512_BF16); with AVX512_FP16 a float16 MatMul runs at float32's speed and native "
    "float16 trained that MLP 1.11x faster than this route (a Sapphire Rapids Xeon)",
    _product,
    lambda hardware: not hardware.cpu_float16,
)
ATTENTION = Route(
    "float32 attention",
    "without AVX512_FP16, attention's float16 score and value products run Eigen's einsum "
    "(GPT-2 on an AMD EPYC with AVX512_BF16: 199 ms of op time a step, 145 in float32; its "
    "step 0.85x float32 unrouted, 1.00x routed); not yet measured with AVX512_FP16, so kept "
    "there too",
    _attention,
    lambda hardware: True,
)
# The routes, in the order a layer is matched against them (one route per layer).
ROUTES: tuple[Route, ...] = (CONVOLUTIONS, PRODUCTS, ATTENTION)


def _hardware(hardware: HardwareInfo | None) -> HardwareInfo:
    return detect_hardware() if hardware is None else hardware


def routes_on(hardware: HardwareInfo | None = None) -> list[Route]:
    """The routes measured to help on this machine's CPU (none with a GPU or TPU)."""
    hardware = _hardware(hardware)
    return [r for r in ROUTES if r.helps(hardware)] if cpu_only(hardware) else []


def served_layers(
    model: keras.Model, hardware: HardwareInfo | None = None
) -> list[tuple[Any, Route]]:
    """The float16 layers of `model` a route on this machine serves, with that route
    (whether they already take it or not; none while the routes are disabled)."""
    routes = routes_on(hardware) if _STATE["enabled"] else []
    return served(all_layers(model), "float16", routes)  # a single layer works too


def float16_product_layers(
    model: keras.Model, hardware: HardwareInfo | None = None
) -> dict[str, bool]:
    """The float16 layers whose product `fast_float16_layers` computes in float32 on this
    machine: `{layer name: True if it already does}` (empty with a GPU or TPU)."""
    return {layer.name: route_of(layer) == r.name for layer, r in served_layers(model, hardware)}


def fast_float16_layers(model: keras.Model, hardware: HardwareInfo | None = None) -> list[str]:
    """Makes the float16 layers of `model` that run slow kernels on this CPU compute their
    products in float32 (`routes_on`): convolutions on every CPU; `Dense` and `EinsumDense`
    on CPUs without AVX512_FP16; `MultiHeadAttention`'s score and value products (with
    dropout) on every CPU, measured only without AVX512_FP16.

    Inputs and kernel are cast up and the product cast back to float16: the layer's output,
    its variables and its saved file are unchanged, the values agree within float16
    rounding, and an overflow past float16's range still shows as `inf` (in the output and,
    for the kernel's gradient, at its float16 cast). Nothing changes on a machine with a GPU,
    with the routes disabled, or for layers that do not compute in float16 (or are
    quantized, or subclass `Dense` with their own `call`). Calling it twice changes nothing
    more. A compiled model that has already run `fit`, `evaluate` or `predict` has those
    traced again at their next call, where a layer was routed now: pass the model you
    compiled (a KerasHub task, not its backbone).

    Args:
        model: `keras.Model` or `keras.Layer`. The model (its nested layers included).
        hardware: `HardwareInfo`; detected when `None`.

    Returns:
        The names of the layers that now compute in float32.

    Example:

    >>> tfmixprec.cpu_float16.fast_float16_layers(model)
    []
    """
    served = served_layers(model, hardware)
    new = [layer for layer, _ in served if route_of(layer) is None]
    for layer, r in served:
        route(layer, r.name, *r.method(layer))
    if new:
        trace_again(model)
    return [layer.name for layer, _ in served]


def enable() -> None:
    """Turns the routes on (the default; they act where `applies()`), and the remapper off
    where the global policy computes in float16 on a machine without a GPU."""
    _STATE["enabled"] = True
    route_around_fused_matmul()


def disable() -> None:
    """Turns the routes off for what comes next: no new float32 products, and a float16
    policy no longer turns the remapper off. Safe for the models already in use: the layers
    already routed keep their route, and a remapper tfmixprec turned off stays off
    (`route_around_fused_matmul` says why; once no float16 model runs in the process,
    `tf.config.optimizer.set_experimental_options({"remapping": True})` turns it on). Sets
    no grappler option and no global policy."""
    _STATE["enabled"] = False


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


def status(model: Any = None, hardware: HardwareInfo | None = None) -> dict[str, Any]:
    """What is on now: `{"enabled", "applies", "remapper_off", "routes"}`. Reads, sets
    nothing (an unset global policy stays unset).

    Args:
        model: A `keras.Model` or layer: `applies` is for it (float16 when any of its layers
            computes in float16); or a `keras.DTypePolicy` or its name; the global policy
            when `None`.
        hardware: `HardwareInfo`; detected when `None`.

    Returns:
        A dict: `enabled` (the switch), `applies` (`applies(model)`), `remapper_off` (the
        remapper is off in this process, `remapper_off()`), `routes` (the names of
        `routes_on()`, this CPU's routes).
    """
    hardware = _hardware(hardware)
    return {
        "enabled": _STATE["enabled"],
        "applies": applies(model, hardware),
        "remapper_off": remapper_off(),
        "routes": [r.name for r in routes_on(hardware)],
    }
