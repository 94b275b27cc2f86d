"""The `tfmixprec` command's arguments and start-up, outside the package: the argument parser
(`build_parser`) and `start_tensorflow` (TensorFlow imported with its start-up log lines
silenced).

`import tfmixprec` imports TensorFlow (it registers tfmixprec's Keras-serializable classes, so
`keras.models.load_model` works right after it), and that takes seconds. This module is not
part of the package and imports nothing of TensorFlow, Keras or tfmixprec at all
(`tests/test_package.py` checks it), so `tfmixprec --help`, `tfmixprec demo --help` and usage
errors answer before TensorFlow is loaded. Two modules read it: the console script
(`_tfmixprec_cli`) and the package's command module (`tfmixprec.tools.cli`); it reads neither.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["build_parser", "drop_startup_noise", "start_tensorflow"]

DEMO_POLICIES = ("auto", "mixed_float16", "mixed_bfloat16", "float32")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _timed_steps(text: str) -> int:
    """Steps per timed run: a step is timed from the end of the first to the end of the
    last, so 2 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 2 (a step is timed from the end of the first to the end "
            f"of the last), got {text!r}"
        )
    return value


BENCH_MODELS = ("mlp", "cnn", "transformer")
ZOO_MODELS = ("gpt2", "llama", "gemma", "mistral", "bert", "vit", "resnet", "mobilenet")


def _bench_model(text: str) -> str:
    """A built-in or zoo model's name, or MODULE:FUNCTION / FILE.py:FUNCTION (checked when
    imported, after TensorFlow starts)."""
    where, _, name = text.rpartition(":")
    if text in BENCH_MODELS or text in ZOO_MODELS or (where and name.isidentifier()):
        return text
    raise argparse.ArgumentTypeError(
        f"expected {', '.join(BENCH_MODELS + ZOO_MODELS)} or MODULE:FUNCTION / "
        f"FILE.py:FUNCTION, got {text!r}"
    )


BENCH_DESCRIPTION = (
    "Times training steps under each policy, side by side in one process. Each policy is "
    "timed once (auto shares the row of the policy it picks: 'mixed_bfloat16 (auto)'): its "
    "model is built, warmed up (the first step traces it: seconds for a built-in model, up "
    "to a minute or more for a zoo model), then timed --repeats runs of --steps steps, the "
    "policies alternating. The built-in models take under a minute. A zoo model runs at its "
    "bench size (GPT-2: 4 layers, hidden 256, vocabulary 8192, sequence 128, batch 16) and "
    "takes minutes: gpt2 took 7 min 18 s with the defaults on a Sapphire Rapids Xeon, 3 min "
    "of it building and warming up; fewer --steps, --repeats or --policies shorten it. "
    "After each warm-up, stderr gives the time left in all, the warm-ups to come included. "
    "The table's 'vs float32' "
    "is the median over the repeats of each repeat's throughput ratio (its runs are timed "
    "back to back), 'min-max' their range: a wide range means the machine's speed changed "
    "during the run."
)


def _add_demo(sub: Any) -> None:
    """The `demo` subcommand's parser."""
    demo = sub.add_parser(
        "demo",
        help="train a small CNN on the digits data set",
        description="Trains a small CNN on scikit-learn's digits under the policy this machine "
        "trains fastest in (or --policy), then a short float16 phase in which a layer really "
        "passes float16's 65504: the steps are skipped, the loss scale backs off, the overflow "
        "is diagnosed and PrecisionRepair moves the layer to float32 while training goes on. "
        'Both runs go to --logdir, for TensorBoard\'s "Mixed precision" tab.',
    )
    demo.add_argument(
        "--policy",
        choices=DEMO_POLICIES,
        default="auto",
        help="the first run's policy (default: auto, the fastest on this machine)",
    )
    demo.add_argument(
        "--epochs", type=_positive_int, default=12, help="the first run's epochs (default: 12)"
    )
    demo.add_argument("--logdir", default="runs", help="TensorBoard log folder (default: runs)")
    demo.add_argument(
        "--batch-size", type=_positive_int, default=64, help="the first run's batch (default: 64)"
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--no-story", action="store_true", help="skip the float16 overflow-and-repair phase"
    )


def _add_bench(sub: Any) -> None:
    """The `bench` subcommand's arguments."""
    what = "step time and throughput per policy, side by side"
    bench = sub.add_parser("bench", help=what, description=BENCH_DESCRIPTION)
    bench.add_argument(
        "--model",
        type=_bench_model,
        default="mlp",
        help=f"{', '.join(BENCH_MODELS)} (built in), a zoo model ({', '.join(ZOO_MODELS)}), "
        "or your own: MODULE:FUNCTION or FILE.py:FUNCTION, a function that builds and "
        "compiles it (default: mlp)",
    )
    bench.add_argument(
        "--policies",
        nargs="+",
        choices=DEMO_POLICIES,
        help="default: float32 mixed_bfloat16 auto (built in); float32 mixed_bfloat16 "
        "mixed_float16 (other models)",
    )
    width = "the built-in model's width (default: 1024)"
    bench.add_argument("--size", type=_positive_int, default=1024, help=width)
    bench.add_argument(
        "--batch-size",
        type=_positive_int,
        help="default: 256 (built in), 32 (your function's model); a zoo model uses its own",
    )
    bench.add_argument(
        "--steps",
        type=_timed_steps,
        default=20,
        help="steps per timed run, 2 or more (default: 20)",
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="timed runs per policy, the median reported (default: 3)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `tfmixprec` argument parser (subcommands doctor, audit, demo, bench)."""
    parser = argparse.ArgumentParser(
        prog="tfmixprec",
        description="Safe, visible and fast mixed precision for Keras 3 on TensorFlow.",
    )
    # No command is not an error: bare `tfmixprec` prints this help (exit 0).
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = sub.add_parser(
        "doctor",
        help="hardware report and the recommended policy",
        description="Reports the TensorFlow and Keras versions, the CPU's float16 and bfloat16 "
        "instructions (AVX512_FP16, AVX512_BF16, AMX), the GPUs and TPUs, the routes tfmixprec "
        "takes around slow float16 and bfloat16 CPU kernels on this machine, the current "
        "policy, and the policy to use here with the reason.",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")

    audit = sub.add_parser(
        "audit",
        help="audit a saved .keras model for mixed precision",
        description="Audits a saved .keras (or .h5) model as it was saved, under the policy its "
        "layers were saved with (or --policy), without running code from the file: which "
        "layers must stay float32, loss scaling, float8, alignment and CPU kernels. Exit "
        "codes: 0 no error (warnings and info allowed), 1 an error found, 2 the file cannot "
        "be audited.",
    )
    audit.add_argument("model", help="path to a .keras file")
    audit.add_argument(
        "--policy",
        choices=DEMO_POLICIES,
        help="audit as if the model had been built under this policy",
    )
    audit.add_argument("--json", action="store_true", help="print JSON")

    _add_demo(sub)
    _add_bench(sub)
    return parser


# TensorFlow's C++ log lines: severity letter, date, time, thread, file:line (absl's format).
_LOG_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ \S+:\d+\] ")
# absl prints this, and every line logged before TensorFlow initializes absl logging, whatever
# TF_CPP_MIN_LOG_LEVEL says (TensorFlow 2.21).
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to"
_NO_DRIVER = "Could not find cuda drivers on your machine"
_CUINIT_FAILED = "failed call to cuInit"


def _hidden(line: str, min_level: int, no_driver: bool) -> bool:
    match = _LOG_LINE.match(line)
    if match is None:
        return min_level >= 1 and line.startswith(_ABSL_BANNER)
    severity = "IWEF".index(match.group(1))
    # Without an NVIDIA driver cuInit fails by necessity: its ERROR line adds nothing to the
    # INFO line that says so, and goes with it.
    return severity < min_level or (min_level >= 2 and no_driver and _CUINIT_FAILED in line)


def drop_startup_noise(text: str, min_level: int) -> str:
    """`text` (what TensorFlow wrote to stderr while starting) without the lines
    TF_CPP_MIN_LOG_LEVEL=`min_level` means to hide; every other line is kept.

    Args:
        text: String. The captured stderr.
        min_level: Int. 0 shows all, 1 hides INFO, 2 also WARNING, 3 also ERROR.

    Returns:
        The kept lines, in order.
    """
    no_driver = _NO_DRIVER in text
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not _hidden(line, min_level, no_driver))


@contextlib.contextmanager
def _filtered_stderr(min_level: int) -> Iterator[None]:
    """Captures file descriptor 2 (where C++ logs too) in the block; writes back what
    `drop_startup_noise` keeps when it ends, also when it raises."""
    import tempfile

    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            sys.stderr.write(drop_startup_noise(text, min_level))
            sys.stderr.flush()


def _min_log_level() -> int:
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def start_tensorflow() -> None:
    """Imports TensorFlow and lists its devices without its start-up log lines.

    Sets TF_CPP_MIN_LOG_LEVEL=2 (INFO and WARNING off) unless it is set already (a user's own
    setting wins), and hides the lines TensorFlow prints before that setting takes effect.
    Does nothing more once TensorFlow is imported.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import_tensorflow_quietly()


def import_tensorflow_quietly() -> None:
    """What `import tfmixprec` does first: imports TensorFlow and lists its physical devices,
    when nothing has imported it yet, without the start-up lines this process's
    TF_CPP_MIN_LOG_LEVEL hides (unset: all are shown, as TensorFlow shows them). Sets nothing;
    a program may still configure its logical devices afterwards."""
    if "tensorflow" in sys.modules:
        return
    with _filtered_stderr(_min_log_level()):
        import tensorflow as tf

        tf.config.list_physical_devices()  # device start-up logs too (cuInit)
