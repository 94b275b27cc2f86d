"""The process-wide settings tfmixprec may change, read and put back as they were: grappler's
optimizer options and Keras's global dtype policy, where a setting never made stays unset."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

# Why: Keras keeps its global dtype policy in its private `global_state`, unset until first
# read: `keras.config.dtype_policy()` sets it (to floatx's policy) when it reads an unset one,
# so the public functions cannot tell "unset" apart nor put it back.
from keras.src.backend.common import global_state

# Why: TensorFlow keeps the grappler options set in this process in the eager context's
# private `_optimizer_experimental_options`: `tf.config.optimizer.set_experimental_options`
# sets an option but cannot unset one, so an option the process never set could only be put
# back as its default, which is another setting (the audit once left `remapping` True).
from tensorflow.python.eager import context

__all__: list[str] = []  # private module: nothing here is part of the package's API


def optimizer_options() -> dict[str, Any]:
    """The grappler options set in this process (`{"remapping": False}`), none for an option
    never set."""
    return dict(context.context()._optimizer_experimental_options)


def restore_optimizer_options(options: dict[str, Any]) -> None:
    """Makes the grappler options set in this process exactly `options` (from
    `optimizer_options`): the others unset, as in a process that never set them. Writes
    nothing when they are already."""
    kept = context.context()._optimizer_experimental_options
    if kept == options:
        return
    kept.clear()
    tf.config.optimizer.set_experimental_options(dict(options))  # functions re-read them


def global_policy() -> Any:
    """Keras's global dtype policy as set (a `keras.DTypePolicy`), or None while unset."""
    return global_state.get_global_attribute("dtype_policy", None)


def restore_global_policy(policy: Any) -> None:
    """Puts back what `global_policy` returned: None makes it unset again."""
    global_state.set_global_attribute("dtype_policy", policy)


@contextlib.contextmanager
def settings_kept() -> Iterator[None]:
    """Within the block anything may change grappler's options or Keras's global policy; after
    it (also when it raises) both are as they were, an unset one unset."""
    options, policy = optimizer_options(), global_policy()
    try:
        yield
    finally:
        restore_optimizer_options(options)
        if global_policy() is not policy:
            restore_global_policy(policy)
