"""Static checks of a model for mixed precision: dtypes, float32 outputs, Tensor Core sizes,
float8 layers."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras

from tfmixprec._common.layers import (
    all_layers,
    check_built_model,
    float32_on_purpose,
    is_container,
    iter_layers,
)
from tfmixprec._common.observe import (
    LayerCall,
    Observation,
    observe,
    policies_swapped,
    unobserved,
)
from tfmixprec._common.text import docs_page, first_few, markdown_table
from tfmixprec._keras.graph import all_sublayers
from tfmixprec._keras.settings import settings_kept
from tfmixprec.checks.model_file import load_model_file
from tfmixprec.checks.training_call import training_clash
from tfmixprec.precision import cpu_bfloat16, cpu_float16, float8, float8_recipe
from tfmixprec.precision.cpu_route import route_of
from tfmixprec.precision.hardware import HardwareInfo, detect_hardware
from tfmixprec.precision.policy import (
    LOW_PRECISION,
    check_policy_name,
    choose_policy,
    float32_reason,
)

__all__ = ["Finding", "LayerDtypes", "AuditReport", "audit"]

SEVERITIES = ("error", "warning", "info")
ALIGNMENT = 8  # NVIDIA: multiples of 8 for float16 on Tensor Cores
IMAGE_CHANNELS = 4  # NVIDIA: a first convolution on 3-channel images needs 4 at stride >= 2
# The smaller of a matmul's N and K from which its Tensor Core alignment is reported. A
# product of M x K by K x N in 16-bit does MNK / (MK + KN + MN) < min(M, N, K) flops per byte
# it moves, so with N or K under 128 it does fewer than 128: below the ~140 (V100), 150-200
# (A100) and 300 (H100) flops per byte at which Tensor Core math, which alignment speeds,
# rather than memory sets its time. There padding buys little and costs much (a 10-class head
# padded to 16 does 60% more work); from 128 on it costs at most 5.4% (7 in 129).
LARGE_PRODUCT = 128
# The most padding may add to a product's work to be advised: a convolution's K is its input
# channels times its window, so 3 channels padded to 8 add 167% even where K is large. An
# image's first convolution is the exception NVIDIA's guide makes itself (3 channels to 4).
PADDING_COST = 0.125


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem found by `audit`.

    Args:
        severity: String. `"error"`, `"warning"` or `"info"`.
        code: String. A short stable identifier, e.g. `"low-precision-output"`.
        layer: String or None. The layer's name (None for model-wide findings).
        message: String. What is wrong.
        fix: String. What to do about it.
    """

    severity: str
    code: str
    layer: str | None
    message: str
    fix: str


@dataclasses.dataclass(frozen=True)
class LayerDtypes:
    """A layer's compute and variable dtypes (as audited)."""

    layer: str
    class_name: str
    policy: str
    compute_dtype: str
    variable_dtype: str


@dataclasses.dataclass
class AuditReport:
    """The result of `audit(model)`: findings and per-layer dtypes.

    `str(report)` is a readable table; `to_dict()`, `to_json()` and `to_markdown()` convert it.
    """

    model: str
    policy: str
    findings: list[Finding]
    layers: list[LayerDtypes]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        """True when there is no error (warnings and info allowed)."""
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "policy": self.policy,
            "ok": self.ok,
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "layers": [dataclasses.asdict(layer) for layer in self.layers],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _summary(self) -> str:
        counts = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        return ", ".join(f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in SEVERITIES)

    def to_markdown(self) -> str:
        lines = [
            f"## Mixed-precision audit of `{self.model}` (policy `{self.policy}`)",
            "",
            self._summary(),
            "",
        ]
        if self.findings:
            rows = [(f.severity, f.layer or "-", f.message, f.fix) for f in self.findings]
            lines += markdown_table(("severity", "layer", "problem", "fix"), rows)
            lines.append("")
        rows = [(x.layer, x.class_name, x.compute_dtype, x.variable_dtype) for x in self.layers]
        lines += markdown_table(("layer", "class", "compute", "variables"), rows)
        return "\n".join(lines)

    def __str__(self) -> str:
        rows = [("layer", "class", "compute", "variables")] + [
            (lyr.layer, lyr.class_name, lyr.compute_dtype, lyr.variable_dtype)
            for lyr in self.layers
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [f"Mixed-precision audit of '{self.model}' (policy {self.policy})", ""]
        for index, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if index == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        if self.findings:
            for f in self.findings:
                where = f" [{f.layer}]" if f.layer else ""
                lines.append(f"{f.severity.upper():7} {f.code}{where}: {f.message}")
                lines.append(f"        fix: {f.fix}")
        elif any(layer.compute_dtype in LOW_PRECISION for layer in self.layers):
            lines.append("No findings: the model is ready for mixed precision.")
        else:
            lines.append(f"No findings: the model computes in float32 (policy {self.policy}).")
        lines.append("")
        lines.append(f"Summary: {self._summary()}")
        return "\n".join(lines)


IMAGE_INPUT = "input channels (a first convolution's, at stride >= 2)"


def _alignment(what: str) -> int:
    return IMAGE_CHANNELS if what == IMAGE_INPUT else ALIGNMENT


def _padded(n: int, alignment: int = ALIGNMENT) -> int:
    return int(math.ceil(n / alignment) * alignment)


def _sizes_to_align(layer: Any, context: _AuditContext) -> list[tuple[str, int, int]]:
    """The sizes of `layer` that Tensor Cores want as multiples of 8: the N and K of the
    matmul it lowers to (for a convolution, its input and output channels, as NVIDIA's
    guide states them), each with the smaller of its product's N and K (`LARGE_PRODUCT`).
    Gathers (an `Embedding` lookup) have none."""
    if isinstance(layer, keras.layers.Dense):
        return _both([("units", layer.units), ("input features", int(layer.kernel.shape[0]))])
    if isinstance(layer, keras.layers.Embedding):
        return _both(_reverse_projection_sizes(layer, context))
    if isinstance(layer, keras.layers.MultiHeadAttention):
        # Each head size is the K (key_dim, of the scores) or the N (value_dim, of the
        # product with the values) of a product whose other size is the sequence's length.
        sizes = [("head size (key_dim)", layer.key_dim, layer.key_dim)]
        if layer.value_dim and layer.value_dim != layer.key_dim:
            sizes.append(("value head size (value_dim)", layer.value_dim, layer.value_dim))
        return sizes
    if isinstance(layer, keras.layers.EinsumDense):
        return _both(_einsum_sizes(layer))
    if hasattr(layer, "pointwise_kernel"):  # SeparableConv1D/2D: a 1x1 convolution last
        return _both(
            [
                ("filters", layer.filters),
                ("pointwise input channels", int(layer.pointwise_kernel.shape[-2])),
            ]
        )
    if hasattr(layer, "filters") and hasattr(layer, "kernel_size") and hasattr(layer, "kernel"):
        return _convolution_sizes(layer, context)
    return []


def _both(sizes: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """The N and K of one product, each with the smaller of the two."""
    smallest = min((size for _, size in sizes), default=0)
    return [(what, size, smallest) for what, size in sizes]


def _convolution_sizes(layer: Any, context: _AuditContext) -> list[tuple[str, int, int]]:
    """A convolution's filters and input channels (per group, for a grouped convolution: each
    group is a convolution of its own). NVIDIA's guide: multiples of 8 for float16, except the
    first layer of a CNN on 3-channel images, where 4 suffice at a stride of 2 or more
    (reported against 4 there: `_padded` rounds to the size's own alignment): a convolution
    that reads the model's inputs, as the observed call shows, itself or through layers that
    keep the image's channels (`_hands_on_channels`: a `Rescaling` and a `Normalization` in
    front of EfficientNetV2's stem). Lowered to a matmul, N is the filters and K the input
    channels times the kernel's window (per group)."""
    transpose = "Transpose" in type(layer).__name__
    groups = 1 if transpose else getattr(layer, "groups", 1) or 1
    channels = int(layer.kernel.shape[-1] if transpose else layer.kernel.shape[-2])  # per group
    per = " per group" if groups > 1 else ""
    filters = ("filters" + per, layer.filters // groups)
    strides = tuple(getattr(layer, "strides", (1,)) or (1,))
    observation = context.observation
    first = any(
        observation.reads_model_inputs(call, _hands_on_channels)
        for call in observation.calls_of(layer)
    )
    smallest = min(filters[1], channels * math.prod(tuple(layer.kernel_size)))
    if first and channels <= IMAGE_CHANNELS and min(strides) >= 2 and not transpose:
        return [(*filters, smallest), (IMAGE_INPUT, channels, smallest)]
    return [(*filters, smallest), ("input channels" + per, channels, smallest)]


def _hands_on_channels(call: LayerCall) -> bool:
    """Whether a leaf call hands on an image with the channels it read: one floating-point
    input, every output as wide (its last dimension), and no kernel (a convolution or a
    `Dense` makes new features, even as many): a `Rescaling`, `Normalization`, `Resizing`,
    `RandomFlip`, `CenterCrop`, padding, cropping, pooling, `BatchNormalization` or
    `Activation`. An image's first convolution is the first behind these."""
    if len(call.input_last_dims) != 1 or any(
        hasattr(call.layer, kernel) for kernel in ("kernel", "pointwise_kernel")
    ):
        return False
    return all(dim == call.input_last_dims[0] for dim in call.output_last_dims)


def _reverse_projection_sizes(layer: Any, context: _AuditContext) -> list[tuple[str, int]]:
    """A (KerasHub or Keras) `ReversibleEmbedding` called with `reverse=True` in float16 or
    bfloat16, as observed: its output projection is a matmul of N = the vocabulary size and
    K = the embedding dimension. A plain lookup is a gather, with no matmul sizes."""
    reverse_low = any(
        call.float_input
        and any(
            dim == layer.input_dim and dtype in LOW_PRECISION
            for dtype, dim in zip(call.output_dtypes, call.output_last_dims)
        )
        for call in context.observation.calls_of(layer)
    )
    if not reverse_low:
        return []
    return [
        ("vocabulary size (input_dim) of the reverse projection", layer.input_dim),
        ("embedding dimension (output_dim) of the reverse projection", layer.output_dim),
    ]


def _einsum_sizes(layer: Any) -> list[tuple[str, int]]:
    """An `EinsumDense`'s matmul sizes as its einsum lowers to one: K, the product of the
    dimensions it contracts (in the input and the kernel, not the output), and N, the product
    of the kernel's dimensions that reach the output. A dimension in all three operands is a
    batch dimension of the product and counts in neither. So grouped-query attention's key
    projection `bkm,mvh->bkvh` with 2 heads of 16 has N = 2x16 = 32, not 2."""
    inputs, rest = layer.equation.replace("...", "").split(",")
    kernel, output = rest.split("->")
    contracted = [(c, int(n)) for c, n in zip(kernel, layer.kernel.shape) if c not in output]
    kept = [(c, int(n)) for c, n in zip(kernel, layer.kernel.shape) if c not in inputs]
    contracted = [(c, n) for c, n in contracted if c in inputs]
    kept = [(c, n) for c, n in kept if c in output]
    return [
        size
        for size in (_product("input features", contracted), _product("output size", kept))
        if size is not None
    ]


def _product(what: str, dims: list[tuple[str, int]]) -> tuple[str, int] | None:
    if not dims:
        return None
    if len(dims) == 1:
        return (f"{what} (equation dimension {dims[0][0]!r})", dims[0][1])
    letters = "".join(c for c, _ in dims)
    sizes = "x".join(str(n) for _, n in dims)
    size = math.prod(n for _, n in dims)
    return (f"{what} (equation dimensions {letters!r}, {sizes} = {size})", size)


@dataclasses.dataclass(frozen=True)
class _AuditContext:
    """What a check reads besides its layer or model.

    Args:
        model_policy: String. The name of the model's own policy.
        policy: String or None. The policy audited instead of the model's own (`audit`'s
            `policy=`), or None.
        layers: Tuple of layers. The model's layers, nested ones included, no `InputLayer`.
        observation: `Observation`. One call of the model on zeros under the audited policy:
            its outputs' dtypes and each leaf call's (`tfmixprec._common.observe.observe`).
        hardware: `HardwareInfo` or None. The machine for machine findings; None when auditing
            under another policy (no machine findings then).
        followers: Frozenset of ints. The `id()`s of the policy objects that follow the
            model's own policy (a layer built with `dtype=` has a policy object of its own).
        no_gpu: Bool. The findings are for a machine without a GPU or TPU: this one, for the
            model as it is or under the policy recommended for it (`float32-model`).
    """

    model_policy: str
    policy: str | None
    layers: tuple[Any, ...]
    observation: Observation
    hardware: HardwareInfo | None
    followers: frozenset[int] = frozenset()
    no_gpu: bool = False

    @property
    def leaves(self) -> list[Any]:
        """The layers that compute (nested models left out): the ones layer checks see."""
        return [layer for layer in self.layers if not is_container(layer)]

    @property
    def cpu_only(self) -> bool:
        """True when auditing on this machine and it has no GPU or TPU."""
        return self.hardware is not None and not (self.hardware.gpus or self.hardware.tpus)

    def policy_of(self, layer: Any) -> keras.DTypePolicy:
        """The policy audited for `layer`: `policy` where it follows the model's own (a layer
        built with a `dtype=` of its own keeps it under any policy)."""
        if self.policy is not None and id(layer.dtype_policy) in self.followers:
            return keras.DTypePolicy(self.policy)
        return layer.dtype_policy

    def compute_dtype(self, layer: Any) -> str:
        """The compute dtype audited for `layer`."""
        return self.policy_of(layer).compute_dtype

    def outputs_of(self, layer: Any) -> list[Any]:
        """The model outputs (`ModelOutput`) that `layer` computed, in any dtype."""
        return [out for out in self.observation.outputs if out.layer is layer]

    def low_precision_outputs(self, layer: Any) -> list[Any]:
        """The model outputs (`ModelOutput`) that `layer` computed and a real call returns in
        float16/bfloat16."""
        return [
            out
            for out in self.observation.outputs
            if out.layer is layer and out.dtype in LOW_PRECISION
        ]


_FLOAT32_FIX = "Call tfmixprec.float32_outputs(model), or give this layer dtype='float32'."
_LOSS_SCALE_FIX = "Compile with tfmixprec.LossScaleOptimizer(your_optimizer)."


# Layer checks: `check(layer, context) -> list[Finding]`, run on every leaf layer.


def _low_precision_output(layer: Any, context: _AuditContext) -> list[Finding]:
    """A model output that a real call returns in float16/bfloat16: the loss sees it.

    Only outputs: a softmax, sigmoid or log-softmax inside the model feeds layers that compute
    in float16/bfloat16 anyway, and computing it in float32 changes nothing measurable there
    (`benchmarks/softmax_precision.py`: an attention's softmax within 2 machine epsilons of a
    float32 one, the same training loss to 4 digits).
    """
    outputs = context.low_precision_outputs(layer)
    if not outputs:
        return []
    dtype, reason = outputs[0].dtype, float32_reason(layer)
    through = ", ".join(repr(passing.name) for passing in outputs[0].through)
    via = f" (through {through})" if through else ""
    if reason is not None:
        message = (
            f"{reason} computed in {dtype} produces a model output{via}: it saturates and "
            "loses small probabilities, whose log the loss takes."
        )
        return [Finding("error", "low-precision-softmax", layer.name, message, _FLOAT32_FIX)]
    message = f"produces a model output in {dtype}{via}; the loss should see float32."
    return [Finding("error", "low-precision-output", layer.name, message, _FLOAT32_FIX)]


def _tensor_core_alignment(layer: Any, context: _AuditContext) -> list[Finding]:
    """Matmul and convolution sizes that are not multiples of 8 (4 for an image's first
    convolution), in products large enough for it to matter (`LARGE_PRODUCT`) where padding
    costs little (`PADDING_COST`): a warning, with what padding costs; an info on a machine
    without a GPU, where it changes nothing."""
    compute = context.compute_dtype(layer)
    if compute not in LOW_PRECISION or not layer.built:  # an unbuilt layer never ran
        return []
    if float8.is_float8(layer):  # its sizes want multiples of 16: float8-misaligned's
        return []
    findings = []
    for what, size, smallest in _sizes_to_align(layer, context):
        alignment = _alignment(what)
        padded = _padded(size, alignment)
        cost = (padded - size) / size
        if cost == 0 or smallest < LARGE_PRODUCT or (cost > PADDING_COST and what != IMAGE_INPUT):
            continue
        kind = "convolutions" if hasattr(layer, "kernel_size") else "matmuls"
        message = (
            f"{what} is {size}, not a multiple of {alignment}: on a GPU, Tensor Cores run "
            f"{compute} {kind} fastest on multiples of {alignment}; padding it to {padded} "
            f"adds {cost:.1%} to the product's work."
        )
        severity = "warning"
        if context.no_gpu:
            severity, message = "info", message + " This machine has no GPU: only GPU runs gain."
        fix = f"Pad {what} to {padded}."
        findings.append(Finding(severity, "tensor-core-alignment", layer.name, message, fix))
    return findings


def _low_precision_variable(layer: Any, context: _AuditContext) -> list[Finding]:
    return [
        Finding(
            "error",
            "low-precision-variable",
            layer.name,
            f"variable {variable.path or variable.name!r} is stored in "
            f"{variable.dtype}; master weights must stay float32.",
            "Build the layer under a mixed_* policy (float32 variables, "
            "low-precision compute) instead of dtype='float16'/'bfloat16'.",
        )
        for variable in layer.weights
        if variable.dtype in LOW_PRECISION
    ]


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


def _float8_problem(layer: Any, context: _AuditContext) -> str | None:
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


def _float8_output_layer(layer: Any, context: _AuditContext) -> list[Finding]:
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


def _float8_first_layer(layer: Any, context: _AuditContext) -> list[Finding]:
    """The model's first matmul layer in float8: it quantizes the model's inputs."""
    if _float8_problem(layer, context) != "float8-first-layer":
        return []
    message = (
        f"quantized to float8 ({layer.dtype_policy.name}) as the model's first matmul layer, "
        "which Transformer Engine's recipe keeps out of float8: it quantizes the model's "
        f"inputs to e4m3 (3 mantissa bits). {docs_page(_FLOAT8_PAGE)}"
    )
    return [Finding("warning", "float8-first-layer", layer.name, message, _FLOAT8_FIX)]


def _float8_misaligned(layer: Any, context: _AuditContext) -> list[Finding]:
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
    padded = " and ".join(f"{what} to {_padded(size, alignment)}" for what, size in bad)
    fix = f"Pad {padded}, or leave the layer out of float8 (tfmixprec.float8_layers does)."
    return [Finding("warning", "float8-misaligned", layer.name, message, fix)]


def _float8_no_gain(model: keras.Model, context: _AuditContext) -> list[Finding]:
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


def _float8_emulated(context: _AuditContext) -> list[Finding]:
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


# Model checks: `check(model, context) -> list[Finding]`, run once.


def _output_outside_layers(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """A model output in float16/bfloat16 made by an operation outside any layer (raw
    tensor arithmetic in a subclassed model's `call`): no layer's dtype can fix it."""
    dtypes = [
        out.dtype
        for out in context.observation.outputs
        if out.layer is None and out.dtype in LOW_PRECISION
    ]
    if not dtypes:
        return []
    message = (
        f"{len(dtypes)} model output(s) in {dtypes[0]} made outside any layer (an operation in "
        "the model's call); the loss should see float32."
    )
    fix = "Cast it in the model's call: keras.ops.cast(output, 'float32')."
    return [Finding("error", "low-precision-output", None, message, fix)]


def _nonfinite_output(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """A call on zeros whose float16/bfloat16 values are not finite: the first layer that
    returned NaN/Inf, and the first such operation, with whether a constant of the model's
    own code was too large for the dtype or its values passed the range (`op_watch`)."""
    observation, op = context.observation, context.observation.nonfinite
    if op is None or observation.finite or not (op.constant or op.inputs_finite):
        return []  # finite, not finite in float32 too, or from a non-finite input
    layer = _nonfinite_source(model, next(c for c in observation.calls if not c.finite))
    at = f" at {op.where}" if op.where else ""
    if op.constant:
        why = (
            f"its {op.operation}{at} is given a constant too large for {op.dtype}: the model's "
            f"own code, not {op.dtype}'s range of its values"
        )
    else:  # every input finite
        why = f"its {op.operation}{at} passes {op.dtype}'s range"
    message = (
        f"a call on a batch of zeros returns NaN/Inf in {op.dtype}: the first layer whose "
        f"output is not finite is {layer.path!r}, and {why}."
    )
    fix = (
        "Compute that layer in float32 (tfmixprec.calibrate(model, data) finds the layers and "
        "explain_overflow says why), or use mixed_bfloat16."
    )
    return [Finding("error", "nonfinite-output", layer.name, message, fix)]


def _nonfinite_source(model: keras.Model, call: LayerCall) -> Any:
    """The layer that made `call`'s NaN/Inf: its own, or, where an input came from an
    operation outside the leaf layers (an attention layer's own code around its dropout), the
    innermost layer around it."""
    if all(source is not None for source in call.input_sources):
        return call.layer
    around = [
        outer
        for outer in all_layers(model)
        if outer is not model and any(part is call.layer for part in all_sublayers(outer))
    ]
    return min(around, key=lambda outer: len(all_sublayers(outer)), default=call.layer)


def _dtype_clash(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """`dtype-clash` (error): a float16/bfloat16 model whose training call on zeros raises
    because its own code mixes dtypes (`training_call`), with the layers `calibrate` would
    compute in float32. Not tried where the inference call did not run."""
    observation = context.observation
    low = any(context.compute_dtype(layer) in LOW_PRECISION for layer in context.leaves)
    if not low or not observation.called or observation.error is not None:
        return []
    follow = [lyr for lyr in (model, *context.layers) if id(lyr.dtype_policy) in context.followers]
    swapped = follow if context.policy is not None else []
    with policies_swapped(swapped, context.policy or context.model_policy):
        found = training_clash(model)
    if found is None:
        return []
    layer = None if found.clash.layer is None else found.clash.layer.name
    return [Finding("error", "dtype-clash", layer, found.message(), found.fix())]


def _float32_on_purpose(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """`float32-on-purpose` (info): layers that `calibrate` or `PrecisionRepair` set to
    float32 because their values pass float16's range (recorded on the model in this
    process): expected, nothing to fix."""
    marked = float32_on_purpose(model)
    if not marked:
        return []
    names = ", ".join(f"{path!r} ({why})" for path, why in marked.items())
    message = f"{len(marked)} layers compute in float32 on purpose: {names}."
    fix = "Nothing to fix: their values pass float16's range (see docs/guides/repair.md)."
    return [Finding("info", "float32-on-purpose", None, message, fix)]


def _unobserved(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """`unobserved` (info): the model could not be called on a batch of zeros, or the audit of
    a file did not call it (past `DECLARED_BUDGET`), so its outputs' dtypes are the ones Keras
    infers symbolically (which a real call can contradict)."""
    error = context.observation.error
    if error is None:
        return []
    symbolic = (
        "its outputs' dtypes are Keras's symbolic ones, which a real call can contradict (a "
        "layer may return float32 under a float16 policy)."
    )
    fix = "Check the outputs' dtypes on a real batch: model(batch).dtype."
    if not context.observation.called:
        message = f"{error}, so {symbolic}"
        fix += (
            " For a file you trust, audit the model in Python, where the call has no budget: "
            "tfmixprec.audit(keras.models.load_model(path))."
        )
    else:
        message = f"calling the model on a batch of zeros failed ({error[:200]}), so {symbolic}"
    return [Finding("info", "unobserved", None, message, fix)]


def _loss_scaling(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """`not-compiled` (info) or `no-loss-scaling` (error) for a model computing in float16;
    `keras-loss-scaling` (info) for a model audited under `mixed_float16` that was compiled
    under another policy, whose optimizer its `compile` wraps there (`_wrapper_at_compile`)."""
    if not any(context.compute_dtype(layer) == "float16" for layer in context.leaves):
        return []
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        message = (
            "the model computes in float16 and is not compiled yet; float16 needs loss scaling."
        )
        return [Finding("info", "not-compiled", None, message, _LOSS_SCALE_FIX)]
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return []
    name = type(optimizer).__name__
    wrapper = _wrapper_at_compile(model, context)
    if wrapper is not None:
        message = (
            f"the model was compiled under {context.model_policy} with {name}; compiled the "
            f"same way under mixed_float16, {wrapper}, so the loss is scaled."
        )
        fix = (
            "None needed, unless you turn that off (compile(auto_scale_loss=False)): then "
            "compile with tfmixprec.LossScaleOptimizer(your_optimizer)."
        )
        return [Finding("info", "keras-loss-scaling", None, message, fix)]
    message = (
        f"the model computes in float16 but its optimizer {name} does not scale the loss: "
        "small gradients flush to zero."
    )
    return [Finding("error", "no-loss-scaling", None, message, _LOSS_SCALE_FIX)]


def _wrapper_at_compile(model: keras.Model, context: _AuditContext) -> str | None:
    """What wraps the model's optimizer for loss scaling when it is compiled under the
    audited policy, or None where nothing would. Keras's `compile` wraps it in its own
    `LossScaleOptimizer` where `auto_scale_loss` is on (its default, which the model does not
    keep) and the model's policy is exactly `mixed_float16`; a KerasHub task's `compile`
    passes through to it (tfmixprec's `MixedPrecisionModel` has a tfmixprec
    `LossScaleOptimizer` under any policy). A model compiled under `mixed_float16` already has
    the optimizer it would get; a class with a `compile` of its own may do anything: None."""
    if context.policy != "mixed_float16" or context.model_policy == "mixed_float16":
        return None
    if type(model).compile.__module__.split(".")[0] not in ("keras", "keras_hub"):
        return None
    return (
        "Keras's compile wraps it in its own LossScaleOptimizer (auto_scale_loss=True, "
        "compile's default)"
    )


def _cpu_float16_kernels(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """Float16 layers that run float16 CPU kernels slow on this machine's CPU, not routed."""
    if not context.cpu_only:
        return []
    served = cpu_float16.served_layers(model, context.hardware)
    # by the layer itself: nested layers share names (each KerasHub block's `query`)
    slow = [(layer.name, route) for layer, route in served if route_of(layer) != route.name]
    if not slow:
        return []
    shown = first_few([repr(name) for name, _ in slow])
    whys = "; ".join(dict.fromkeys(route.why for _, route in slow))
    message = (
        f"on this machine (no GPU), {len(slow)} float16 layer(s) ({shown}) run TensorFlow "
        f"float16 CPU kernels that are slow on this CPU: {whys} (benchmarks/RESULTS.md, 16)."
    )
    fix = (
        "Train through tfmixprec (MixedPrecisionModel.compile or make_train_step do it), "
        "or call tfmixprec.cpu_float16.fast_float16_layers(model): their products then "
        "run in float32, within float16 rounding."
    )
    return [Finding("info", "cpu-float16-kernels", None, message, fix)]


def _cpu_bfloat16_kernels(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """bfloat16 layers that a `cpu_bfloat16` route serves on this CPU: routed or not yet."""
    if not context.cpu_only:
        return []
    served = [
        (layer, route)
        for layer, route in cpu_bfloat16.served_layers(model, context.hardware)
        # a table's logits only where this model's observed call computes them
        if route is not cpu_bfloat16.LOGITS
        or any(call.float_input for call in context.observation.calls_of(layer))
    ]
    if not served:
        return []
    shown = first_few([f"{layer.name!r} ({route.name})" for layer, route in served])
    if all(route_of(layer) == route.name for layer, route in served):
        message = f"{len(served)} bfloat16 layer(s) take a tfmixprec.cpu_bfloat16 route: {shown}."
        fix = "None needed: their outputs and saved files are as Keras makes them."
        return [Finding("info", "cpu-bfloat16-routed", None, message, fix)]
    why = "; ".join(dict.fromkeys(route.why for _, route in served))  # each route once
    message = (
        f"on this CPU, {len(served)} bfloat16 layer(s) run slower than they need: {shown} "
        f"({why}; docs/guides/bfloat16-on-cpus.md)."
    )
    fix = (
        "Train through tfmixprec (MixedPrecisionModel.compile does it), or call "
        "tfmixprec.cpu_bfloat16.fast_bfloat16_layers(model): within bfloat16 rounding."
    )
    return [Finding("info", "cpu-bfloat16-kernels", None, message, fix)]


def _xla_bfloat16_cpu(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """A bfloat16 model compiled with XLA on a machine without a GPU."""
    if not context.cpu_only or model.dtype_policy.compute_dtype != "bfloat16":
        return []
    if not (getattr(model, "compiled", False) and model.jit_compile):
        return []
    message = (
        "compiled with jit_compile=True under bfloat16 on a CPU: XLA's CPU backend "
        "does not use AMX/AVX512_BF16, so bfloat16 steps can be slower than float32."
    )
    fix = "Compile with jit_compile=False (Keras's default on CPUs)."
    return [Finding("warning", "xla-bfloat16-cpu", None, message, fix)]


def _float32_model(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """`float32-model` (info): the model, as it is, computes in float32 only; what the audit
    finds under the policy recommended for this machine (`choose_policy`)."""
    leaves = context.leaves
    if context.hardware is None or not leaves:
        return []
    if any(context.compute_dtype(layer) in LOW_PRECISION for layer in leaves):
        return []
    choice = choose_policy(context.hardware)
    if choice.name == "float32":
        message = (
            "the model computes in float32 only, the policy recommended for this machine: "
            f"{choice.reason}"
        )
        fix = (
            "None needed here. For a GPU, audit it under the policy to use there: "
            "policy='mixed_float16' or 'mixed_bfloat16' (tfmixprec audit FILE --policy ...)."
        )
        return [Finding("info", "float32-model", None, message, fix)]
    skipped = None if context.observation.called else context.observation.error
    recommended = _context(model, choice.name, None, context.followers, skipped)
    found = _run_checks(model, dataclasses.replace(recommended, no_gpu=context.no_gpu))
    shown = [f"{f.code} [{f.layer or 'model'}] ({f.severity})" for f in found]
    what = "nothing to change" if not found else f"{_count(found)}: " + ", ".join(shown[:5])
    message = (
        f"the model computes in float32 only: no mixed precision yet. Under {choice.name}, "
        f"the policy recommended for this machine, the audit finds {what}"
        f"{', ...' if len(shown) > 5 else ''}."
    )
    fix = (
        f"Audit it under that policy for the details (tfmixprec.audit(model, "
        f"policy={choice.name!r}), or tfmixprec audit FILE --policy {choice.name}), then build "
        f"it under tfmixprec.set_policy({choice.name!r})."
    )
    return [Finding("info", "float32-model", None, message, fix)]


def _count(findings: Sequence[Finding]) -> str:
    """`"1 error, 2 warnings"`: the severities present, in order."""
    counts = [(s, sum(f.severity == s for f in findings)) for s in SEVERITIES]
    return ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts if n)


_Check = Callable[[Any, _AuditContext], list[Finding]]

# Every check `audit` runs, one row each: ("layer", check) runs `check(layer, context)` on each
# leaf layer in the model's order, ("model", check) runs `check(model, context)` once after them.
# The report lists errors, then warnings, then info; within a severity, in this order.
CHECKS: tuple[tuple[str, _Check], ...] = (
    ("layer", _low_precision_output),  # or low-precision-softmax for a softmax-like output
    ("layer", _tensor_core_alignment),
    ("layer", _low_precision_variable),
    ("layer", _float8_output_layer),  # error at an output, warning for a softmax-like layer
    ("layer", _float8_first_layer),
    ("layer", _float8_misaligned),
    ("model", _output_outside_layers),
    ("model", _nonfinite_output),
    ("model", _dtype_clash),  # a training call on zeros raises: the model cannot train
    ("model", _unobserved),
    ("model", _float32_on_purpose),
    ("model", _loss_scaling),  # not-compiled / no-loss-scaling
    ("model", _cpu_float16_kernels),
    ("model", _cpu_bfloat16_kernels),  # or cpu-bfloat16-routed
    ("model", _xla_bfloat16_cpu),
    ("model", _float8_no_gain),  # float8 layers in float32; no float8 Tensor Cores here (info)
    ("model", _float32_model),  # float32-model: what the recommended policy would find
)


def _followers(model: keras.Model, layers: Sequence[Any]) -> frozenset[int]:
    """The `id()`s of the policy objects that follow the model's own policy.

    A layer built without `dtype=` holds the very policy object that was global when it was
    built, the model's own; one built with `dtype=` holds an object of its own. Where no layer
    holds the model's object, the object most layers share does (layers built in a
    `policy_scope` and a model made after it); where none is shared (a model loaded by
    `keras.models.load_model`: every layer gets its own), layers whose policy has the model's
    policy's name count as following it.
    """
    own = model.dtype_policy
    if any(layer.dtype_policy is own for layer in layers):
        return frozenset([id(own)])
    shared = collections.Counter(id(layer.dtype_policy) for layer in layers).most_common(1)
    if shared and shared[0][1] > 1:
        return frozenset([shared[0][0]])
    return frozenset(id(lyr.dtype_policy) for lyr in layers if lyr.dtype_policy.name == own.name)


def _observe_as_audited(
    model: keras.Model,
    layers: Sequence[Any],
    policy: str | None,
    followers: frozenset[int],
    skipped: str | None = None,
) -> Observation:
    """`observe(model)`, with the layers that follow the model's own policy computing in
    `policy` for the call (their own policies back after it); no call where `skipped` says
    why not. Where the call cannot run, the outputs' symbolic dtypes are those of the model as
    built: the outputs of layers that follow it are taken to be in `policy`'s compute dtype."""
    swapped = [layer for layer in [model, *layers] if id(layer.dtype_policy) in followers]
    if skipped is not None:
        observation = unobserved(model, skipped)
    elif policy is None:
        return observe(model)
    else:
        with policies_swapped(swapped, policy):
            observation = observe(model)
    if observation.error is None or policy is None:
        return observation
    follow = {id(layer) for layer in swapped}
    compute = keras.DTypePolicy(policy).compute_dtype
    outputs = tuple(
        dataclasses.replace(out, dtype=compute) if id(out.layer) in follow else out
        for out in observation.outputs
    )
    return dataclasses.replace(observation, outputs=outputs)


def _context(
    model: keras.Model,
    policy: str | None,
    hardware: HardwareInfo | None,
    followers: frozenset[int] | None = None,
    skipped: str | None = None,
) -> _AuditContext:
    """Checks `audit`'s arguments and gathers what the checks read (`followers`: see
    `_followers`; a saved model's are read from its file; `skipped`: why not to call the
    model, for a file past `DECLARED_BUDGET`)."""
    if policy is not None:
        policy = check_policy_name(policy)
        if policy == "auto":
            policy = choose_policy(hardware).name
    check_built_model(model, "audit")
    machine = None
    if policy is None:  # the model as it is, on this machine
        machine = detect_hardware() if hardware is None else hardware
    layers = [lyr for lyr in iter_layers(model) if not isinstance(lyr, keras.layers.InputLayer)]
    followers = _followers(model, layers) if followers is None else followers
    observation = _observe_as_audited(model, layers, policy, followers, skipped)
    return _AuditContext(
        model_policy=model.dtype_policy.name,
        policy=policy,
        layers=tuple(layers),
        observation=observation,
        hardware=machine,
        followers=followers,
        no_gpu=machine is not None and not (machine.gpus or machine.tpus),
    )


def _run_checks(model: keras.Model, context: _AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for layer in context.leaves:
        for scope, check in CHECKS:
            if scope == "layer":
                findings += check(layer, context)
    for scope, check in CHECKS:
        if scope == "model":
            findings += check(model, context)
    return sorted(findings, key=lambda finding: SEVERITIES.index(finding.severity))


def _layer_dtypes(layer: Any, context: _AuditContext) -> LayerDtypes:
    policy = context.policy_of(layer)
    return LayerDtypes(
        layer=layer.name,
        class_name=type(layer).__name__,
        policy=policy.name,
        compute_dtype=policy.compute_dtype,
        variable_dtype=policy.variable_dtype,
    )


def audit(
    model: keras.Model | str | os.PathLike,
    policy: str | None = None,
    hardware: HardwareInfo | None = None,
) -> AuditReport:
    """Checks a built model for mixed-precision problems.

    Calls the model once on a batch of zeros (inference mode; nothing changes) and judges
    what the call shows; a float16/bfloat16 model is replayed once in training mode too (its
    loss, no gradients, nothing changes): a dtype clash of its own code there, which makes
    every training step raise, is an error (`dtype-clash`, with the layers `calibrate`
    would compute in float32). Flags: model outputs a real call returns in float16 or bfloat16
    (error: `low-precision-softmax` for a softmax/sigmoid/log-softmax output layer,
    `low-precision-output` otherwise), since the loss sees them; a softmax inside the model
    (an attention's, say) feeds float16/bfloat16 layers and is not flagged (measured:
    `benchmarks/softmax_precision.py`). Matmul and convolution sizes that are not multiples
    of 8 in float16/bfloat16 layers, in products whose N and K are both 128 or more and
    where padding adds at most 12.5% work (warning, with the padded size and its cost; an
    info for the model as it is on a machine without a GPU, where only GPU runs gain; a
    warning under `policy`, a plan for whichever machine trains it): a `Dense`'s units and
    input features, an `EinsumDense`'s K and N as its einsum lowers to a matmul (dimensions
    it keeps per head are batch dimensions), a convolution's filters and input channels (4
    suffice for an image's first convolution at stride >= 2), an attention's head sizes, and
    the output projection of an embedding called in reverse; an embedding lookup is a gather
    and has none. A float16 model compiled without a LossScaleOptimizer (error; info if not
    compiled, and an info, `keras-loss-scaling`, for a model compiled with Keras's `compile`
    under another policy and audited under `mixed_float16`, where Keras wraps it);
    variables stored in float16/bfloat16 (error: master weights must stay float32). A model
    that computes in float32 only gets a `float32-model` info: what the
    audit finds under `choose_policy()`'s recommendation. Layers quantized to float8 (Keras's
    `quantize("float8")`, as `model.quantize("float8")` does to every `Dense`), each judged
    once, as `float8_layers` would leave it out: a model output (error) or a softmax-like
    layer (warning), `float8-output-layer`; the model's first matmul layer (warning,
    `float8-first-layer`); a layer computing in float32 (warning, `float8-no-gain`); matmul
    dimensions not multiples of 16 (warning, `float8-misaligned`). On a machine without a GPU
    of compute capability 8.9 or later, float8 layers get a `float8-no-gain` info: float8 is
    emulated there.

    Args:
        model: `keras.Model` (a built model), or the path of a saved `.keras` (or legacy
            `.h5`) file. A file is read as it was saved: loaded under its model's own policy,
            compiled as Keras compiled it (its saved optimizer says whether Keras wrapped it
            in a `LossScaleOptimizer`), and never with code from the file: a file that holds
            code (a `Lambda` layer's bytecode) or needs classes from outside Keras and
            tfmixprec is refused. What its config declares is measured before anything is
            built (docs/guides/audit-in-ci.md): weights the file does not hold, past 256 MiB,
            are refused, and a call on zeros whose tensors would pass 256 MiB is not made
            (an `unobserved` info says so).
        policy: String. Audit as if the model had been built under this policy (`"auto"`
            allowed): layers that follow the model's own policy are assumed to follow this
            one; layers with a policy of their own keep it. `None` audits the model as it is,
            on this machine (it also says what is slow for it here, e.g. float16 on a CPU).
        hardware: `HardwareInfo`. The machine for those findings; detected when `None`.

    Returns:
        An `AuditReport`.

    Raises:
        TypeError: If `model` is not a `keras.Model` or a path.
        ValueError: If the model is not built, `policy` is unknown, or the file cannot be
            audited (missing, a directory, not a model, holds code, declares weights it does
            not hold, does not load).

    Example:

    >>> report = tfmixprec.audit(model)
    >>> print(report)
    """
    # The audit leaves the process as it found it: compiling a file's model through tfmixprec
    # turns grappler's remapper off on a CPU, loading one sets Keras's global policy for a
    # while, and reading the global policy sets it where it was unset.
    with settings_kept(), cpu_float16.process_state_kept():
        followers = skipped = None
        if isinstance(model, (str, os.PathLike)):
            model, followers, skipped = load_model_file(model)
        context = _context(model, policy, hardware, followers, skipped)
        return AuditReport(
            model=model.name,
            policy=context.policy or context.model_policy,
            findings=_run_checks(model, context),
            layers=[_layer_dtypes(layer, context) for layer in context.layers],
        )
