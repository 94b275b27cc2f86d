"""`explain_overflow` on models that really overflow in float16: is each named correctly?

Four cases, each trained with `fit` in `mixed_float16` until a step overflows (or, for the
last, until training shows the problem), then diagnosed from the bad batch:

- `transformer`: a Transformer block (multi-head attention + feed-forward) fed activations
  large enough that its attention logits pass 65504: expected `forward-overflow` in the
  attention layer, finite in float32/bfloat16;
- `nan-label`: a classifier whose batch holds a NaN label: expected `bad-data`;
- `high-scale`: an MLP started at a loss scale of 2^24, too high for its gradients:
  expected `backward-overflow`, the scale's own backoff, nothing to fix;
- `underflow`: a deep MLP whose loss is tiny (x 2^-27), trained without loss scaling:
  expected `underflow`, with the share of gradients flushed to zero.

It prints, per case, the expected and the found cause and layer, the overflow report kept in
the step (`tfmixprec.overflow_report`), and the diagnosis as markdown.

    python benchmarks/diagnosis.py            # about a minute here
"""

from __future__ import annotations

import argparse
import os
import platform

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmixprec  # noqa: E402


def transformer_block(tokens: int = 16, width: int = 32) -> tuple[keras.Model, tuple, str]:
    inputs = keras.Input((tokens, width))
    attended = keras.layers.MultiHeadAttention(4, width // 4, name="attention")(inputs, inputs)
    hidden = keras.layers.LayerNormalization(name="norm")(inputs + attended)
    hidden = keras.layers.Dense(4 * width, activation="relu", name="ffn_in")(hidden)
    hidden = keras.layers.Dense(width, name="ffn_out")(hidden)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(hidden)
    outputs = keras.layers.Dense(4, activation="softmax", dtype="float32", name="probs")(pooled)
    model = tfmixprec.MixedPrecisionModel(inputs, outputs, name="transformer")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    # Activations of size ~300 (e.g. an un-normalized residual stream): q.k passes 65504.
    x = (300.0 * rng.normal(size=(32, tokens, width))).astype("float32")
    y = rng.integers(0, 4, size=(32,))
    return model, (x, y), "forward-overflow in attention"


def classifier_with_nan_label() -> tuple[keras.Model, tuple, str]:
    inputs = keras.Input((20,))
    hidden = keras.layers.Dense(64, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(1, dtype="float32", name="out")(hidden)
    model = tfmixprec.MixedPrecisionModel(inputs, outputs, name="regressor")
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 20)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    y[5, 0] = np.nan
    return model, (x, y), "bad-data"


def _dense_stack(
    hidden: keras.KerasTensor, depth: int, width: int, activation: str
) -> keras.KerasTensor:
    """`depth` Dense layers named dense_0, dense_1, ... on top of `hidden`."""
    for i in range(depth):
        hidden = keras.layers.Dense(width, activation=activation, name=f"dense_{i}")(hidden)
    return hidden


def mlp_at_a_high_scale() -> tuple[keras.Model, tuple, str]:
    inputs = keras.Input((64,))
    hidden = _dense_stack(inputs, depth=3, width=128, activation="relu")
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32", name="probs")(hidden)
    model = tfmixprec.MixedPrecisionModel(inputs, outputs, name="mlp")
    model.compile(
        optimizer=tfmixprec.LossScaleOptimizer("adam", initial_scale=2.0**24),
        loss="sparse_categorical_crossentropy",
    )
    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, 64)).astype("float32")
    y = rng.integers(0, 10, size=(32,))
    return model, (x, y), "backward-overflow"


def deep_mlp_with_tiny_gradients() -> tuple[keras.Model, tuple, str]:
    inputs = keras.Input((64,))
    hidden = _dense_stack(inputs, depth=6, width=64, activation="tanh")
    outputs = keras.layers.Dense(10, dtype="float32", name="logits")(hidden)
    model = tfmixprec.MixedPrecisionModel(inputs, outputs, name="deep_mlp")

    def tiny(y_true, y_pred):  # a loss whose scale is tiny, as in benchmarks/parity.py
        loss = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        return loss * 2.0**-27

    model.compile(optimizer="sgd", loss=tiny, loss_scaling="none")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 64)).astype("float32")
    y = rng.integers(0, 10, size=(32,))
    return model, (x, y), "underflow"


CASES = {
    "transformer": transformer_block,
    "nan-label": classifier_with_nan_label,
    "high-scale": mlp_at_a_high_scale,
    "underflow": deep_mlp_with_tiny_gradients,
}


def run_case(name: str) -> tuple[str, tfmixprec.OverflowDiagnosis]:
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        model, (x, y), expected = CASES[name]()
        # The optimizer's variables now, as Keras makes them under a distribution strategy: left to
        # the first `fit`, its first trace makes them and TensorFlow traces the step again.
        model.optimizer.build(model.trainable_variables)
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # one step on the batch
    report = tfmixprec.overflow_report(model)
    diagnosis = tfmixprec.explain_overflow(model, (x, y))
    found = diagnosis.cause + (f" in {diagnosis.layer}" if diagnosis.layer else "")
    ok = found == expected or (not expected.count(" in ") and diagnosis.cause == expected)
    print(f"## {name}: expected {expected}; found {found} [{'OK' if ok else 'WRONG'}]")
    print(f"overflow report kept in the step: {report}")
    print(diagnosis.to_markdown())
    print()
    return found, diagnosis


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    print(
        f"machine: {platform.processor() or platform.machine()}, TensorFlow {tf.__version__}, "
        f"Keras {keras.__version__}"
    )
    for name in args.cases:
        run_case(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
