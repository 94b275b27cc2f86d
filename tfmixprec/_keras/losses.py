"""The dtype a Keras loss object computes in, read and set on the object.

Why: Keras 3's `Loss.__init__` stores the dtype it computes in as `_dtype_policy` and
`_dtype` (`keras/src/losses/loss.py`, from Keras 3.0 to 3.15), `__call__` casts the labels and
predictions to `self.dtype`, and there is no setter. A loss built with `dtype="float16"` (or
a subclass that passes it) then overflows by itself past 65504 whatever the layers compute
in; `calibrate` and `PrecisionRepair` repair it by setting both on the loss object `compile`
was given, which is the object Keras's compiled loss calls (`compile_utils.get_loss` keeps a
`Loss` as it is). A plain function (or a string naming one) has no dtype of its own: Keras
wraps it in a `LossFunctionWrapper` (`keras.src.losses.losses`, not exported; Keras 3.0 to
3.15), which casts the predictions to float32 and matches their rank to the labels' first;
`as_compiled` wraps it the same way, so a replay computes the loss as `fit` does.
"""

from __future__ import annotations

from typing import Any

import keras
from keras.src.losses.losses import LossFunctionWrapper

__all__: list[str] = []  # private module: nothing here is part of the package's API


def loss_dtype(loss: Any) -> str | None:
    """The dtype `loss` computes in: a `keras.losses.Loss`'s own; None for a function."""
    if not isinstance(loss, keras.losses.Loss):
        return None
    return str(loss.dtype)


def set_loss_dtype(loss: keras.losses.Loss, dtype: str) -> None:
    """Makes `loss` compute in `dtype` from its next call (a traced function that called it
    keeps what it traced: its owner traces again)."""
    policy = keras.dtype_policies.get(dtype)
    loss._dtype_policy = policy
    loss._dtype = policy.compute_dtype


def loss_in(loss: keras.losses.Loss, dtype: str) -> keras.losses.Loss:
    """A copy of `loss` that computes in `dtype` (`loss` itself unchanged): the same object's
    attributes in a new one of its class, not a copy rebuilt from its config (`copy.copy`
    goes through Keras's saving, which needs the class registered and keeps only what
    `get_config` returns)."""
    copied = object.__new__(type(loss))
    copied.__dict__.update(vars(loss))
    set_loss_dtype(copied, dtype)
    return copied


def as_compiled(loss: Any) -> Any:
    """`loss` as Keras's compiled loss calls it: a `keras.losses.Loss` as it is, a plain
    function in a `LossFunctionWrapper` (float32, ranks matched)."""
    if isinstance(loss, keras.losses.Loss) or not callable(loss):
        return loss
    return LossFunctionWrapper(loss, name=getattr(loss, "__name__", None))
