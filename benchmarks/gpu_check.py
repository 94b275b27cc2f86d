"""A GPU check meant to take under 10 minutes: step time per precision, zoo GPT-2 and ViT.

On KerasHub's GPT-2 and ViT from `tfmixprec.zoo` (the models `benchmarks/zoo.py` times, at the
zoo's `"bench"` size: 4 layers, hidden 256, 4 heads; GPT-2 with vocabulary 8192 and sequence
128, ViT on 64x64 images in 16 patches), with a batch large enough for a GPU (GPT-2 128, ViT
512), each compiled with Adam, with XLA off and on (`compile(jit_compile=...)`):

- `float32`: the reference;
- `mixed_bfloat16`: the model built under `mixed_bfloat16`, no loss scaling;
- `mixed_float16`: built under `mixed_float16`, with tfmixprec's `LossScaleOptimizer`;
- `float8`: built under `mixed_bfloat16`, then `tfmixprec.float8_layers(model)` before
  `compile` (Keras's `layer.quantize("float8")` on the Dense / EinsumDense layers Transformer
  Engine's recipe keeps in float8; the notes say how many). Keras's float8 is
  quantize-dequantize: XLA on a GPU with float8 Tensor Cores (compute capability 8.9 or later)
  can rewrite it into float8 matmuls; elsewhere expect it slower than bfloat16;
- `mixed_float16, keras LSO` (GPT-2 only): the same float16 model with Keras's own
  `keras.optimizers.LossScaleOptimizer`; its note is tfmixprec's overhead, the median over
  the rounds of tfmixprec's step time over Keras's (`benchmarks/overhead.py` measures it in
  full).

Every variant is built from the zoo's seed and trains on the same data (`ZooModel.dataset`)
in one process: each is warmed up (traced and compiled), then timed in rounds that alternate
their order (A, B, C, C, B, A, ...), each a `fit` of `--steps` steps timed by
`tfmixprec.bench.StepTimer` (from the end of the first batch to the end of the last). A round
starts only while the run is under `--budget` seconds (at least one runs; a row whose warm-up
would start past it prints `skipped (--budget spent)`). The table gives the median ms/step
and the speed against float32 of the same model and XLA setting (float32's ms/step over the
row's: above 1.00x is faster). A variant that raises (XLA refusing an op, float8 on a device
without it) prints `failed: <ExceptionType>` in its cell and its message on stderr, and the
run goes on; progress goes to stderr, the table to stdout.

    python benchmarks/gpu_check.py            # on a GPU machine (meant for < 10 min on an H100)
    python benchmarks/gpu_check.py --smoke    # tiny models, 3 steps, on a CPU, for the tests

On a GPU machine (TensorFlow with CUDA: `pip install "tensorflow[and-cuda]" keras-hub` and
this package), run it from the repository's root: `python benchmarks/gpu_check.py`. Under
`--smoke` the zoo's tiny size runs (as `benchmarks/zoo.py --quick`), one round without a
warm-up (the untimed first batch traces), and XLA on GPT-2's float32 row only (the other XLA
rows print `skipped (--smoke)`: each costs 5-15 s of compiling on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("gpt2", "vit")
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16", "float8")
KERAS_LSO = "mixed_float16, keras LSO"  # the overhead row: Keras's own LossScaleOptimizer
OVERHEAD_MODEL = "gpt2"
BATCH = {"gpt2": 128, "vit": 512}  # the zoo's bench batch is 16: too small for a GPU
SMOKE_SKIP = "skipped (--smoke)"
BUDGET_SKIP = "skipped (--budget spent)"
SMOKE_XLA = (MODELS[0], POLICIES[0])  # the one XLA row --smoke runs: it exercises the path


@dataclasses.dataclass
class Variant:
    """One (model, policy, XLA) row: its model and data once built, its timings or error."""

    model: str
    policy: str
    xla: bool
    batch: int = 0
    net: Any = None
    data: Any = None
    note: str = ""
    error: str = ""  # "failed: <ExceptionType>", SMOKE_SKIP or BUDGET_SKIP
    times: list[float] = dataclasses.field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.model} / {self.policy} / XLA {'on' if self.xla else 'off'}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--smoke", action="store_true", help="tiny models, 3 steps, for CI")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed fit")
    parser.add_argument("--repeats", type=int, default=5, help="most timed rounds")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds: no new round after")
    parser.add_argument("--batch", type=int, help="batch for both models (default: per model)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats = 3, 1
    return args


def device_name() -> str:
    """The first GPU's name (and compute capability), or "CPU (no GPU)"."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "CPU (no GPU)"
    details = tf.config.experimental.get_device_details(gpus[0])
    capability = details.get("compute_capability")
    cc = f", compute capability {capability[0]}.{capability[1]}" if capability else ""
    return f"{details.get('device_name', gpus[0].name)}{cc} (1 of {len(gpus)} GPUs used)"


def variants_for(args: argparse.Namespace) -> list[Variant]:
    """Every row, in table order: per model, XLA off then on, float32 first."""
    rows = []
    for model in MODELS:
        policies = POLICIES + ((KERAS_LSO,) if model == OVERHEAD_MODEL else ())
        for xla in (False, True):
            for policy in policies:
                row = Variant(model, policy, xla)
                if args.smoke and xla and (model, policy) != SMOKE_XLA:
                    row.error = SMOKE_SKIP
                rows.append(row)
    return rows


def _optimizer(policy: str) -> Any:
    import keras

    import tfmixprec

    if policy == "mixed_float16":
        return tfmixprec.LossScaleOptimizer(keras.optimizers.Adam())
    if policy == KERAS_LSO:
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    return keras.optimizers.Adam()  # bfloat16, float8 (its scales need no loss scaling)


def _dataset(entry: Any, batch: int) -> Any:
    """Two batches of `batch` of the zoo's data, repeated (the zoo's batch divides `batch`)."""
    if batch % entry.batch_size:
        raise ValueError(f"--batch must be a multiple of {entry.batch_size}. Received: {batch}")
    sized = dataclasses.replace(entry, batch_size=batch)
    return sized.dataset(2 * batch // entry.batch_size).prefetch(2)


def build(row: Variant, args: argparse.Namespace) -> None:
    """Builds, quantizes (float8) and compiles `row`'s model; sets its data and note."""
    import tfmixprec
    from tfmixprec.tools import zoo

    policy = {"float8": "mixed_bfloat16", KERAS_LSO: "mixed_float16"}.get(row.policy, row.policy)
    with tfmixprec.policy_scope(policy):
        entry = zoo.build(row.model, size="tiny" if args.smoke else "bench")
    if row.policy == "float8":
        from tfmixprec import float8_layers  # at call time: the float8 module is new

        changes = float8_layers(entry.model)
        names = ", ".join(c.layer for c in changes[:3]) + (", ..." if len(changes) > 3 else "")
        row.note = f"{len(changes)} layers in float8 ({names})" if changes else "0 in float8"
    elif row.policy == "mixed_float16":
        row.note = "tfmixprec LSO"
    entry.model.compile(optimizer=_optimizer(row.policy), loss=entry.loss, jit_compile=row.xla)
    # The optimizer's variables now, as Keras makes them under a distribution strategy: left to
    # the first `fit`, its first trace makes them and TensorFlow traces the step again.
    entry.model.optimizer.build(entry.model.trainable_variables)
    batch = entry.batch_size if args.smoke else args.batch or BATCH[row.model]
    row.net, row.data, row.batch = entry.model, _dataset(entry, batch), batch


def attempt(row: Variant, work: Any) -> None:
    """Runs `work()`; an exception marks the row failed (its message to stderr), and the model
    is dropped so its memory can go."""
    try:
        work()
    except Exception as err:  # noqa: BLE001 - any failure is one cell of the table
        row.error, row.net, row.data = f"failed: {type(err).__name__}", None, None
        first = (str(err).strip().splitlines() or [""])[0][:300]
        print(f"{row.label}: {row.error}: {first}", file=sys.stderr, flush=True)


def warm_up(rows: list[Variant], args: argparse.Namespace, start: float) -> None:
    """Builds every row; outside `--smoke` also traces and compiles it with a short fit. Rows
    not reached within `--budget` are skipped."""
    from tfmixprec.tools import bench

    steps = max(3, args.steps // 4)
    for row in rows:
        if not row.error and time.perf_counter() - start > args.budget:
            row.error = BUDGET_SKIP
        if row.error:
            continue
        attempt(row, lambda row=row: build(row, args))
        if not args.smoke and not row.error:
            attempt(row, lambda row=row: bench.time_fit(row.net, row.data, steps))
        print(f"{row.label}: ready{' (' + row.error + ')' if row.error else ''}", file=sys.stderr)


def time_rounds(rows: list[Variant], args: argparse.Namespace, start: float) -> int:
    """Timed fits of every live row in alternating order, while under the budget; returns the
    number of rounds."""
    from tfmixprec.tools import bench

    rounds = 0
    while rounds < args.repeats and (rounds == 0 or time.perf_counter() - start < args.budget):
        order = rows if rounds % 2 == 0 else list(reversed(rows))
        for row in order:
            if not row.error:

                def timed(row: Variant = row) -> None:
                    row.times.append(bench.time_fit(row.net, row.data, args.steps).per_step)

                attempt(row, timed)
        rounds += 1
        elapsed = time.perf_counter() - start
        print(f"round {rounds}/{args.repeats} done, {elapsed:.0f} s", file=sys.stderr, flush=True)
    return rounds


def overhead(rows: list[Variant], model: str, xla: bool) -> str:
    """tfmixprec's LossScaleOptimizer over Keras's: the median of the rounds' ratios."""
    pair = {r.policy: r for r in rows if r.model == model and r.xla == xla}
    ours, theirs = pair["mixed_float16"], pair[KERAS_LSO]
    if not (ours.times and theirs.times):
        return "tfmixprec LSO / keras LSO: -"
    ratio = statistics.median(a / b for a, b in zip(ours.times, theirs.times))
    return f"tfmixprec LSO / keras LSO: {ratio:.2f}x"


def _float32_of(rows: list[Variant], row: Variant) -> Variant:
    return next(r for r in rows if (r.model, r.xla, r.policy) == (row.model, row.xla, "float32"))


def table(rows: list[Variant]) -> list[str]:
    lines = [
        "| model | policy | xla | ms/step | speed vs float32 | notes |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = _float32_of(rows, row)
        ms = f"{1000 * statistics.median(row.times):.2f}" if row.times else row.error
        speed = "-"
        if row.times and base.times:
            speed = f"{statistics.median(base.times) / statistics.median(row.times):.2f}x"
        note = row.note
        if row.policy == KERAS_LSO:
            note = overhead(rows, row.model, row.xla) + (f"; {note}" if note else "")
        xla = "on" if row.xla else "off"
        lines.append(f"| {row.model} | {row.policy} | {xla} | {ms} | {speed} | {note} |")
    return lines


def header(args: argparse.Namespace, rows: list[Variant], rounds: int) -> str:
    import keras
    import tensorflow as tf

    sizes = []
    for model in MODELS:
        built = [r for r in rows if r.model == model and r.net is not None]
        if built:  # the first built row's: float32's (float8 adds its scales)
            params = built[0].net.count_params() / 1e6
            sizes.append(f"{model} {params:.2f}M parameters, batch {built[0].batch}")
    size = "tiny" if args.smoke else "bench"
    fits = f"{rounds} timed fit{'s' if rounds != 1 else ''}"
    return (
        f"device: {device_name()}; TensorFlow {tf.__version__}, Keras {keras.__version__}; "
        f"zoo size {size}: {'; '.join(sizes)}; ms/step: median of {fits} of {args.steps} steps"
    )


def main(argv: list[str] | None = None) -> list[Variant]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    rows = variants_for(args)
    warm_up(rows, args, start)
    rounds = time_rounds(rows, args, start)
    print("\n".join([header(args, rows, rounds), "", *table(rows)]), flush=True)
    return rows


if __name__ == "__main__":
    main()
