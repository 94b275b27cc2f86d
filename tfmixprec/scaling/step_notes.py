"""While a step is traced: tensors one part of it made that a later part uses again, so the
step reads each value once.

`LossScaleOptimizer` notes, per thread (replicas trace in threads) and per graph (weakly,
and each tensor by name: no graph is held):

- `scaled_with`: the loss scale `scale_loss` read, for the `apply` that follows it in that
  graph: the gradients it receives were scaled with it, so they are unscaled with it;
- `scale`: the scale that `apply` used, read before its apply-or-skip branch, which grows or
  backs off from it, and which the batch keeper records (`step_scale()`);
- `finite`: the finite check's flag that `apply` branched on, for `skipped()`.

Every `apply` in a thread, in any graph (a branch, a loop, a nested function), drops what
was noted there before it (`forget`), so nothing of one step is reused by the next.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import tensorflow as tf

__all__: list[str] = []  # internal: the optimizer's

_LOCK = threading.Lock()  # replicas trace in threads at once


class StepNotes:
    """The tensors noted while tracing, by name, in each thread (see the module)."""

    def __init__(self) -> None:
        self._noted: dict[int, dict[str, tuple[Any, str]]] = {}

    def forget(self) -> None:
        """Drops what this thread noted: a new step."""
        with _LOCK:
            self._noted.pop(threading.get_ident(), None)

    def note(self, key: str, tensor: tf.Tensor) -> None:
        """Notes `tensor` under `key` for this thread (nothing eagerly)."""
        if tf.executing_eagerly():
            return
        graph = weakref.ref(tensor.graph)
        with _LOCK:
            self._noted.setdefault(threading.get_ident(), {})[key] = (graph, tensor.name)

    def here(self, key: str, around: bool = False) -> tf.Tensor | None:
        """The tensor noted under `key` in this thread if the graph being traced is its graph
        (`around`: or a graph nested in it, such as a branch's, which then captures it);
        else None, and always None eagerly."""
        if tf.executing_eagerly():
            return None
        with _LOCK:
            noted, name = self._noted.get(threading.get_ident(), {}).get(key, (None, ""))
        graph = None if noted is None else noted()
        current = tf.compat.v1.get_default_graph()
        while graph is not None and current is not None:
            if current is graph:
                return graph.get_tensor_by_name(name)
            current = getattr(current, "outer_graph", None) if around else None
        return None
