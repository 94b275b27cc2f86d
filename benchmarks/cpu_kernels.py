"""The float16 CPU kernels that `tfmixprec.cpu_float16` routes around, timed against float32.

Each op runs in its own `tf.function`, on the CPU, in float32, float16 and bfloat16; the figure
is the median of `--repeats` calls after one warm-up call, and the ratio is to float32. The
fused MatMul is a `Dense` forward (MatMul + BiasAdd, which grappler's remapper fuses into
`_FusedMatMul`), timed with the remapper on (TensorFlow's default) and off (as tfmixprec sets
it for float16 on a machine without a GPU). `float16 via float32` is what tfmixprec runs
instead: the inputs cast up, the float32 kernel, the result cast back.

    python benchmarks/cpu_kernels.py            # 1024-wide matmuls, 64x32x32x32 convolutions
    python benchmarks/cpu_kernels.py --size 64  # a quick run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tfmixprec.tools.bench import describe_machine  # noqa: E402

DTYPES = ("float32", "float16", "bfloat16")


def _time(fn, *args, repeats: int) -> float:
    fn(*args).numpy()  # trace and warm up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).numpy()
        runs.append(time.perf_counter() - start)
    return 1000 * statistics.median(runs)


def _ops(size: int) -> dict:
    """name -> (inputs builder, op). Shapes scale with `size` (1024: the README's figures)."""
    batch, pixels, channels = max(size // 16, 2), max(size // 32, 4), max(size // 32, 4)

    def matmul(a, b):
        return tf.matmul(a, b)

    def matmul_transposed(a, b):
        return tf.matmul(a, b, transpose_a=True)  # as in every backward pass

    def dense_forward(x, w, bias):
        return tf.nn.bias_add(tf.matmul(x, w), bias)  # fused into _FusedMatMul by grappler

    def attention_scores(q, k):
        return tf.einsum("bhqd,bhkd->bhqk", q, k)

    def conv_filter_gradient(x, dy):
        return tf.raw_ops.Conv2DBackpropFilter(
            input=x,
            filter_sizes=[3, 3, channels, channels],
            out_backprop=dy,
            strides=[1, 1, 1, 1],
            padding="SAME",
        )

    def conv_input_gradient(dy, w):  # also a Conv2DTranspose forward
        return tf.raw_ops.Conv2DBackpropInput(
            input_sizes=[batch, pixels, pixels, channels],
            filter=w,
            out_backprop=dy,
            strides=[1, 1, 1, 1],
            padding="SAME",
        )

    def depthwise_filter_gradient(x, dy):
        return tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
            input=x,
            filter_sizes=[3, 3, channels, 1],
            out_backprop=dy,
            strides=[1, 1, 1, 1],
            padding="SAME",
        )

    normal = tf.random.normal
    return {
        "MatMul": (lambda: [normal((size, size)), normal((size, 2 * size))], matmul),
        "MatMul, transposed": (
            lambda: [normal((size, size)), normal((size, 2 * size))],
            matmul_transposed,
        ),
        "Dense forward": (
            lambda: [normal((size, 2 * size)), normal((2 * size, 2 * size)), normal((2 * size,))],
            dense_forward,
        ),
        "attention einsum": (
            lambda: [normal((32, 4, 64, size // 8))] * 2,
            attention_scores,
        ),
        "Conv2DBackpropFilter": (
            lambda: [
                normal((batch, pixels, pixels, channels)),
                normal((batch, pixels, pixels, channels)),
            ],
            conv_filter_gradient,
        ),
        "Conv2DBackpropInput": (
            lambda: [
                normal((batch, pixels, pixels, channels)),
                normal((3, 3, channels, channels)),
            ],
            conv_input_gradient,
        ),
        "DepthwiseConv2dNativeBackpropFilter": (
            lambda: [
                normal((batch, pixels, pixels, channels)),
                normal((batch, pixels, pixels, channels)),
            ],
            depthwise_filter_gradient,
        ),
    }


def measure(size: int, repeats: int, remapping: bool) -> dict[str, dict[str, float]]:
    """Milliseconds per call: `{op: {dtype or "float16 via float32": ms}}`."""
    tf.config.optimizer.set_experimental_options({"remapping": remapping})
    results: dict[str, dict[str, float]] = {}
    for name, (make, op) in _ops(size).items():
        inputs = make()
        row = {}
        for dtype in DTYPES:
            cast = [tf.cast(t, dtype) for t in inputs]
            row[dtype] = _time(tf.function(op), *cast, repeats=repeats)
        half = [tf.cast(t, "float16") for t in inputs]

        def via_float32(*args, op=op):
            return tf.cast(op(*[tf.cast(a, tf.float32) for a in args]), tf.float16)

        row["float16 via float32"] = _time(tf.function(via_float32), *half, repeats=repeats)
        results[name] = row
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="matmul width (default 1024)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    machine = describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores), GPUs: {machine['gpus'] or 'none'}; "
        f"TensorFlow {machine['tensorflow']}; size {args.size}, median of {args.repeats}"
    )
    columns = [*DTYPES, "float16 via float32"]
    everything = {}
    with tf.device("/CPU:0"):
        for remapping in (True, False):
            results = measure(args.size, args.repeats, remapping)
            everything[remapping] = results
            print(f"\nremapper {'on (default)' if remapping else 'off'}: ms per call (x float32)")
            print(f"{'op':24}" + "".join(f"{c:>24}" for c in columns))
            for name, row in results.items():
                cells = "".join(
                    f"{row[c]:>13.2f} ({row[c] / row['float32']:6.2f}x)" for c in columns
                )
                print(f"{name:24}{cells}")
    return everything


if __name__ == "__main__":
    main()
