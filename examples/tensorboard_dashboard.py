"""Write a TensorBoard run that shows the dynamic loss scale at work.

A small float16 model starts with a loss scale far too high (2**20): the first steps overflow
and the scale backs off; then it grows every `--growth-interval` clean steps, overflows again,
and backs off: the sawtooth of a dynamic loss scale. Open TensorBoard's "Mixed precision" tab
to see the loss scale with each overflow step marked, the loss and the layers (or the "Custom
Scalars" tab, category "Mixed precision", for the same values as TensorBoard's own charts).

    python examples/tensorboard_dashboard.py --logdir runs/dashboard
    tensorboard --logdir runs/dashboard
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# tfmixprec first: it imports TensorFlow without the start-up lines this log level hides
import tfmixprec  # noqa: E402, I001
import keras  # noqa: E402
import numpy as np  # noqa: E402


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """1024 samples of a noisy linear target of 4 of 16 features."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 16)).astype("float32")
    y = (x[:, :4] @ rng.normal(size=(4, 1)) + 0.1 * rng.normal(size=(1024, 1))).astype("float32")
    return x, y


def build_model(growth_interval: int) -> tfmixprec.MixedPrecisionModel:
    """A 16-32-32-1 regressor under the current policy, its loss scale starting at 2**20."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu", name="hidden_1")(inputs)
    hidden = keras.layers.Dense(32, activation="relu", name="hidden_2")(hidden)
    outputs = keras.layers.Dense(1, dtype="float32", name="output")(hidden)
    model = tfmixprec.MixedPrecisionModel(inputs, outputs)
    opt = tfmixprec.LossScaleOptimizer(
        keras.optimizers.Adam(3e-3),
        initial_scale=2.0**20,
        growth_interval=growth_interval,
    )
    model.compile(optimizer=opt, loss="mse")
    return model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="TensorBoard dashboard of the loss scale.")
    parser.add_argument("--logdir", default="runs/dashboard")
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--growth-interval", type=int, default=20)
    args = parser.parse_args(argv)

    x, y = make_data()
    with tfmixprec.policy_scope(args.policy):
        model = build_model(args.growth_interval)
        gradients = tfmixprec.GradientRangeMonitor((x[:64], y[:64]), update_freq=16)
        board = tfmixprec.TensorBoard(args.logdir, update_freq=1, gradient_monitor=gradients)
        monitor = tfmixprec.LossScaleMonitor(verbose=1, update_freq=32)
        history = model.fit(
            x, y, batch_size=32, epochs=args.epochs, verbose=0, callbacks=[board, monitor]
        )

    state = model.optimizer.read_state()
    result = {
        "final_loss": history.history["loss"][-1],
        "loss_scale": state["loss_scale"],
        "overflow_steps": state["overflow_steps"],
        "applied_steps": state["iterations"],
        "grad_underflow_fraction": gradients.weight_stats.underflow_fraction,
    }
    print(
        f"final loss {result['final_loss']:.4f}, loss scale {result['loss_scale']:g}, "
        f"overflow steps {result['overflow_steps']} of "
        f"{result['overflow_steps'] + result['applied_steps']}"
    )
    tab = 'then the "Mixed precision" tab'
    print(f"open the dashboard: tensorboard --logdir {args.logdir}, {tab}")
    return result


if __name__ == "__main__":
    main()
