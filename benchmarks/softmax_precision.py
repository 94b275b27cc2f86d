"""Does a softmax computed in float16/bfloat16 inside a model lose anything? The evidence behind
`tfmixprec.audit`'s rule that only what the loss sees (the model's outputs) must be float32.

Keras's `MultiHeadAttention` computes its softmax with its own `Softmax` layer, in the layer's
dtype, whenever it has dropout (KerasHub's GPT-2 and BERT do); without dropout it takes the
fused `ops.dot_product_attention`, which casts the scores to float32, takes the softmax there
and casts the probabilities back to the layer's dtype before the product with the values.
Either way the probabilities reach the product in float16/bfloat16. Two measurements:

1. Kernels. Scores drawn from N(0, sigma) and rounded to the low dtype (as the scores einsum
   leaves them), softmax over `n` keys, then the attention product with values: the forward
   output and the backward gradient of the scores, through (a) the softmax in the low dtype
   (the `Softmax` layer as Keras runs it) and (b) a float32 softmax cast back (the fused path;
   also what `dtype="float32"` on the `Softmax` layer gives). Errors against float64 of the
   same rounded inputs, in units of the low dtype's machine epsilon.
2. Training. A KerasHub GPT-2 (dropout 0.1, so the `Softmax` layer runs) trained from the same
   seed under float32, under the mixed policy as built, and under the mixed policy with its
   attention `Softmax` layers computing in float32: the loss at every step, and its largest
   relative distance from float32's.

    python benchmarks/softmax_precision.py            # about a minute on 2 cores
    python benchmarks/softmax_precision.py --quick    # a tiny run, for the tests

`--quick` shrinks the kernels to one size (64 keys, sigma 4, 8 rows) and the GPT-2 to
`QUICK_GPT2` (1 layer, hidden 32, sequence 16, vocabulary 64) for 2 steps: every line still runs.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# The GPT-2 trained in part 2, and the one `--quick` trains (tests: its size changes nothing
# the table's code does, and a KerasHub model's tracing dominates the run's time).
GPT2 = dict(layers=2, hidden=128, heads=4, vocabulary=512, sequence=64)
QUICK_GPT2 = dict(layers=1, hidden=32, heads=4, vocabulary=64, sequence=16)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--keys", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--sigmas", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--rows", type=int, default=64, help="query rows per measurement")
    parser.add_argument("--steps", type=int, default=30, help="GPT-2 training steps")
    parser.add_argument("--quick", action="store_true", help="a tiny run, for the tests")
    args = parser.parse_args(argv)
    args.gpt2 = GPT2
    if args.quick:
        args.keys, args.sigmas, args.rows, args.steps = [64], [4.0], 8, 2
        args.gpt2 = QUICK_GPT2
    return args


# ------------------------------------------------------------------ 1. kernels
def _paths(scores, values, upstream, dtype):
    """Forward output and score gradient through the low-dtype softmax and the float32 one."""
    import tensorflow as tf

    results = {}
    for path in ("low", "float32"):
        with tf.GradientTape() as tape:
            tape.watch(scores)
            if path == "low":
                probs = tf.nn.softmax(scores)
            else:
                probs = tf.cast(tf.nn.softmax(tf.cast(scores, tf.float32)), dtype)
            out = tf.matmul(probs, values)
        grad = tape.gradient(out, scores, output_gradients=upstream)
        results[path] = (out.numpy().astype("float64"), grad.numpy().astype("float64"))
    return results


def _reference(scores, values, upstream):
    """Float64 forward output and score gradient of the same (rounded) inputs."""
    import numpy as np

    s, v, g = (np.asarray(t.numpy(), "float64") for t in (scores, values, upstream))
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = g @ v.T
    return p @ v, p * (dp - (dp * p).sum(-1, keepdims=True))


def _relative(value, reference):
    import numpy as np

    return float(np.abs(value - reference).max() / np.abs(reference).max())


def kernels(args: argparse.Namespace) -> list[str]:
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    lines = [
        "| dtype | keys | sigma | forward: low-dtype softmax | forward: float32 softmax "
        "| backward: low-dtype softmax | backward: float32 softmax |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype in EPSILON:
        for n in args.keys:
            for sigma in args.sigmas:
                scores = tf.cast(rng.normal(0, sigma, (args.rows, n)).astype("float32"), dtype)
                values = tf.cast(rng.normal(0, 1, (n, 64)).astype("float32"), dtype)
                upstream = tf.cast(rng.normal(0, 1, (args.rows, 64)).astype("float32"), dtype)
                out_ref, grad_ref = _reference(scores, values, upstream)
                paths = _paths(scores, values, upstream, dtype)
                eps = EPSILON[dtype]
                cells = [
                    f"{_relative(paths[p][i], ref) / eps:.2f} eps"
                    for i, ref in ((0, out_ref), (1, grad_ref))
                    for p in ("low", "float32")
                ]
                lines.append(f"| {dtype} | {n} | {sigma:g} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------ 2. training
def _gpt2(policy: str, softmax_in_float32: bool, size: dict):
    import keras
    import keras_hub

    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=size["vocabulary"],
        num_layers=size["layers"],
        num_heads=size["heads"],
        hidden_dim=size["hidden"],
        intermediate_dim=2 * size["hidden"],
        dropout=0.1,
        max_sequence_length=size["sequence"],
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if softmax_in_float32:
        # A benchmark may reach inside: every attention's own Softmax layer computes in float32.
        for layer in model._flatten_layers(include_self=False):
            if isinstance(layer, keras.layers.Softmax):
                layer.dtype_policy = keras.DTypePolicy("float32")
    keras.config.set_dtype_policy("float32")
    return model


def _losses(policy: str, softmax_in_float32: bool, steps: int, size: dict) -> list[float]:
    import keras
    import numpy as np

    import tfmixprec
    from tfmixprec.tools import bench

    model = _gpt2(policy, softmax_in_float32, size)
    optimizer = keras.optimizers.Adam(1e-3)
    if policy == "mixed_float16":
        optimizer = tfmixprec.LossScaleOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(True))
    # The optimizer's variables now, as Keras makes them under a distribution strategy: left to
    # the first `fit`, its first trace makes them and TensorFlow traces the step again.
    model.optimizer.build(model.trainable_variables)
    # A learnable task: each sequence counts up from a random start by a random stride.
    rng, top = np.random.default_rng(1), size["vocabulary"] - 1
    start = rng.integers(0, top, (steps * 8, 1))
    stride = rng.integers(1, 4, (steps * 8, 1))
    tokens = (1 + (start + stride * np.arange(size["sequence"] + 1)) % top).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
    keras.utils.set_random_seed(2)  # the same dropout masks in every run
    record = bench.StepLosses()
    model.fit(x, tokens[:, 1:], batch_size=8, shuffle=False, verbose=0, callbacks=[record])
    return record.losses


def training(args: argparse.Namespace) -> list[str]:
    import numpy as np

    size = args.gpt2
    reference = np.array(_losses("float32", False, args.steps, size))
    lines = [
        f"GPT-2 ({size['layers']} layer{'s' if size['layers'] > 1 else ''}, hidden "
        f"{size['hidden']}, {size['heads']} heads, dropout 0.1, sequence {size['sequence']}, "
        f"batch 8, sequences that count up by a stride), Adam 1e-3, "
        f"{args.steps} steps from the same seed; float32 loss {reference[0]:.4f} -> "
        f"{reference[-1]:.4f}",
        "",
        "| policy | attention softmax | last loss | max relative distance from float32 |",
        "|---|---|---|---|",
    ]
    for policy in ("mixed_float16", "mixed_bfloat16"):
        low = policy.split("_")[1]
        for in_float32 in (False, True):
            losses = np.array(_losses(policy, in_float32, args.steps, size))
            distance = float(np.max(np.abs(losses - reference) / np.abs(reference)))
            where = "float32 (Softmax dtype='float32')" if in_float32 else f"{low} (as built)"
            lines.append(f"| {policy} | {where} | {losses[-1]:.4f} | {distance:.2e} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import keras
    import tensorflow as tf

    from tfmixprec.tools import bench

    machine = bench.describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores), GPUs: {machine['gpus'] or 'none'}; "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
    )
    print("\n1. Softmax then attention product: largest error against float64, in machine epsilons")
    print("\n".join(["", *kernels(args)]))
    print("\n2. Training with the attention softmax in the low dtype or in float32\n")
    print("\n".join(training(args)))


if __name__ == "__main__":
    main()
