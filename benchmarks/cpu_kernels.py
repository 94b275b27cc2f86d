"""The float16 CPU kernels that `tfmixprec.cpu_float16` routes around, timed against float32,
and each route of `cpu_float16.ROUTES` timed in training on this CPU.

Kernels: each op runs in its own `tf.function`, on the CPU, in float32, float16 and bfloat16;
the figure is the median of `--repeats` calls after one warm-up call, and the ratio is to
float32. The fused MatMul is a `Dense` forward (MatMul + BiasAdd, which grappler's remapper
fuses into `_FusedMatMul`), timed with the remapper on (TensorFlow's default) and off (as
tfmixprec sets it for float16 on a machine without a GPU). `float16 via float32` is what a
route runs instead: the inputs cast up, the float32 kernel, the result cast back.

Routes: for each route, a small model of the layers it serves (4 x Dense, 2 x Conv2D, a
MultiHeadAttention with dropout) trains in float32, in native float16 and in float16 through
the route, with the remapper off, alternating runs; the figure is the median ms per step.
Whether a route helps depends on the CPU's kernels (AVX512_FP16 gives native float16
matmuls), so this is what decides it for a CPU: the last column is native float16's step time
over the route's (above 1.00x the route is faster here), next to whether tfmixprec takes the
route on this CPU. Each row prints as soon as it is measured.

    python benchmarks/cpu_kernels.py                # everything (a few minutes on 2 cores)
    python benchmarks/cpu_kernels.py --size 64      # a quick run
    python benchmarks/cpu_kernels.py --only routes  # the routes only
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmixprec  # noqa: E402
from tfmixprec.precision import cpu_float16  # noqa: E402
from tfmixprec.precision.cpu_route import route  # noqa: E402
from tfmixprec.precision.hardware import HardwareInfo  # noqa: E402
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


def measure(size: int, repeats: int, remapping: bool, show=None) -> dict[str, dict[str, float]]:
    """Milliseconds per call: `{op: {dtype or "float16 via float32": ms}}`; `show(name, row)`
    is called with each row as soon as it is measured."""
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
        if show is not None:
            show(name, row)
    return results


def _route_model(name: str, size: int) -> tuple[keras.Model, tuple[int, ...], int]:
    """A model of the layers route `name` serves (built under the current policy), its input
    shape and its batch."""
    layers = keras.layers
    if name == cpu_float16.CONVOLUTIONS.name:
        shape, batch = (max(size // 32, 8), max(size // 32, 8), 16), 32
        h = inputs = keras.Input(shape)
        for _ in range(2):
            h = layers.Conv2D(32, 3, padding="same", activation="relu")(h)
        h = layers.GlobalAveragePooling2D()(h)
    elif name == cpu_float16.ATTENTION.name:
        shape, batch = (max(size // 8, 8), max(size // 4, 16)), 16
        inputs = keras.Input(shape)
        h = layers.MultiHeadAttention(4, shape[1] // 4, dropout=0.1)(inputs, inputs)
        h = layers.GlobalAveragePooling1D()(h)
    else:  # Dense / EinsumDense products
        shape, batch = (size,), 256
        h = inputs = keras.Input(shape)
        for _ in range(4):
            h = layers.Dense(size, activation="relu")(h)
    outputs = layers.Dense(10, dtype="float32")(h)
    return keras.Model(inputs, outputs), shape, batch


def _train_step(model: keras.Model):
    """A plain training step (SGD, cross-entropy) of `model`, as a `tf.function`."""
    optimizer = keras.optimizers.SGD(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step


def _step_ms(step, x: tf.Tensor, y: tf.Tensor, steps: int) -> float:
    """The mean ms per step over `steps` calls of `step`, after one warm-up call."""
    step(x, y).numpy()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(x, y)
    loss.numpy()
    return 1000 * (time.perf_counter() - start) / steps


def measure_routes(size: int, repeats: int, steps: int, show=None) -> dict[str, dict]:
    """ms per training step per route: `{route: {"float32", "float16", "routed": ms,
    "on here": bool}}`, the remapper off; `show(name, row)` is told each row."""
    tf.config.optimizer.set_experimental_options({"remapping": False})
    here = {r.name for r in cpu_float16.routes_on()}
    results = {}
    for r in cpu_float16.ROUTES:
        models = {}
        for variant, policy in (("float32", "float32"), ("float16", "mixed_float16")):
            with tfmixprec.policy_scope(policy):
                keras.utils.set_random_seed(0)
                models[variant], shape, batch = _route_model(r.name, size)
        keras.utils.set_random_seed(0)
        with tfmixprec.policy_scope("mixed_float16"):
            models["routed"], _, _ = _route_model(r.name, size)
        every_route = HardwareInfo(cpu_name="any")  # no GPU, no AVX512_FP16: every route
        for layer, served_by in cpu_float16.served_layers(models["routed"], every_route):
            if served_by is r:  # this route only
                route(layer, r.name, *r.method(layer))
        x = tf.constant(np.random.default_rng(0).normal(size=(batch, *shape)), tf.float32)
        y = tf.constant(np.random.default_rng(1).integers(0, 10, size=(batch,)))
        steps_of = {variant: _train_step(model) for variant, model in models.items()}
        runs = {variant: [] for variant in models}
        for _ in range(repeats):  # alternating, so a slow spell of the machine hits all three
            for variant, step in steps_of.items():
                runs[variant].append(_step_ms(step, x, y, steps))
        row = {variant: statistics.median(ms) for variant, ms in runs.items()}
        row["on here"] = r.name in here
        results[r.name] = row
        if show is not None:
            show(r.name, row)
    return results


def _show_kernel(name: str, row: dict[str, float]) -> None:
    columns = [*DTYPES, "float16 via float32"]
    cells = "".join(f"{row[c]:>13.2f} ({row[c] / row['float32']:6.2f}x)" for c in columns)
    print(f"{name:24}{cells}", flush=True)


def _show_route(name: str, row: dict) -> None:
    on = "yes" if row["on here"] else "no"
    print(
        f"{name:22}{on:>10}{row['float32']:>12.1f}{row['float16']:>12.1f}{row['routed']:>12.1f}"
        f"{row['float16'] / row['routed']:>17.2f}x",
        flush=True,
    )


def _routes_header(size: int, steps: int, repeats: int) -> None:
    hardware = tfmixprec.detect_hardware()
    print(
        f"\nroutes (remapper off), ms per training step, median of {repeats} runs of {steps} "
        f"steps; this CPU: AVX512_FP16 {'yes' if hardware.cpu_float16 else 'no'}, "
        f"AVX512_BF16/AMX_BF16 {'yes' if hardware.cpu_bfloat16 else 'no'}",
        flush=True,
    )
    print(
        f"{'route':22}{'on here':>10}{'float32':>12}{'float16':>12}{'routed':>12}"
        f"{'float16 / routed':>18}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="matmul width (default 1024)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (default 5)")
    parser.add_argument(
        "--steps", type=int, default=10, help="training steps per route run (default 10)"
    )
    parser.add_argument("--only", choices=("kernels", "routes"), default=None, help="default: both")
    args = parser.parse_args(argv)
    machine = describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores), GPUs: {machine['gpus'] or 'none'}; "
        f"TensorFlow {machine['tensorflow']}; size {args.size}, median of {args.repeats}",
        flush=True,
    )
    columns = [*DTYPES, "float16 via float32"]
    everything: dict = {}
    with tf.device("/CPU:0"):
        for remapping in (True, False) if args.only != "routes" else ():
            print(f"\nremapper {'on (default)' if remapping else 'off'}: ms per call (x float32)")
            print(f"{'op':24}" + "".join(f"{c:>24}" for c in columns), flush=True)
            everything[remapping] = measure(args.size, args.repeats, remapping, _show_kernel)
        if args.only != "kernels":
            _routes_header(args.size, args.steps, args.repeats)
            everything["routes"] = measure_routes(args.size, args.repeats, args.steps, _show_route)
            print(
                "\nfloat16 / routed above 1.00x: the route is faster on this CPU. A route on "
                "here that measures below 1.00x (or one off here that measures above) is worth "
                "reporting with this output (benchmarks/RESULTS.md, 16).",
                flush=True,
            )
    return everything


if __name__ == "__main__":
    main()
