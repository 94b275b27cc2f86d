"""The unscaling contract: which gradients reaching `apply` are already unscaled.

`apply` takes scaled gradients and unscales them, except those that `get_unscaled_gradients`
unscaled since the last `scale_loss`. `UnscaleLedger` holds that fact in per-replica variables
(`ON_READ`) written at run time, so it holds across `tf.function`s, threads and replicas:

- `record` marks gradients as unscaled: per variable when the variables are known (the
  optimizer is built and they are named, or the list covers all of them), or all of them when
  it runs before the optimizer is built (a record "before build": the first step of a TF 2
  loop, whose variables are not known yet).
- `unscale_for_apply` divides each gradient `apply` received by 1 or the scale and consumes
  the marks of the variables it applies, so two `apply` calls on two halves both see theirs.
- `clear` (in `scale_loss`) starts a step with nothing recorded.

Misuses that cannot be decided raise at run time (in eager mode at once) and change nothing.
The variables are not checkpointed: they describe one step, not the training run.

Where one graph both starts the step (`clear`) and applies it, and nothing between the two
could record (no `record` traced there, and no op that runs other code: a function call, a
conditional, a loop, a Python function), nothing can be recorded when `apply` runs: the graph
then divides by the scale with no branch on the record (Keras 3's `train_step`, so every
`fit`). On a GPU a branch outside XLA waits for its flag on the host. This is what one graph
knows of its own ops in program order, not state carried between calls: a function traced
elsewhere and called in between, or a `record` in any replica's thread, keeps the branch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

# Internal module: the package exports nothing from it (other modules import what they use).
__all__: list[str] = []

SCALED_AGAIN = (
    "get_unscaled_gradients() was called since the last scale_loss(), but apply() / "
    "apply_gradients() received the scaled gradients, not the ones it returned. tfmixprec "
    "cannot tell which you meant, so nothing was applied. Pass the gradients that "
    "get_unscaled_gradients() returned to apply_gradients(); or, to only look at unscaled "
    "values (e.g. to log a norm), divide by optimizer.loss_scale yourself and pass the scaled "
    "gradients to apply_gradients(), which unscales them."
)
UNSCALED_TWICE = (
    "get_unscaled_gradients() received gradients that it had already unscaled since the last "
    "scale_loss(); dividing them again would shrink the update by the loss scale. Call it once "
    "per step, on the gradients of the scaled loss."
)
COUNT_BEFORE_BUILD = (
    "get_unscaled_gradients() ran before the optimizer was built, on a different number of "
    "gradients than the variables apply() built it with, so tfmixprec cannot tell which "
    "gradients are unscaled. Call optimizer.build(variables) first, or pass "
    "get_unscaled_gradients(grads, variables)."
)
FLOAT8_BEFORE_BUILD = (
    "get_unscaled_gradients() ran before the optimizer was built, so it could not leave alone "
    "the gradients of float8 variables (which Keras overwrites with their gradient): they were "
    "divided by the loss scale. Call optimizer.build(model.trainable_variables) before the "
    "first step, or pass get_unscaled_gradients(grads, variables)."
)

# Values of `before_build`: 0 no record before build; else one that divided every gradient
# (`_ALL_DIVIDED`) or one that was told the variables and left the float8 ones alone.
_ALL_DIVIDED, _FLOAT8_KEPT = 1, 2

# Two fingerprints match within this relative tolerance (XLA may sum in another order).
_FINGERPRINT_RTOL = 2.0**-10


def gradient_values(grads: Sequence[Any]) -> list[Any]:
    """The dense value tensors of `grads`: `None` dropped, `tf.IndexedSlices` as their values."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]


def fingerprint(grads: Sequence[Any]) -> tf.Tensor:
    """Sum of |g| over the gradients, in float32: tells scaled from unscaled gradients."""
    parts = [tf.reduce_sum(tf.abs(tf.cast(v, tf.float32))) for v in gradient_values(grads)]
    return tf.add_n(parts) if parts else tf.constant(0.0)


def _close(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    finite = tf.logical_and(tf.math.is_finite(a), tf.math.is_finite(b))
    near = tf.abs(a - b) <= _FINGERPRINT_RTOL * tf.maximum(tf.abs(a), tf.abs(b))
    return tf.logical_and(finite, near)


def _check(ok: tf.Tensor, message: str) -> Any:
    """Raises `InvalidArgumentError(message)` at run time where `ok` is False (eager: now)."""
    if tf.executing_eagerly():
        if not bool(ok):
            raise tf.errors.InvalidArgumentError(None, None, message)
        return tf.no_op()
    return tf.debugging.Assert(ok, [message])


# Ops that run code traced elsewhere (a function, a branch, a loop body, Python): a `record`
# inside one is not seen by the graph that calls it.
_RUNS_OTHER_CODE = frozenset(
    {
        "PartitionedCall",
        "StatefulPartitionedCall",
        "If",
        "StatelessIf",
        "Case",
        "StatelessCase",
        "While",
        "StatelessWhile",
        "EagerPyFunc",
        "PyFunc",
        "PyFuncStateless",
    }
)


def _graphs_out() -> list[Any]:
    """The graph being traced and the graphs around it (empty when eager)."""
    if tf.executing_eagerly():
        return []
    graph, found = tf.compat.v1.get_default_graph(), []
    while graph is not None:
        found.append(graph)
        graph = getattr(graph, "outer_graph", None)
    return found


def replica_variable(value: Any, name: str | None = None, shape: Any = None) -> tf.Variable:
    """A variable each replica writes its own copy of at run time (read in cross-replica
    context: the first replica's); the unscaling record and the batch keeper's slots."""
    return tf.Variable(
        value,
        shape=shape,
        trainable=False,
        name=name,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


class UnscaleLedger:
    """Per-replica run-time record of which gradients are already unscaled (see module doc).

    `has_record` says whether anything is recorded since the last `clear`; while it is 0 the
    other variables are stale and ignored. A traced step that clears and applies with no
    record in between (Keras 3's way, and `fit`) costs one scalar write in `clear` and no
    branch; an `apply` that cannot know reads `has_record` and branches on it.
    """

    def __init__(self) -> None:
        self.has_record = replica_variable(0, "unscaled_has_record")
        self.before_build = replica_variable(0, "unscaled_before_build")
        self.count_before_build = replica_variable(0, "unscaled_count_before_build")
        self.scaled_fingerprint = replica_variable(0.0, "scaled_fingerprint")
        self.unscaled_fingerprint = replica_variable(0.0, "unscaled_fingerprint")
        self.marks: tf.Variable | None = None  # one int per variable, made by `build`
        # While tracing: the graphs where `clear` ran and no `record` since, each with the
        # threads (one a replica) that cleared and the number of ops the graph had then.
        self._cleared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def build(self, num_variables: int) -> None:
        """Creates the per-variable marks for an optimizer of `num_variables` variables."""
        self.marks = replica_variable(tf.zeros([num_variables], tf.int32), "unscaled_marks")

    def _check_replicas(self) -> None:
        ctx = tf.distribute.get_replica_context()
        distributed = isinstance(self.has_record, tf.distribute.DistributedValues)
        if ctx is not None and ctx.num_replicas_in_sync > 1 and not distributed:
            raise ValueError(
                "get_unscaled_gradients() under a strategy with "
                f"{ctx.num_replicas_in_sync} replicas needs an optimizer created inside "
                "strategy.scope() (its per-replica state was created outside). Create the "
                "optimizer inside `with strategy.scope():`."
            )

    def record(
        self,
        grads: list[Any],
        scale: tf.Tensor,
        indices: list[int] | None,
        knew_float8: bool = False,
    ) -> Any:
        """Records `grads` as unscaled: the variables at `indices`, or (`indices` None, before
        the optimizer is built) all of them. `knew_float8`: a record before build that was
        told the variables (the float8 ones were left alone).

        Returns:
            The run-time check that `grads` were not already unscaled (an op to depend on).
        """
        self._check_replicas()
        for graph in _graphs_out():  # this graph and those around it, every thread
            self._cleared.pop(graph, None)
        scaled = fingerprint(grads)
        recorded = self.has_record.read_value() > 0
        again = tf.logical_and(recorded, _close(scaled, self.unscaled_fingerprint.read_value()))
        check = _check(tf.logical_not(again), UNSCALED_TWICE)
        with tf.control_dependencies([check]):
            self.scaled_fingerprint.assign(scaled)
            self.unscaled_fingerprint.assign(scaled / tf.cast(scale, tf.float32))
            if indices is None:
                self.before_build.assign(_FLOAT8_KEPT if knew_float8 else _ALL_DIVIDED)
                self.count_before_build.assign(len(grads))
                if self.marks is not None:  # a function traced before the optimizer was built
                    self.marks.assign(tf.zeros_like(self.marks.read_value()))
            else:
                self.before_build.assign(tf.where(recorded, self.before_build.read_value(), 0))
                marks = self.marks.read_value()
                marks = tf.where(recorded, marks, tf.zeros_like(marks))
                updates = tf.ones([len(indices)], tf.int32)
                self.marks.assign(
                    tf.tensor_scatter_nd_update(marks, [[i] for i in indices], updates)
                )
            self.has_record.assign(1)
        return check

    def clear(self) -> None:
        """A new step: nothing is unscaled until the next `record`."""
        self.has_record.assign(0)
        if not tf.executing_eagerly():
            graph = tf.compat.v1.get_default_graph()
            cleared = self._cleared.setdefault(graph, {})
            cleared[threading.get_ident()] = len(graph.get_operations())  # its latest clear

    def _nothing_recorded(self) -> bool:
        """While tracing: whether this graph, in this thread, cleared the record and nothing
        since could have recorded (`_RUNS_OTHER_CODE`), so nothing is recorded now."""
        graph = tf.compat.v1.get_default_graph()
        first = self._cleared.get(graph, {}).get(threading.get_ident())
        if first is None:
            return False
        return not any(op.type in _RUNS_OTHER_CODE for op in graph.get_operations()[first:])

    def unscale_for_apply(
        self,
        grads: list[Any],
        indices: list[int],
        scale: tf.Tensor,
        has_float8: bool,
        divide: Callable[[Any, int, tf.Tensor], Any],
    ) -> list[Any]:
        """The gradients `apply` received, each divided by `scale` unless already unscaled.

        Uses up the records of the variables at `indices`. Raises (at run time, changing
        nothing) if the gradients claimed as unscaled are the scaled ones that were recorded,
        or if a record made before build cannot be matched to the variables. With nothing
        recorded (Keras 3's way, `fit`) this is one read and one branch around the divisions.

        Args:
            grads: The gradients `apply` received (`None` allowed).
            indices: Their variables' positions in the optimizer.
            scale: The current loss scale.
            has_float8: Whether the optimizer trains variables overwritten with their gradient.
            divide: `divide(grad, position, divisor)` returns one unscaled gradient.
        """
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        scale = tf.cast(scale, tf.float32)
        if not tf.executing_eagerly() and self._nothing_recorded():  # Keras 3's way, `fit`
            result = list(grads)
            for i in present:
                result[i] = divide(grads[i], i, scale)
            return result

        def checked() -> list[Any]:
            divisors = self._consume(grads, indices, scale, has_float8)
            return [divide(grads[i], i, divisors[i]) for i in present]

        with tf.name_scope("unscaled_record"):
            outputs = tf.cond(
                self.has_record.read_value() > 0,
                checked,
                lambda: [divide(grads[i], i, scale) for i in present],
            )
        result = list(grads)
        for i, output in zip(present, outputs):
            result[i] = output
        return result

    def _consume(
        self, grads: list[Any], indices: list[int], scale: tf.Tensor, has_float8: bool
    ) -> tf.Tensor:
        """With a record since `clear`: the divisor of each gradient (1 for one recorded as
        unscaled, else `scale`), after the run-time checks of misuse; the records of the
        variables at `indices` are used up (another `apply` on other variables sees its own).
        """
        before_build = self.before_build.read_value()
        all_recorded = before_build > 0  # a record before build covers every gradient
        marks = self.marks.read_value()
        unscaled = tf.logical_or(tf.gather(marks, indices) > 0, all_recorded)
        present = tf.constant([g is not None for g in grads], tf.bool)
        claimed_unscaled = tf.logical_and(unscaled, present)

        def looks_scaled() -> tf.Tensor:
            sums = tf.stack([fingerprint([g]) for g in grads])
            received = tf.reduce_sum(tf.where(claimed_unscaled, sums, 0.0))
            return tf.logical_and(
                _close(received, self.scaled_fingerprint.read_value()),
                tf.logical_not(_close(received, self.unscaled_fingerprint.read_value())),
            )

        scaled_again = tf.cond(
            tf.reduce_any(claimed_unscaled), looks_scaled, lambda: tf.constant(False)
        )
        checks = [_check(tf.logical_not(scaled_again), SCALED_AGAIN)]
        count_ok = tf.logical_or(
            tf.logical_not(all_recorded),
            tf.equal(self.count_before_build.read_value(), marks.shape[0]),
        )
        checks.append(_check(count_ok, COUNT_BEFORE_BUILD))
        if has_float8:  # a record before build that did not know the variables divided them
            checks.append(_check(tf.not_equal(before_build, _ALL_DIVIDED), FLOAT8_BEFORE_BUILD))
        with tf.control_dependencies(checks):
            zeros = tf.zeros([len(indices)], tf.int32)
            left = tf.tensor_scatter_nd_update(marks, [[i] for i in indices], zeros)
            self.marks.assign(left)
            self.before_build.assign(0)
            self.has_record.assign(tf.cast(tf.reduce_any(left > 0), tf.int32))
            use_scale = tf.logical_not(tf.logical_and(unscaled, tf.logical_not(scaled_again)))
            return tf.where(use_scale, scale, 1.0)
