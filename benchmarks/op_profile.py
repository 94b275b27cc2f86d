"""Where a training step's time goes, per op, per policy: the account behind `cpu_bfloat16`.

For one zoo model (`tfmixprec.zoo`, the `"bench"` size by default), each stack is built and
compiled with `"adam"` the Keras way, warmed up, then `--steps` steps of `fit` run under
TensorFlow's profiler. The trace's CPU op events are summed per op type and per part of the
model (the matmuls, the loss and metric, dropout, normalization, ...), in milliseconds of op
time per step: summed over the threads that ran them, so they add up to more than the step's
wall time on 2 cores, but they show which work a policy speeds up and which it does not.

    python benchmarks/op_profile.py                       # GPT-2, about 3 minutes
    python benchmarks/op_profile.py --model mobilenet
    python benchmarks/op_profile.py --quick               # tiny model, for the tests

Stacks:

- `float32`;
- `bf16 keras`: plain `mixed_bfloat16`;
- `bf16 tfmixprec`: the same with `tfmixprec.cpu_bfloat16`'s routes on this CPU;
- `bf16 elementwise`: those routes and `cpu_bfloat16.ELEMENTWISE` too (PyTorch's CPU
  autocast's split: the products in bfloat16; `Dense` bias and activation, `Dropout` and
  `Softmax` in float32; Keras's `LayerNormalization` computes in float32 already);
- `bf16 adopted`: compiled the ordinary way and given one tfmixprec callback
  (`LossScaleMonitor`), which routes the model when `fit` sets it (`fit/adoption.py`).

`--paired N` then times N rounds of `--steps`-step fits, the stacks alternating in this one
process (their models kept), and prints each stack's median step and its ratio to float32.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STACKS = ("float32", "bf16 keras", "bf16 tfmixprec", "bf16 elementwise", "bf16 adopted")
DEFAULT_STACKS = STACKS[:3]
# The parts of a step, matched in order on an op event's name ("scope/.../name:OpType").
PARTS = (
    ("matmul", lambda path, op: "MatMul" in op or "Einsum" in op or "Conv" in op),
    # the train step's own ops, outside the model: the loss, the metrics, their masks
    ("loss and metrics", lambda path, op: "compile_loss" in path or _step_level(path)),
    ("optimizer", lambda path, op: "adam" in path or "Variable" in op),
    ("cast", lambda path, op: op == "Cast"),
    ("dropout", lambda path, op: "dropout" in path or op.startswith("StatelessRandom")),
    ("normalization", lambda path, op: "norm" in path),
    ("activation", lambda path, op: "gelu" in path.lower() or "relu" in op.lower()),
    ("attention softmax", lambda path, op: "softmax" in path),
)


def _step_level(path: str) -> bool:
    parts = [p for p in path.split("/") if p not in ("StatefulPartitionedCall", "gradient_tape")]
    return len(parts) <= 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=list(DEFAULT_STACKS))
    parser.add_argument("--size", choices=("tiny", "bench"), default="bench")
    parser.add_argument("--steps", type=int, default=4, help="profiled steps")
    parser.add_argument("--top", type=int, default=12, help="op types listed")
    parser.add_argument("--paired", type=int, default=0, help="alternating timed rounds")
    parser.add_argument("--versus", choices=STACKS, help="a second reference for --paired")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps")
    args = parser.parse_args(argv)
    if args.versus and args.versus not in args.stacks:
        parser.error(f"--versus {args.versus!r} is not one of --stacks")
    if args.quick:
        args.size, args.steps = "tiny", 2
    return args


def op_times(trace_dir: str, steps: int) -> collections.Counter:
    """`{(part, op type): ms of op time per step}` from a profiler trace's CPU op events."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    times: collections.Counter = collections.Counter()
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                scope, _, op = name.rpartition(":")
                if "/" not in scope or not op:
                    continue  # not an op of the step's graph
                part = next((p for p, test in PARTS if test(scope, op)), "other")
                times[(part, re.sub(r"^_Mkl(Native)?", "", op))] += event.duration_ps / 1e9 / steps
    return times


def build(args: argparse.Namespace, stack: str) -> tuple[Any, Any, list]:
    """The stack's compiled model, its data and the callbacks its `fit` gets."""
    import tfmixprec
    from tfmixprec.tools import zoo

    policy = "float32" if stack == "float32" else "mixed_bfloat16"
    with tfmixprec.policy_scope(policy):
        entry = zoo.build(args.model, size=args.size)
        entry.model.compile(optimizer="adam", loss=entry.loss)
        # The optimizer's variables now, as Keras makes them under a distribution strategy: left to
        # the first `fit`, its first trace makes them and TensorFlow traces the step again.
        entry.model.optimizer.build(entry.model.trainable_variables)
    routes = tfmixprec.cpu_bfloat16.routes_on()
    if stack == "bf16 tfmixprec":
        tfmixprec.cpu_bfloat16.fast_bfloat16_layers(entry.model)
    elif stack == "bf16 elementwise":
        routes = [*routes, tfmixprec.cpu_bfloat16.ELEMENTWISE]
        tfmixprec.cpu_bfloat16.fast_bfloat16_layers(entry.model, routes=routes)
    callbacks = [tfmixprec.LossScaleMonitor()] if stack == "bf16 adopted" else []
    return entry.model, entry.dataset(2), callbacks


def profile(args: argparse.Namespace, built: tuple) -> tuple[float, collections.Counter]:
    import tensorflow as tf

    from tfmixprec.tools import bench

    model, dataset, callbacks = built
    bench.time_fit(model, dataset, 3, callbacks)  # traced and warm
    step = bench.time_fit(model, dataset, args.steps + 1, callbacks).per_step
    with tempfile.TemporaryDirectory(prefix="tfmixprec-profile-") as trace:
        tf.profiler.experimental.start(trace)
        bench.time_fit(model, dataset, args.steps, callbacks)
        tf.profiler.experimental.stop()
        return step, op_times(trace, args.steps)


def paired(args: argparse.Namespace, built: dict) -> list[str]:
    """`--paired` rounds of `--steps + 1`-step fits, the stacks alternating (the order
    reversed every other round): each stack's median step, its ratio to the first stack's,
    and the range of the per-round ratios to the first stack and to `--versus`."""
    from tfmixprec.tools import bench

    times: dict[str, list[float]] = {s: [] for s in args.stacks}
    for index in range(args.paired):
        order = args.stacks if index % 2 == 0 else list(reversed(args.stacks))
        for s in order:
            model, dataset, callbacks = built[s]
            times[s].append(bench.time_fit(model, dataset, args.steps + 1, callbacks).per_step)
    first, versus = args.stacks[0], args.versus or args.stacks[0]
    lines = [
        f"| stack | median ms/step | vs {first} | per round, vs {first} | per round, vs {versus} |",
        "|---|---|---|---|---|",
    ]
    for s in args.stacks:
        spans = []
        for reference in (times[first], times[versus]):
            ratios = [a / b for a, b in zip(reference, times[s])]
            spans.append(f"{min(ratios):.2f}-{max(ratios):.2f}x")
        lines.append(
            f"| {s} | {1000 * statistics.median(times[s]):.1f} | "
            f"{statistics.median(times[first]) / statistics.median(times[s]):.2f}x | "
            f"{spans[0]} | {spans[1]} |"
        )
    return lines


def table(args: argparse.Namespace, results: dict) -> list[str]:
    """Per part, then the top op types: ms of op time per step for each stack."""
    head = "| | " + " | ".join(args.stacks) + " |"
    lines = [head, "|---" * (len(args.stacks) + 1) + "|"]
    step = " | ".join(f"**{1000 * results[s][0]:.0f}**" for s in args.stacks)
    lines.append(f"| step, wall ms | {step} |")
    parts: dict[str, collections.Counter] = {s: collections.Counter() for s in args.stacks}
    for s in args.stacks:
        for (part, _), ms in results[s][1].items():
            parts[s][part] += ms
    for part in [p for p, _ in PARTS] + ["other"]:
        cells = " | ".join(f"{parts[s][part]:.0f}" for s in args.stacks)
        lines.append(f"| {part}, op ms | {cells} |")
    totals = " | ".join(f"{sum(parts[s].values()):.0f}" for s in args.stacks)
    lines.append(f"| all ops, op ms | {totals} |")
    first = results[args.stacks[0]][1]
    for key, _ in first.most_common(args.top):
        cells = " | ".join(f"{results[s][1][key]:.1f}" for s in args.stacks)
        lines.append(f"| {key[1]} ({key[0]}) | {cells} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from tfmixprec.tools import bench

    machine = bench.describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores); TensorFlow "
        f"{machine['tensorflow']}, Keras {machine['keras']}; {args.model} ({args.size}), "
        f"{args.steps} profiled steps"
    )
    built = {stack: build(args, stack) for stack in args.stacks}
    results = {stack: profile(args, built[stack]) for stack in args.stacks}
    print("\n".join(["", *table(args, results)]), flush=True)
    if args.paired:
        print("\n".join(["", *paired(args, built)]))
    return results


if __name__ == "__main__":
    main()
