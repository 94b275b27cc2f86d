"""Train an MLP with float8 layers and write what float8 does to them to TensorBoard.

The model is built under `mixed_bfloat16` and `tfmixprec.float8_layers` quantizes the layers
that suit float8 (not the first layer, not the output layer). `tfmixprec.TensorBoard` writes,
per float8 layer and quantized tensor (inputs, kernel, output gradient), the scale, the amax
and the shares of values that saturated and that were zero once quantized; a
`tfmixprec.Float8Monitor` reads the same numbers in Python, printed at the end. Open the
"Custom Scalars" tab, category "Mixed precision: float8".

    python examples/float8_dashboard.py --logdir runs/float8
    tensorboard --logdir runs/float8
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# tfmixprec first: it imports TensorFlow without the start-up lines this log level hides
import tfmixprec  # noqa: E402, I001
import keras  # noqa: E402


def build() -> keras.Model:
    """An MLP for the 8x8 digits: 64 -> 128 -> 128 -> 128 -> 10."""
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(128, activation="relu", name="first")]
        + [keras.layers.Dense(128, activation="gelu", name=f"hidden_{i}") for i in (1, 2)]
        + [keras.layers.Dense(10, name="logits")]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs/float8")
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args(argv)
    tfmixprec.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    model = build()
    for change in tfmixprec.float8_layers(model):
        print(f"{change.layer}: {change.old} -> {change.new} (matmul {change.dims})")
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    (x, y), _ = tfmixprec.datasets.load_digits()
    board = tfmixprec.TensorBoard(args.logdir, update_freq=5)
    monitor = tfmixprec.Float8Monitor()
    history = model.fit(
        x.reshape(-1, 64),
        y,
        batch_size=64,
        epochs=args.epochs,
        verbose=0,
        callbacks=[board, monitor],
    )
    print(f"loss: {history.history['loss'][0]:.3f} -> {history.history['loss'][-1]:.3f}")
    _, last = monitor.history[-1]
    for layer in last:
        for name, stats in layer.tensors().items():
            print(
                f"{layer.layer} {name}: scale {stats.scale:.3g}, amax {stats.amax:.3g}, "
                f"saturated {stats.saturated_fraction:.2%}, flushed {stats.flushed_fraction:.2%}"
            )


if __name__ == "__main__":
    main()
