"""While a step is traced: tensors one part of it made that a later part uses again, so the
step reads each value once.

`LossScaleOptimizer` notes, per thread (replicas trace in threads) and per graph (weakly,
and each tensor by name: no graph is held):

- `scaled_with`: the loss scale `scale_loss` read, for the `apply` that follows it in that
  graph: the gradients it receives were scaled with it, so they are unscaled with it;
- `scale`: the scale that `apply` used, read before its apply-or-skip branch, which grows or
  backs off from it (handed to both branches where they are built in `apply`'s thread),
  and which the batch keeper records (`scale_used()`);
- `finite`: the finite check's flag that `apply` branched on, for `skipped()`.

Every `apply` in a thread, in any graph (a branch, a loop, a nested function), drops what
was noted there before it (`forget`), so nothing of one step is reused by the next; and a
scale written after `scale_loss` read it (an assignment in between, or an earlier step's
branch in the same graph, noted by a thread whose id this one now has) is read again.
`written_since` says which variables the ops traced since a point may write, and with what
value where an assignment wrote last (the state guard's, too).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import keras
import tensorflow as tf

__all__: list[str] = []  # internal: the optimizer's

_LOCK = threading.Lock()  # replicas trace in threads at once


class StepNotes:
    """The tensors noted while tracing, by name, in each thread (see the module)."""

    def __init__(self) -> None:
        self._noted: dict[int, dict[str, tuple[Any, str, int]]] = {}

    def forget(self) -> None:
        """Drops what this thread noted: a new step."""
        with _LOCK:
            self._noted.pop(threading.get_ident(), None)

    def note(self, key: str, tensor: tf.Tensor) -> None:
        """Notes `tensor` under `key` for this thread (nothing eagerly)."""
        if tf.executing_eagerly():
            return
        graph = tensor.graph
        noted = (weakref.ref(graph), tensor.name, len(graph.get_operations()))
        with _LOCK:
            self._noted.setdefault(threading.get_ident(), {})[key] = noted

    def here(self, key: str, unwritten: Any = None) -> tf.Tensor | None:
        """The tensor noted under `key` in this thread if the graph being traced is its
        graph; else None, and always None eagerly. `unwritten`: the variable it was read
        from, None too where an op since may have written it (an assignment in between, or
        an earlier step whose thread had this thread's id)."""
        if tf.executing_eagerly():
            return None
        with _LOCK:
            noted, name, ops = self._noted.get(threading.get_ident(), {}).get(key, (None, "", 0))
        graph = tf.compat.v1.get_default_graph()
        if noted is None or noted() is not graph:
            return None
        if unwritten is not None and written_since(ops, [unwritten])[0]:
            return None
        return graph.get_tensor_by_name(name)


def written_since(first: int, variables: list[Any]) -> tuple[set[int], dict[int, tf.Tensor]]:
    """The ids of those of `variables` that an op added to the graph being traced since its
    op `first` may write: one that takes the variable's handle for anything but a read (a
    write, or a function, branch or loop that may write inside); and, by id, the value each
    holds after them where the last such op is an assignment (`AssignVariableOp`) of one copy
    (no strategy): that value, so that it is not read again."""
    graph = tf.compat.v1.get_default_graph()
    inside = {id(outer): inner for outer, inner in graph.captures}
    owner = {}
    for variable in variables:
        for copy in _copies(variable):
            handle = inside.get(id(copy.handle), copy.handle)
            owner[handle.ref()] = variable
    written: dict[int, Any] = {}  # by id: the value last assigned, or None
    for op in graph.get_operations()[first:]:
        if op.type not in _READS:
            for t in op.inputs:
                if t.ref() in owner:
                    plain = op.type == "AssignVariableOp" and t is op.inputs[0]
                    written[id(owner[t.ref()])] = op.inputs[1] if plain else None
    return set(written), {key: value for key, value in written.items() if value is not None}


_READS = frozenset({"ReadVariableOp", "VariableShape", "VarIsInitializedOp"})


def _copies(variable: Any) -> tuple:
    """The `tf.Variable`s behind a Keras or TF variable (one per replica when distributed)."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return tuple(getattr(value, "values", None) or (value,))
