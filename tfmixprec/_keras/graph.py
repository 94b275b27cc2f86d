"""What tfmixprec reads of a model's layer graph through Keras internals: every nested
layer, the layer and output index that produced a tensor, build shapes, the losses a
call added, the functional model's class."""

from __future__ import annotations

from typing import Any

# Why: Keras makes `Model(inputs, outputs)` functional by rewriting the class's bases in
# place; `MixedPrecisionModel.__new__` routes functional use to its own subclass instead, so
# it needs Keras's test for functional arguments and the Functional class.
from keras.src.models.functional import Functional  # noqa: F401  (re-exported)
from keras.src.models.model import functional_init_arguments  # noqa: F401  (re-exported)

__all__: list[str] = []  # private module: nothing here is part of the package's API


def all_sublayers(model: Any) -> list[Any]:
    """Every layer inside `model`, nested ones included, in Keras's own order.

    Why: `Layer._flatten_layers` is the only walk that reaches layers nested in subclassed
    models and in attributes; there is no public equivalent.
    """
    return list(model._flatten_layers(include_self=False, recursive=True))


def every_layer_built(model: Any) -> bool:
    """Whether `model` and every layer inside it (`all_sublayers`) is built: a subclassed
    model called once in inference leaves a layer it runs in training only unbuilt, to make
    its variables in the train step's trace."""
    return model.built and all(layer.built for layer in all_sublayers(model))


def producing_layer(tensor: Any) -> Any:
    """The layer (Keras operation) that produced a symbolic tensor of a functional model, or None.

    Why: Keras records it only in the tensor's private `_keras_history`; the public
    `model.outputs` carry no link back to their layers.
    """
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation


def producing_output_index(tensor: Any) -> int | None:
    """Which output of its producing layer a symbolic tensor is (a nested model's outputs are
    numbered in `keras.tree.flatten` order), or None.

    Why: as `producing_layer`, Keras keeps it only in the private `_keras_history`.
    """
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.tensor_index


def build_shapes(model: Any) -> dict[str, Any] | None:
    """The input shapes a subclassed model was built with (`{argument name: shape}`), or None.

    Why: Keras keeps them only in the private `_build_shapes_dict`; `model.inputs` is empty for
    subclassed models.
    """
    return getattr(model, "_build_shapes_dict", None)


# Why: an inference call of a model replaces the losses its layers added with `add_loss` (Keras
# keeps them in the private `_losses`, read by `model.losses`); tfmixprec's observing call puts
# them back as they were.
def call_losses(layer: Any) -> list[Any]:
    """The losses `layer` added in its last call (`add_loss`)."""
    return list(getattr(layer, "_losses", []))


def set_call_losses(layer: Any, losses: list[Any]) -> None:
    """Puts back what `call_losses` returned."""
    if hasattr(layer, "_losses"):
        layer._losses[:] = losses


def node_outputs(layer: Any) -> list[Any]:
    """The symbolic tensors `layer` returned in the functional graphs it was called in.

    Why: Keras records a layer's calls in a graph only in its private `_inbound_nodes`.
    """
    return [
        tensor for node in getattr(layer, "_inbound_nodes", []) for tensor in node.output_tensors
    ]
