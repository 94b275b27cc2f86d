"""How much float8 costs in loss: bfloat16 against `tfmixprec.float8_layers` and against
Keras's own `model.quantize("float8")` (every `Dense`, the output layer included), after the
same steps from the same start.

For each model (the zoo's GPT-2 and ViT, and an MLP on the bundled digits), three runs from
the same initial weights and batches under `mixed_bfloat16`:

- `bfloat16`: no float8;
- `float8_layers`: the layers `tfmixprec.float8_layers` picks;
- `model.quantize`: Keras's `model.quantize("float8")`, which also quantizes the output layer
  (and the first layer).

It prints the mean training loss over the steps and the loss on the training data after
training, each with its difference to `bfloat16`. Losses only, never a timing:
float8 runs emulated on a CPU (see `benchmarks/gpu_check.py` for speed).

    python benchmarks/float8_quality.py                 # tiny zoo sizes, 60 steps, a CPU
    python benchmarks/float8_quality.py --size bench --steps 200   # on a GPU
    python benchmarks/float8_quality.py --growth        # float16 + float8, loss scale growth

With `--growth`: the MLP under `mixed_float16` with two float8 layers and tfmixprec's dynamic
loss scale (growth every 5 steps), and per step the loss scale and how many of the first
float8 layer's output-gradient values saturated (`Float8Monitor(update_freq=1)`).
"""

from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfmixprec  # noqa: E402

VARIANTS = ("bfloat16", "float8_layers", "model.quantize")
MODELS = ("gpt2", "vit", "mlp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--size", choices=("tiny", "bench"), default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--growth", action="store_true", help="float16 + float8 instead")
    return parser.parse_args(argv)


def build(name: str, size: str, steps: int) -> tuple[keras.Model, tuple, int, object]:
    """The model (built under mixed_bfloat16 from a fixed seed), its data and batch size."""
    tfmixprec.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    if name == "mlp":
        (x, y), _ = tfmixprec.datasets.load_digits()
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(128, activation="relu")]
            + [keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        batch = 64
        n = steps * batch
        return model, (np.resize(x.reshape(-1, 64), (n, 64)), np.resize(y, n), None), batch, loss
    entry = tfmixprec.zoo.build(name, size=size)
    return entry.model, entry.data(steps), entry.batch_size, entry.loss


def run(name: str, variant: str, args: argparse.Namespace) -> tuple[int, float, float]:
    """Trains one variant; returns (float8 layers, mean training loss, final loss)."""
    model, (x, y, w), batch, loss = build(name, args.size, args.steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: layers without a quantize method
        if variant == "float8_layers":
            tfmixprec.float8_layers(model)
        elif variant == "model.quantize":
            model.quantize("float8")
    optimizer = keras.optimizers.Adam(args.learning_rate)
    model.compile(optimizer=optimizer, loss=loss, weighted_metrics=[])
    # The optimizer's variables now, as Keras makes them under a distribution strategy: left to
    # the first `fit`, its first trace makes them and TensorFlow traces the step again.
    optimizer.build(model.trainable_variables)
    history = model.fit(x, y, sample_weight=w, batch_size=batch, verbose=0, shuffle=False)
    final = model.evaluate(x, y, sample_weight=w, batch_size=batch, verbose=0)
    final = final[0] if isinstance(final, list) else final
    quantized = sum(tfmixprec.float8.is_float8(layer) for layer in model._flatten_layers())
    return quantized, float(history.history["loss"][-1]), float(final)


def table(args: argparse.Namespace) -> list[str]:
    lines = [
        f"machine: {tfmixprec.detect_hardware().cpu_name}; zoo size {args.size}; "
        f"{args.steps} steps, Adam({args.learning_rate}); loss: the mean over the steps / "
        "on the training data after training",
        "",
        "| model | variant | float8 layers | training loss | vs bfloat16 | final loss | "
        "vs bfloat16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        base = None
        for variant in VARIANTS:
            quantized, last, final = run(name, variant, args)
            base = base or (last, final)
            lines.append(
                f"| {name} | {variant} | {quantized} | {last:.4f} | {last / base[0] - 1:+.1%} "
                f"| {final:.4f} | {final / base[1] - 1:+.1%} |"
            )
    return lines


def growth_table(steps: int) -> list[str]:
    """Per step of a float16 MLP with float8 layers: the loss scale after the step, and the
    saturated and flushed output-gradient values of its first float8 layer."""
    tfmixprec.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    (x, y), _ = tfmixprec.datasets.load_digits()
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(128, activation="relu")]
        + [keras.layers.Dense(128, activation="gelu"), keras.layers.Dense(128)]
        + [keras.layers.Dense(10)]
    )
    tfmixprec.float8_layers(model)
    tfmixprec.float32_outputs(model)
    inner = keras.optimizers.Adam(1e-3)
    optimizer = tfmixprec.LossScaleOptimizer(inner, initial_scale=2.0**10, dynamic_growth_steps=5)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    optimizer.build(model.trainable_variables)  # as in `run`: one trace of the step
    monitor, scales = tfmixprec.Float8Monitor(update_freq=1), []
    read = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: scales.append(optimizer.read_state()["loss_scale"])
    )
    n = 64 * steps
    model.fit(
        x.reshape(-1, 64)[:n],
        y[:n],
        batch_size=64,
        verbose=0,
        shuffle=False,
        callbacks=[monitor, read],
    )
    lines = [
        "| step | loss scale after it | saturated | flushed | values |",
        "|---|---|---|---|---|",
    ]
    for (step, (layer, *_)), scale in zip(monitor.history, scales):
        grad = layer.outputs_grad
        lines.append(f"| {step} | {scale:g} | {grad.saturated} | {grad.flushed} | {grad.values} |")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    lines = growth_table(min(args.steps, 22)) if args.growth else table(args)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
