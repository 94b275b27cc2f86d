"""Per-step overhead of tfmixprec vs Keras's own LossScaleOptimizer, in `model.fit`.

Three variants (four with `--repair`), same model, policy, data and batch:

- `keras`: `keras.Model` + `keras.optimizers.LossScaleOptimizer` + plain `fit` (the baseline);
- `optimizer`: `keras.Model` + `tfmixprec.LossScaleOptimizer` (Keras's own train_step);
- `full`: `tfmixprec.MixedPrecisionModel` (its train_step and optimizer, the state guard
  included: with `--batchnorm` the model's batch-norm statistics are put back on a skipped
  step) + `LossScaleMonitor` + `tfmixprec.TensorBoard` at its default `update_freq` ("epoch");
- `repair` (with `--repair`): `full` with a `PrecisionRepair` armed (its step keeps the batch
  of an overflow step), paired with `full` too.

Runs alternate in one process in ABBA order (A, B, C, then C, B, A, ...) so drift hits all
alike; the figures are the medians of the paired ratios to `keras`. Each pairing (`optimizer`,
`full` and `repair` against `keras`, `repair` against `full`) is also summed per ABBA block (two
consecutive repeats, one in each order), where a drift linear in time cancels exactly: the
summary prints each pairing's block ratio (median and quartiles), against the goal (<= 1.02
without XLA, <= 1.00 with `--jit-compile`). XLA off and on are one command each:

    python benchmarks/overhead.py --repeats 40                  # XLA off
    python benchmarks/overhead.py --repeats 40 --jit-compile    # XLA on

Per-step time is measured inside each `fit` call, from the end of its first batch to the end
of its last (a callback), so `fit`'s set-up and tear-down (which read the state once per
`fit`/epoch) are not counted. Host syncs are counted in the same window by wrapping
TensorFlow's one device-to-host read of an eager tensor (`EagerTensor._numpy`, behind
`.numpy()`, `float()`, `int()`, `bool()` and `np.asarray`) with a counter, in this benchmark
only: the difference to `keras` is what tfmixprec adds per step.

    python benchmarks/overhead.py                       # mixed_bfloat16 (this CPU's policy)
    python benchmarks/overhead.py --batchnorm           # with state the guard puts back
    python benchmarks/overhead.py --repair              # with PrecisionRepair armed
    python benchmarks/overhead.py --policy mixed_float16 --width 2048   # on a GPU
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.framework import ops as tf_ops  # noqa: E402

import tfmixprec  # noqa: E402
from tfmixprec.tools import bench  # noqa: E402

VARIANTS = ("keras", "optimizer", "full")


class StepWindow(bench.StepTimer):
    """`StepTimer` that also counts the device-to-host reads of eager tensors in its window."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.syncs = 0
        self._original = tf_ops._EagerTensorBase._numpy

    def window_open(self) -> None:
        self.syncs = 0
        original = self._original

        def counting(tensor):  # a plain function, so it binds to the tensor
            self.syncs += 1
            return original(tensor)

        tf_ops._EagerTensorBase._numpy = counting

    def window_close(self) -> None:
        tf_ops._EagerTensorBase._numpy = self._original

    def on_train_end(self, logs=None):
        self.window_close()


def build(kind: str, args: argparse.Namespace, log_dir: str):
    keras.utils.set_random_seed(0)
    cls = tfmixprec.MixedPrecisionModel if kind in ("full", "repair") else keras.Model
    inputs = keras.Input((args.features,))
    h = inputs
    for _ in range(args.depth):
        h = keras.layers.Dense(args.width, activation="relu")(h)
        if args.batchnorm:  # non-trainable state the full stack guards on a skipped step
            h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(h)
    model = cls(inputs, outputs)
    inner = keras.optimizers.Adam(1e-4)
    if kind == "keras":
        opt = keras.optimizers.LossScaleOptimizer(inner)
    else:
        opt = tfmixprec.LossScaleOptimizer(inner)  # dynamic, like Keras's
    model.compile(
        optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=args.jit_compile
    )
    callbacks = []
    if kind in ("full", "repair"):
        callbacks = [tfmixprec.LossScaleMonitor(), tfmixprec.TensorBoard(log_dir)]
        if kind == "repair":  # armed: the step keeps overflow batches, the callback reads nothing
            callbacks.append(tfmixprec.PrecisionRepair())
    return model, callbacks


def run_fit(model, callbacks, dataset, steps: int) -> StepWindow:
    return bench.time_fit(model, dataset, steps, callbacks, timer=StepWindow(steps))


def _quartiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]


def print_pairings(times: dict[str, list[float]], goal: float) -> dict[str, float]:
    """Prints each pairing's ratio per ABBA block (repeats 2i and 2i+1 summed, one in each
    order) and per run, and returns the block medians (the run medians with one repeat)."""
    pairs = [(kind, "keras") for kind in times if kind != "keras"]
    if "repair" in times:
        pairs.append(("repair", "full"))
    blocks = len(times["keras"]) // 2
    found = {}
    for kind, base in pairs:
        runs = [t / b for t, b in zip(times[kind], times[base])]
        sums = [
            (times[kind][2 * i] + times[kind][2 * i + 1])
            / (times[base][2 * i] + times[base][2 * i + 1])
            for i in range(blocks)
        ]
        ratios = sums or runs
        q1, q3 = _quartiles(ratios)
        found[f"{kind}/{base}"] = statistics.median(ratios)
        print(
            f"pairing {kind} / {base}: {statistics.median(ratios):.3f} median over {blocks} "
            f"ABBA blocks (quartiles {q1:.3f} .. {q3:.3f}); per run {statistics.median(runs):.3f}"
            f" (goal <= {goal:.2f})"
        )
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=40, help="timed runs per variant")
    parser.add_argument("--jit-compile", action="store_true")
    parser.add_argument(
        "--batchnorm", action="store_true", help="a BatchNormalization after each Dense"
    )
    parser.add_argument(
        "--repair", action="store_true", help="PrecisionRepair armed in the full stack"
    )
    args = parser.parse_args(argv)

    keras.config.set_dtype_policy(args.policy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 8, args.features)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch * 8,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat().prefetch(2)

    log_dir = tempfile.mkdtemp(prefix="tfmixprec-overhead-")
    kinds = VARIANTS + (("repair",) if args.repair else ())
    variants = {kind: build(kind, args, log_dir) for kind in kinds}
    for model, callbacks in variants.values():  # trace and warm up
        run_fit(model, callbacks, dataset, max(5, args.steps // 5))

    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    syncs: dict[str, int] = {kind: 0 for kind in kinds}
    for repeat in range(args.repeats):
        order = kinds if repeat % 2 == 0 else tuple(reversed(kinds))
        for kind in order:
            model, callbacks = variants[kind]
            window = run_fit(model, callbacks, dataset, args.steps)
            times[kind].append(window.per_step)
            syncs[kind] += window.syncs
    ratios = {
        kind: statistics.median(t / k for t, k in zip(times[kind], times["keras"]))
        for kind in kinds
    }

    total_steps = args.repeats * (args.steps - 1)  # steps inside the timed windows
    print(
        f"machine: {platform.machine()} ({os.cpu_count()} cores), devices: "
        f"{[d.device_type for d in tf.config.list_physical_devices()]}; "
        f"tensorflow {tf.__version__}, keras {keras.__version__}, tfmixprec {tfmixprec.__version__}"
    )
    print(
        f"policy={args.policy} MLP {args.depth}x{args.width} features={args.features} "
        f"batch={args.batch} steps/run={args.steps} repeats={args.repeats} "
        f"jit_compile={args.jit_compile} batchnorm={args.batchnorm} repair={args.repair}"
    )
    for kind in kinds:
        print(
            f"{kind:10s} median {1000 * statistics.median(times[kind]):8.3f} ms/step   "
            f"paired ratio to keras {ratios[kind]:.3f}   host syncs per step: "
            f"{syncs[kind] / total_steps:.3f} ({(syncs[kind] - syncs['keras']) / total_steps:+.3f} "
            "vs keras)"
        )
    for kind in ("optimizer", "full"):
        paired = sorted(t / k for t, k in zip(times[kind], times["keras"]))
        q1, q3 = paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
        spread = statistics.median(times["keras"])
        print(
            f"{kind:10s} paired ratios: quartiles {q1:.3f} .. {q3:.3f}; keras alone varies "
            f"{min(times['keras']) / spread:.2f} .. {max(times['keras']) / spread:.2f} "
            "of its median"
        )
    goal = 1.00 if args.jit_compile else 1.02
    blocks = print_pairings(times, goal)
    print(
        f"full-stack median paired ratio: {ratios['full']:.3f} (goal <= {goal:.2f}); "
        f"optimizer only: {ratios['optimizer']:.3f}"
    )
    if args.repair:  # the same stack with PrecisionRepair armed, paired with it
        paired = statistics.median(r / f for r, f in zip(times["repair"], times["full"]))
        print(
            f"with PrecisionRepair armed: paired ratio to keras {ratios['repair']:.3f}, to the "
            f"full stack without it {paired:.3f} (goal <= {goal:.2f})"
        )
    return {
        "ratios": ratios,
        "abba": blocks,
        "syncs_per_step": {k: v / total_steps for k, v in syncs.items()},
    }


if __name__ == "__main__":
    main()
