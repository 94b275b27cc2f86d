"""The fixed cost of one `apply`: graph ops and time per step, tfmixprec vs Keras's optimizer.

The same tiny step (`scale_loss`, gradients, `apply`) in a `tf.function`, with Keras's
`LossScaleOptimizer` and with tfmixprec's (dynamic scale both), on `--variables` variables of
64x64: the ops in the traced graph (top level and inside `cond` branches) and the median time
per step over alternating runs. Small variables make the per-step overhead visible.

    python benchmarks/step_ops.py
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

KINDS = ("keras", "tfmixprec")


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
    args = parser.parse_args(argv)

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
