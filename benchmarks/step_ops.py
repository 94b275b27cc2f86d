"""The fixed cost of one `apply`: graph ops and time per step, tfmixprec vs Keras's optimizer.

The same tiny step (`scale_loss`, gradients, `apply`) in a `tf.function`, with Keras's
`LossScaleOptimizer` and with tfmixprec's (dynamic scale both), on `--variables` variables of
64x64: the ops in the traced graph (top level and inside `cond` branches) and the median time
per step over alternating runs. Small variables make the per-step overhead visible.

    python benchmarks/step_ops.py
    python benchmarks/step_ops.py --fit     # the ops of fit's traced step, per op type

`--fit` counts the ops of the train function `fit` traced (`tfmixprec.testing.step_ops`: the
step's body and every function it calls, each branch whether it runs or not) for a 2-layer
float16 MLP (`jit_compile=False`): Keras's own `LossScaleOptimizer` on a `keras.Model` (the
baseline) against tfmixprec's optimizer on a `keras.Model`, a `MixedPrecisionModel`, and a
`keras.Model` compiled with Keras's optimizer that a tfmixprec callback adopts; without
callbacks, with `LossScaleMonitor`, and with every callback (`PrecisionRepair` armed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmixprec  # noqa: E402

KINDS = ("keras", "tfmixprec")

# fit's traced step: the budgets against Keras's own step (tests/fit/test_step_ops.py).
BUDGET_ONE_CALLBACK = 1.2  # no callback, or LossScaleMonitor alone
BUDGET_EVERY_CALLBACK = 1.3  # every callback, PrecisionRepair armed
X = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
Y = np.zeros((64, 1), "float32")
# model: how it is compiled; callbacks: none, LossScaleMonitor, or every callback
MODELS = ("keras", "optimizer", "MixedPrecisionModel", "adopted")
CALLBACKS = ("none", "monitor", "every")


def fit_model(model_kind: str, callbacks: str = "none") -> keras.Model:
    """A 2-layer float16 MLP of `model_kind`, fitted for one epoch with `callbacks`.

    The float16 CPU routes are off while it is built and fitted (`tfmixprec.cpu_float16`, as
    they were after): on a CPU without AVX512_FP16 a tfmixprec callback would route the float16
    `Dense` through a float32 product, 5 ops more that a GPU's step never has, so the count is
    the same on every CPU."""
    keras.utils.set_random_seed(0)
    with (
        warnings.catch_warnings(),
        tfmixprec.cpu_float16.process_state_kept(),
        tfmixprec.policy_scope("mixed_float16"),
    ):
        tfmixprec.cpu_float16.disable()
        warnings.simplefilter("ignore")  # float16 without a GPU, adoption: said elsewhere
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(16, name="hidden")(inputs)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(hidden)
        cls = tfmixprec.MixedPrecisionModel if model_kind == "MixedPrecisionModel" else keras.Model
        model = cls(inputs, outputs)
        optimizer = {
            "keras": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
            "adopted": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
            "optimizer": lambda: tfmixprec.LossScaleOptimizer(keras.optimizers.Adam()),
            "MixedPrecisionModel": lambda: "adam",
        }[model_kind]()
        model.compile(optimizer, "mse", jit_compile=False)
        with tempfile.TemporaryDirectory() as log_dir:
            model.fit(X, Y, batch_size=32, verbose=0, callbacks=_callbacks(callbacks, log_dir))
    return model


def _callbacks(which: str, log_dir: str) -> list:
    if which == "none":
        return []
    if which == "monitor":
        return [tfmixprec.LossScaleMonitor()]
    return [  # every callback, the batch keepers armed (diagnose=, PrecisionRepair)
        tfmixprec.LossScaleMonitor(diagnose=1),
        tfmixprec.OverflowGuard(),
        tfmixprec.GradientRangeMonitor((X[:8], Y[:8]), update_freq=1),
        tfmixprec.TensorBoard(log_dir, update_freq=1, diagnose=1),
        tfmixprec.PrecisionRepair(verbose=0),
    ]


def fit_table(cases: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, int]]:
    """Prints the ops of each case's traced step per op type (the types that differ from the
    baseline's, then the totals) and returns them."""
    counted = {("keras", "none"): tfmixprec.testing.step_ops(fit_model("keras"))}
    for case in cases:
        if case not in counted:
            counted[case] = tfmixprec.testing.step_ops(fit_model(*case))
    base = counted[("keras", "none")]
    names = [f"{m} + {c}" if c != "none" else m for m, c in counted]
    print("| op type | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for op in sorted(set().union(*counted.values())):
        row = [found.get(op, 0) for found in counted.values()]
        if any(n != base.get(op, 0) for n in row):
            print(f"| {op} | " + " | ".join(map(str, row)) + " |")
    totals = [sum(found.values()) for found in counted.values()]
    print("| **all ops** | " + " | ".join(map(str, totals)) + " |")
    ratios = [f"{total / totals[0]:.2f}x" for total in totals]
    print("| **x Keras's** | " + " | ".join(ratios) + " |")
    return counted


def make_step(kind: str, num_variables: int):
    variables = [keras.Variable(np.zeros((64, 64), "float32")) for _ in range(num_variables)]
    inner = keras.optimizers.Adam(1e-4)
    if kind == "keras":
        opt = keras.optimizers.LossScaleOptimizer(inner)
    else:
        opt = tfmixprec.LossScaleOptimizer(inner)
    opt.build(variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.add_n([tf.reduce_sum(v) for v in variables]))
        opt.apply(tape.gradient(scaled, variables), variables)

    return step


def count_ops(step) -> tuple[int, int]:
    """Ops at the top level of the traced graph, and inside its functions (cond branches)."""
    graph = step.get_concrete_function().graph
    library = graph.as_graph_def().library.function
    return len(graph.get_operations()), sum(len(f.node_def) for f in library)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variables", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--fit", action="store_true", help="the op table of fit's step")
    args = parser.parse_args(argv)
    if args.fit:
        print(f"tensorflow {tf.__version__}, keras {keras.__version__}")
        cases = [(m, c) for m in MODELS for c in CALLBACKS if m != "keras" or c == "none"]
        return fit_table([c for c in cases if c != ("adopted", "none")])

    steps = {kind: make_step(kind, args.variables) for kind in KINDS}
    for step in steps.values():
        for _ in range(20):
            step()  # trace and warm up
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for repeat in range(args.repeats):
        for kind in KINDS if repeat % 2 == 0 else tuple(reversed(KINDS)):
            start = time.perf_counter()
            for _ in range(args.calls):
                steps[kind]()
            times[kind].append((time.perf_counter() - start) / args.calls)
    result = {}
    for kind in KINDS:
        top, branches = count_ops(steps[kind])
        per_step = statistics.median(times[kind]) * 1e6
        result[kind] = {"top_ops": top, "branch_ops": branches, "us_per_step": per_step}
        print(
            f"{kind:10s} ops: {top} top level + {branches} in branches; "
            f"median {per_step:.0f} us/step ({args.variables} variables of 64x64)"
        )
    return result


if __name__ == "__main__":
    main()
