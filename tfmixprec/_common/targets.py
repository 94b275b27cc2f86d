"""Made-up targets that a compiled model's loss accepts: `tfmixprec bench --model` trains on
them, the audit's training call computes the loss on them.

A classifier compiled with `sparse_categorical_crossentropy` takes integer labels, one a
sample (the output's shape without its last axis); `categorical_crossentropy` one-hot rows;
a binary loss 0/1 targets; a regression loss values of the output's shape. The loss is read
from `model.loss` as `compile` got it: a name, a `keras.losses.Loss` object (its `fn`: the
same Keras function for `SparseCategoricalCrossentropy(from_logits=True)`), a function, or
one per output (a list, or a dict by output name). A loss that is not Keras's own gets zeros
of the output's shape (bench says so if the loss refuses them).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

__all__: list[str] = []  # private module: nothing here is part of the package's API

_SPARSE = (keras.losses.sparse_categorical_crossentropy,)
_ONE_HOT = (
    keras.losses.categorical_crossentropy,
    keras.losses.categorical_focal_crossentropy,
    keras.losses.categorical_hinge,
)
_BINARY = (
    keras.losses.binary_crossentropy,
    keras.losses.binary_focal_crossentropy,
    keras.losses.hinge,
    keras.losses.squared_hinge,
)


def made_up_targets(model: keras.Model, outputs: Any) -> tuple[Any, str]:
    """Targets for `model`'s compiled loss on `outputs` (the model's outputs on a batch, in
    their structure), and what they are in words (for an error that says how to fix a loss
    that refuses them)."""
    losses = _loss_per_output(getattr(model, "loss", None), outputs, model)
    flat = keras.tree.flatten(outputs)
    made = [_target(loss, output) for loss, output in zip(losses, flat)]
    targets = keras.tree.pack_sequence_as(outputs, [value for value, _ in made])
    return targets, "; ".join(dict.fromkeys(what for _, what in made))


def _loss_per_output(loss: Any, outputs: Any, model: keras.Model) -> list[Any]:
    """The loss of each output in `keras.tree.flatten(outputs)`'s order (None where there is
    none or it cannot be told)."""
    count = len(keras.tree.flatten(outputs))
    if isinstance(loss, list | tuple):
        return list(loss) if len(loss) == count else [None] * count
    if isinstance(loss, dict):
        if isinstance(outputs, dict):
            return [loss.get(key) for key in sorted(outputs)]  # keras.tree's order
        names = list(getattr(model, "output_names", None) or [])
        return [loss.get(name) for name in names] if len(names) == count else [None] * count
    return [loss] * count


def _target(loss: Any, output: Any) -> tuple[np.ndarray, str]:
    function = _function(loss)
    shape = tuple(output.shape)
    if function in _SPARSE:
        return np.zeros(shape[:-1], "int32"), "integer class labels (0), one a sample"
    if function in _ONE_HOT:
        rows = np.zeros(shape, "float32")
        rows[..., 0] = 1.0
        return rows, "one-hot rows (class 0)"
    if function in _BINARY:
        return np.zeros(shape, "float32"), "0/1 targets (0) shaped like the output"
    return np.zeros(shape, "float32"), "float32 zeros shaped like the output"


def _function(loss: Any) -> Any:
    """The Keras function behind `loss` (a name, a `Loss` object that wraps one, a
    function), or `loss` itself."""
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            return None
    return getattr(loss, "fn", loss)
