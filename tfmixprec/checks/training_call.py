"""One training call of a model on zeros, for `audit`: the dtype clash of a model that runs in
inference and cannot train.

KerasHub's MoE decoders (Mixtral, Qwen-MoE) under `mixed_float16` or `mixed_bfloat16` run in
inference and raise in every training call: their sparse MoE block multiplies the router's
float16 softmax by a mask its code casts to float32 in the load-balancing loss, which it
computes in training only (`replay.clash`). The audit's inference call cannot see it, so the
audit also replays one training step's forward on the batch of zeros `observe` calls the
model on: the replay engine's (`replay.calibration.Replayer`, `replay.engine.replay`: the
step's training mode, every leaf call watched, the model's state put back), with the compiled
loss as `fit` computes it (`model.compute_loss`: the compiled loss on targets it accepts,
`_common.targets`, and the losses the call added) and no backward pass (the loss is constant
to the tape: the gradients are not what the audit reads). Where that call meets a
`DtypeClash`, the layers whose float32 lets it run are found as `calibrate` finds them
(`float32_set` on the same batch), so the finding names the fix `calibrate` would apply.

Private: used by `audit`; nothing here is part of the package's API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.layers import layer_names
from tfmixprec._common.observe import zeros_like_inputs
from tfmixprec._common.targets import made_up_targets
from tfmixprec.replay.calibration_search import float32_set
from tfmixprec.replay.clash import DtypeClash, DtypeClashError
from tfmixprec.replay.replayer import Replayer

__all__: list[str] = []  # private module: nothing here is part of the package's API


@dataclasses.dataclass(frozen=True)
class TrainingClash:
    """What a training call on zeros met: the clash, and the layers (full names, as
    `calibrate` reports them) whose float32 lets the call run, or why none does.

    Attributes:
        clash: `DtypeClash`. The operation of the model's code that mixes dtypes.
        float32_layers: Tuple of strings. What `calibrate` would compute in float32.
        problem: String or None. What no float32 layer fixes, in a sentence.
    """

    clash: DtypeClash
    float32_layers: tuple[str, ...]
    problem: str | None

    def message(self) -> str:
        return (
            f"a training call on a batch of zeros raises: {self.clash.describe()}. The model "
            "runs in inference, but every training step raises."
        )

    def fix(self) -> str:
        if self.problem is not None or not self.float32_layers:
            return "Cast the tensor to the other dtype in that code: no layer in float32 helps."
        layers = ", ".join(repr(name) for name in self.float32_layers)
        return (
            f"Compute {layers} in float32 (tfmixprec.calibrate(model, data) finds it, and "
            "report.apply(model) sets it), or cast the tensor in that code."
        )


def training_clash(model: keras.Model) -> TrainingClash | None:
    """Replays one training call of `model` on a batch of zeros, with its loss and without
    gradients, its state put back; the `TrainingClash` it meets, or None (the call runs, or
    fails for another reason than a dtype clash: the audit's inference call judges the
    rest)."""
    x = zeros_like_inputs(model)
    replayer = Replayer(model, [(x, None, None)], _step_loss(model, x))
    try:
        replayer.run(replayer.batches[0], 1.0)
    except DtypeClashError as err:
        found = float32_set(replayer)
        names = layer_names(model)
        layers = tuple(names[id(layer)] for layer, _ in found.layers)
        return TrainingClash(err.clash, layers, found.problem)
    except Exception:  # noqa: BLE001 - the user's model failing otherwise is not this check's
        return None
    return None


def _step_loss(model: keras.Model, x: Any) -> Callable[[Any, Any], Any]:
    """The loss of a training step as `fit` computes it (`compute_loss`: the compiled loss on
    made-up targets it accepts, and the losses the call added), held constant for the tape;
    zero for a model compiled without a loss."""

    def loss(_: Any, y_pred: Any) -> Any:
        if getattr(model, "loss", None) is None and not model.losses:
            return tf.zeros(())
        targets, _ = made_up_targets(model, y_pred)
        return tf.stop_gradient(model.compute_loss(x, targets, y_pred))  # training=True

    return loss
