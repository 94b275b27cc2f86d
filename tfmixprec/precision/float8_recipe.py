"""float8 in one form: the recipe that decides which layers are quantized and how (alignment,
the roles that keep a layer out, each quantized tensor with its format and largest value),
the one counting primitive of what quantizing does to a tensor (`quantization_counts`), and
the one statistics type its readers give (`Float8TensorStats`, per layer `Float8LayerStats`).

`precision.float8` (the plan and the in-step counters), `checks.audit` (the float8 findings),
`replay.diagnosis` (a replay's float8 layers) and the readers all read `RECIPE`, so they
cannot disagree; a share of no values is nan in every reader."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.dtypes import FLOAT8_MAX
from tfmixprec.precision.policy import float32_reason

__all__ = [
    "Float8LayerStats",
    "Float8Recipe",
    "Float8Tensor",
    "Float8TensorStats",
]  # and quantization_counts, offered as `tfmixprec.float8.quantization_counts`


@dataclasses.dataclass(frozen=True)
class Float8Tensor:
    """One tensor a float8 layer quantizes, as Keras's float8 layers keep it.

    Attributes:
        name: String. `"inputs"`, `"kernel"` or `"outputs_grad"`.
        scale: String. The layer's variable holding its scale (a value is divided by it).
        amax_history: String. The layer's variable holding its amax history.
        format: String. The float8 format: `"float8_e4m3fn"` or `"float8_e5m2"`.
    """

    name: str
    scale: str
    amax_history: str
    format: str

    @property
    def maximum(self) -> float:
        """The format's largest finite value (448 for e4m3fn, 57344 for e5m2)."""
        return FLOAT8_MAX[self.format]


# A layer's roles that keep it out of float8, with how `float8_reason` says so.
ROLES = {
    "output": "makes a model output",
    "softmax": "a softmax-like layer",
    "first": "the model's first layer (its first matmul)",
}


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """The float8 recipe: what `float8_layers` quantizes, what the audit checks a float8
    layer against, and what the statistics count. One value (`RECIPE`) that all of them
    read, kept the way Transformer Engine keeps its recipes.

    Attributes:
        alignment: Int. Both matmul dimensions of a float8 layer must be multiples of it
            (16: Transformer Engine's float8 GEMMs).
        excluded_roles: Tuple of strings. The roles that keep a layer out of float8, in the
            order they are reported: `"output"` (it makes a model output), `"softmax"` (a
            softmax-like activation reads its result), `"first"` (the model's first matmul
            layer, which would quantize the model's inputs).
        tensors: Tuple of `Float8Tensor`. The tensors a float8 layer quantizes: its inputs
            and kernel in e4m3, its output gradient in e5m2 (Keras's, and Transformer
            Engine's HYBRID format).
    """

    alignment: int = 16
    excluded_roles: tuple[str, ...] = ("output", "softmax", "first")
    tensors: tuple[Float8Tensor, ...] = (
        Float8Tensor("inputs", "inputs_scale", "inputs_amax_history", "float8_e4m3fn"),
        Float8Tensor("kernel", "kernel_scale", "kernel_amax_history", "float8_e4m3fn"),
        Float8Tensor(
            "outputs_grad", "outputs_grad_scale", "outputs_grad_amax_history", "float8_e5m2"
        ),
    )

    def __post_init__(self) -> None:
        if isinstance(self.alignment, bool) or not isinstance(self.alignment, int):
            raise TypeError(
                f"alignment must be a positive int. Received: alignment={self.alignment!r}"
            )
        if self.alignment < 1:
            raise ValueError(
                f"alignment must be a positive int. Received: alignment={self.alignment!r}"
            )
        unknown = [role for role in self.excluded_roles if role not in ROLES]
        if unknown:
            raise ValueError(
                f"excluded_roles holds unknown roles {unknown!r}: use some of {list(ROLES)}."
            )
        formats = [t.format for t in self.tensors if t.format not in FLOAT8_MAX]
        if formats:
            raise ValueError(
                f"tensors use unknown float8 formats {formats!r}: use {sorted(FLOAT8_MAX)}."
            )

    def tensor(self, name: str) -> Float8Tensor:
        """The quantized tensor called `name` (`"inputs"`, `"kernel"`, `"outputs_grad"`)."""
        for tensor in self.tensors:
            if tensor.name == name:
                return tensor
        raise ValueError(
            f"a float8 layer quantizes {[t.name for t in self.tensors]}, not {name!r}."
        )

    def excluded_role(self, layer: Any, *, output: bool, first: bool) -> str | None:
        """The first of `excluded_roles` that `layer` has (None: none of them). `output`
        and `first`: whether it makes a model output, whether it is the first matmul layer."""
        has = {"output": output, "softmax": float32_reason(layer) is not None, "first": first}
        return next((role for role in self.excluded_roles if has[role]), None)

    def misaligned(self, dims: Sequence[int]) -> list[int]:
        """The sizes among `dims` that are not multiples of `alignment`."""
        return [size for size in dims if size % self.alignment]


RECIPE = Float8Recipe()


def quantization_counts(x: Any, scale: Any, fmt: str) -> tf.Tensor:
    """How many values of `x` saturate and how many are zero once quantized to `fmt` with
    `scale`, as Keras's float8 layers quantize: `x / scale` in `x`'s dtype, clipped at the
    format's largest value, cast to float8. Saturated and zero are Transformer Engine's
    "overflows" and "underflows" (a value that is zero to begin with counts as zero); flushed
    are the values that were not zero and are once quantized (what float8 lost).

    Args:
        x: Tensor. The values to quantize.
        scale: Scalar. The scale (Keras's; Transformer Engine's `scale_inv`).
        fmt: String. `"float8_e4m3fn"` or `"float8_e5m2"`.

    Returns:
        int64 Tensor `[values, saturated, zero, flushed]`.

    Example:

    >>> x = tf.constant([0.0, 1e-6, 1.0, 500.0])
    >>> tfmixprec.float8.quantization_counts(x, 1.0, "float8_e4m3fn").numpy().tolist()
    [4, 1, 2, 1]
    """
    if fmt not in FLOAT8_MAX:
        raise ValueError(f"fmt must be one of {sorted(FLOAT8_MAX)}. Received: fmt={fmt!r}")
    x = tf.convert_to_tensor(x)
    scaled = x / tf.cast(scale, x.dtype)
    saturated = tf.abs(tf.cast(scaled, tf.float32)) > FLOAT8_MAX[fmt]
    zero = tf.equal(keras.quantizers.quantize_and_dequantize(x, scale, fmt, x.dtype), 0)
    return tf.stack(
        [
            tf.size(x, out_type=tf.int64),
            tf.math.count_nonzero(saturated, dtype=tf.int64),
            tf.math.count_nonzero(zero, dtype=tf.int64),
            tf.math.count_nonzero(zero & tf.not_equal(x, 0), dtype=tf.int64),
        ]
    )


@dataclasses.dataclass(frozen=True)
class Float8TensorStats:
    """What quantizing one tensor of a float8 layer did: over the training steps counted
    (`float8_stats`), or in a replay of one step (`explain_overflow`). Quantizing is Keras's:
    `x / scale` in `x`'s dtype, clipped at the format's largest value, cast to float8. The
    counts are `quantization_counts`'s.

    Attributes:
        format: String. `"float8_e4m3fn"` (inputs, kernel) or `"float8_e5m2"` (the output
            gradient).
        scale: Float. The scale (Keras's: a value is divided by it; Transformer Engine's
            `scale_inv`): the layer's scale variable now (`float8_stats`), or the one the
            replay quantized with.
        amax: Float. The largest magnitude: in the amax history, which the next scale
            follows (`float8_stats`), or of the tensor in the replay, as its amax history
            would record it (`inf` or `nan` where the tensor holds one).
        values: Int. Values quantized.
        saturated: Int. Of those, the ones past the format's largest value at the scale
            (clipped there; an Inf among them): Transformer Engine's overflows.
        zero: Int. Of those, the ones that were zero once quantized (Transformer Engine's
            underflows: zeros to begin with included).
        flushed: Int. Of those, the ones that were not zero and were once quantized.
        history_moved: Bool. False when the amax history is still all zeros although the
            optimizer applied steps: the scale then never leaves its start (1.0). Keras
            updates the histories through the gradient, so a layer whose output never reaches
            the loss, or one called without `training=True`, keeps them at zero. Always True
            in a replay.

    A fraction of no values (nothing was quantized: no gradient reached the layer's output,
    or no training step ran) is `nan`: there is no share to give.
    """

    format: str
    scale: float
    amax: float
    values: int
    saturated: int
    zero: int
    flushed: int
    history_moved: bool = True

    def _share(self, count: int) -> float:
        return count / self.values if self.values else float("nan")

    @property
    def saturated_fraction(self) -> float:
        """Share of the values that saturated (nan when none were counted)."""
        return self._share(self.saturated)

    @property
    def underflow_fraction(self) -> float:
        """Share of the values that were zero once quantized (nan when none were counted)."""
        return self._share(self.zero)

    @property
    def flushed_fraction(self) -> float:
        """Share of the values that were not zero and were once quantized (nan when none were
        counted)."""
        return self._share(self.flushed)

    def since(self, earlier: Float8TensorStats) -> Float8TensorStats:
        """These counts less `earlier`'s (the scale, amax and history as now)."""
        return dataclasses.replace(
            self,
            values=self.values - earlier.values,
            saturated=self.saturated - earlier.saturated,
            zero=self.zero - earlier.zero,
            flushed=self.flushed - earlier.flushed,
        )

    def describe(self) -> str:
        """What went wrong only: `"12.50% saturated (past 57344 x scale 1), amax 1.2e+05"`."""
        parts = []
        if self.saturated:
            limit = f"{FLOAT8_MAX[self.format]:g} x scale {self.scale:.4g}"
            parts.append(f"{self.saturated_fraction:.2%} saturated (past {limit})")
        if self.flushed:
            parts.append(f"{self.flushed_fraction:.2%} flushed to 0 at scale {self.scale:.4g}")
        return f"{' and '.join(parts)}, amax {self.amax:.4g}"


def percent(fraction: float) -> str:
    """A share as the tables print it: `"12.50%"`, or `"-"` for the share of no values."""
    return "-" if math.isnan(fraction) else f"{fraction:.2%}"


@dataclasses.dataclass(frozen=True)
class Float8LayerStats:
    """One float8 layer's `Float8TensorStats` (`layer`: its name, or its path where the model
    has another layer of that name): `inputs` and `kernel` (e4m3), `outputs_grad` (e5m2)."""

    layer: str
    inputs: Float8TensorStats
    kernel: Float8TensorStats
    outputs_grad: Float8TensorStats

    def tensors(self) -> dict[str, Float8TensorStats]:
        return {t.name: getattr(self, t.name) for t in RECIPE.tensors}

    def since(self, earlier: Float8LayerStats) -> Float8LayerStats:
        """The counts since `earlier` (a read of the same layer)."""
        mine, theirs = self.tensors(), earlier.tensors()
        return Float8LayerStats(self.layer, **{n: mine[n].since(theirs[n]) for n in mine})
