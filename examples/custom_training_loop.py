"""Custom GradientTape loops with tfmixprec, three ways.

1. `tfmixprec.make_train_step`: a compiled step that returns {loss, loss_scale, overflow}.
2. `tfmixprec.compute_unscaled_gradients`: your own step, the scaling done for you.
3. The TensorFlow 2 mixed-precision guide's loop (`get_scaled_loss` /
   `get_unscaled_gradients` / `apply_gradients`), unchanged, on tfmixprec's optimizer.

Each trains a small classifier on synthetic data, injects one Inf batch to show the skipped
step, and prints the loss, the loss scale and the overflow count. Under `mixed_bfloat16` (what
`auto` picks on a CPU with AVX512_BF16 or AMX) there is no loss scale: bfloat16 has float32's
range. Each way then uses a fixed scale of 1, which still skips the Inf step, and says so.

    python examples/custom_training_loop.py [--policy auto] [--steps 60]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# tfmixprec first: it imports TensorFlow without the start-up lines this log level hides
import tfmixprec  # noqa: E402, I001
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def make_data(n: int = 512, features: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features,)).astype("float32")
    y = (x @ w > 0).astype("int32")
    return x, y


def make_model(features: int = 16) -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(2),
            keras.layers.Softmax(),
        ]
    )
    tfmixprec.float32_outputs(model)  # the softmax output computes in float32
    return model


def batches(x, y, batch: int, steps: int, bad_step: int):
    for step in range(steps):
        start = (step * batch) % (len(x) - batch)
        xb, yb = x[start : start + batch].copy(), y[start : start + batch]
        if step == bad_step:
            xb[0, 0] = np.inf  # one corrupt batch: the step is skipped, weights untouched
        yield tf.constant(xb), tf.constant(yb)


def make_optimizer() -> tfmixprec.LossScaleOptimizer:
    """Adam in a tfmixprec.LossScaleOptimizer: a dynamic loss scale for float16; for bfloat16
    and float32 a fixed scale of 1 (no scaling), as make_train_step and compile choose."""
    adam = keras.optimizers.Adam(1e-2)
    if keras.config.dtype_policy().compute_dtype == "float16":
        return tfmixprec.LossScaleOptimizer(adam)
    return tfmixprec.LossScaleOptimizer(adam, initial_scale=1.0, dynamic=False)


def loss_scale_text(state: dict) -> str:
    """`loss_scale=16384` under float16; under bfloat16/float32, that there is none."""
    compute_dtype = keras.config.dtype_policy().compute_dtype
    if compute_dtype == "float16":
        return f"loss_scale={state['loss_scale']:g}"
    return f"loss_scale=none ({compute_dtype} needs no loss scaling)"


def run_make_train_step(x, y, steps: int) -> dict:
    model = make_model()
    step = tfmixprec.make_train_step(
        model, keras.losses.SparseCategoricalCrossentropy(), keras.optimizers.Adam(1e-2)
    )
    for xb, yb in batches(x, y, 32, steps, bad_step=steps // 2):
        logs = step(xb, yb)
    return {"loss": float(logs["loss"]), "optimizer": step.optimizer, "model": model}


def run_compute_unscaled_gradients(x, y, steps: int) -> dict:
    model = make_model()
    opt = make_optimizer()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads, _finite = tfmixprec.compute_unscaled_gradients(
            tape, loss, model.trainable_variables, opt
        )
        opt.apply(grads, model.trainable_variables)  # skips the step if not finite
        return loss

    for xb, yb in batches(x, y, 32, steps, bad_step=steps // 2):
        loss = train_step(xb, yb)
    return {"loss": float(loss), "optimizer": opt, "model": model}


def run_tf2_guide_loop(x, y, steps: int) -> dict:
    model = make_model()
    opt = make_optimizer()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
            scaled_loss = opt.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = opt.get_unscaled_gradients(scaled_grads)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for xb, yb in batches(x, y, 32, steps, bad_step=steps // 2):
        loss = train_step(xb, yb)
    return {"loss": float(loss), "optimizer": opt, "model": model}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description="Custom training loops with tfmixprec.")
    parser.add_argument("--policy", default="auto", help="auto, mixed_float16, ...")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)

    policy = tfmixprec.set_policy(args.policy)
    print(f"policy: {policy.name}")
    x, y = make_data()
    results = {}
    for name, run in [
        ("make_train_step", run_make_train_step),
        ("compute_unscaled_gradients", run_compute_unscaled_gradients),
        ("tf2_guide_loop", run_tf2_guide_loop),
    ]:
        keras.utils.set_random_seed(0)
        result = run(x, y, args.steps)
        state = result["optimizer"].read_state()
        probs = result["model"].predict(x, verbose=0)
        accuracy = float(np.mean(np.argmax(probs, axis=1) == y))
        print(
            f"{name:27s} loss={result['loss']:.4f} accuracy={accuracy:.3f} "
            f"{loss_scale_text(state)} overflow_steps={state['overflow_steps']} "
            f"applied_steps={state['iterations']}"
        )
        results[name] = {
            "loss": result["loss"],
            "accuracy": accuracy,
            "overflow_steps": state["overflow_steps"],
            "applied_steps": state["iterations"],
            "loss_scale": state["loss_scale"],
        }
    return results


if __name__ == "__main__":
    main()
