"""The process-wide settings tfmixprec may change, read and put back as they were: grappler's
optimizer options, Keras's global dtype policy, where a setting never made stays unset, and
Keras's global seed generator (`global_seeds_kept`)."""

from __future__ import annotations

import contextlib
import random
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

# Why: an unseeded `keras.random.normal` draws from Keras's global `SeedGenerator`, kept in the
# same private `global_state` under this name and created on first use; Keras offers no public
# reader of it (`keras.utils.set_random_seed` replaces it, which is another setting). Keras
# 3.12 writes the name as a literal; later releases name it `GLOBAL_SEED_GENERATOR`.
GLOBAL_SEED_GENERATOR = "global_seed_generator"

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


@contextlib.contextmanager
def global_seeds_kept() -> Iterator[None]:
    """Within the block anything may draw from Keras's global seed generator (an unseeded
    `keras.random.normal` in a layer, a replay's); after it (also when it raises) its state is
    as it was, so the next draw is the one it would have been. A generator the block created is
    removed again, with Python's `random` state it drew its seed from, so the first use after
    the block creates the one it would have created."""
    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    state = None if generator is None else generator.state.numpy().copy()
    python_random = random.getstate() if generator is None else None
    try:
        yield
    finally:
        if global_state.get_global_attribute(GLOBAL_SEED_GENERATOR) is not generator:
            global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, generator)
            if generator is None:  # the block created one, from a draw of Python's `random`
                random.setstate(python_random)
        if generator is not None and (generator.state.numpy() != state).any():
            generator.state.assign(state)
