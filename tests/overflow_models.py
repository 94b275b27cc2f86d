"""Small float16 models whose values pass 65504 in one known way (finite in float32), shared
by test_calibration and test_repair; a run with an overflow and bad data (diagnosis, the
keeper); a tiny KerasHub MoE decoder whose training call mixes dtypes (model code, audit); a fit
over one overflow step with its logs and the Keras guide's custom step (the guarded logs)."""

import contextlib

import keras
import numpy as np
import tensorflow as tf

import tfmixprec

C = keras.initializers.Constant


def model(kind, optimizer=None, cls=None, strategy=None):
    """A float16 model whose values pass 65504 in one way (`kind`), finite in float32."""
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with tfmixprec.policy_scope("mixed_float16"), scope:
        inputs = keras.Input((4, 8) if kind == "attention" else (8,))
        if kind == "attention":  # the logits pass 65504 inside MultiHeadAttention
            attention = keras.layers.MultiHeadAttention(
                2, 8, name="mha", dropout=0.1, kernel_initializer=C(30.0)
            )
            hidden = keras.layers.LayerNormalization(name="norm")(attention(inputs, inputs))
            hidden = keras.layers.Flatten(name="flat")(hidden)
        else:
            stem = keras.layers.Dense(16, name="stem")(inputs)
            # "flows": frozen, so training (the 1e5 activations would make a trainable `proj`
            # diverge) does not change where the values pass 65504.
            frozen = {"trainable": kind != "flows"}
            big = keras.layers.Dense(16, name="big", kernel_initializer=C(10000.0), **frozen)
            hidden = big(inputs)
            if kind == "flows":  # into the next layer, which brings it back into range
                proj = keras.layers.Dense(16, name="proj", kernel_initializer=C(1e-6), **frozen)
                hidden = proj(hidden)
            elif kind == "residual":  # a residual add, then a normalization
                hidden = keras.layers.Add(name="add")([hidden, stem])
            if kind in ("norm", "residual"):
                hidden = keras.layers.LayerNormalization(name="norm")(hidden)
            hidden = keras.layers.Dense(16, name="after")(hidden)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(hidden)
        built = (cls or keras.Model)(inputs, outputs)
        optimizer = optimizer or tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(1e-6))
        built.compile(optimizer, "mse")
    return built


def two_branches():
    """`big1` reads feature 0 and `big2` feature 1 (x 10000 each): a batch whose feature 0 is
    10 overflows `big1` only, one whose feature 1 is 10 `big2` only."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        branches = []
        for index in (0, 1):
            kernel = np.zeros((8, 16), "float32")
            kernel[index] = 10000.0
            dense = keras.layers.Dense(16, name=f"big{index + 1}", kernel_initializer=C(0.0))
            branch = dense(inputs)
            dense.kernel.assign(kernel)
            small = keras.layers.Dense(4, name=f"proj{index + 1}", kernel_initializer=C(1e-4))
            branches.append(small(branch))
        hidden = keras.layers.Concatenate(name="join")(branches)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(hidden)
        built = keras.Model(inputs, outputs)
        built.compile(keras.optimizers.SGD(1e-4), "mse")
    return built


def data(kind, n=32):
    """`n` rows of standard normal inputs (4 positions of them for attention), zero targets."""
    x = np.random.default_rng(0).normal(size=(n, 8)).astype("float32")
    if kind == "attention":
        x = np.repeat(x[:, None, :], 4, axis=1)
    return x, np.zeros((n, 1), "float32")


def overflowing(n=256, every=8, feature=0):
    """`n` rows of small inputs in which every `every`-th row has 10 at `feature`: each batch
    of `every` rows or more passes 65504 in `big` (10000 x 10), zero targets."""
    x = 0.1 * np.random.default_rng(1).normal(size=(n, 8)).astype("float32")
    x[::every, feature] = 10.0
    return x, np.zeros((n, 1), "float32")


def loss_model(loss=None, strategy=None):
    """A float16 model whose outputs are finite (1.0) while its loss, a mean squared error
    against labels of 400 computed in float16 (`loss`: by default Keras's own, built with
    dtype="float16"), is not: 399^2 = 159201 passes 65504."""
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with tfmixprec.policy_scope("mixed_float16"), scope:
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(8, name="hidden", kernel_initializer=C(1 / 8))(inputs)
        outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=C(1 / 8))(
            hidden
        )
        made = keras.Model(inputs, outputs)
        loss = keras.losses.MeanSquaredError(dtype="float16") if loss is None else loss
        made.compile(keras.optimizers.SGD(1e-6), loss)
    return made


def loss_data(n=64):
    """Inputs of ones (outputs of exactly 1.0) and labels of 400."""
    return np.ones((n, 8), "float32"), np.full((n, 1), 400.0, "float32")


def bad_run_model(jit_compile=False, **compile_args):
    """A float16 MixedPrecisionModel and 32 rows: batch 1 (of 8) is finite but not in float16,
    batch 3 holds a NaN."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, name="big")(inputs)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(hidden)
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        optimizer = tfmixprec.LossScaleOptimizer("sgd", initial_scale=8.0)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile, **compile_args)
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    x[9, 0] = 1e6  # batch 1: finite, but not in float16
    x[25, 1] = np.nan  # batch 3: bad data
    return model, x, np.ones((32, 1), "float32")


def tiny_moe(backbone, task):
    """A tiny KerasHub MoE decoder (`backbone` and `task` classes) from its config, under
    mixed_float16, compiled the ordinary way."""
    common = dict(
        vocabulary_size=64,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        num_experts=4,
        top_k=2,
    )
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        model = task(backbone=backbone(common), preprocessor=None)
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit_over_one_overflow(cls, metrics, jit_compile, strategy=None):
    """A `cls` model fitted on 4 batches, batch 1 overflowing (past float16's range in the
    forward pass), with `OverflowGuard`; each step's logs (None for a key they lack) and what
    `get_metrics_result()` said after each."""
    keras.utils.set_random_seed(0)
    with (
        tfmixprec.policy_scope("mixed_float16"),
        (strategy or tf.distribute.get_strategy()).scope(),
    ):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(4, dtype="float32")(keras.layers.Dense(4)(inputs))
        model = cls(inputs, outputs, name="one_overflow")
        opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0, dynamic=False)
        model.compile(optimizer=opt, loss="mse", metrics=metrics, jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")
    x[4, 0] = 1e6
    logged, own = [], []

    def record(batch, logs):  # float32, as the step computes (Keras 3.12 gives Python floats)
        now = {k: float(np.float32(v)) for k, v in model.get_metrics_result().items()}
        logged.append({k: float(logs[k]) if k in logs else None for k in now})
        own.append(now)

    record = keras.callbacks.LambdaCallback(on_train_batch_end=record)
    callbacks = [tfmixprec.OverflowGuard(), record]
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=callbacks)
    assert model.optimizer.read_state()["overflow_steps"] == 1
    return model, logged, own


class NestedLogsModel(keras.Model):
    """The Keras 3 guide's custom `train_step` ("Customizing what happens in fit()" with
    TensorFlow): every metric updated by hand, `{m.name: m.result()}` returned, so the
    compiled metrics come as one nested dict under `compile_metrics`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}
