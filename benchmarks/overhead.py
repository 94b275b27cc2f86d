"""Per-step overhead of tfmixprec's LossScaleOptimizer vs Keras's own, in `model.fit`.

Same model, policy, data and batch for both; runs alternate in one process (A, B, A, B, ...)
so drift in the machine hits both alike; the printed figure is the median of the paired
ratios tfmixprec / Keras. A ratio of 1.00 means no overhead.

    python benchmarks/overhead.py                      # float32 policy (CPU-friendly)
    python benchmarks/overhead.py --policy mixed_float16 --width 1024   # on a GPU
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


def build(width: int, depth: int, features: int) -> keras.Model:
    layers = [keras.Input((features,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(10), keras.layers.Activation("softmax", dtype="float32")]
    return keras.Sequential(layers)


def make_variant(kind: str, args: argparse.Namespace) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = build(args.width, args.depth, args.features)
    inner = keras.optimizers.Adam(1e-4)
    if kind == "keras":
        opt = keras.optimizers.LossScaleOptimizer(inner)
    else:
        opt = tfmixprec.LossScaleOptimizer(inner)
    model.compile(
        optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=args.jit_compile
    )
    return model


def time_fit(model: keras.Model, dataset: tf.data.Dataset, steps: int) -> float:
    start = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="float32")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=15, help="paired runs")
    parser.add_argument("--jit-compile", action="store_true")
    args = parser.parse_args(argv)

    keras.config.set_dtype_policy(args.policy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 8, args.features)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch * 8,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat().prefetch(2)

    models = {kind: make_variant(kind, args) for kind in ("keras", "tfmixprec")}
    for model in models.values():  # trace and warm up
        time_fit(model, dataset, max(5, args.steps // 5))

    times: dict[str, list[float]] = {kind: [] for kind in models}
    ratios = []
    for repeat in range(args.repeats):
        order = list(models) if repeat % 2 == 0 else list(reversed(models))
        for kind in order:
            times[kind].append(time_fit(models[kind], dataset, args.steps))
        ratios.append(times["tfmixprec"][-1] / times["keras"][-1])

    result = {
        "keras_ms": 1000 * statistics.median(times["keras"]),
        "tfmixprec_ms": 1000 * statistics.median(times["tfmixprec"]),
        "median_ratio": statistics.median(ratios),
    }
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} "
        f"({os.cpu_count()} cores), devices: "
        f"{[d.device_type for d in tf.config.list_physical_devices()]}"
    )
    print(
        f"tensorflow {tf.__version__}, keras {keras.__version__}, tfmixprec {tfmixprec.__version__}"
    )
    print(
        f"policy={args.policy} width={args.width} depth={args.depth} batch={args.batch} "
        f"steps/run={args.steps} repeats={args.repeats} jit_compile={args.jit_compile}"
    )
    print(f"Keras LossScaleOptimizer     : {result['keras_ms']:.3f} ms/step (median)")
    print(f"tfmixprec LossScaleOptimizer : {result['tfmixprec_ms']:.3f} ms/step (median)")
    print("ratios per pair: " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"median paired ratio tfmixprec/keras: {result['median_ratio']:.3f} (goal <= 1.02)")
    return result


if __name__ == "__main__":
    main()
