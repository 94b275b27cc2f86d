"""What `explain_overflow` returns: the verdict on one replayed batch (`OverflowDiagnosis`: one of
`CAUSES`, the layer, the message and the numbers behind them), each layer in the replay
(`LayerReplay`) and each float8 layer whose quantization saturated or flushed values
(`Float8Replay`), with their text, markdown and JSON forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tfmixprec._common.text import jsonable, markdown_table
from tfmixprec.precision import float8_recipe
from tfmixprec.precision.float8_recipe import (
    Float8TensorStats,
    percent,
)
from tfmixprec.scaling.loss_scale import format_scale

__all__ = ["Float8Quantized", "Float8Replay", "LayerReplay", "OverflowDiagnosis"]


CAUSES = (
    "bad-data",
    "model-code",
    "forward-overflow",
    "loss-overflow",
    "backward-overflow",
    "underflow",
    "none",
)


@dataclasses.dataclass(frozen=True)
class LayerReplay:
    """One layer in the replay, in the order the forward pass ran it.

    Attributes:
        layer: String. The layer's name.
        compute_dtype: String. The dtype it computes in.
        max_abs: Float. The largest finite |x| of its output (in its compute dtype).
        nan: Int. NaN values in its output. inf: Int. Inf values in its output.
        float32_max_abs: Float. The largest |x| of its output in the float32 replay (`inf`
            when not finite even in float32).
        gradient_nonfinite: Int. Non-finite values in the gradients of its variables at the
            replayed scale.
        gradient_underflow: Float. Share of its scaled gradients (measured in float32) below
            2^-24.
    """

    layer: str
    compute_dtype: str
    max_abs: float
    nan: int
    inf: int
    float32_max_abs: float
    gradient_nonfinite: int = 0
    gradient_underflow: float = 0.0


# 0.4.0's name of the replay's statistics type: the one `Float8TensorStats` now.
Float8Quantized = Float8TensorStats


@dataclasses.dataclass(frozen=True)
class Float8Replay:
    """A float8 layer whose quantization saturated or flushed values in the replay.

    Attributes:
        layer: String. The layer's name.
        policy: String. Its dtype policy (`"float8_from_mixed_float16"`, ...).
        inputs: `Float8TensorStats`. Its inputs (e4m3, at `inputs_scale`).
        kernel: `Float8TensorStats`. Its kernel (e4m3, at `kernel_scale`).
        outputs_grad: `Float8TensorStats`. The gradient of the scaled loss at its output (e5m2,
            at `outputs_grad_scale`), the one the step quantizes.
    """

    layer: str
    policy: str
    inputs: Float8TensorStats
    kernel: Float8TensorStats
    outputs_grad: Float8TensorStats

    def tensors(self) -> dict[str, Float8TensorStats]:
        return {t.name: getattr(self, t.name) for t in float8_recipe.RECIPE.tensors}

    def __str__(self) -> str:
        found = [
            f"{name} ({tensor.format[7:]}) {tensor.describe()}"
            for name, tensor in self.tensors().items()
            if tensor.saturated or tensor.flushed
        ]
        return f"float8 layer {self.layer!r}: " + "; ".join(found)


@dataclasses.dataclass(frozen=True)
class OverflowDiagnosis:
    """What the replay of one batch found: the cause, the layer, and the numbers behind them.

    Attributes:
        cause: String. One of `CAUSES` (each explained in the docstring of
            `tfmixprec.replay.diagnosis`).
        layer: String or None. The first layer where the cause appears.
        message: String. What happened and what to do, in a sentence or two.
        loss_scale: Float. The scale replayed.
        loss: Float. The batch's loss (float32).
        scaled_loss: Float. `loss * loss_scale`, in float32.
        halvings: Int or None. For `backward-overflow`: how many halvings of the scale made
            the gradients finite (None if not even at a scale of 1).
        finite_scale: Float or None. The scale at which they were finite.
        underflow_fraction: Float. Share of all scaled gradients (float32) below 2^-24.
        layers: Tuple of `LayerReplay`, in forward order.
        float8: Tuple of `Float8Replay`: where the step overflowed, the float8 layers whose
            quantization saturated or flushed values in the replay, with the scales they had
            (empty for a model without float8 layers).
    """

    cause: str
    layer: str | None
    message: str
    loss_scale: float
    loss: float
    scaled_loss: float
    halvings: int | None
    finite_scale: float | None
    underflow_fraction: float
    layers: tuple[LayerReplay, ...]
    float8: tuple[Float8Replay, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The diagnosis as plain Python values (JSON-ready: `inf`/`nan` as strings)."""
        return jsonable(dataclasses.asdict(self))

    def to_markdown(self) -> str:
        """A short verdict and a markdown table of the layers (for TensorBoard and issues)."""
        head = f"**{self.cause}**" + (f" in `{self.layer}`" if self.layer else "")
        lines = [
            f"{head}: {self.message}",
            "",
            f"loss scale {format_scale(self.loss_scale)}, loss {self.loss:.6g}, "
            f"underflow {self.underflow_fraction:.2%}",
            "",
        ]
        header = ("layer", "dtype", "max finite abs", "NaN", "Inf", "max abs (float32)")
        rows = [
            (r.layer, r.compute_dtype, f"{r.max_abs:.4g}", r.nan, r.inf, f"{r.float32_max_abs:.4g}")
            + (r.gradient_nonfinite,)
            for r in self.layers
        ]
        lines += markdown_table((*header, "grad non-finite"), rows)
        return "\n".join(lines + _float8_table(self.float8))

    def __str__(self) -> str:
        where = f" in layer {self.layer!r}" if self.layer else ""
        return "\n".join([f"{self.cause}{where}: {self.message}", *map(str, self.float8)])


def _float8_table(records: Sequence[Float8Replay]) -> list[str]:
    """The float8 layers' quantization in the replay, one row a tensor (none: no lines)."""
    if not records:
        return []
    rows = [
        (r.layer, name, t.format, f"{t.scale:.4g}", f"{t.amax:.4g}", t.values)
        + (percent(t.saturated_fraction), percent(t.flushed_fraction))
        for r in records
        for name, t in r.tensors().items()
    ]
    header = ("float8 layer", "tensor", "format", "scale", "amax", "values", "saturated")
    intro = (
        "float8 quantization in the replay (the scales as they are; the scaled loss's gradient):"
    )
    return ["", intro, "", *markdown_table((*header, "flushed to 0"), rows)]
