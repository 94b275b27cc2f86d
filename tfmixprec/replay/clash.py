"""When a model's own code mixes dtypes: the layer, the operation and the line.

Some models fail under a mixed policy before any value overflows: their code casts one
tensor to float32 by hand and multiplies it by one the policy computes in float16 (KerasHub's
MoE decoders do, in the load-balancing loss of their sparse MoE block, in training calls
only). TensorFlow does not promote dtypes, so the operation raises: an `InvalidArgumentError`
eagerly ("cannot compute Mul as input #1(zero-based) was expected to be a half tensor but is a
float tensor [Op:Mul]"), a `TypeError` while tracing ("Input 'y' of 'Mul' Op has type float32
that does not match type float16 of argument 'x'"). Keras names the layer whose call raised
("Exception encountered when calling MixtralSparseMoeBlock.call()").

`clash_of` reads those into a `DtypeClash`: the layer (the innermost one of that class around
the last leaf call that finished), the operation, the two dtypes, and the line of the model's
own code (the deepest frame outside TensorFlow, Keras and tfmixprec). A replay that meets one
raises `DtypeClashError`, which `explain_overflow` names as cause `model-code` and `calibrate`
and `PrecisionRepair` try to fix with the fewest layers in float32.

Private: shared with `engine`, `diagnosis` and `calibration`."""

from __future__ import annotations

import dataclasses
import re
import traceback
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfmixprec._common.layers import all_layers
from tfmixprec._keras.graph import all_sublayers
from tfmixprec._keras.op_watch import model_line

__all__: list[str] = []  # private module: nothing here is part of the package's API

_EAGER = re.compile(r"expected to be a (\w+) tensor but is a (\w+) tensor \[Op:(\w+)\]")
_TRACED = re.compile(r"of '(\w+)' Op has type (\w+) that does not match type (\w+)")
_CALLING = re.compile(r"Exception encountered when calling (\w+)\.call\(\)")
_NAMES = {"half": "float16", "float": "float32", "double": "float64", "bfloat16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class DtypeClash:
    """An operation of a model's own code that mixes two dtypes.

    Attributes:
        layer: The layer whose call raised (None where Keras named no layer).
        operation: String. The TensorFlow operation (`"Mul"`).
        dtypes: Tuple of two strings. The dtypes it was given (`("float16", "float32")`).
        where: String. The line of the model's code: `path:line` (the path from the package
            folder on, `keras_hub/src/models/...`), or `""` where none is found.
    """

    layer: Any
    operation: str
    dtypes: tuple[str, str]
    where: str

    def describe(self) -> str:
        """`"the model's own code multiplies ..."`: what failed, in a sentence's words."""
        at = f" at {self.where}" if self.where else ""
        inside = f" in {self.layer.name!r}" if self.layer is not None else ""
        first, second = (f"{_article(name)} {name}" for name in self.dtypes)
        return (
            f"the model's own code mixes dtypes{inside}: {self.operation} of {first} and "
            f"{second} tensor{at} (TensorFlow does not promote dtypes)"
        )


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


class DtypeClashError(TypeError):
    """A replay's model call that failed on a `DtypeClash` (the original error is its
    `__cause__`)."""

    def __init__(self, clash: DtypeClash) -> None:
        super().__init__(clash.describe())
        self.clash = clash


def clash_of(err: BaseException, model: Any, called: Sequence[Any]) -> DtypeClash | None:
    """The `DtypeClash` `err` reports, or None where it is another error. `called`: the leaf
    layers whose calls finished before it, in order."""
    if not isinstance(err, (tf.errors.InvalidArgumentError, TypeError)):
        return None
    text = str(err)
    eager, traced = _EAGER.search(text), _TRACED.search(text)
    if eager is not None:
        expected, given, operation = eager.groups()
        dtypes = (_NAMES.get(expected, expected), _NAMES.get(given, given))
    elif traced is not None:
        operation, given, expected = traced.groups()
        dtypes = (expected, given)
    else:
        return None
    layer = _layer_in_traceback(err, model)
    if layer is None:  # Keras's own note of the layer, where the frames do not show it
        calling = _CALLING.search(text)
        layer = _raising_layer(model, calling.group(1), called) if calling else None
    return DtypeClash(layer, operation, dtypes, model_line(traceback.extract_tb(err.__traceback__)))


def _layer_in_traceback(err: BaseException, model: Any) -> Any:
    """The innermost layer of `model` whose method is among `err`'s traceback frames (the
    frame's `self`), or None."""
    layers = {id(layer): layer for layer in all_layers(model)}
    found, tb = None, err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in layers and owner is not model:
            found = owner
        tb = tb.tb_next
    return found


def _raising_layer(model: Any, class_name: str, called: Sequence[Any]) -> Any:
    """The layer of class `class_name` whose call raised: the innermost one around the last
    leaf call that finished; else (a leaf layer raised) the first of that class whose call
    never finished; else the first of that class."""
    candidates = [layer for layer in all_layers(model) if type(layer).__name__ == class_name]
    if not candidates:
        return None
    last = called[-1] if called else None
    around = [c for c in candidates if any(part is last for part in all_sublayers(c))]
    if around:
        return min(around, key=lambda c: len(all_sublayers(c)))
    unfinished = [c for c in candidates if not any(c is leaf for leaf in called)]
    return (unfinished or candidates)[0]
