"""bfloat16 at the matmul limit on CPUs: the layers that `mixed_bfloat16` leaves slow there.

Profiled per op in a training step (benchmarks/RESULTS.md, 11; `benchmarks/op_profile.py`),
on an AMD EPYC with AVX512_BF16 and no AMX, TensorFlow 2.21, Keras 3.15, two routes help:

- **bfloat16 logits.** Keras does not autocast an embedding's variables, so a
  `ReversibleEmbedding`'s reverse projection (a language model's logits: KerasHub's GPT-2,
  Llama, Gemma, Mistral) multiplies bfloat16 activations by the float32 table, and the
  product, the model's largest matmul, runs in float32 under `mixed_bfloat16`. On the GPT-2
  benchmark it took 203 of the step's 597 ms of op time; in bfloat16, 108. The route computes
  it in bfloat16 and returns the logits in float32, as Keras returns them. It helps on every
  CPU with bfloat16 matmuls (AVX512_BF16 or AMX: a matmul runs 2x float32 on both).
- **float32 depthwise convolutions.** TensorFlow's bfloat16 depthwise convolution gradients
  run slower than float32 on the EPYC (filter 49 against 30 ms, input 20 against 6, on
  MobileNetV3Small). The route computes them in float32 (the kernel read in bfloat16 first),
  on CPUs with AVX512_BF16 and no AMX, the only ones measured.

Element-wise work stays as Keras computes it. PyTorch's CPU autocast split (the products in
bfloat16; a `Dense` layer's bias and activation, `Dropout` and `Softmax` in float32, each
output cast back; Keras's `LayerNormalization` computes in float32 already) is the route
`ELEMENTWISE`, which no CPU takes by default. On the GPT-2 benchmark on the EPYC, paired in
one process, its step ran at 0.97-1.11x the speed of the step without it (medians of four
runs), where the same step measured twice ran 0.96-1.12x apart: no gain past the noise
(benchmarks/RESULTS.md, 17).
It was not measured on AMX: `fast_bfloat16_layers(model, routes=(*routes_on(), ELEMENTWISE))`
takes it there, to measure with `benchmarks/op_profile.py`.

A route replaces the layer's `call` on that instance only: its output dtype, variables and
saved file are unchanged, and its values agree with plain `mixed_bfloat16` within bfloat16
rounding. Routes are on by default where `applies()`: a bfloat16 policy, no GPU or TPU, a CPU
with bfloat16 instructions. `MixedPrecisionModel.compile` routes its model, and so does a
tfmixprec callback in `fit` for a model compiled the ordinary way (`fit/adoption.py`: the
train function traced again, once, where a layer was routed; GPT-2 then runs the routed step).
`fast_bfloat16_layers(model)` routes any model in one call (a model that already ran `fit`
has its traced functions traced again); `enable` / `disable` switch them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from tfmixprec._common.layers import all_layers, compute_dtype_of
from tfmixprec._keras.fit import trace_again
from tfmixprec._keras.kernels import (
    REVERSIBLE_EMBEDDING,
    compute_dtype_reverse_call,
    float32_convolution_call,
    float32_epilogue_call,
    float32_inside_call,
    reverse_called,
)
from tfmixprec.precision.cpu_route import Route, cpu_only, route, route_of, served
from tfmixprec.precision.hardware import HardwareInfo, detect_hardware

__all__ = [
    "DEPTHWISE",
    "ELEMENTWISE",
    "LOGITS",
    "ROUTES",
    "Route",
    "applies",
    "bfloat16_route_layers",
    "disable",
    "enable",
    "fast_bfloat16_layers",
    "routes_on",
    "served_layers",
    "status",
]

_STATE = {"enabled": True}


def _reverse_projection(layer: Any) -> tuple[str, Any] | None:
    if REVERSIBLE_EMBEDDING is None or type(layer).call is not REVERSIBLE_EMBEDDING.call:
        return None
    if layer.reverse_dtype is not None or getattr(layer, "quantization_mode", None):
        return None  # the user chose its dtype, or it is quantized
    if reverse_called(layer) is False:
        return None  # only looked up (a BERT classifier's table): no product to route
    return "call", compute_dtype_reverse_call


_DEPTHWISE_CALLS = (keras.layers.DepthwiseConv1D.call, keras.layers.DepthwiseConv2D.call)


def _depthwise(layer: Any) -> tuple[str, Any] | None:
    if type(layer).call not in _DEPTHWISE_CALLS or getattr(layer, "quantization_mode", None):
        return None
    return "call", float32_convolution_call


LOGITS = Route(
    "bfloat16 logits",
    "Keras does not autocast an embedding table, so the reverse projection runs in "
    "float32 (GPT-2 benchmark: 203 ms of op time a step in float32, 108 in bfloat16)",
    _reverse_projection,
    lambda hardware: hardware.cpu_bfloat16,
)
DEPTHWISE = Route(
    "float32 depthwise convolution",
    "bfloat16 depthwise convolution gradients run 1.6-3x slower than float32 on CPUs with "
    "AVX512_BF16 and no AMX (MobileNetV3Small: 65 ms a step, 46 routed)",
    _depthwise,
    lambda hardware: hardware.cpu_bfloat16 and not hardware.cpu_amx,
)
ROUTES: tuple[Route, ...] = (LOGITS, DEPTHWISE)

_EPILOGUE_CALLS = (keras.layers.Dense.call, keras.layers.EinsumDense.call)
_INSIDE_CALLS = (keras.layers.Dropout.call, keras.layers.Softmax.call)


def _elementwise(layer: Any) -> tuple[str, Any] | None:
    if getattr(layer, "quantization_mode", None) or getattr(layer, "lora_enabled", False):
        return None
    call = type(layer).call
    if call in _EPILOGUE_CALLS:  # Keras keeps no activation as `linear`: nothing to route
        linear = layer.activation in (None, keras.activations.linear)
        return ("call", float32_epilogue_call) if layer.bias is not None or not linear else None
    if call in _INSIDE_CALLS:
        return "call", float32_inside_call
    return None


ELEMENTWISE = Route(
    "float32 element-wise",
    "PyTorch's CPU autocast split (bias, activation, dropout and softmax in float32 around "
    "bfloat16 products) ran GPT-2 at 0.97-1.11x the speed of the other routes alone on "
    "AVX512_BF16 without AMX, within the noise; unmeasured on AMX: taken on request only",
    _elementwise,
    lambda hardware: False,  # on no CPU by default: `fast_bfloat16_layers(routes=...)` takes it
)


def _hardware(hardware: HardwareInfo | None) -> HardwareInfo:
    return detect_hardware() if hardware is None else hardware


def applies(policy: Any = None, hardware: HardwareInfo | None = None) -> bool:
    """True where a route may help: enabled, a bfloat16 compute dtype, no GPU or TPU, and a
    CPU with bfloat16 instructions.

    Args:
        policy: `keras.DTypePolicy` or its name, or a model or layer (bfloat16 when any of its
            layers computes in bfloat16); the global policy when `None` (read, not set).
        hardware: `HardwareInfo`; detected when `None`.
    """
    hardware = _hardware(hardware)
    return (
        _STATE["enabled"]
        and compute_dtype_of(policy, "bfloat16") == "bfloat16"
        and cpu_only(hardware)
        and hardware.cpu_bfloat16
    )


def routes_on(hardware: HardwareInfo | None = None) -> list[Route]:
    """The routes measured to help on this machine's CPU (none with a GPU or TPU)."""
    hardware = _hardware(hardware)
    if not cpu_only(hardware):
        return []
    return [r for r in ROUTES if r.helps(hardware)]


def served_layers(
    model: keras.Model,
    hardware: HardwareInfo | None = None,
    routes: Sequence[Route] | None = None,
) -> list[tuple[Any, Route]]:
    """The bfloat16 layers of `model` a route serves, with that route (none while the routes
    are disabled): of `routes`, or where `None` of the routes on this machine (`routes_on`)."""
    if not _STATE["enabled"]:
        routes = []
    elif routes is None:
        routes = routes_on(hardware)
    return served(all_layers(model), "bfloat16", routes)  # a single layer works too


def bfloat16_route_layers(
    model: keras.Model, hardware: HardwareInfo | None = None
) -> dict[str, tuple[str, bool]]:
    """The bfloat16 layers a route serves on this machine: `{layer name: (route name, True
    if the layer already takes it)}` (empty with a GPU, or on a CPU without bfloat16)."""
    return {
        layer.name: (r.name, route_of(layer) == r.name)
        for layer, r in served_layers(model, hardware)
    }


def fast_bfloat16_layers(
    model: keras.Model,
    hardware: HardwareInfo | None = None,
    routes: Sequence[Route] | None = None,
) -> list[str]:
    """Routes the bfloat16 layers of `model` that run slow kernels on this CPU (`ROUTES`).

    A language model's reverse projection computes in bfloat16 instead of float32; on CPUs
    with AVX512_BF16 and no AMX, depthwise convolutions compute in float32. Each layer's
    output dtype, variables and saved file are unchanged, and its values agree with plain
    `mixed_bfloat16` within bfloat16 rounding. Nothing changes where `applies()` is False for
    the layers' policy (a GPU, a CPU without bfloat16, the routes disabled), for layers that
    do not compute in bfloat16, or twice.

    Args:
        model: `keras.Model` or `keras.Layer`. The model (its nested layers included).
        hardware: `HardwareInfo`; detected when `None`.
        routes: The `Route`s to take, for example `(ELEMENTWISE,)`, which no CPU takes by
            default; `None` (the default): those measured to help on this CPU, `routes_on()`.

    A compiled model that has already run `fit`, `evaluate` or `predict` has those traced
    again at their next call, where a layer was routed now (so call it once, before `fit`,
    on a model compiled the ordinary way; a tfmixprec callback in `fit` calls it too). Pass
    the model you compiled (a KerasHub task, not its backbone): only its own traced functions
    are traced again.

    Returns:
        The names of the layers that now take a route.

    Example:

    >>> tfmixprec.cpu_bfloat16.fast_bfloat16_layers(model)
    []
    """
    hardware = _hardware(hardware)
    if not applies("mixed_bfloat16", hardware):
        return []
    served = served_layers(model, hardware, routes)
    new = [layer for layer, _ in served if route_of(layer) is None]
    for layer, r in served:
        route(layer, r.name, *r.method(layer))
    if new:
        trace_again(model)
    return [layer.name for layer, _ in served]


def enable() -> None:
    """Turns the routes on (the default; they act where `applies()`)."""
    _STATE["enabled"] = True


def disable() -> None:
    """Turns them off: no new routes (layers already routed keep their route)."""
    _STATE["enabled"] = False


def status(model: Any = None, hardware: HardwareInfo | None = None) -> dict[str, Any]:
    """What is on now: `{"enabled", "applies", "routes"}`. Reads, sets nothing (an unset
    global policy stays unset).

    Args:
        model: A `keras.Model` or layer: `applies` is for it (bfloat16 when any of its layers
            computes in bfloat16); or a `keras.DTypePolicy` or its name; the global policy
            when `None`.
        hardware: `HardwareInfo`; detected when `None`.

    Returns:
        A dict: `enabled` (the switch), `applies` (`applies(model)`), `routes` (the names of
        `routes_on()`, this CPU's routes).
    """
    return {
        "enabled": _STATE["enabled"],
        "applies": applies(model, hardware),
        "routes": [r.name for r in routes_on(hardware)],
    }
