"""The audit's float8 findings (Keras's `quantize("float8")`): each float8 layer judged once, as
`float8_layers` would leave it out (`float8-output-layer`, `float8-first-layer`,
`float8-no-gain`, `float8-misaligned`), and float8 emulated on a machine without float8
Tensor Cores.
"""

from __future__ import annotations

from typing import Any

import keras

from tfmixprec._common.text import docs_page, first_few
from tfmixprec.checks.audit_alignment import padded_size
from tfmixprec.checks.audit_context import AuditContext
from tfmixprec.checks.audit_report import Finding
from tfmixprec.precision import float8, float8_recipe
from tfmixprec.precision.policy import (
    LOW_PRECISION,
    float32_reason,
)

__all__: list[str] = []


# float8 layers (Keras's `quantize("float8")`): each gets at most one of the layer findings
# below, for the first reason that applies of those `float8_recipe.RECIPE` gives to leave a layer
# out of `float8_layers`, in this order: its excluded roles (an output or softmax-like layer, the
# model's first matmul layer), a layer computing in float32, sizes not multiples of the
# recipe's alignment (the fix of each earlier one takes the layer out of float8, which makes
# the later ones moot).
_ROLE_FINDINGS = {
    "output": "float8-output-layer",
    "softmax": "float8-output-layer",
    "first": "float8-first-layer",
}


_FLOAT8_PAGE = "guides/float8"
_FLOAT8_FIX = (
    "Quantize the model with tfmixprec.float8_layers(model) instead of "
    "model.quantize('float8'): it leaves this layer out of float8."
)


def _float8_problem(layer: Any, context: AuditContext) -> str | None:
    """The one float8 layer finding `layer` gets (see above), or None: not float8, or float8
    suits it."""
    if not float8.is_float8(layer):
        return None
    first = layer is float8.first_matmul_layer(context.observation)
    role = float8_recipe.RECIPE.excluded_role(
        layer, output=bool(context.outputs_of(layer)), first=first
    )
    if role is not None:
        return _ROLE_FINDINGS[role]
    if context.compute_dtype(layer) not in LOW_PRECISION:
        return "float8-no-gain"
    dims = float8.matmul_dims(layer)
    if dims is not None and float8_recipe.RECIPE.misaligned(dims):
        return "float8-misaligned"
    return None


def float8_output_layer(layer: Any, context: AuditContext) -> list[Finding]:
    """A float8 layer that makes a model output (error) or has a softmax-like activation
    inside the model (warning): `model.quantize("float8")` quantizes the output layer too."""
    if _float8_problem(layer, context) != "float8-output-layer":
        return []
    policy, outputs = layer.dtype_policy.name, context.outputs_of(layer)
    if not outputs:
        message = (
            f"quantized to float8 ({policy}), its {float32_reason(layer)} reads logits "
            "computed from e4m3 inputs and kernel (3 mantissa bits)."
        )
        message += f" {docs_page(_FLOAT8_PAGE)}"
        return [Finding("warning", "float8-output-layer", layer.name, message, _FLOAT8_FIX)]
    through = ", ".join(repr(passing.name) for passing in outputs[0].through)
    via = f" (through {through})" if through else ""
    message = (
        f"quantized to float8 ({policy}), it makes a model output{via}: the loss sees values "
        f"computed from e4m3 inputs and kernel (3 mantissa bits). {docs_page(_FLOAT8_PAGE)}"
    )
    return [Finding("error", "float8-output-layer", layer.name, message, _FLOAT8_FIX)]


def float8_first_layer(layer: Any, context: AuditContext) -> list[Finding]:
    """The model's first matmul layer in float8: it quantizes the model's inputs."""
    if _float8_problem(layer, context) != "float8-first-layer":
        return []
    message = (
        f"quantized to float8 ({layer.dtype_policy.name}) as the model's first matmul layer, "
        "which Transformer Engine's recipe keeps out of float8: it quantizes the model's "
        f"inputs to e4m3 (3 mantissa bits). {docs_page(_FLOAT8_PAGE)}"
    )
    return [Finding("warning", "float8-first-layer", layer.name, message, _FLOAT8_FIX)]


def float8_misaligned(layer: Any, context: AuditContext) -> list[Finding]:
    """A float8 layer whose matmul dimensions are not both multiples of the recipe's alignment."""
    if _float8_problem(layer, context) != "float8-misaligned":
        return []
    k, n = float8.matmul_dims(layer)
    out = "units" if isinstance(layer, keras.layers.Dense) else "output size"
    named = [("input features", k), (out, n)]
    alignment = float8_recipe.RECIPE.alignment
    bad = [(what, size) for what, size in named if float8_recipe.RECIPE.misaligned((size,))]
    shown = " and ".join(f"{what} ({size})" for what, size in bad)
    message = (
        f"{shown} {'is' if len(bad) == 1 else 'are'} not a multiple of {alignment}: "
        f"float8 Tensor Cores need both matmul dimensions (input features {k}, {out} {n}) to "
        f"be. {docs_page(_FLOAT8_PAGE)}"
    )
    padded = " and ".join(f"{what} to {padded_size(size, alignment)}" for what, size in bad)
    fix = f"Pad {padded}, or leave the layer out of float8 (tfmixprec.float8_layers does)."
    return [Finding("warning", "float8-misaligned", layer.name, message, fix)]


def float8_no_gain(model: keras.Model, context: AuditContext) -> list[Finding]:
    """float8 where it cannot help: a float8 layer computing in float32 (warning, each), and
    float8 layers on a machine without float8 Tensor Cores (info, once)."""
    findings = []
    for layer in context.leaves:
        if _float8_problem(layer, context) == "float8-no-gain":
            message = (
                f"quantized to float8 ({layer.dtype_policy.name}) but computes in float32: the "
                "quantize-dequantize around a float32 matmul costs time and precision and "
                f"gains nothing. {docs_page(_FLOAT8_PAGE)}"
            )
            fix = (
                "Quantize only layers that compute in bfloat16 or float16: build under a mixed "
                "policy and call tfmixprec.float8_layers(model), which leaves float32 layers out."
            )
            findings.append(Finding("warning", "float8-no-gain", layer.name, message, fix))
    return findings + _float8_emulated(context)


def _float8_emulated(context: AuditContext) -> list[Finding]:
    """`float8-no-gain` (info): float8 layers on a machine without float8 Tensor Cores,
    named in the order the observed call ran them."""
    quantized = [layer for layer in context.leaves if float8.is_float8(layer)]
    if context.hardware is None or not quantized or any(g.float8 for g in context.hardware.gpus):
        return []
    ran = [id(call.layer) for call in context.observation.calls]
    quantized.sort(key=lambda layer: ran.index(id(layer)) if id(layer) in ran else len(ran))
    shown = first_few([repr(layer.name) for layer in quantized])
    dtypes = " or ".join(sorted({context.compute_dtype(layer) for layer in quantized}))
    message = (
        f"{len(quantized)} float8 layer(s) ({shown}) run here as emulated quantize-dequantize, "
        f"slower than {dtypes} alone: no GPU with float8 Tensor Cores (compute capability 8.9 "
        f"or later), so float8 is useful here for checking numerics. {docs_page(_FLOAT8_PAGE)}"
    )
    fix = (
        "None needed to check numerics (tfmixprec.float8_stats(model) reads what quantizing "
        "does); for speed, train on an Ada, Hopper or later GPU."
    )
    return [Finding("info", "float8-no-gain", None, message, fix)]
