"""Training throughput per policy: float32, mixed_bfloat16, mixed_float16 and auto.

For an MLP, a small CNN and a Transformer encoder block sized so that the matmuls dominate,
each policy is timed with plain Keras (`keras.Model` + `compile` + `fit`) and with the
tfmixprec stack (`MixedPrecisionModel`, tfmixprec's optimizer), in one process, alternating
runs; the ratio is to float32 of the same stack. On a GPU the script runs unchanged.

On a machine without a GPU, some of TensorFlow's float16 CPU kernels are slow, which ones by
CPU (the convolution filter gradient up to ~600x float32, the fused MatMul up to ~1000x on a
Sapphire Rapids Xeon, matmuls and attention's einsum without AVX512_FP16 1.1-10x); the
tfmixprec stack takes this CPU's routes around them (`tfmixprec.cpu_float16.routes_on()`) and
runs float16 at full size. Plain Keras's float16 runs keep the slow kernels (the remapper is
process-wide, so once tfmixprec has turned it off for float16 it is off for them too) and use
fewer steps and a smaller batch (`--float16-steps`, `--float16-batch`); their samples/s is
still per sample. With `--float16-batch` and `--float16-steps` equal to the float32 ones, the
two stacks' float16 rows compare native float16 with the routes (benchmarks/RESULTS.md, 16).

    python benchmarks/speedup.py                  # all three models
    python benchmarks/speedup.py --models mlp --steps 10
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfmixprec.tools import bench  # noqa: E402

SIZES = {"mlp": 2048, "cnn": 256, "transformer": 512}
# Batches large enough that the matmuls, not the per-step optimizer update, dominate.
BATCHES = {"mlp": 1024, "cnn": 128, "transformer": 32}
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16", "auto")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=bench.MODELS, default=list(bench.MODELS))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--batch", type=int, default=None, help="default: per model")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--float16-steps", type=int, default=3)
    parser.add_argument(
        "--float16-batch", type=int, default=16, help="float16 batch on a machine with no GPU"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the model sizes")
    args = parser.parse_args(argv)

    machine = bench.describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores), GPUs: {machine['gpus'] or 'none'}; "
        f"Python {machine['python']}, TensorFlow {machine['tensorflow']}, Keras {machine['keras']}"
    )
    all_results = []
    for model in args.models:
        size = max(8, int(SIZES[model] * args.scale))
        batch = args.batch or BATCHES[model]
        results = bench.run_bench(
            model=model,
            policies=args.policies,
            stacks=("keras", "tfmixprec"),
            size=size,
            batch=batch,
            steps=args.steps,
            repeats=args.repeats,
            float16_steps=args.float16_steps,
            float16_batch=args.float16_batch,
        )
        print(f"\n{model} (size {size}, batch {batch})")
        print(bench.format_table(results))
        all_results.extend(results)
    # A policy asked under two names (auto and the one it picks) is one result.
    by_key = {(r.model, name, r.stack): r for r in all_results for name in r.asked or (r.policy,)}
    print("\nauto vs raw Keras bfloat16 (tfmixprec auto throughput / keras mixed_bfloat16):")
    for model in args.models:
        auto = by_key.get((model, "auto", "tfmixprec"))
        raw = by_key.get((model, "mixed_bfloat16", "keras"))
        if auto and raw:
            print(
                f"  {model:12} {auto.samples_per_s / raw.samples_per_s:.2f} "
                f"(auto -> {auto.resolved_policy})"
            )
    return {"results": all_results}


if __name__ == "__main__":
    main()
