"""The calibration's replays (`Replayer`): its batches replayed through `engine.replay` with chosen
layers in float32, each leaf call summed up (its largest value, its NaN/Inf, its inputs'),
NaN/Inf that the batch's float32 replay holds too judged on purpose; and computing layers in
float32 (`float32_policy`, `float32_swapped` for a replay, `move_to_float32` for good,
with a warning where the model's config does not record it: `warn_not_recorded`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.arrays import float_array, float_arrays
from tfmixprec._common.dtypes import DTYPE_MAX, FLOAT16_MAX
from tfmixprec._common.layers import (
    all_layers,
)
from tfmixprec._common.observe import policies_swapped
from tfmixprec._common.text import docs_page
from tfmixprec._common.validate import check_bool
from tfmixprec.precision.float8 import is_float8
from tfmixprec.precision.policy import compute_in_float32
from tfmixprec.replay.engine import TRAINING, replay

__all__: list[str] = []


# Values in a float16 layer must stay 4x under 65504: activations grow as training goes on
# (a residual stream that just passed 65504 in one block passes it in the block before a few
# steps later), so a set chosen at the limit would need a repair again and again.
HEADROOM = 4.0


@dataclasses.dataclass(frozen=True)
class _Call:
    """One leaf layer call: its output's largest finite |x|, non-finite count, count past
    float16's range and size; whether its inputs held a NaN/Inf."""

    layer: Any
    dtype: str
    max_abs: float
    bad: int
    past: int
    size: int
    bad_inputs: bool
    input_max: float
    out_dtype: str  # the narrowest dtype of its outputs (a float16 layer may return float32)
    # Its NaN/Inf are the float32 replay's too, whose loss and gradients are finite: on
    # purpose (a `-inf` key mask before a softmax), not an overflow (`Replayer.run`).
    on_purpose: bool = False

    @property
    def overflows(self) -> bool:
        """Not finite, and not on purpose."""
        return bool(self.bad) and not self.on_purpose

    @property
    def risky(self) -> bool:
        """Overflows, or within `HEADROOM` of its outputs' dtype's largest value."""
        return self.overflows or self.max_abs > near_limit(self.out_dtype)

    @property
    def risky_inputs(self) -> bool:
        return self.bad_inputs or self.input_max > near_limit(self.dtype)


def near_limit(dtype: str) -> float:
    """The largest |x| a layer computing in `dtype` may hold, with `HEADROOM`."""
    return DTYPE_MAX.get(dtype, math.inf) / HEADROOM


@dataclasses.dataclass(frozen=True)
class ReplayRun:
    calls: tuple[_Call, ...]
    loss: float
    grads: tuple[Any, ...]

    @property
    def first_bad(self) -> int | None:
        """The first call that is not finite or comes within `HEADROOM` of its range."""
        return next((i for i, call in enumerate(self.calls) if call.risky), None)

    @property
    def grads_finite(self) -> bool:
        return all(g is None or bool(np.isfinite(float_array(g)).all()) for g in self.grads)

    @property
    def sound(self) -> bool:
        """Whether the loss and the gradients are finite (of a float32 replay: its NaN/Inf
        values are on purpose)."""
        return math.isfinite(self.loss) and self.grads_finite


def _on_purpose(run: ReplayRun, reference: ReplayRun) -> ReplayRun:
    """`run`, its calls' NaN/Inf that `reference` (the batch in float32, `sound`) has too
    marked on purpose, inputs and outputs: a value not finite in float32 as well that leaves
    the loss and gradients finite is not the overflow."""
    if not reference.sound or len(reference.calls) != len(run.calls):
        return run
    calls = [
        dataclasses.replace(
            call,
            on_purpose=0 < call.bad <= ref.bad,
            bad_inputs=call.bad_inputs and not ref.bad_inputs,
        )
        if call.layer is ref.layer and (call.bad or call.bad_inputs)
        else call
        for call, ref in zip(run.calls, reference.calls)
    ]
    return dataclasses.replace(run, calls=tuple(calls))


def _call(layer: Any, args: tuple, result: Any) -> _Call:
    out = float_arrays(result)
    finite = [np.abs(a[np.isfinite(a)]) for a in out]
    biggest = max((float(f.max()) for f in finite if f.size), default=0.0)
    bad = sum(int((~np.isfinite(a)).sum()) for a in out)
    past = sum(int((np.abs(a) > FLOAT16_MAX).sum()) for a in out)
    size = sum(a.size for a in out)
    inputs = float_arrays(args)
    bad_inputs = any(not np.isfinite(a).all() for a in inputs)
    input_max = max((float(np.abs(a).max()) for a in inputs if a.size), default=0.0)
    dtypes = {_dtype_name(item) for item in keras.tree.flatten(result) if item is not None}
    narrowest = min(dtypes, key=lambda name: DTYPE_MAX.get(name, math.inf), default="float32")
    return _Call(
        layer, layer.compute_dtype, biggest, bad, past, size, bad_inputs, input_max, narrowest
    )


def _dtype_name(value: Any) -> str:
    dtype = getattr(value, "dtype", None)
    return tf.as_dtype(dtype).name if dtype is not None else "float32"


class Replayer:
    """Replays `batches` of `model` with `loss_fn` (`replay.replay`, in `training` mode: the
    step's, `replay.TRAINING`, by default): forward and backward of the loss times a scale,
    with chosen layers (or all: `in_float32`) in float32."""

    def __init__(
        self,
        model: keras.Model,
        batches: Sequence[tuple],
        loss_fn: Callable,
        training: bool = TRAINING,
    ) -> None:
        self.model, self.batches, self.loss_fn = model, list(batches), loss_fn
        self.training = check_bool("training", training)
        # Each layer's own compute dtype (a replay swaps some to float32), for the messages.
        self.dtypes = {id(layer): layer.compute_dtype for layer in all_layers(model)}
        self._float32: dict[int, tuple[ReplayRun, ...]] = {}

    def run(
        self,
        batch: tuple,
        scale: float,
        float32: Sequence[Any] = (),
        plain: bool = False,
        loss_fn: Callable | None = None,
        judged: bool = True,
    ) -> ReplayRun:
        """One replay with `float32` in float32 (`float32_swapped`; `plain`: float8 layers
        without their quantization too), float8 layers differentiated eagerly; with
        `loss_fn` in place of the replayer's loss when given. `judged`: NaN/Inf that the
        batch's replay in float32 has too, finite loss and gradients there, are on purpose
        (`_on_purpose`), for a batch of the replayer's."""
        calls: list[_Call] = []
        record = lambda layer, args, result: calls.append(_call(layer, args, result))  # noqa: E731
        loss_fn = self.loss_fn if loss_fn is None else loss_fn
        with float32_swapped(list(float32), plain):
            done = replay(self.model, batch, loss_fn, scale, record, training=self.training)
        run = ReplayRun(tuple(calls), done.loss, done.grads)
        index = next((i for i, mine in enumerate(self.batches) if mine is batch), None)
        if not judged or index is None or not any(c.bad or c.bad_inputs for c in run.calls):
            return run
        return _on_purpose(run, self.in_float32(index))

    def forget(self) -> None:
        """Drops the float32 replays kept (`in_float32`): the loss changed."""
        self._float32.clear()

    def all_runs(self, scale: float, float32: Sequence[Any] = ()) -> list[ReplayRun]:
        return [self.run(batch, scale, float32) for batch in self.batches]

    def in_float32(self, index: int) -> ReplayRun:
        """Batch `index` with every layer in float32, float8 ones without their quantization,
        at scale 1 (kept: asked often)."""
        if index not in self._float32:
            everything = all_layers(self.model)
            run = self.run(self.batches[index], 1.0, everything, True, judged=False)
            self._float32[index] = (run,)
        return self._float32[index][0]

    def finite_at(self, scale: float, float32: Sequence[Any]) -> bool:
        """Whether every batch is finite forward and backward at `scale` (False where the
        model's call fails with `float32` in float32, see `runs_with`)."""
        if not self.runs_with(float32):
            return False
        return all(
            run.first_bad is None and run.grads_finite and math.isfinite(run.loss * scale)
            for run in self.all_runs(scale, float32)
        )

    def runs_with(self, float32: Sequence[Any]) -> bool:
        """Whether the model's call runs with `float32` in float32: a layer's call that adds
        a sublayer's output to a tensor of its own (`x + residual` in a Transformer block)
        fails when one is float32 and the other float16 (TensorFlow does not promote)."""
        try:
            self.run(self.batches[0], 1.0, float32)
        except (tf.errors.OpError, TypeError, ValueError):
            return False
        return True


def float32_policy(layer: Any) -> Any:
    """The policy that makes `layer` compute in float32: `float32`, and for a float8 layer
    `float8_from_float32`, which keeps its quantization. A plain policy would stop its float8
    quantization but leave its float8 variables on it (Keras removes none): trained no more,
    and missing from a model loaded from its saved file, whose optimizer state then no
    longer fits (tfmixprec's refuses it)."""
    if is_float8(layer):
        return keras.dtype_policies.get("float8_from_float32")
    return keras.DTypePolicy("float32")


@contextlib.contextmanager
def float32_swapped(layers: Sequence[Any], plain: bool = False) -> Iterator[None]:
    """Within the block, `layers` compute in float32 (`float32_policy`; with `plain`, float8
    layers without their quantization too); their own policies are back after it."""
    float8 = [] if plain else [layer for layer in layers if is_float8(layer)]
    others = [layer for layer in layers if not any(layer is f for f in float8)]
    with policies_swapped(others, "float32"):
        with policies_swapped(float8, keras.dtype_policies.get("float8_from_float32")):
            yield


def move_to_float32(model: keras.Model, layers: Sequence[Any]) -> bool:
    """Makes each of `layers` compute in float32 (`float32_policy`: a float8 layer keeps its
    quantization) and drops `model`'s traced functions; returns whether the model's saved
    config records the change (see `policy.compute_in_float32`)."""
    return compute_in_float32(model, layers, float32_policy)


def warn_not_recorded(model: keras.Model, who: str, names: Sequence[str]) -> None:
    """Warns that `model`'s config does not record the float32 layers `who` set."""
    warnings.warn(
        f"{who} set {', '.join(repr(n) for n in names)} of model {model.name!r} to float32, "
        "but its config does not record layer dtypes, so a saved and reloaded model computes "
        f"them in the policy's dtype again (calibrate and apply again after loading). "
        f"{docs_page('guides/repair')}",
        UserWarning,
        stacklevel=3,
    )
