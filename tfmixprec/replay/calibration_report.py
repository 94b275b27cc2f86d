"""What `calibrate` returns: per leaf layer, its values and gradients (`LayerCalibration`), and the
report (`CalibrationReport`: the scale to start at, the float32 layers and why, its text and
table) with `apply`, which makes the change on the model (layers, loss, starting scale).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.layers import (
    all_layers,
    forget_traced_functions,
    layer_names,
    mark_float32,
)
from tfmixprec._common.text import jsonable, markdown_table
from tfmixprec._common.validate import check_bool
from tfmixprec._keras.losses import loss_dtype, set_loss_dtype
from tfmixprec.precision.policy import PolicyChange
from tfmixprec.replay.calibration_search import KERAS_START, MARGIN
from tfmixprec.replay.replayer import float32_policy, move_to_float32, warn_not_recorded
from tfmixprec.scaling.loss_scale import format_scale

__all__ = ["CalibrationReport", "LayerCalibration"]


@dataclasses.dataclass(frozen=True)
class LayerCalibration:
    """One leaf layer over the calibration batches.

    Attributes:
        layer: String. The layer's path in the model.
        compute_dtype: String. The dtype it computes in, as the model is.
        max_abs: Float. The largest finite |x| of its outputs in that dtype.
        nonfinite: Int. NaN/Inf values in its outputs in that dtype.
        float32_max_abs: Float. The largest |x| of its outputs with the model in float32.
        past_float16: Float. Share of those float32 outputs past float16's 65504.
        gradient_max: Float. The largest |gradient| of its variables (float32, unscaled; 0
            without variables).
        gradient_underflow: Float. Share of its gradient values that are not zero but fall
            below float16's smallest subnormal, 2^-24, once multiplied by `initial_scale`.
    """

    layer: str
    compute_dtype: str
    max_abs: float
    nonfinite: int
    float32_max_abs: float
    past_float16: float
    gradient_max: float
    gradient_underflow: float


@dataclasses.dataclass(frozen=True)
class CalibrationReport:
    """What `calibrate` found: the scale to start at, the layers to compute in float32, and
    the numbers behind them. `print` it, or `to_dict()` / `to_markdown()`.

    Attributes:
        initial_scale: Float. The largest power of two that keeps the largest gradient times
            the scale `MARGIN` (8) times under 65504 (the mixed-precision paper's rule), and
            verified finite on the batches with `float32_layers` applied. 1 for a model
            without a float16 layer (bfloat16 and float32 need no loss scale).
        float32_layers: Tuple of strings. The layers that must compute in float32, named by
            the layers they are nested in (`reasons` says why, one each). Empty when nothing
            overflows or comes within the 4x headroom (`HEADROOM`).
        reasons: Tuple of strings. Why each of `float32_layers` is there.
        cause: String. The first overflow found (`"none"`, `"forward-overflow"`,
            `"near-overflow"`: within the 4x headroom only, `"backward-overflow"`), or what no
            float32 layer fixes (`"bad-data"`, `"not-precision"`, explained by `problem`;
            `float32_layers` is then empty).
        problem: String or None. What neither the layers nor the scale can fix.
        gradient_max: Float. The largest |gradient| over the batches (float32, unscaled) of a
            layer that computes in float16 once `float32_layers` compute in float32.
        start_skips: Int or None. Steps a start at `initial_scale` skips on these batches
            (halvings until finite; None: not finite even at 1).
        keras_start_skips: Int or None. The same for a start at 2^15, Keras's default.
        batches: Int. The batches replayed.
        layers: Tuple of `LayerCalibration`, one per leaf layer in the order they ran.
        float32_loss: String or None. Why the loss must compute in float32 (cause
            `"loss-overflow"`: a `keras.losses.Loss` built with a float16 or bfloat16 dtype
            that overflows by itself; `apply` sets the compiled loss's dtype), or None.
    """

    initial_scale: float
    float32_layers: tuple[str, ...]
    reasons: tuple[str, ...]
    cause: str
    problem: str | None
    gradient_max: float
    start_skips: int | None
    keras_start_skips: int | None
    batches: int
    layers: tuple[LayerCalibration, ...]
    float32_loss: str | None = None

    def apply(self, model: keras.Model, set_scale: bool = True) -> list[PolicyChange]:
        """Makes `float32_layers` of `model` compute in float32 (and its compiled loss, where
        `float32_loss` says so) and starts its optimizer's loss scale at `initial_scale`.
        Everything is checked before anything changes.

        Args:
            model: `keras.Model`. The model calibrated (its layers are found by path).
            set_scale: Bool. Also start the optimizer's loss scale at `initial_scale` (a
                tfmixprec or Keras `LossScaleOptimizer` that has not taken a step yet).

        Returns:
            List of `PolicyChange(layer, old, new, why)`: one per layer changed, one named
            `"loss"` for the compiled loss's dtype, and one named `"loss_scale"` for the
            optimizer's starting scale.

        Raises:
            ValueError: If a layer of the report is not in `model`, the report computes the
                loss in float32 and the model's compiled loss is no `keras.losses.Loss`, or
                `set_scale` is True and the optimizer has taken steps already.
        """
        check_bool("set_scale", set_scale)
        layers = self._layers_of(model)
        loss = self._loss_of(model)
        restart = _scale_setter(model, self.initial_scale) if set_scale else None
        changes = [
            PolicyChange(path, layer.dtype_policy.name, float32_policy(layer).name, why)
            for (path, why), layer in zip(zip(self.float32_layers, self.reasons), layers)
            if layer.compute_dtype != "float32"
        ]
        recorded = move_to_float32(model, layers) if changes else True
        mark_float32(model, {c.layer: f"calibrate: {c.why}" for c in changes})
        if loss is not None and loss_dtype(loss) != "float32":
            changes.append(PolicyChange("loss", loss_dtype(loss), "float32", self.float32_loss))
            set_loss_dtype(loss, "float32")
            forget_traced_functions(model)
        if restart is not None:
            changes.append(restart())
        if not recorded:  # last: a warning turned error leaves nothing half-done
            warn_not_recorded(model, "calibrate", self.float32_layers)
        return changes

    def _loss_of(self, model: keras.Model) -> Any:
        """The compiled loss whose dtype `apply` sets (None: the report leaves the loss)."""
        if self.float32_loss is None:
            return None
        loss = getattr(model, "loss", None)
        if loss_dtype(loss) is None:
            raise ValueError(
                f"apply computes the loss in float32, but model {model.name!r} is compiled "
                f"with loss={loss!r}, which has no dtype of its own to set. Compile it with "
                "a keras.losses.Loss built with dtype='float32'."
            )
        return loss

    def _layers_of(self, model: keras.Model) -> list[Any]:
        keys = layer_names(model)
        found = {keys[id(layer)]: layer for layer in all_layers(model)}
        missing = [path for path in self.float32_layers if path not in found]
        if missing:
            raise ValueError(
                f"apply found no layer {missing[0]!r} in model {model.name!r}: the report is "
                "of another model. Call calibrate(model, data) on this model, then apply it."
            )
        return [found[path] for path in self.float32_layers]

    def to_dict(self) -> dict[str, Any]:
        """The report as plain Python values (JSON-ready: `inf`/`nan` as strings)."""
        return jsonable(dataclasses.asdict(self))

    def write_summary(self, log_dir: str, step: int = 0) -> None:
        """Writes the report (`to_markdown()`) as a `mixed_precision/calibration` text into
        `log_dir/train`, the run `tfmixprec.TensorBoard(log_dir)` writes: TensorBoard's Text
        tab shows it next to the training that follows.

        Args:
            log_dir: String. The TensorBoard log directory.
            step: Int. The step to show it at (0: before the first step).
        """
        writer = tf.summary.create_file_writer(os.path.join(log_dir, "train"))
        with writer.as_default(), tf.summary.record_if(True):
            tf.summary.text("mixed_precision/calibration", self.to_markdown(), step=step)
        writer.close()

    def to_markdown(self) -> str:
        """The verdict and a markdown table of the layers (for TensorBoard and issues)."""
        rows = [
            (
                f"`{r.layer}`",
                r.compute_dtype,
                f"{r.max_abs:.4g}",
                r.nonfinite,
                f"{r.float32_max_abs:.4g}",
                f"{r.past_float16:.2%}",
                f"{r.gradient_max:.3g}",
                f"{r.gradient_underflow:.2%}",
            )
            for r in self.layers
        ]
        header = ("layer", "dtype", "max |x|", "NaN/Inf", "max |x| float32", "past 65504")
        table = markdown_table((*header, "max |grad|", "grad underflow"), rows)
        return "\n".join([*str(self).splitlines(), "", *table])

    def __str__(self) -> str:
        lines = [f"initial_scale: {format_scale(self.initial_scale)} ({self._skips_line()})"]
        if self.float32_layers:
            lines.append(f"float32_layers ({self.cause}):")
            lines += [f"  {p}: {why}" for p, why in zip(self.float32_layers, self.reasons)]
        else:
            none = " (nothing overflows in these batches)" if self.cause == "none" else ""
            lines.append(f"float32_layers: none{none}")
        if self.float32_loss is not None:
            lines.append(f"float32_loss: {self.float32_loss}")
        if self.problem is not None:
            lines.append(f"not fixed by float32 layers ({self.cause}): {self.problem}")
        return "\n".join(lines)

    def _skips_line(self) -> str:
        def skips(count: int | None) -> str:
            return "no finite scale" if count is None else f"{count} skipped"

        return (
            f"largest gradient {self.gradient_max:.3g}; steps skipped at the start on "
            f"{self.batches} batches: {skips(self.start_skips)}, from Keras's "
            f"{format_scale(KERAS_START)}: {skips(self.keras_start_skips)}"
        )


def _scale_setter(model: keras.Model, scale: float) -> Callable[[], PolicyChange] | None:
    """Checks that `model`'s optimizer can start at `scale`; returns the change to make (None:
    no loss-scaling optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    if not hasattr(optimizer, "inner_optimizer"):
        return None
    reader = getattr(optimizer, "read_state", None)  # tfmixprec's counts skipped steps too
    steps = reader()["step"] if reader is not None else int(np.asarray(optimizer.iterations))
    if steps:
        raise ValueError(
            f"apply starts the loss scale before the first step, but the optimizer of model "
            f"{model.name!r} has taken {steps} steps. Pass set_scale=False to change the "
            "layers only."
        )
    config = getattr(optimizer, "loss_scale_config", None)
    if config is not None:  # the config's own checks, before anything changes
        try:
            dataclasses.replace(config, initial_scale=scale)
        except ValueError as err:
            raise ValueError(
                f"apply would start the loss scale at {format_scale(scale)}, outside the "
                f"optimizer's [min_scale, max_scale] = [{config.min_scale:g}, "
                f"{config.max_scale:g}]: calibrate the model with this optimizer (its bounds "
                f"are read then), or pass set_scale=False. ({err})"
            ) from err
    old = _current_scale(optimizer)

    def change() -> PolicyChange:
        _start_scale(optimizer, scale)
        why = f"the largest gradient times it stays {MARGIN:g}x under float16's 65504"
        return PolicyChange("loss_scale", format_scale(old), format_scale(scale), why)

    return change


def _current_scale(optimizer: Any) -> float:
    """The loss scale of a tfmixprec or Keras `LossScaleOptimizer` (Keras's before `build`:
    its `initial_scale`)."""
    if hasattr(optimizer, "loss_scale_config"):
        return float(np.asarray(optimizer.loss_scale))
    variable = getattr(optimizer, "dynamic_scale", None)
    return float(np.asarray(variable)) if variable is not None else float(optimizer.initial_scale)


def _start_scale(optimizer: Any, scale: float) -> None:
    if hasattr(optimizer, "loss_scale_config"):
        optimizer.start_at(scale)
    elif getattr(optimizer, "dynamic_scale", None) is not None:  # Keras's, built
        optimizer.dynamic_scale.assign(scale)
    else:  # Keras's, before `build`: read by `build`
        optimizer.initial_scale = scale
