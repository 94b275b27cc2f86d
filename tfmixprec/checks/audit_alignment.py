"""The audit's Tensor Core sizes (`tensor-core-alignment`): the N and K of the matmul each
float16/bfloat16 layer lowers to (a `Dense`'s, an `EinsumDense`'s, a convolution's, an
attention's heads, an embedding's reverse projection), reported where padding them to a
multiple of 8 pays.
"""

from __future__ import annotations

import math
from typing import Any

import keras

from tfmixprec._common.observe import (
    LayerCall,
)
from tfmixprec.checks.audit_context import AuditContext
from tfmixprec.checks.audit_report import Finding
from tfmixprec.precision import float8
from tfmixprec.precision.policy import (
    LOW_PRECISION,
)

__all__: list[str] = []


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
IMAGE_INPUT = "input channels (a first convolution's, at stride >= 2)"


def _alignment(what: str) -> int:
    return IMAGE_CHANNELS if what == IMAGE_INPUT else ALIGNMENT


def padded_size(n: int, alignment: int = ALIGNMENT) -> int:
    return int(math.ceil(n / alignment) * alignment)


def _sizes_to_align(layer: Any, context: AuditContext) -> list[tuple[str, int, int]]:
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


def _convolution_sizes(layer: Any, context: AuditContext) -> list[tuple[str, int, int]]:
    """A convolution's filters and input channels (per group, for a grouped convolution: each
    group is a convolution of its own). NVIDIA's guide: multiples of 8 for float16, except the
    first layer of a CNN on 3-channel images, where 4 suffice at a stride of 2 or more
    (reported against 4 there: `padded_size` rounds to the size's own alignment): a convolution
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


def _reverse_projection_sizes(layer: Any, context: AuditContext) -> list[tuple[str, int]]:
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


def tensor_core_alignment(layer: Any, context: AuditContext) -> list[Finding]:
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
        padded = padded_size(size, alignment)
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
