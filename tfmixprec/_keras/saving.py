"""A `.keras` archive as Keras's saving library lays it out, for the audit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

# Why: `declared_model` builds a legacy .h5 file's config the way Keras's own legacy loader
# does (its `saving_utils.model_from_config`): the public deserializer takes Keras 3 configs
# only.
from keras.src.legacy.saving.saving_utils import model_from_config

__all__: list[str] = []  # private module: nothing here is part of the package's API


# Why: the audit reads a `.keras` archive as Keras's saving library lays it out (its
# `saving_lib`): the model's config and its variables, with the optimizer's in a group of its
# own (an `inner_optimizer` group inside it for a loss-scale wrapper).
ARCHIVE_CONFIG = "config.json"


ARCHIVE_WEIGHTS = "model.weights.h5"


def saved_optimizer_wrapped(weights: Any) -> bool | None:
    """Whether the optimizer state in an open `model.weights.h5` (an `h5py.File`) is a
    loss-scale wrapper's (it has an inner optimizer), or None when it holds none."""
    if "optimizer" not in weights:
        return None
    return "inner_optimizer" in weights["optimizer"]


@contextlib.contextmanager
def declared_model(config: dict[str, Any], legacy: bool) -> Iterator[Any]:
    """The model a saved config declares, built in a TensorFlow graph of its own that never
    runs: each variable has its shape and dtype but holds no memory (its initializer is an
    operation of that graph), and each tensor of its graph is symbolic. `legacy`: a legacy
    .h5 file's config. Valid inside the block only."""
    with tf.Graph().as_default():
        if legacy:
            yield model_from_config(config)
        else:
            yield keras.saving.deserialize_keras_object(config, safe_mode=True)
