"""Accuracy parity, the mixed-precision paper's table for tasks that run on a CPU.

Tasks:

- `digits`: scikit-learn's digits (8x8 images), a CNN (two 32-filter convolutions, a
  128-unit dense layer), Adam.
- `underflow`: the same data, an MLP (two hidden layers of 256) whose loss is multiplied by
  2^-27 and trained with SGD at a learning rate multiplied by 2^27. In float32 that is exactly
  the ordinary problem (powers of two); in float16 most gradients fall below 2^-24 and flush
  to zero, as the SSD activation gradients did in the paper.

Columns: float32; mixed_float16 without loss scaling (plain Keras, `auto_scale_loss=False`);
mixed_float16 with a fixed scale of 128; mixed_float16 with tfmixprec's dynamic scale;
mixed_bfloat16. Rows: final test accuracy (mean over seeds), overflow (skipped) steps, final
loss scale. On a machine without a GPU every float16 column, plain Keras's included, runs
through `tfmixprec.cpu_float16` (its products in float32, within float16 rounding), so the
models are sized as they would be on a GPU.

    python benchmarks/parity.py            # 3 seeds, the full table
    python benchmarks/parity.py --quick    # 1 seed, 2 epochs: a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tfmixprec  # noqa: E402
from tfmixprec.tools.bench import describe_machine  # noqa: E402
from tfmixprec.tools.datasets import load_digits  # noqa: E402

UNDERFLOW = 2.0**-27
COLUMNS = {
    "float32": ("float32", "none"),
    "fp16 no scaling": ("mixed_float16", "keras"),
    "fp16 fixed 128": ("mixed_float16", "fixed128"),
    "fp16 dynamic": ("mixed_float16", "dynamic"),
    "bf16": ("mixed_bfloat16", "none"),
}


def build(task: str) -> keras.Model:
    layers = keras.layers
    if task == "digits":
        inputs = keras.Input((8, 8, 1))
        h = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        h = layers.Conv2D(32, 3, padding="same", activation="relu")(h)
        h = layers.MaxPooling2D()(h)
        h = layers.Flatten()(h)
        h = layers.Dense(128, activation="relu")(h)
    else:
        inputs = keras.Input((64,))
        h = layers.Dense(256, activation="tanh")(inputs)
        h = layers.Dense(256, activation="tanh")(h)
    logits = layers.Dense(10)(h)
    outputs = layers.Activation("softmax", dtype="float32")(logits)  # float32 output
    return inputs, outputs


def make_loss(task: str):
    base = keras.losses.SparseCategoricalCrossentropy()
    if task == "digits":
        return base

    def scaled_down(y_true, y_pred):
        return UNDERFLOW * base(y_true, y_pred)

    return scaled_down


def run(task: str, column: str, seed: int, epochs: int, data) -> dict:
    (x_train, y_train), (x_test, y_test) = data
    if task == "underflow":
        x_train, x_test = x_train.reshape(len(x_train), -1), x_test.reshape(len(x_test), -1)
    policy, scaling = COLUMNS[column]
    with tfmixprec.policy_scope(policy):
        keras.utils.set_random_seed(seed)
        inputs, outputs = build(task)
        if task == "digits":
            inner = keras.optimizers.Adam(3e-3)
        else:
            inner = keras.optimizers.SGD(0.5 / UNDERFLOW)
        loss = make_loss(task)
        if scaling == "keras":
            model = keras.Model(inputs, outputs)
            tfmixprec.cpu_float16.fast_float16_layers(model)  # a CPU user's one line
            model.compile(optimizer=inner, loss=loss, metrics=["accuracy"], auto_scale_loss=False)
        else:
            model = tfmixprec.MixedPrecisionModel(inputs, outputs)
            if scaling == "fixed128":
                optimizer = tfmixprec.LossScaleOptimizer(inner, loss_scale=128)
            elif scaling == "dynamic":
                optimizer = tfmixprec.LossScaleOptimizer(inner)
            else:
                optimizer = inner  # compile() wraps it with a fixed scale of 1
            model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
        model.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=0)
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    result = {"accuracy": accuracy, "overflow_steps": None, "loss_scale": None}
    if isinstance(model.optimizer, tfmixprec.LossScaleOptimizer):
        state = model.optimizer.read_state()
        result["overflow_steps"] = state["overflow_steps"]
        result["loss_scale"] = state["loss_scale"]
    return result


def table(task: str, results: dict[str, list[dict]]) -> str:
    columns = list(results)
    lines = [
        f"| {task} | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]

    def cell(values, fmt):
        values = [v for v in values if v is not None]
        return fmt(values) if values else "n/a"

    acc = [
        cell(
            [r["accuracy"] for r in results[c]],
            lambda v: (
                f"{100 * statistics.mean(v):.1f}%"
                + (f" ± {100 * statistics.stdev(v):.1f}" if len(v) > 1 else "")
            ),
        )
        for c in columns
    ]
    overflow = [
        cell([r["overflow_steps"] for r in results[c]], lambda v: f"{statistics.mean(v):g}")
        for c in columns
    ]
    scale = [
        cell(
            [r["loss_scale"] for r in results[c]],
            lambda v: "/".join(sorted({f"{x:g}" for x in v})),
        )
        for c in columns
    ]
    lines.append("| test accuracy (mean ± sd over seeds) | " + " | ".join(acc) + " |")
    lines.append("| overflow (skipped) steps | " + " | ".join(overflow) + " |")
    lines.append("| final loss scale | " + " | ".join(scale) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--tasks", nargs="+", default=["digits", "underflow"])
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 epochs")
    parser.add_argument("--train-size", type=int, default=None, help="use fewer images")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs = 1, 2

    machine = describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores), GPUs: {machine['gpus'] or 'none'}; "
        f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}; seeds={args.seeds} "
        f"epochs={args.epochs}"
    )
    data = load_digits()
    if args.train_size:
        (x_train, y_train), test = data
        data = ((x_train[: args.train_size], y_train[: args.train_size]), test)
    everything = {}
    start = time.perf_counter()
    for task in args.tasks:
        results = {column: [] for column in COLUMNS}
        for column in COLUMNS:
            for seed in range(args.seeds):
                results[column].append(run(task, column, seed, args.epochs, data))
        print()
        print(table(task, results))
        everything[task] = results
    print(f"\ntotal time {time.perf_counter() - start:.0f} s")
    return everything


if __name__ == "__main__":
    main()
