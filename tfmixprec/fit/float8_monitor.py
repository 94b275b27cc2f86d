"""`Float8Monitor`: what float8 quantization did to each float8 layer, read every
`update_freq` steps during `fit` (`Float8Reader`, the reads the callbacks share)."""

from __future__ import annotations

import warnings
from typing import Any

import keras

from tfmixprec._common.cadence import Every
from tfmixprec._common.text import docs_page
from tfmixprec._common.validate import check_int_at_least_one
from tfmixprec._keras.fit import make_train_function
from tfmixprec.precision.float8 import Float8LayerStats, applied_steps, float8_stats, watch_float8

__all__ = ["Float8Monitor"]


_FROZEN_SAID = "_tfmixprec_float8_frozen_said"  # on a model: the histories already said


class Float8Reader:
    """One callback's reads of a model's float8 layers: the layers watched when `fit` starts
    (the train function retraced if a layer was not), and each read as the counts since the
    previous one. An amax history that never moved is said once per model (a warning)."""

    def __init__(self) -> None:
        self.model: Any = None
        self._last: dict[str, Float8LayerStats] = {}

    def start(self, model: keras.Model) -> bool:
        """From `on_train_begin`: watches `model`'s float8 layers; returns whether it has any."""
        self.model = model
        if watch_float8(model):
            make_train_function(model)  # the fit in progress calls the new one
        self._last = {s.layer: s for s in float8_stats(model)}
        return bool(self._last)

    def read(self) -> list[Float8LayerStats]:
        """The stats of each float8 layer since the previous read (one host read)."""
        now = float8_stats(self.model)
        interval = [s.since(self._last[s.layer]) if s.layer in self._last else s for s in now]
        self._last = {s.layer: s for s in now}
        self._say_frozen(now)
        return interval

    def _say_frozen(self, stats: list[Float8LayerStats]) -> None:
        said = self.model.__dict__.setdefault(_FROZEN_SAID, set())
        for layer in stats:
            for name, tensor in layer.tensors().items():
                if not tensor.history_moved and (layer.layer, name) not in said:
                    said.add((layer.layer, name))
                    warnings.warn(
                        f"float8 layer {layer.layer!r}: its {name} amax history is still all "
                        f"zeros after {applied_steps(self.model)} applied steps, so its "
                        f"{name} scale stays at {tensor.scale:g}{_why_frozen(layer)}. "
                        f"{docs_page('guides/float8')}",
                        stacklevel=3,
                    )


def _int_at_least_one(value: Any) -> bool:
    try:
        check_int_at_least_one("update_freq", value)
    except ValueError:
        return False
    return True


def _why_frozen(layer: Float8LayerStats) -> str:
    """What a frozen history says of the layer: never called with `training=True` (no values
    counted), or its output never reaches the loss."""
    if layer.inputs.values == 0:
        return (
            " (no training call quantized anything here: a model whose call does not pass "
            "`training` on to its layers runs them as in inference)"
        )
    if layer.outputs_grad.values == 0:
        return " (no gradient reaches its output)"
    return ""


@keras.saving.register_keras_serializable(package="tfmixprec")
class Float8Monitor(keras.callbacks.Callback):
    """Every `update_freq` steps (or at each epoch's end), reads what float8 quantization did
    to each float8 layer since the last read: the three scales and amaxes, and the shares of
    values that saturated and that were zero once quantized (`float8_stats`). The counts are
    kept in the step, in variables; the callback reads them only when due.

    Layers quantized otherwise than by `float8_layers` (`model.quantize("float8")`) are
    watched from the start of `fit` (the train function is traced again once). An amax
    history still all zeros after applied steps is a warning, once per model.

    Args:
        update_freq: `"epoch"` or Int >= 1. When to read.

    Attributes:
        history: List of `(step, [Float8LayerStats, ...])`, one per read: the 1-based number
            of steps of this `fit` (the epoch with `"epoch"`), and the counts since the
            previous read.

    Raises:
        ValueError: If `update_freq` is not `"epoch"` or an integer >= 1.

    Example:

    >>> monitor = tfmixprec.Float8Monitor()
    >>> history = model.fit(x, y, callbacks=[monitor], verbose=0)
    >>> step, layers = monitor.history[-1]  # one Float8LayerStats per float8 layer
    """

    def __init__(self, update_freq: int | str = "epoch") -> None:
        super().__init__()
        if update_freq != "epoch" and (
            isinstance(update_freq, str) or not _int_at_least_one(update_freq)
        ):
            raise ValueError(
                'update_freq must be "epoch" or an integer >= 1. '
                f"Received: update_freq={update_freq!r}"
            )
        self.update_freq = update_freq
        self.history: list[tuple[int, list[Float8LayerStats]]] = []
        self._reader = Float8Reader()
        self._every = Every(1 if update_freq == "epoch" else update_freq)

    def get_config(self) -> dict[str, Any]:
        return {"update_freq": self.update_freq}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Float8Monitor:
        return cls(**config)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._reader.start(self.model)
        self._every.start()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._every.epoch_begin()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._every.due(batch) and self.update_freq != "epoch":
            self.history.append((self._every.steps, self._reader.read()))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.update_freq == "epoch":
            self.history.append((epoch + 1, self._reader.read()))
