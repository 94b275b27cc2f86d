"""Which layers' gradients were not finite: the overflow attribution the step keeps, per layer.

The finite check of each step already reduces every gradient once; on an overflow step the
loss-scale unit keeps, per variable, how many overflow steps its gradient was not finite in
and the last one (optimizer variables: checkpointed, and the same on every replica because the
flags are all-reduced). This module only reads them: `overflow_report(model)` (or
`optimizer.overflow_report()`) maps the variables to their layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras

from tfmixprec._common.layers import variable_owners
from tfmixprec._common.text import markdown_table
from tfmixprec._keras.float8 import float8_variable_role

__all__ = ["LayerOverflows", "OverflowReport", "overflow_report"]


@dataclasses.dataclass(frozen=True)
class LayerOverflows:
    """One layer's part in the overflow steps so far.

    Attributes:
        layer: String. The layer's name (with `optimizer.overflow_report()`, the path of its
            variables, e.g. `"sequential/dense"`).
        overflow_steps: Int. Overflow steps in which a gradient of this layer held an Inf or
            NaN (the most of any of its variables).
        last_step: Int. The last of them (0-based, skipped steps counted, as the loss-scale
            counters number steps).
        variables: Tuple of strings. The paths of its variables whose gradients were not
            finite at least once.
        float8: Tuple of strings. For a float8 layer, which of those variables belong to its
            float8 quantization, by role (`"outputs_grad amax history"`): Keras keeps each
            quantized tensor's scale and amax history as variables whose "gradient" is
            their new value, so an Inf in the tensor quantized (the output gradient of the
            scaled loss, say) lands in its amax history.
    """

    layer: str
    overflow_steps: int
    last_step: int
    variables: tuple[str, ...]
    float8: tuple[str, ...] = ()

    def labels(self) -> list[str]:
        """Each of `variables` as a report shows it: a float8 one with its role."""
        roles = {role.replace(" ", "_"): role for role in self.float8}
        return [
            f"`{path}` (float8 {roles[path.rsplit('/', 1)[-1]]})"
            if path.rsplit("/", 1)[-1] in roles
            else f"`{path}`"
            for path in self.variables
        ]


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """Per layer, how many overflow steps its gradients took part in, most first.

    Attributes:
        overflow_steps: Int. All overflow (skipped) steps so far.
        last_overflow_step: Int. The last overflow step (0-based, skipped steps counted), or
            -1 if none.
        layers: Tuple of `LayerOverflows`, one for each layer with a non-finite gradient, the
            most overflow steps first (ties: the most recent first).
    """

    overflow_steps: int
    last_overflow_step: int
    layers: tuple[LayerOverflows, ...]

    @property
    def last_overflow_layers(self) -> list[str]:
        """The layers whose gradients were not finite at the last overflow step."""
        last = self.last_overflow_step
        return [row.layer for row in self.layers if last >= 0 and row.last_step == last]

    def to_dict(self) -> dict[str, Any]:
        """The report as plain Python values (JSON-ready)."""
        return {
            "overflow_steps": self.overflow_steps,
            "last_overflow_step": self.last_overflow_step,
            "last_overflow_layers": self.last_overflow_layers,
            "layers": [
                dataclasses.asdict(row)
                | {"variables": list(row.variables)}
                | {"float8": list(row.float8)}
                for row in self.layers
            ],
        }

    def to_markdown(self) -> str:
        """A markdown table, one row a layer (for TensorBoard text summaries and issues)."""
        rows = [
            (r.layer, r.overflow_steps, r.last_step, ", ".join(r.labels())) for r in self.layers
        ]
        lines = [f"**{_steps(self.overflow_steps)}**, last at step {self.last_overflow_step}", ""]
        lines += markdown_table(("layer", "overflow steps", "last step", "variables"), rows)
        return "\n".join(lines)

    def __str__(self) -> str:
        if self.overflow_steps == 0:
            return "No overflow steps so far."
        if not self.layers:
            return (
                f"{_steps(self.overflow_steps)}, none attributed to a layer (they came "
                "from gradients outside the optimizer's variables, or before attribution)."
            )
        width = max(len(row.layer) for row in self.layers)
        lines = [
            f"{_steps(self.overflow_steps)}; at the last (step {self.last_overflow_step}) "
            f"gradients were not finite in: {', '.join(self.last_overflow_layers) or '-'}",
            f"  {'layer':<{width}}  overflow steps  last step",
        ]
        for row in self.layers:
            lines.append(f"  {row.layer:<{width}}  {row.overflow_steps:>14}  {row.last_step:>9}")
        for row in self.layers:
            if row.float8:
                lines.append(
                    f"  {row.layer}: the float8 {', '.join(row.float8)} was not finite (Keras "
                    "keeps the largest |x| of the tensor quantized as its gradient)"
                )
        return "\n".join(lines)


def _steps(count: int) -> str:
    return f"{count} overflow step{'' if count == 1 else 's'}"


def _path_layer(variable: Any) -> str:
    path = getattr(variable, "path", None) or variable.name
    return path.rsplit("/", 1)[0] if "/" in path else path


def build_report(
    variables: Sequence[Any],
    counts: Sequence[int],
    last_steps: Sequence[int],
    overflow_steps: int,
    last_overflow_step: int,
    model: keras.Model | None = None,
) -> OverflowReport:
    """Groups per-variable counts by layer (internal: the optimizer passes its state).

    Args:
        variables: The optimizer's variables, in its order.
        counts: Per variable, the overflow steps its gradient was not finite in.
        last_steps: Per variable, the last such step, or -1.
        overflow_steps: All overflow steps so far.
        last_overflow_step: The last of them, or -1.
        model: The model whose layer names to use, or `None` for variable paths.
    """
    owners = {} if model is None else variable_owners(model)
    rows: dict[str, dict[str, Any]] = {}
    for variable, count, last in zip(variables, counts, last_steps):
        if count <= 0:
            continue
        owner = owners.get(id(variable))
        name = owner.name if owner is not None else _path_layer(variable)
        row = rows.setdefault(name, {"count": 0, "last": -1, "variables": [], "float8": []})
        row["count"] = max(row["count"], int(count))
        row["last"] = max(row["last"], int(last))
        row["variables"].append(getattr(variable, "path", None) or variable.name)
        role = float8_variable_role(variable)
        row["float8"] += [role] if role is not None else []
    layers = [
        LayerOverflows(
            name, row["count"], row["last"], tuple(row["variables"]), tuple(row["float8"])
        )
        for name, row in rows.items()
    ]
    layers.sort(key=lambda row: (-row.overflow_steps, -row.last_step))
    return OverflowReport(overflow_steps, last_overflow_step, tuple(layers))


def overflow_report(model: Any) -> OverflowReport:
    """Per layer, how many overflow steps its gradients took part in, and the last one.

    Reads the attribution the optimizer keeps in every step (no replay, one host read).

    Args:
        model: A `keras.Model` compiled with a tfmixprec `LossScaleOptimizer` (or that
            optimizer itself, reported by variable paths).

    Returns:
        An `OverflowReport` (printable; `to_dict()`, `to_markdown()`).

    Raises:
        TypeError: If there is no tfmixprec `LossScaleOptimizer` to read.

    Example:

    >>> report = tfmixprec.overflow_report(model)
    >>> report.last_overflow_layers
    []
    """
    optimizer = getattr(model, "optimizer", None) if isinstance(model, keras.Model) else model
    reader = getattr(optimizer, "overflow_sources", None)
    if reader is None:
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            what = "Keras's own keras.optimizers.LossScaleOptimizer"
        else:
            what = "None (not compiled)" if optimizer is None else type(optimizer).__name__
        raise TypeError(
            "overflow_report reads the attribution a tfmixprec.LossScaleOptimizer keeps. "
            f"Received: {type(model).__name__} whose optimizer is {what}. Compile with "
            "tfmixprec.LossScaleOptimizer(...) or use tfmixprec.MixedPrecisionModel. (A "
            "bfloat16 or float32 model needs no loss scaling, and without it no step is "
            "skipped: a fixed scale, tfmixprec.LossScaleOptimizer(opt, initial_scale=1, "
            "dynamic=False), skips and attributes the non-finite ones.)"
        )
    owner = model if isinstance(model, keras.Model) else None
    return optimizer.overflow_report(owner)
