"""`model.fit` with tfmixprec's train_step and callbacks.

Trains a small classifier on scikit-learn's digits (shipped inside the package) with
`MixedPrecisionModel`, `LossScaleMonitor`, `OverflowGuard` and `GradientRangeMonitor`, then
prints what each saw. One batch of the training data is corrupted with a NaN on purpose: the
step is skipped, the guard does not stop (an isolated overflow is not a divergence).

    python examples/fit_with_callbacks.py [--policy auto] [--epochs 5]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# tfmixprec first: it imports TensorFlow without the start-up lines this log level hides
import tfmixprec  # noqa: E402, I001
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfmixprec.datasets import load_digits  # noqa: E402


def load_data():
    """The digits split, flattened, with one NaN in the training data."""
    (x, y), (x_test, y_test) = load_digits()
    x, x_test = x.reshape(len(x), -1), x_test.reshape(len(x_test), -1)
    x = x.copy()
    x[70, 3] = np.nan  # one corrupt sample: batch 2 of the first epoch overflows
    return (x, y), (x_test, y_test)


def build_model() -> tfmixprec.MixedPrecisionModel:
    """A 64-64-10 classifier under the current policy, outputs in float32, compiled."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax", name="probs")(hidden)
    model = tfmixprec.MixedPrecisionModel(inputs, outputs)
    tfmixprec.float32_outputs(model)
    # A plain optimizer: compile picks the loss scale (dynamic for float16, none for bfloat16).
    model.compile(
        optimizer=keras.optimizers.Adam(2e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def print_result(result: dict, state: dict, stats: tfmixprec.GradientRangeStats) -> None:
    print(f"policy {result['policy']}: test accuracy {result['test_accuracy']:.3f}")
    bfloat16 = keras.DTypePolicy(result["policy"]).compute_dtype == "bfloat16"
    # bfloat16 has float32's range: there is no loss scale, and none to recommend.
    scale = "no loss scale" if bfloat16 else f"loss scale {state['loss_scale']:g}"
    print(
        f"overflow steps {result['overflow_steps']} (the NaN batch, once per epoch), "
        f"{scale}, guard stopped: {result['guard_stopped']}"
    )
    # recommend_loss_scale: the smallest power of two that lifts all but the smallest 1% of
    # these (unscaled) gradients into float16's normal range, the largest kept below 65504;
    # the dynamic scale may sit above it, and below the overflow point.
    advice = (
        "no loss scale needed (bfloat16 has float32's range)"
        if bfloat16
        else f"smallest sufficient loss scale {result['recommended_scale']:g} (lifts 99% of them "
        f"into float16's normal range; training at {state['loss_scale']:g})"
    )
    print(
        f"weight gradients: {stats.underflow_fraction:.2%} below 2^-24, "
        f"{stats.subnormal_fraction:.2%} float16-subnormal, {stats.zero_fraction:.2%} zero; "
        f"{advice}"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="fit with tfmixprec callbacks")
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)

    (x, y), (x_test, y_test) = load_data()
    policy = tfmixprec.set_policy(args.policy)
    model = build_model()
    monitor = tfmixprec.LossScaleMonitor(verbose=1, update_freq=10)
    guard = tfmixprec.OverflowGuard(patience=50, max_consecutive=5)
    gradients = tfmixprec.GradientRangeMonitor(
        (x_test[:64], y_test[:64]), update_freq=20, layers=["hidden"]
    )
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=args.epochs,
        shuffle=False,
        verbose=2,
        callbacks=[monitor, guard, gradients],
    )
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    state = model.optimizer.read_state()
    stats = gradients.weight_stats
    result = {
        "policy": policy.name,
        "epochs_run": len(history.history["loss"]),
        "test_accuracy": accuracy,
        "overflow_steps": state["overflow_steps"],
        "guard_stopped": guard.stopped_step is not None,
        "underflow_fraction": stats.underflow_fraction,
        "recommended_scale": gradients.recommend_loss_scale(),
    }
    print_result(result, state, stats)
    return result


if __name__ == "__main__":
    main()
