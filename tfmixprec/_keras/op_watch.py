"""The first float16 or bfloat16 operation whose output is not finite, seen as it runs.

Why: TensorFlow calls an op callback with each eagerly run operation's inputs and outputs
(`tensorflow.python.framework.op_callbacks.add_op_callback`, private, the hook that
`tf.debugging.enable_check_numerics` is built on; TF 2.16 to 2.21; thread-local, as the
eager context is). `enable_check_numerics` itself stops at the first Inf/NaN in any dtype,
and float32 code holds intended ones (T5 takes the log of 0 for its relative positions), so
it cannot say which low-precision operation went wrong. This watches float16 and bfloat16
outputs only, and tells an operation whose inputs were finite (float16's range) from one
given a value that was already not finite and that no operation made: a constant too large
for float16 in the model's own code (T5's mask bias, `-1e9`, is `-inf` in float16).
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

__all__: list[str] = []  # private module: nothing here is part of the package's API

_LOW = (tf.float16, tf.bfloat16)
_MACHINERY = ("/tensorflow/", "/keras/src/", "/tfmixprec/", "/tf_keras/", "/absl/", "/optree/")


@dataclasses.dataclass(frozen=True)
class NonfiniteOp:
    """The first float16/bfloat16 operation whose output held Inf or NaN.

    Attributes:
        operation: String. The TensorFlow operation (`"Mul"`).
        dtype: String. Its output's dtype.
        where: String. The line of the model's code that ran it (`path:line`, the path from
            the package folder on), or `""`.
        constant: Bool. One of its inputs was already not finite, and no watched operation
            made it: a constant too large for the dtype (the model's own code).
        inputs_finite: Bool. Every input was finite: the operation's values passed the
            dtype's range, or it made Inf/NaN of a 0 (`zero_inputs`).
        zero_inputs: Tuple of ints. The positions of the floating-point inputs that held an
            exact 0: with `inputs_finite`, a `Log` of a value that underflowed to 0 before
            it, or a division by one, say.
    """

    operation: str
    dtype: str
    where: str
    constant: bool
    inputs_finite: bool
    zero_inputs: tuple[int, ...] = ()


def _finite(tensor: Any) -> bool:
    if not tensor.dtype.is_floating:
        return True
    return bool(np.isfinite(tensor.numpy()).all())


def _holds_zero(tensor: Any) -> bool:
    return tensor.dtype.is_floating and bool((tensor.numpy() == 0).any())


def model_line(frames: Sequence[traceback.FrameSummary]) -> str:
    """`path:line` of the deepest of `frames` outside the machinery (TensorFlow, Keras,
    tfmixprec): the model's own code, the path from its package folder on; `""` where none."""
    own = [
        frame
        for frame in frames
        if not any(part in frame.filename.replace("\\", "/") for part in _MACHINERY)
    ]
    if not own:
        return ""
    path = own[-1].filename.replace("\\", "/")
    path = path.split("site-packages/")[-1] if "site-packages/" in path else path
    return f"{path}:{own[-1].lineno}"


def first_nonfinite_op(run: Callable[[], Any]) -> NonfiniteOp | None:
    """Runs `run()` eagerly, watching every operation; returns the first whose float16 or
    bfloat16 output held Inf or NaN (None: none did). `run`'s errors propagate."""
    found: list[NonfiniteOp] = []
    made: list[Any] = []  # the non-finite outputs of the operations run so far, kept alive

    def watch(
        op_type: str, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None, graph: Any = None
    ) -> None:
        if graph is not None or found:
            return None
        bad_out = [out for out in outputs or () if not _finite(out)]
        low = [out for out in bad_out if out.dtype in _LOW]
        if low:
            bad = [x for x in inputs if not _finite(x)]
            constant = any(not any(x is m for m in made) for x in bad)
            found.append(
                NonfiniteOp(
                    op_type,
                    low[0].dtype.name,
                    model_line(traceback.extract_stack()),
                    constant,
                    not bad,
                    tuple(i for i, x in enumerate(inputs) if _holds_zero(x)),
                )
            )
        made.extend(bad_out)
        return None

    op_callbacks.add_op_callback(watch)
    try:
        run()
    finally:
        op_callbacks.remove_op_callback(watch)
    return found[0] if found else None
