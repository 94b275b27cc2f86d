"""Models for the diagnosis of values that are not finite on purpose, or underflow: a float32
key mask of `-inf` next to a layer that really passes float16's range; `log(softmax(x))`."""

import keras
import numpy as np

import tfmixprec

C = keras.initializers.Constant


class KeyMask(keras.layers.Layer):
    """Adds `fill` to the last two of four scores: a key mask, as attention code writes it."""

    def __init__(self, fill, **kwargs):
        super().__init__(**kwargs)
        self.fill = fill

    def call(self, scores):
        mask = keras.ops.convert_to_tensor([0.0, 0.0, self.fill, self.fill], scores.dtype)
        return scores + mask


def masked_model(fill=-np.inf, model_class=tfmixprec.MixedPrecisionModel, jit_compile=False):
    """`scores` -> `mask` (float32, `fill` on two keys) -> a float32 softmax `attend`: finite
    whatever the fill. `wide` (float16) passes 65504 (1e5 times weights that sum to 1), `down`
    casts `wide`'s outputs back to float16 and brings them to 16."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        scores = keras.layers.Dense(4, name="scores", dtype="float32")(inputs)
        weights = keras.layers.Softmax(name="attend", dtype="float32")(
            KeyMask(fill, name="mask", dtype="float32")(scores)
        )
        wide = keras.layers.Dense(16, name="wide", kernel_initializer=C(1e5))(weights)
        down = keras.layers.Dense(4, name="down", kernel_initializer=C(1e-5))(wide)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(down)
        model = model_class(inputs, outputs)
        # A rate of 0: the weights stay as built (`down` sees values of 1e5, and any rate
        # would soon make its outputs diverge).
        sgd = keras.optimizers.SGD(0.0)
        optimizer = tfmixprec.LossScaleOptimizer(sgd, initial_scale=8.0)
        model.compile(optimizer, "mse", jit_compile=jit_compile)
    return model


def masked_data(n=16):
    return np.ones((n, 8), "float32"), np.zeros((n, 1), "float32")


class LogProbabilities(keras.layers.Layer):
    """`log(softmax(x))`, as written by hand (not `log_softmax`)."""

    def call(self, logits):
        return keras.ops.log(keras.ops.softmax(logits))


def log_softmax_model(model_class=tfmixprec.MixedPrecisionModel):
    """`logits` (float16) gives 26.5 for the first of 8 classes and 0 for the others on inputs
    of 1: their probabilities, exp(-26.5) = 3e-12, round to 0 in float16, and `log_probs`'s
    log of them is -inf; in float32 its largest |x| is 26.5."""
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        kernel = np.zeros((8, 8), "float32")
        kernel[:, 0] = 26.5 / 8
        logits = keras.layers.Dense(8, name="logits", kernel_initializer=C(kernel))(inputs)
        log_probs = LogProbabilities(name="log_probs")(logits)
        outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer="ones")(
            log_probs
        )
        model = model_class(inputs, outputs)
        model.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.0)), "mse")
    return model
