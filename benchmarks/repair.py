"""`PrecisionRepair` and `calibrate` on models that really fail in `mixed_float16` (issue 28).

Three models whose float16 training fails with Keras's own optimizer (`compile(optimizer=
keras.optimizers.Adam(...))` under `keras.config.set_dtype_policy("mixed_float16")`, which
wraps it in Keras's `LossScaleOptimizer`), while they train in float32:

- `gpt2-ffn`: a KerasHub GPT-2 (2 layers, hidden 64, built from its config, nothing
  downloaded) whose first block's feed-forward intermediate kernel is multiplied by
  `--ffn-gain` after building, so its outputs pass 65504 (float16's largest value) while the
  LayerNormalization after the residual keeps the model finite in float32. Large
  feed-forward activations are what broke T5 in float16 (its pretrained feed-forward weights
  grew so, Hugging Face clamps them); the gain stands for such trained weights.
- `residual`: a plain functional stack of 16 residual blocks (two He-initialized Dense layers
  and a `keras.layers.Add`) with a LayerNormalization only at the end, on unnormalized inputs
  (standard deviation 5): each block about doubles the stream's variance (why Fixup and
  SkipInit exist), so the stream passes 65504 in the last blocks, before the normalization.
- `gelu-regression`: a regressor whose first Dense (tanh-approximated GELU, as GPT-2 and BERT
  use) sees raw features in the hundreds. Its forward pass is finite in float16, but the
  GELU's derivative computes x^3 (past 65504 from |x| > 114): its gradients are NaN at any
  loss scale, even unscaled.

Each model is trained four ways, from the same weights (`--seed`), data and batch order:

- `float32`: the all-float32 policy, the reference loss;
- `f16 keras`: `mixed_float16` with Keras's optimizer, no tfmixprec;
- `f16 repair`: the same compile, with `tfmixprec.PrecisionRepair()` in the callbacks;
- `f16 calibrate`: the same compile, then `tfmixprec.calibrate(model, (x, y))` and
  `report.apply(model)` before `fit` (the float32 layers and the starting loss scale), with
  `PrecisionRepair()` in the callbacks too, to count the repairs still needed (goal: 0).

Per run: the last epoch's mean training loss and its relative difference to `float32`; the
skipped steps (batches run minus the optimizer's `iterations`: a skipped step does not
advance the inner optimizer's counter, in Keras's `LossScaleOptimizer` and in tfmixprec's
alike); the repairs made and the layers moved to float32; and the time per step, measured
inside `fit` from the end of each epoch's first batch to the end of its last (a callback),
the median over the epochs (an epoch with a repair, which replays and traces again, counts
as one of them), with its ratio to `float32` and to `f16 keras`.

    python benchmarks/repair.py                 # about 4 minutes on 2 CPU cores
    python benchmarks/repair.py --quick         # tiny sizes, a smoke test (< 60 s)
    python benchmarks/repair.py --models residual --epochs 12
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmixprec  # noqa: E402

VARIANTS = ("float32", "f16 keras", "f16 repair", "f16 calibrate")


class EpochStepTimes(keras.callbacks.Callback):
    """Seconds per step of each epoch, from the end of its first batch to the end of its last
    (the first step's tracing and the epoch's set-up are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_step: list[float] = []

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._start, self._end, self._last = 0.0, 0.0, 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        now = time.perf_counter()
        if batch == 0:
            self._start = now
        self._end, self._last = now, batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._last > 0:
            self.per_step.append((self._end - self._start) / self._last)


# ------------------------------------------------------------------ the models
def gpt2_ffn(args: argparse.Namespace) -> tuple[keras.Model, object, tuple]:
    """A KerasHub GPT-2 whose block 0 feed-forward intermediate kernel is scaled up."""
    import keras_hub

    vocabulary, sequence, hidden = (64, 8, 32) if args.quick else (128, 32, 64)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary,
        num_layers=2,
        num_heads=4,
        hidden_dim=hidden,
        intermediate_dim=4 * hidden,
        max_sequence_length=sequence,
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    kernel = backbone.get_layer("transformer_layer_0")._feedforward_intermediate_dense.kernel
    kernel.assign(kernel * args.ffn_gain)  # the same weights under every policy
    # Sequences counting up from a random start by a random stride (tfmixprec.zoo's task).
    rng = np.random.default_rng(args.seed)
    n = args.batch * args.steps
    start = rng.integers(0, vocabulary - 1, (n, 1))
    stride = rng.integers(1, 4, (n, 1))
    tokens = (1 + (start + stride * np.arange(sequence + 1)) % (vocabulary - 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, sequence), "int32")}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, (x, tokens[:, 1:])


def residual(args: argparse.Namespace) -> tuple[keras.Model, object, tuple]:
    """Residual Dense blocks, one LayerNormalization at the end, unnormalized inputs."""
    features, width, blocks = (16, 32, 6) if args.quick else (32, 128, 16)
    inputs = keras.Input((features,))
    stream = keras.layers.Dense(width, name="stem")(inputs)
    for i in range(blocks):
        dense = dict(kernel_initializer="he_normal")  # each block doubles the stream's variance
        branch = keras.layers.Dense(width, "relu", name=f"block_{i}_in", **dense)(stream)
        branch = keras.layers.Dense(width, name=f"block_{i}_out", **dense)(branch)
        stream = keras.layers.Add(name=f"block_{i}_add")([stream, branch])
    hidden = keras.layers.LayerNormalization(name="norm")(stream)
    outputs = keras.layers.Dense(10, name="logits", dtype="float32")(hidden)
    model = keras.Model(inputs, outputs, name="residual")
    rng = np.random.default_rng(args.seed)
    n = args.batch * args.steps
    centers = rng.normal(size=(10, features))
    y = rng.integers(0, 10, n).astype("int32")
    x = (args.input_scale * (centers[y] + 0.5 * rng.normal(size=(n, features)))).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, (x, y)


def gelu_regression(args: argparse.Namespace) -> tuple[keras.Model, object, tuple]:
    """A regressor with tanh-GELU Dense layers on raw features in the hundreds."""
    features, width = (8, 16) if args.quick else (16, 64)

    def gelu(x):
        return keras.activations.gelu(x, approximate=True)

    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(width, activation=gelu, name="dense_0")(inputs)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden)
    hidden = keras.layers.Dense(width, activation="relu", name="dense_1")(hidden)
    outputs = keras.layers.Dense(1, name="prediction", dtype="float32")(hidden)
    model = keras.Model(inputs, outputs, name="gelu_regression")
    rng = np.random.default_rng(args.seed)
    n = args.batch * args.steps
    raw = rng.uniform(100.0, 1000.0, (n, features))  # e.g. sensor readings, areas, prices
    weights = rng.normal(size=(features, 1)) / np.sqrt(features)
    y = ((raw - 550.0) / 260.0) @ weights + 0.1 * rng.normal(size=(n, 1))
    return model, keras.losses.MeanSquaredError(), (raw.astype("float32"), y.astype("float32"))


MODELS = {"gpt2-ffn": gpt2_ffn, "residual": residual, "gelu-regression": gelu_regression}


# ------------------------------------------------------------------ one run
def run(name: str, variant: str, args: argparse.Namespace) -> dict:
    keras.config.set_dtype_policy("float32" if variant == "float32" else "mixed_float16")
    keras.utils.set_random_seed(args.seed)
    model, loss, (x, y) = MODELS[name](args)
    model.compile(optimizer=keras.optimizers.Adam(args.learning_rate), loss=loss)
    timer = EpochStepTimes()
    callbacks: list = [timer]
    repair = None
    report = None
    if variant == "f16 calibrate":
        report = tfmixprec.calibrate(model, (x, y), batch_size=args.batch)
        print(f"[{name}] calibrate:\n{report}")
        report.apply(model)
    if variant in ("f16 repair", "f16 calibrate"):
        repair = tfmixprec.PrecisionRepair()
        callbacks.append(repair)
    started = time.perf_counter()
    history = model.fit(
        x,
        y,
        batch_size=args.batch,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    seconds = time.perf_counter() - started
    batches = args.epochs * args.steps
    applied = int(np.asarray(model.optimizer.iterations))
    return {
        "loss": float(history.history["loss"][-1]),
        "losses": [float(v) for v in history.history["loss"]],
        "skipped": batches - applied,
        "batches": batches,
        "repairs": None if repair is None else len(repair.repairs),
        "moved": [] if repair is None else [p for r in repair.repairs for p in r.layers],
        "calibrated": () if report is None else report.float32_layers,
        "initial_scale": None if report is None else report.initial_scale,
        "step_ms": 1000 * statistics.median(timer.per_step),
        "fit_s": seconds,
    }


def _loss(value: float) -> str:
    return f"{value:.4g}" if np.isfinite(value) else str(value)


def _layers(paths) -> str:
    return ", ".join(f"`{p}`" for p in paths) if paths else "none"


def table(results: dict) -> list[str]:
    lines = [
        "| model | run | final loss | vs float32 | skipped steps | repairs | layers in float32 "
        "| ms/step | x float32 | x f16 keras |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        reference = runs["float32"]
        for variant, r in runs.items():
            rel = abs(r["loss"] - reference["loss"]) / abs(reference["loss"])
            versus = "-" if variant == "float32" else (f"{rel:.2%}" if np.isfinite(rel) else "NaN")
            repairs = "-" if r["repairs"] is None else str(r["repairs"])
            if variant == "f16 calibrate":
                layers = f"{_layers(r['calibrated'])} (calibrate)"
                if r["moved"]:
                    layers += f"; {_layers(r['moved'])} (repair)"
            else:
                layers = _layers(r["moved"]) if r["repairs"] is not None else "-"
            keras_ms = runs["f16 keras"]["step_ms"] if "f16 keras" in runs else float("nan")
            lines.append(
                f"| {name} | {variant} | {_loss(r['loss'])} | {versus} | "
                f"{r['skipped']} of {r['batches']} | {repairs} | {layers} | "
                f"{r['step_ms']:.1f} | {r['step_ms'] / reference['step_ms']:.2f}x | "
                f"{r['step_ms'] / keras_ms:.2f}x |"
            )
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes and steps (smoke)")
    parser.add_argument("--epochs", type=int, default=None, help="default 16 (--quick: 2)")
    parser.add_argument("--steps", type=int, default=None, help="batches per epoch (16; 4)")
    parser.add_argument("--batch", type=int, default=None, help="default 32 (--quick: 8)")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--ffn-gain", type=float, default=200000.0)
    parser.add_argument("--input-scale", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.epochs = args.epochs or (2 if args.quick else 16)
    args.steps = args.steps or (4 if args.quick else 16)
    args.batch = args.batch or (8 if args.quick else 32)
    if "float32" not in args.variants:
        args.variants.insert(0, "float32")  # the reference

    print(
        f"machine: {platform.machine()} ({os.cpu_count()} cores); tensorflow {tf.__version__}, "
        f"keras {keras.__version__}, tfmixprec {tfmixprec.__version__}"
    )
    print(
        f"epochs={args.epochs} steps/epoch={args.steps} batch={args.batch} "
        f"lr={args.learning_rate} ffn_gain={args.ffn_gain:g} input_scale={args.input_scale:g} "
        f"seed={args.seed} quick={args.quick}"
    )
    results: dict = {}
    for name in args.models:
        results[name] = {}
        for variant in [v for v in VARIANTS if v in args.variants]:
            print(f"[{name}] {variant} ...", flush=True)
            results[name][variant] = r = run(name, variant, args)
            print(
                f"[{name}] {variant}: loss {_loss(r['loss'])}, skipped {r['skipped']} of "
                f"{r['batches']}, repairs {r['repairs']}, {r['step_ms']:.1f} ms/step, "
                f"fit {r['fit_s']:.1f} s",
                flush=True,
            )
    keras.config.set_dtype_policy("float32")
    print()
    print("\n".join(table(results)))
    print()
    for name, runs in results.items():  # how far a few lost steps put a run behind
        losses = runs["float32"]["losses"]
        if len(losses) > 1:
            fell = (losses[-2] - losses[-1]) / losses[-1]
            print(
                f"{name}: float32's epoch loss fell by {fell:.2%} over its last epoch "
                f"({args.steps} steps)"
            )
    return results


if __name__ == "__main__":
    main()
