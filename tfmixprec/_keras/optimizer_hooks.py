"""Keras's `LossScaleOptimizer` as tfmixprec's optimizer extends it: the apply/skip hooks,
the variables an optimizer was built with, the compiled optimizer of a model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

# Why: the optimizer's `build` sets attributes that Keras's tracker must not collect twice
# (the parent `LossScaleOptimizer.build` is decorated the same way).
from keras.src.utils.tracking import no_automatic_dependency_tracking  # noqa: F401

__all__: list[str] = []  # private module: nothing here is part of the package's API


def built_variables(optimizer: Any) -> list[Any]:
    """The variables a built Keras optimizer was built with.

    Why: Keras keeps them only in the private `_trainable_variables`; tfmixprec's
    `LossScaleOptimizer.from_keras` builds its replacement of a used Keras
    `LossScaleOptimizer` for the same variables.
    """
    return list(optimizer._trainable_variables)


def set_compiled_optimizer(model: Any, optimizer: Any) -> None:
    """Makes `model.save` write `optimizer` as the compiled optimizer.

    Why: Keras writes the optimizer it was given at `compile()`, kept in the private
    `_compile_config`, and `load_model` compiles with it again; after the callbacks replace
    Keras's `LossScaleOptimizer` by tfmixprec's, the file must name the new one, else the
    loaded model gets Keras's again and the saved optimizer variables do not fit it.
    """
    config = getattr(model, "_compile_config", None)
    if config is not None:
        config.config["optimizer"] = optimizer


class KerasLossScaleHooks(keras.optimizers.LossScaleOptimizer):
    """Keras's `LossScaleOptimizer`, with its private hooks mapped onto named methods.

    Why: Keras's `apply` (`_tf_apply`) does the finite check and the apply/skip `cond` in a
    cross-replica context under strategies that need `merge_call`; a `cond` in replica context
    whose branch calls the inner optimizer is not allowed. So tfmixprec keeps Keras's `apply`
    and its structure, and maps its private parts onto named methods that subclasses
    implement: `check_step` (the finite check, with per-variable flags), `apply_finite_step`
    and `skip_step`. Keras 3.12 to 3.15 have the same `_tf_apply`. `apply_when` runs the same
    step only at the end of an accumulation window (the `cond` on the window, like the one on
    the finite flag, in cross-replica context where the strategy needs it).
    """

    def __dir__(self) -> list[str]:
        """Every attribute but `inner_optimizer`. Why: Keras's saving walk
        (`saving_lib._walk_saveable`, Keras 3.12 to 3.15) finds an object's children through
        `dir()`, and would load the inner optimizer again as a child after this optimizer's
        `load_own_variables` refused the file (moving `iterations`, also with
        `skip_mismatch=True`). tfmixprec's optimizer saves and loads the inner optimizer's
        state with its own, so that a refusal assigns nothing."""
        return [name for name in super().__dir__() if name != "inner_optimizer"]

    def check_step(self, grads: Sequence[Any], trainable_variables: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def apply_finite_step(self, grads: Sequence[Any], trainable_variables: Any) -> None:
        raise NotImplementedError

    def skip_step(self, evidence: Any = None) -> None:
        raise NotImplementedError

    def note_step(self, finite: Any) -> None:
        """Called after the apply-or-skip branch on `finite`, in the graph that branched."""

    # Why: Keras's `_tf_apply` asks `check_finite(grads)` for one bool, so its skip branch
    # cannot know which variables' gradients were not finite (the gradients' variables are
    # not passed to `check_finite`). This keeps Keras's structure (a `merge_call` and the
    # `cond` in cross-replica context where the strategy needs it) with `check_step`, which
    # also returns the per-variable flags, and hands them to the skip branch.
    def _tf_apply(self, grads: Sequence[Any], trainable_variables: Any = None) -> None:
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._checked_step(grads, trainable_variables)
            return

        def in_cross_replica(distribution: Any, grads: Any, variables: Any) -> None:
            self._cross_replica_step(distribution, (grads, variables), lambda g, v: (g, v))

        tf.distribute.get_replica_context().merge_call(
            in_cross_replica, args=(grads, trainable_variables)
        )

    def apply_when(self, ready: Any, window: Any, clear: Any) -> None:
        """If `ready`, applies or skips the gradients `window()` returns, as `apply` does,
        then calls `clear()`; else does nothing.

        For gradient accumulation: `ready` (a scalar bool every replica computes alike) says
        the window is full; `window()` returns `(grads, variables)`, each replica's own (read
        from its accumulators, in that replica's context). Nothing crosses replicas unless
        `ready`; then, as in `apply`, the finite flags and the gradients are all-reduced once.
        `clear()` runs in replica or in cross-replica context.
        """
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if tf.__internal__.distribute.strategy_supports_no_merge_call():

            def step() -> None:
                self._checked_step(*window())
                clear()

            with tf.name_scope("accumulation_window"):
                tf.cond(ready, step, lambda: None)
            return

        def in_cross_replica(distribution: Any, ready: Any) -> None:
            def step() -> None:
                self._cross_replica_step(distribution, (), window)
                clear()

            with tf.name_scope("accumulation_window"):
                tf.cond(distribution.experimental_local_results(ready)[0], step, lambda: None)

        tf.distribute.get_replica_context().merge_call(in_cross_replica, args=(ready,))

    def _checked_step(self, grads: Any, variables: Any) -> None:
        """In replica context: the finite check, then apply or skip, each branch from the
        scale the `apply` in this thread read (`scale_used`: no read in the branches)."""
        finite, evidence = self.check_step(grads, variables)
        scale = self.scale_used()
        with tf.name_scope("apply_or_skip"):
            tf.cond(
                finite,
                lambda: self.apply_finite_step(grads, variables, scale=scale),
                lambda: self.skip_step(evidence, scale=scale),
            )
        if not tf.executing_eagerly():
            self.note_step(finite)

    def _cross_replica_step(self, distribution: Any, args: tuple, step_args: Any) -> None:
        """In cross-replica context: each replica checks `step_args(*its args)`; the `cond`
        is here, since a `cond` in replica context must not call `merge_call` (the inner
        optimizer does)."""
        each_replica = distribution.extended.call_for_each_replica
        checked = each_replica(lambda *a: self.check_step(*step_args(*a)), args=args)
        # Every replica computed the same values (the flags are all-reduced).
        finite, evidence = (distribution.experimental_local_results(v)[0] for v in checked)

        def apply_fn() -> None:
            each_replica(lambda *a: self.apply_finite_step(*step_args(*a)), args=args)

        with tf.name_scope("apply_or_skip"):
            tf.cond(finite, apply_fn, lambda: self.skip_step(evidence))

    # Keras's hooks (called from `LossScaleOptimizer._common_apply` / `_tf_apply`).
    def _stateful_handle_finite_grads(self, grads: Sequence[Any], trainable_variables: Any) -> None:
        self.apply_finite_step(grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self) -> None:
        self.skip_step()

    # Why: TensorFlow checkpoints (`tf.train.Checkpoint`) reach an optimizer's variables
    # through Keras's private `_variables` list, by position: a tfmixprec release that added
    # a state variable shifted the rest, and a checkpoint of one release restored into the
    # wrong variables of the next (0.2.0 into 0.3.0: a shape error). Every tfmixprec state
    # variable is also an attribute of its loss-scale unit or its accumulator (tracked by
    # name: `_loss_scale/overflow_steps`, ...), and Keras's own two by `_iterations` and
    # `_learning_rate`: without the positional list, a checkpoint of any release restores
    # each variable by its name, and what an older one lacks stays as it is.
    # Keras's own LossScaleOptimizer also tracks its two variables by name (`step_counter`,
    # `dynamic_scale`): under those names a checkpoint of Keras's restores into tfmixprec's.
    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        children = dict(super()._trackable_children(save_type, **kwargs))
        children.pop("_variables", None)
        children.update(step_counter=self.step_counter, dynamic_scale=self.dynamic_scale)
        return children

    # Why: Keras keeps these as private helpers of the base optimizer.
    def tracked_variables(self) -> list[Any]:
        """The variables the optimizer was built with."""
        return list(self._trainable_variables)

    def variable_index(self, variable: Any) -> int:
        """The position of `variable` among `tracked_variables()`."""
        return self._get_variable_index(variable)

    def overwrites_with_gradient(self, variable: Any) -> bool:
        """True for variables whose "gradient" is a new value (float8 scale/amax variables)."""
        return bool(self._overwrite_variable_with_gradient(variable))
