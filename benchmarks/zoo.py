"""Step time, peak memory and loss parity per policy on real architectures (`tfmixprec.zoo`).

For each zoo model at the `"bench"` size (KerasHub's GPT-2 with 4 layers, hidden 256, 4 heads,
vocabulary 8192, sequence 128, batch 16; Llama, Gemma, Mistral, BERT and ViT at the same
width; a ResNet-18 and keras.applications' MobileNetV3Small on 64x64 images), five stacks,
each compiled with `"adam"` the Keras way:

- `float32`: the reference;
- `bf16 keras` / `f16 keras`: plain Keras under `mixed_bfloat16` / `mixed_float16` (Keras wraps
  the float16 optimizer in its own `LossScaleOptimizer`);
- `bf16 tfmixprec` / `f16 tfmixprec`: the same model trained with tfmixprec's callbacks
  (`LossScaleMonitor`, `OverflowGuard`: Keras's optimizer adopted), and its CPU routes on a
  machine without a GPU: for bfloat16 `tfmixprec.cpu_bfloat16` (a language model's logits in
  bfloat16, depthwise convolutions in float32, where measured to help), for float16
  `tfmixprec.cpu_float16` (the remapper off, Dense / EinsumDense / convolution products in
  float32). The last column counts the layers a route changed: with none, the step is the
  same as plain Keras's, and any difference in its time is the machine's noise.

Every (model, stack) runs in its own process (the remapper switch and the peak memory are
process-wide), in an order that alternates from model to model. A process builds the model
from the zoo's seed, trains `--parity-steps` steps on the same data as every other stack
(their per-step losses: the parity, the largest distance from float32's, relative to
float32's first loss; steps a loss scale skipped are counted), warms
up, then times `--runs` fits of `--steps` steps (`tfmixprec.bench.StepTimer`: from the end of
the first batch to the end of the last; the median is the figure). Peak memory is the
process's peak resident set (`ru_maxrss`), TensorFlow's runtime included.

    python benchmarks/zoo.py                         # about 30 minutes on 2 cores
    python benchmarks/zoo.py --models gpt2 resnet    # some of them
    python benchmarks/zoo.py --quick                 # tiny models, for the tests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("gpt2", "llama", "gemma", "mistral", "bert", "vit", "resnet", "mobilenet")
STACKS = ("float32", "bf16 keras", "bf16 tfmixprec", "f16 keras", "f16 tfmixprec")
POLICY = {"float32": "float32", "bf16": "mixed_bfloat16", "f16": "mixed_float16"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    parser.add_argument("--size", choices=("tiny", "bench"), default="bench")
    parser.add_argument("--steps", type=int, default=8, help="steps per timed fit")
    parser.add_argument("--runs", type=int, default=3, help="timed fits per process")
    parser.add_argument("--parity-steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    parser.add_argument("--quick", action="store_true", help="tiny models, for the tests")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "STACK"), help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    # For the tests: these stacks' workers run in the driver's process (no start of TensorFlow
    # each; their peak memory is then the driver's); the others still in processes of their own.
    parser.add_argument(
        "--in-process", nargs="+", choices=STACKS, default=[], help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.steps, args.runs, args.parity_steps = "tiny", 2, 1, 2
    return args


# ------------------------------------------------------------------ in a worker process
def worker_main(args: argparse.Namespace) -> None:
    import contextlib
    import io
    import resource

    import keras

    import tfmixprec
    from tfmixprec.tools import bench, zoo

    name, stack = args.worker
    dtype, _, through = stack.partition(" ")
    with tfmixprec.policy_scope(POLICY[dtype]):
        entry = zoo.build(name, size=args.size)
        entry.model.compile(optimizer="adam", loss=entry.loss)
        # The optimizer's variables now, as Keras makes them under a distribution strategy: left to
        # the first `fit`, its first trace makes them and TensorFlow traces the step again.
        entry.model.optimizer.build(entry.model.trainable_variables)
    model, callbacks, routed = entry.model, [], []
    if through == "tfmixprec":
        callbacks = [tfmixprec.LossScaleMonitor(), tfmixprec.OverflowGuard(verbose=0)]
        if dtype == "f16":
            tfmixprec.cpu_float16.route_around_fused_matmul("mixed_float16")
            routed = tfmixprec.cpu_float16.fast_float16_layers(model)
        else:
            routed = tfmixprec.cpu_bfloat16.fast_bfloat16_layers(model)
    record = bench.StepLosses()
    keras.utils.set_random_seed(1)  # the same dropout masks in every stack
    with contextlib.redirect_stdout(io.StringIO()):  # the callbacks' one-line notes
        model.fit(
            entry.dataset(args.parity_steps + 1),
            epochs=1,
            steps_per_epoch=args.parity_steps,
            verbose=0,
            callbacks=[*callbacks, record],
        )
        # Applied steps count in `iterations` (Keras's and tfmixprec's optimizers alike).
        skipped = args.parity_steps - int(model.optimizer.iterations.numpy())
        dataset = entry.dataset(args.parity_steps + 1)
        bench.time_fit(model, dataset, args.steps, callbacks)  # warm up
        times = [
            bench.time_fit(model, dataset, args.steps, callbacks).per_step for _ in range(args.runs)
        ]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    with open(args.record, "w") as f:
        json.dump(
            {
                "step_s": statistics.median(times),
                "peak_mib": peak,
                "losses": record.losses,
                "skipped": skipped,
                "routed": routed,
            },
            f,
        )


# ------------------------------------------------------------------ the driver
def launch(args: argparse.Namespace, name: str, stack: str, folder: str) -> dict:
    record = os.path.join(folder, f"{name}-{stack.replace(' ', '-')}.json")
    if stack in args.in_process:
        worker_main(argparse.Namespace(**{**vars(args), "worker": [name, stack], "record": record}))
        with open(record) as f:
            return json.load(f)
    command = [sys.executable, os.path.abspath(__file__), "--worker", name, stack]
    command += ["--record", record, "--size", args.size, "--steps", str(args.steps)]
    command += ["--runs", str(args.runs), "--parity-steps", str(args.parity_steps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"{name} / {stack} failed:\n{done.stderr[-3000:]}")
    with open(record) as f:
        return json.load(f)


def parity(losses: list[float], reference: list[float]) -> float:
    """The largest distance of a step's loss from float32's, relative to float32's first loss
    (the loss's own scale: a loss that nears 0 would make a step-by-step ratio explode)."""
    return max(abs(a - b) for a, b in zip(losses, reference)) / abs(reference[0])


def _routed(stack: str, routed: list[str]) -> str:
    """How many layers tfmixprec's CPU routes changed (none: the same step as plain Keras)."""
    if not stack.endswith("tfmixprec"):
        return "-"
    return (
        f"{len(routed)} ({', '.join(routed[:2])}{', ...' if len(routed) > 2 else ''})"
        if routed
        else "0"
    )


def table(args: argparse.Namespace, results: dict) -> list[str]:
    lines = [
        "| model | stack | ms/step | vs float32 | peak MiB | loss parity (largest distance from "
        "float32's / its first loss) | layers routed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        base = results[name].get("float32")
        for stack in args.stacks:
            r = results[name][stack]
            ratio = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
            close = f"{parity(r['losses'], base['losses']):.1e}" if base else "-"
            skipped = f" ({r['skipped']} of them skipped)" if r["skipped"] else ""
            lines.append(
                f"| {name} | {stack} | {1000 * r['step_s']:.1f} | {ratio} | "
                f"{r['peak_mib']:.0f} | {close}{skipped} | {_routed(stack, r['routed'])} |"
            )
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker_main(args)
        return {}
    import keras
    import tensorflow as tf

    from tfmixprec.tools import bench

    machine = bench.describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores), GPUs: {machine['gpus'] or 'none'}; "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}; zoo size {args.size}, "
        f"{args.runs} fits of {args.steps} steps per process, parity over {args.parity_steps} steps"
    )
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tfmixprec-zoo-") as folder:
        for index, name in enumerate(args.models):
            order = args.stacks if index % 2 == 0 else list(reversed(args.stacks))
            results[name] = {stack: launch(args, name, stack, folder) for stack in order}
            print(f"{name}: done", flush=True)
    print("\n".join(["", *table(args, results)]))
    return results


if __name__ == "__main__":
    main()
