"""The `tfmixprec` command: exit codes, key output. Where the process is what a test checks
(the exit code the shell sees, the console script, `python -m`, help without TensorFlow,
start-up lines, the console's warning lines) it runs as a user runs it, in a subprocess
(`run`); elsewhere `tfmixprec.tools.cli.main` runs it in this process (`run_here`), which
checks that it leaves the process as it found it."""

import json
import os
import re
import statistics
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import keras
import pytest
import tensorflow as tf
from cli_runs import run_here
from live_tensorboard import get_json

import tfmixprec
from tfmixprec.precision.hardware import HardwareInfo
from tfmixprec.tools import bench

SCRIPT = Path(sys.executable).parent / "tfmixprec"
# A line TensorFlow's C++ logs (severity, date, time, thread, file:line): its ERROR lines
# differ by CPU, so no test counts them.
TF_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\] ")


def run(*args, cwd=None, timeout=300):
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "tfmixprec"]
    result = subprocess.run(
        command + list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    return result.returncode, result.stdout, result.stderr


def test_console_script_is_installed():
    assert SCRIPT.exists(), "pip install should create the `tfmixprec` command"


def test_doctor():
    code, out, _ = run_here("doctor")
    assert code == 0
    assert out.startswith("tfmixprec doctor")
    assert re.search(r"recommended\s+(mixed_float16|mixed_bfloat16|float32): ", out)
    routes_line = next(line for line in out.splitlines() if "float16 routes" in line)
    code, out, _ = run_here("doctor", "--json")
    data = json.loads(out)
    assert code == 0 and data["recommended_policy"] in (
        "mixed_float16",
        "mixed_bfloat16",
        "float32",
    )
    # --json holds what the text shows: every float16 route, the fused MatMul off among them
    assert ("the fused MatMul off" in routes_line) == ("the fused MatMul off" in str(data))
    assert all(route in routes_line for route in data["float16_routes"])


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    with tfmixprec.policy_scope("mixed_float16"):
        bad = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(4, activation="softmax")]
        )
        bad.save(folder / "bad.keras")
        clean = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(8, dtype="float32")]
        )
        clean.compile(optimizer=tfmixprec.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
        clean.save(folder / "clean.keras")
        # Keras wraps "sgd" in its own LossScaleOptimizer (the file names only "sgd").
        keras_scaled = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(8),
                keras.layers.Softmax(dtype="float32"),
            ],
            name="keras_scaled",
        )
        keras_scaled.compile(optimizer="sgd", loss="mse")
        keras_scaled.save(folder / "keras_scaled.keras")
        keras_scaled.save(folder / "legacy.h5")
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    plain.save(folder / "float32.keras")
    (folder / "notes.txt").write_text("not a model")
    (folder / "a_folder").mkdir()
    marker = folder / "ran"
    tokens = keras.Input((4,))
    payload = eval(f"lambda x: (open({str(marker)!r}, 'w').close(), x)[1]")
    keras.Model(tokens, keras.layers.Lambda(payload, name="payload")(tokens)).save(
        folder / "code.keras"
    )
    marker.unlink()  # building the model called the lambda
    with zipfile.ZipFile(folder / "broken.keras", "w") as archive:
        archive.writestr("config.json", "{this is not json")
    return folder


def test_audit_exit_codes(saved_models):
    code, out, _ = run("audit", str(saved_models / "bad.keras"))  # the code the shell sees
    assert code == 1
    assert "ERROR   low-precision-softmax" in out
    code, out, _ = run_here("audit", str(saved_models / "clean.keras"))
    assert code == 0, out
    assert "ERROR" not in out and "WARNING" not in out
    hardware = tfmixprec.detect_hardware()
    # What is slow here is said, as information: float16 Dense products, on a CPU without
    # AVX512_FP16 (with it they run natively and nothing is routed: nothing to say).
    routed = not hardware.gpus and not hardware.cpu_float16
    assert ("INFO    cpu-float16-kernels" in out) is routed
    code, out, _ = run_here("audit", str(saved_models / "float32.keras"))
    assert code == 0
    args = ("audit", str(saved_models / "float32.keras"), "--policy", "mixed_float16")
    code, out, _ = run_here(*args)
    assert code == 1 and "low-precision-output" in out
    code, out, _ = run_here("audit", str(saved_models / "bad.keras"), "--json")
    assert code == 1 and json.loads(out)["ok"] is False


@pytest.mark.parametrize("name", ["keras_scaled.keras", "legacy.h5"])
def test_audit_of_a_file_agrees_with_the_model_in_memory(saved_models, name):
    code, out, err = run_here("audit", str(saved_models / name), "--json")
    assert code == 0, out + err
    assert "Skipping variable loading" not in err
    with tfmixprec.policy_scope("mixed_float16"):
        model = keras.models.load_model(saved_models / "keras_scaled.keras")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer  # as it was saved
    data = json.loads(out)
    assert data["policy"] == "mixed_float16"
    assert data["findings"] == tfmixprec.audit(model).to_dict()["findings"]


def test_audit_never_runs_a_files_code(saved_models):
    code, out, err = run_here("audit", str(saved_models / "code.keras"))
    assert code == 2 and out == ""
    assert "holds code: layer 'payload' (Lambda) is a Python lambda stored as bytecode" in err
    assert "tfmixprec.audit(keras.models.load_model(path, safe_mode=False))" in err
    assert not (saved_models / "ran").exists()


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing.keras", "no such file: "),
        ("notes.txt", "is not a Keras model file"),
        ("broken.keras", "could not load"),
        ("a_folder", "is a directory, not a model file"),
    ],
)
def test_audit_bad_files(saved_models, name, message):
    code, out, err = run_here("audit", str(saved_models / name))
    assert code == 2
    assert message in err and name in err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["demo", "--epochs", "0"], "expected a positive integer, got '0'"),
        (["demo", "--policy", "fp8"], "invalid choice: 'fp8'"),
        (["audit"], "the following arguments are required: model"),
        (["bench", "--model", "rnn"], "or MODULE:FUNCTION / FILE.py:FUNCTION, got 'rnn'"),
    ],
)
def test_bad_arguments_are_usage_errors(args, message):
    code, _, err = run(*args)
    assert code == 2
    assert err.startswith("usage: tfmixprec")  # parsed before TensorFlow could log a line
    assert message in err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One `tfmixprec demo` for the module's tests: its output and its log folder."""
    folder = tmp_path_factory.mktemp("demo")
    code, out, err = run_here("demo", "--epochs", "8", "--logdir", str(folder / "runs"), cwd=folder)
    assert code == 0, err[-2000:]
    return out, err, folder / "runs"


def test_demo_trains_and_reports(demo_run):
    out, _, runs = demo_run
    assert "loss_scale" in out  # in Keras's progress output
    accuracy = float(re.search(r"test accuracy\s+([0-9.]+)", out).group(1))
    assert accuracy > 0.90
    assert re.search(r"overflow steps\s+\d+ of \d+", out)
    events = list(runs.glob("demo-*-*/train/events.out.tfevents.*"))
    assert events, "the demo writes TensorBoard logs"


def test_demo_tells_the_float16_story_and_ends_with_the_tab(demo_run):
    """A layer really passes 65504: 5 steps skipped as the scale backs off, the diagnosis of the
    first, the repair at the fifth (PrecisionRepair's max_consecutive), clean steps after it."""
    out, err, runs = demo_run
    assert "float16 story: mixed_float16, shown for its loss-scale story, not for speed" in out
    assert "UserWarning: mixed_float16 without a GPU" not in err  # the demo says it itself
    story = out[out.index("tfmixprec float16 story") :].splitlines()
    assert story[0] == "tfmixprec float16 story (steps 0-based, skipped steps counted)"
    assert story[1] == (
        "  overflow        5 of 48 steps skipped, steps 0-4: loss scale 32768 -> 16384 -> "
        "8192 -> 4096 -> 2048"
    )
    assert re.fullmatch(
        r"  diagnosis       step 0: forward-overflow in 'wide', its outputs reach "
        r"[0-9.]+e\+05 in float32",
        story[2],
    )
    assert re.fullmatch(
        r"  repair          step 4: 'wide', 'narrow' now float32, loss scale restarted at \d+",
        story[3],
    )
    losses = re.fullmatch(r"  after it        43 steps, 0 overflow; loss per epoch (.*)", story[4])
    first, *_, last = (float(v) for v in losses.group(1).split(" -> "))
    assert last < first  # training went on
    assert story[-2:] == [
        f"  TensorBoard     tensorboard --logdir {runs}",
        '                  then open the "Mixed precision" tab',
    ]
    [logs] = runs.glob("demo-float16-story-*")
    assert list((logs / "train").glob("events.out.tfevents.*"))


def test_demo_logs_make_the_tab_show_the_story(demo_run, tensorboard_server):
    _, _, runs = demo_run
    port = tensorboard_server(runs)
    listed = get_json(port, "/data/plugin/tfmixprec/runs")["runs"]
    [story] = [run for run in listed if run.startswith("demo-float16-story-")]
    assert len(listed) == 2  # and the first run's
    data = get_json(port, "/data/plugin/tfmixprec/data", {"run": story})
    assert data["overflows"] == [[step, 1.0] for step in range(5)]
    diagnosis, repair = data["events"]
    assert (diagnosis["kind"], diagnosis["step"], diagnosis["cause"], diagnosis["layer"]) == (
        "diagnosis",
        0,
        "forward-overflow",
        "wide",
    )
    assert (repair["kind"], repair["step"], repair["layers"]) == ("repair", 4, ["wide", "narrow"])


def test_demo_without_the_story(tmp_path):
    args = ("demo", "--epochs", "1", "--quiet", "--no-story", "--logdir", str(tmp_path / "runs"))
    code, out, err = run_here(*args, cwd=tmp_path)
    assert code == 0, err[-2000:]
    assert "float16 story" not in out
    assert out.rstrip().endswith('then open the "Mixed precision" tab')
    assert [p.name.split("-")[1] for p in (tmp_path / "runs").iterdir()] != ["float16"]
    assert len(list((tmp_path / "runs").iterdir())) == 1


def test_bench_table():
    """The default policies: auto shares the row of the policy it picks here, which is timed
    once; two repeats give each ratio's range, with the line that says how to read it."""
    picked = tfmixprec.choose_policy().name  # mixed_bfloat16 with AVX512_BF16/AMX, else float32
    code, out, err = run_here(
        "bench", "--size", "64", "--batch-size", "32", "--steps", "2", "--repeats", "2"
    )
    assert code == 0, err[-2000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("machine: ")
    assert lines[1].split()[-2:] == ["float32", "min-max"]
    rows = [line for line in lines if line.startswith("mlp")]
    labels = [f"float32{' (auto)' if picked == 'float32' else ''}"]
    labels.append(f"mixed_bfloat16{' (auto)' if picked == 'mixed_bfloat16' else ''}")
    assert [row[12:39].strip() for row in rows] == labels
    assert rows[0].endswith("1.00x")  # float32 against itself: no range
    assert re.fullmatch(r"\d+\.\d\dx \d+\.\d\d-\d+\.\d\dx", " ".join(rows[1].split()[-2:]))
    assert bench.SPREAD_NOTE in out
    # Progress on stderr: each warm-up with the time left in all (the warm-ups to come
    # included), then the time left after each run.
    progress = [line for line in err.splitlines() if line.startswith("bench: ")]
    left = r"ms/step \(\d+ s with tracing\), about \d+ s left in all"
    assert re.fullmatch(
        rf"bench: warmed up 1/2: {re.escape(labels[0])}, tfmixprec [\d.]+ {left}", progress[0]
    )
    assert re.fullmatch(
        rf"bench: warmed up 2/2: {re.escape(labels[1])}, tfmixprec [\d.]+ {left}", progress[1]
    )
    assert re.fullmatch(r"bench: timing 2 runs of each: about \d+ s", progress[2])
    assert re.fullmatch(r"bench: run 1/2 of each done, about \d+ s left", progress[3])
    assert re.fullmatch(r"bench: run 2/2 of each done, about 0 s left", progress[4])
    assert len(progress) == 5


def test_each_policy_is_timed_once_under_the_names_that_ask_for_it():
    bf16 = HardwareInfo(cpu_name="Test CPU", cpu_flags=frozenset({"avx512_bf16"}))
    plain = HardwareInfo(cpu_name="Test CPU")
    asked = ["float32", "mixed_bfloat16", "auto", "mixed_bfloat16"]
    assert bench.distinct_policies(asked, bf16) == [("float32",), ("mixed_bfloat16", "auto")]
    assert bench.distinct_policies(asked, plain) == [("float32", "auto"), ("mixed_bfloat16",)]
    assert bench.distinct_policies(["auto"], bf16) == [("auto",)]

    def result(asked, resolved):
        return bench.BenchResult("m", asked[0], resolved, "keras", 8, 1.0, 8.0, [1.0], asked)

    assert result(("mixed_bfloat16", "auto"), "mixed_bfloat16").label == "mixed_bfloat16 (auto)"
    assert result(("auto",), "mixed_bfloat16").label == "mixed_bfloat16 (auto)"
    assert result(("float32",), "float32").label == "float32"


def test_the_table_shows_the_paired_ratios_median_and_range():
    """Each repeat's throughput ratio to float32 of the same stack, paired by repeat: the
    reporter's 2.75x and 1.55x are two repeats of one run, shown with their range."""

    def result(policy, stack, batch, runs_ms):
        step = statistics.median(runs_ms)
        return bench.BenchResult(
            "mlp", policy, policy, stack, batch, step, batch * 1000 / step, runs_ms
        )

    results = [
        result("float32", "keras", 16, [100.0, 110.0, 275.0]),
        result("mixed_bfloat16", "keras", 16, [40.0, 71.0, 100.0]),
        result("mixed_float16", "tfmixprec", 8, [25.0, 25.0, 25.0]),  # the model's float32
    ]
    assert [bench.paired_ratios(r, results) for r in results] == [
        pytest.approx([1.0, 1.0, 1.0]),
        pytest.approx([2.5, 110 / 71, 2.75]),
        pytest.approx([2.0, 2.2, 5.5]),
    ]
    table = bench.format_table(results).splitlines()
    assert [line.split()[-2:] for line in table[2:5]] == [
        ["145.5", "1.00x"],
        ["2.50x", "1.55-2.75x"],
        ["2.20x", "2.00-5.50x"],
    ]
    assert table[5] == bench.SPREAD_NOTE
    one = [result("float32", "keras", 16, [100.0]), result("mixed_bfloat16", "keras", 16, [50.0])]
    assert bench.format_table(one).splitlines()[-1].endswith(" 2.00x")  # one repeat: no range


USER_MODELS = """
import keras
import numpy as np
import tensorflow as tf


def build():
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(4, dtype="float32"),
        ],
        name="mine",
    )
    model.compile(optimizer="adam", loss="mse")
    return model


def with_data():
    x = np.ones((8, 16), "float32")
    return build(), x, np.zeros((8, 4), "float32")


def not_compiled():
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)], name="draft")


def raises():
    raise RuntimeError("no GPU quota")


def two_inputs():
    a, b = keras.Input((4,)), keras.Input((6,))
    joined = keras.layers.Concatenate()([keras.layers.Dense(8)(a), keras.layers.Dense(8)(b)])
    model = keras.Model([a, b], keras.layers.Dense(2, dtype="float32")(joined), name="two")
    model.compile(optimizer="sgd", loss="mse")
    return model


def my_sparse_loss(y_true, y_pred):  # not Keras's: bench cannot tell it takes integer labels
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred)


def sparse_labels():  # its loss needs integer labels: bench's made-up targets do not fit
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss=my_sparse_loss)
    return model


def language_model():
    tokens = keras.Input((8,), dtype="int32")
    embedding = keras.layers.ReversibleEmbedding(64, 16, name="embedding")
    hidden = keras.layers.Dense(16, activation="gelu")(embedding(tokens))
    model = keras.Model(tokens, embedding(hidden, reverse=True), name="lm")
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    x = np.ones((32, 8), "int32")
    return model, x, x


# What bench cannot run, each for its own reason (test_bench_bad_input_is_one_line_and_exit_2).
def returns_none():
    return None


class NonNegative(keras.layers.Layer):
    def call(self, x):
        tf.debugging.assert_non_negative(x, message="inputs must be >= 0")
        return x


def call_fails():  # traces fine; its call fails on bench's made-up N(0, 1) inputs
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(4)(NonNegative()(inputs)), name="checks")
    model.compile(optimizer="adam", loss="mse")
    return model


class FailsInTraining(keras.layers.Layer):
    def call(self, x, training=None):
        if training:
            tf.debugging.assert_less(tf.reduce_max(x), x.dtype.min, message="fails in training")
        return x


def train_fails():  # builds and computes its loss; its training step fails
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(4)(FailsInTraining()(inputs)), name="trains")
    model.compile(optimizer="sgd", loss="mse")
    return model


def variable_length():
    tokens = keras.Input((None, 4), name="tokens")
    model = keras.Model(tokens, keras.layers.Dense(2)(tokens))
    model.compile(optimizer="sgd", loss="mse")
    return model


def text_input():
    text = keras.Input((1,), dtype="string", name="text")
    model = keras.Model(text, keras.layers.StringLookup(vocabulary=["a"])(text))
    model.compile(optimizer="sgd", loss="mse")
    return model


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def subclassed():
    model = Subclassed()
    model.compile(optimizer="sgd", loss="mse")
    return model


def mismatched():
    return build(), np.ones((64, 16), "float32"), np.zeros((40, 4), "float32")


def sets_policy_then_raises():
    keras.config.set_dtype_policy("mixed_bfloat16")
    raise RuntimeError("no GPU quota")
"""


def test_bench_your_own_model(tmp_path):
    """`tfmixprec bench --model FILE.py:FUNCTION`: each policy times the model the function
    builds under it (plain Keras and through tfmixprec's CPU routes), and one line says which
    policy to use."""
    (tmp_path / "models.py").write_text(USER_MODELS)
    args = ("bench", "--steps", "2", "--repeats", "1", "--policies", "float32", "mixed_bfloat16")
    code, out, err = run_here(*args, "--model", "models.py:build", cwd=tmp_path)
    assert code == 0, err[-2000:]
    rows = [line.split() for line in out.splitlines() if line.startswith("build ")]
    # Dense layers take no bfloat16 route: the tfmixprec stack would be the same step.
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("float32", "keras", "32"),
        ("mixed_bfloat16", "keras", "32"),
    ]
    assert "bench: mixed_bfloat16, tfmixprec: no layer to route here, the same step as keras" in err
    assert rows[0][-1] == "1.00x"
    recommended = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"recommended: (float32: no other policy ran 1\.05x float32 or faster \(best: "
        r"mixed_bfloat16, (keras|tfmixprec), [\d.]+x\)(; set_policy\('auto'\) picks "
        r"mixed_bfloat16 here, but for this model use float32)?|mixed_bfloat16( through "
        r"tfmixprec)?, [\d.]+x float32(; set_policy\('auto'\) picks float32 here)?)\.",
        recommended,
    ), recommended
    # A language model's logits take a route on a CPU with bfloat16 instructions.
    code, out, err = run_here(*args, "--model", "models.py:language_model", cwd=tmp_path)
    assert code == 0, err[-2000:]
    stacks = [line.split()[2] for line in out.splitlines() if line.startswith("language_model ")]
    routed = bool(tfmixprec.cpu_bfloat16.routes_on())
    assert stacks == ["keras", "keras", "tfmixprec"] if routed else ["keras", "keras"]
    # A module in the current folder, as `python -m` finds it; a model with two inputs.
    try:
        code, out, err = run_here(*args, "--model", "models:two_inputs", cwd=tmp_path)
    finally:
        sys.modules.pop("models", None)  # imported as `python -m` would: not this process's
    assert code == 0, err[-2000:]
    assert len([line for line in out.splitlines() if line.startswith("two_inputs ")]) == 2
    args = (*args, "--model", "models.py:with_data", "--batch-size", "8")
    code, out, err = run_here(*args, cwd=tmp_path)
    assert code == 0, err[-2000:]
    batches = [line.split()[3] for line in out.splitlines() if line.startswith("with_data ")]
    assert batches == ["8", "8"]


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    """A folder with the user's model files: good ones, and some that fail to import."""
    folder = tmp_path_factory.mktemp("user_models")
    (folder / "models.py").write_text(USER_MODELS)
    (folder / "broken.py").write_text("def build(:\n")
    (folder / "raises_on_import.py").write_text("raise RuntimeError('no GPU quota')\n")
    return folder


THERE = re.escape("Fix it there (run it in Python for the traceback).")
RETURN_DATA = re.escape("Return (model, x, y) from your function.")
FREE = r"needs at least [\d.]+ [kMGTP]?B of memory, more than the [\d.]+ [kMGTP]?B free here\."
# Each kind of bad input to `tfmixprec bench`: its arguments, and its one line after
# "tfmixprec bench: error: " (a regular expression). argparse's errors come after its usage.
BAD_BENCH_INPUTS = {
    "not-a-model-name": (
        ["--model", "gpt3"],
        re.escape(
            "argument --model: expected mlp, cnn, transformer, gpt2, llama, gemma, mistral, "
            "bert, vit, resnet, mobilenet or MODULE:FUNCTION / FILE.py:FUNCTION, got 'gpt3'"
        ),
    ),
    "unknown-policy": (
        ["--policies", "float32", "fp8"],
        r"argument --policies: invalid choice: 'fp8' \(choose from .+\)",
    ),
    "steps-0": (
        ["--steps", "0"],
        re.escape(
            "argument --steps: expected an integer >= 2 (a step is timed from the end of the "
            "first to the end of the last), got '0'"
        ),
    ),
    "steps-1": (["--steps", "1"], r"argument --steps: expected an integer >= 2 .*, got '1'"),
    "negative-repeats": (
        ["--repeats", "-1"],
        re.escape("argument --repeats: expected a positive integer, got '-1'"),
    ),
    "batch-size-0": (
        ["--batch-size", "0"],
        re.escape("argument --batch-size: expected a positive integer, got '0'"),
    ),
    "size-not-a-number": (
        ["--size", "big"],
        re.escape("argument --size: expected a positive integer, got 'big'"),
    ),
    # The case: refused before TensorFlow allocates (it raised ResourceExhaustedError).
    "size-past-memory": (
        ["--model", "mlp", "--size", "3000000"],
        re.escape(
            "--model mlp --size 3000000 --batch-size 256 (3.6e+13 parameters a model, 2 "
            "models side by side) "  # float32 and mixed_bfloat16; auto picks one of them
        )
        + FREE
        + r" Pass --size \d+ or less\.",
    ),
    "batch-past-memory": (
        ["--model", "mlp", "--size", "64", "--batch-size", "100000000000"],
        re.escape("--model mlp --size 64 --batch-size 100000000000 (1.7e+04 parameters a ")
        + r"model, 2 models side by side\) "
        + FREE
        + re.escape(" Pass a smaller --batch-size."),
    ),
    "transformer-too-narrow": (
        ["--model", "transformer", "--size", "3"],
        re.escape(
            "The transformer's width must be at least 4 (4 attention heads of width "
            "size // 4). Received: size=3; pass --size 4 or more."
        ),
    ),
    "file-missing": (
        ["--model", "missing.py:build"],
        re.escape("No file 'missing.py' (from --model 'missing.py:build'). Pass a built-in")
        + r" .+ or FILE\.py:FUNCTION\.",
    ),
    "module-missing": (
        ["--model", "no_such_module_here:build"],
        re.escape(
            "Cannot import 'no_such_module_here' (from --model 'no_such_module_here:build'): "
            "No module named 'no_such_module_here'"
        ),
    ),
    "function-missing": (
        ["--model", "models.py:nothing"],
        re.escape("'models.py' has no function 'nothing' (from --model 'models.py:nothing')."),
    ),
    "file-does-not-parse": (
        ["--model", "broken.py:build"],
        re.escape("--model 'broken.py:build': importing 'broken.py' raised SyntaxError: ")
        + ".+"
        + THERE,
    ),
    "file-raises-on-import": (
        ["--model", "raises_on_import.py:build"],
        re.escape(
            "--model 'raises_on_import.py:build': importing 'raises_on_import.py' raised "
            "RuntimeError: no GPU quota. "
        )
        + THERE,
    ),
    "function-raises": (
        ["--model", "models.py:raises"],
        re.escape("--model 'models.py:raises': calling it raised RuntimeError: no GPU quota. ")
        + THERE,
    ),
    "function-sets-the-policy-and-raises": (
        ["--model", "models.py:sets_policy_then_raises"],
        r"--model 'models\.py:sets_policy_then_raises': calling it raised RuntimeError: no GPU "
        r"quota\. " + THERE,
    ),
    "returns-no-model": (
        ["--model", "models.py:returns_none"],
        re.escape(
            "models.py:returns_none must return a compiled keras.Model, or (model, x, y) or "
            "(model, x, y, sample_weight). Received: NoneType"
        ),
    ),
    "model-not-compiled": (
        ["--model", "models.py:not_compiled"],
        re.escape(
            "models.py:not_compiled returned model 'draft' not compiled: compile it in the "
            "function (model.compile(optimizer=..., loss=...)), as you train it."
        ),
    ),
    # The case: the model's own call fails on bench's made-up inputs.
    "model-call-fails-on-made-up-inputs": (
        ["--model", "models.py:call_fails"],
        re.escape(
            "--model 'models.py:call_fails': calling its model on made-up inputs (floats from "
            "N(0, 1), integers of ones) raised InvalidArgumentError: inputs must be >= 0."
        )
        + ".* "
        + RETURN_DATA,
    ),
    "input-of-unknown-length": (
        ["--model", "models.py:variable_length"],
        re.escape(
            "--model 'models.py:variable_length': its model's input 'tokens' has shape "
            "(None, None, 4): bench cannot make data for it. "
        )
        + RETURN_DATA,
    ),
    "input-of-strings": (
        ["--model", "models.py:text_input"],
        re.escape(
            "--model 'models.py:text_input': its model's input 'text' has dtype string: bench "
            "makes numbers only. "
        )
        + RETURN_DATA,
    ),
    "subclassed-model": (
        ["--model", "models.py:subclassed"],
        re.escape(
            "--model 'models.py:subclassed': its model 'subclassed' has no symbolic inputs (a "
            "subclassed model): bench cannot make data for it. "
        )
        + RETURN_DATA,
    ),
    "made-up-inputs-past-memory": (
        ["--model", "models.py:build", "--batch-size", "10000000000000"],
        re.escape(
            "--model 'models.py:build' --batch-size 10000000000000: a batch of made-up inputs "
            "for its model "
        )
        + FREE
        + re.escape(" Pass a smaller --batch-size."),
    ),
    "fewer-samples-than-a-batch": (
        ["--model", "models.py:with_data"],
        re.escape(
            "models.py:with_data returned 8 samples, fewer than the batch size 32: return "
            "more, or pass a smaller --batch-size."
        ),
    ),
    "x-and-y-of-other-lengths": (
        ["--model", "models.py:mismatched"],
        re.escape(
            "models.py:mismatched returned arrays of 40 and 64 samples: return x and y (and "
            "sample_weight) with as many rows each."
        ),
    ),
    "loss-does-not-take-the-made-up-targets": (
        ["--model", "models.py:sparse_labels"],
        re.escape(
            "--model 'models.py:sparse_labels': computing its loss on made-up targets (float32 "
            "zeros shaped like the output) raised ValueError: "
        )
        + ".+ "
        + RETURN_DATA,
    ),
    # float16 without a GPU turns grappler's remapper off: it is on again after the error.
    "fails-under-float16": (
        ["--model", "models.py:train_fails", "--policies", "mixed_float16"],
        r"--model 'models\.py:train_fails': training its model .+ raised InvalidArgumentError: "
        r"assertion failed: \[fails in training\].+" + THERE,
    ),
}


def _process_state():
    """What a bench may change in the process: the global policy, grappler's remapper and
    tfmixprec's float16 CPU switches."""
    remapping = tf.config.optimizer.get_experimental_options().get("remapping", True)
    return keras.config.dtype_policy().name, remapping, tfmixprec.cpu_float16.status()


@pytest.mark.parametrize("kind", list(BAD_BENCH_INPUTS))
def test_bench_bad_input_is_one_line_and_exit_2(user_models, monkeypatch, capsys, kind):
    """Each kind of bad input: exit code 2 and one line on stderr that names the bad value and
    the fix (argparse's after its usage), no traceback, no table; the process as it was."""
    from tfmixprec.tools.cli import main

    args, expected = BAD_BENCH_INPUTS[kind]
    monkeypatch.chdir(user_models)
    before = _process_state()
    try:
        code = main(["bench", "--steps", "2", "--repeats", "1", *args])
        usage_error = False
    except SystemExit as exit_:
        code, usage_error = exit_.code, True
    out, err = capsys.readouterr()
    assert code == 2
    *usage, line = err.splitlines()
    if usage_error:  # argparse's usage, then its one line
        assert usage[0].startswith("usage: tfmixprec bench [-h]"), err
        assert all(not part.startswith("tfmixprec bench: error:") for part in usage), err
    else:
        assert usage == [], err
        assert out.startswith("machine: ") and "vs float32" not in out
    assert re.fullmatch("tfmixprec bench: error: " + expected, line), line
    assert _process_state() == before


@pytest.mark.parametrize("kind", ["model-call-fails-on-made-up-inputs", "size-past-memory"])
def test_bench_bad_input_reaches_the_console_as_one_line(user_models, kind):
    """Through the console script, with its own Python warnings: one line, no traceback."""
    args, expected = BAD_BENCH_INPUTS[kind]
    code, out, err = run("bench", "--steps", "2", "--repeats", "1", *args, cwd=user_models)
    assert code == 2
    assert "Traceback" not in err and "vs float32" not in out
    lines = [line for line in err.splitlines() if not TF_LOG_LINE.match(line)]  # any CPU's
    assert len(lines) == 1, err
    assert re.fullmatch("tfmixprec bench: error: " + expected, lines[0]), lines[0]


def test_bench_help_says_the_defaults(capsys):
    from tfmixprec.tools.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "steps per timed run, 2 or more (default: 20)" in help_text
    assert "timed runs per policy, the median reported (default: 3)" in help_text
    # What a long model costs, before it is run: the zoo's, and why.
    assert "A zoo model runs at its bench size" in help_text
    assert "gpt2 took 7 min 18 s with the defaults" in help_text
    assert "the first step traces it" in help_text
    assert "'min-max' their range" in help_text


def test_bench_model_names_match_the_package():
    """The parser names the models without importing tfmixprec: the same names."""
    import _tfmixprec_args
    from tfmixprec.tools import bench, zoo

    assert _tfmixprec_args.BENCH_MODELS == bench.MODELS
    assert _tfmixprec_args.ZOO_MODELS == tuple(zoo.MODELS)
    # The command table of the docs names them all, and the function forms.
    page = (Path(__file__).parents[2] / "docs" / "index.md").read_text()
    (row,) = [line for line in page.splitlines() if line.startswith("| `tfmixprec bench")]
    for name in (*bench.MODELS, *zoo.MODELS, "MODULE:FUNCTION", "FILE.py:FUNCTION"):
        assert f"`{name}`" in row, name


def test_recommend_from_results():
    from tfmixprec.tools.bench import BenchResult, recommend

    def result(policy, stack, step_ms):
        return BenchResult("m", policy, policy, stack, 16, step_ms, 16000 / step_ms, [step_ms])

    auto = tfmixprec.choose_policy().name
    chosen = recommend([result("float32", "keras", 100), result("mixed_bfloat16", "tfmixprec", 50)])
    assert (chosen.policy, chosen.stack, chosen.speedup) == ("mixed_bfloat16", "tfmixprec", 2.0)
    assert chosen.text.startswith("recommended: mixed_bfloat16 through tfmixprec, 2.00x float32")
    assert chosen.text.endswith("." if auto == "mixed_bfloat16" else f"picks {auto} here.")
    slower = recommend([result("float32", "keras", 100), result("mixed_bfloat16", "keras", 104)])
    assert (slower.policy, slower.speedup) == ("float32", 1.0)
    assert "no other policy ran 1.05x float32 or faster (best: mixed_bfloat16, keras, 0.962x)" in (
        slower.text
    )
    with pytest.raises(ValueError, match="recommend needs a float32 result"):
        recommend([result("mixed_bfloat16", "keras", 50)])
    with pytest.raises(ValueError, match="recommend needs a result under another policy"):
        recommend([result("float32", "keras", 50)])


# ------------------------------------------------------------------ a quiet, fast command
def _run_command(command, env=None, timeout=300):
    """Runs `command`; `env` replaces the environment (default: ours without TF's log level)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return result.returncode, result.stdout, result.stderr


def _imported_modules(importtime_stderr):
    """The modules `python -X importtime` says the process imported."""
    return re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", importtime_stderr, re.M)


@pytest.mark.parametrize(
    "args, code, expected",
    [
        (["--help"], 0, "usage: tfmixprec [-h] COMMAND ..."),
        (["demo", "--help"], 0, "[--policy {auto,mixed_float16,mixed_bfloat16,float32}]"),
        (["bench", "-h"], 0, "[--model MODEL]"),
        (["demo", "--policy", "fp8"], 2, "invalid choice: 'fp8'"),
        (["demo", "--epochs", "0"], 2, "expected a positive integer, got '0'"),
        ([], 0, "usage: tfmixprec [-h] COMMAND ..."),  # bare: the help, not an error
    ],
)
def test_help_and_usage_errors_never_import_tensorflow(args, code, expected):
    assert SCRIPT.read_text().count("from _tfmixprec_cli import main") == 1
    got, out, err = _run_command([sys.executable, "-X", "importtime", str(SCRIPT), *args])
    assert got == code, err[-2000:]
    assert expected in (out if code == 0 else err)
    modules = _imported_modules(err)
    assert "_tfmixprec_cli" in modules and "argparse" in modules  # the check sees imports
    top = {name.split(".")[0] for name in modules}
    assert top & {"tensorflow", "keras", "tfmixprec", "numpy"} == set()


def test_doctor_help_describes_the_report(capsys):
    from _tfmixprec_args import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["doctor", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the CPU's float16 and bfloat16 instructions (AVX512_FP16, AVX512_BF16, AMX)" in out
    assert "the routes tfmixprec takes around slow float16 and bfloat16 CPU kernels" in out
    assert "--json print the report as JSON" in out


def test_help_lists_every_command():
    code, out, _ = _run_command([str(SCRIPT), "--help"])
    assert code == 0
    for line in [
        "doctor    hardware report and the recommended policy",
        "audit     audit a saved .keras model for mixed precision",
        "demo      train a small CNN on the digits data set",
        "bench     step time and throughput per policy, side by side",
    ]:
        assert line in out


# The lines TF_CPP_MIN_LOG_LEVEL=2 means to hide: TensorFlow's INFO and WARNING log lines and
# absl's banner. Its ERROR lines are its own business and differ by CPU (a float16 kernel
# without AVX512_FP16 logs one on an AMD EPYC), so no test asserts them either way.
HIDDEN_TF_LINE = re.compile(r"^[IW]\d{4} [\d:.]+\s+\d+ \S+:\d+\] |absl::InitializeLog", re.M)


def test_doctor_starts_tensorflow_quietly():
    """Run as a user runs it, without TF_CPP_MIN_LOG_LEVEL: none of the start-up lines that
    the level it sets (2) hides."""
    code, out, err = _run_command([str(SCRIPT), "doctor"])
    assert code == 0 and out.startswith("tfmixprec doctor")
    assert HIDDEN_TF_LINE.findall(err) == [], err
    assert "rebuild TensorFlow with the appropriate compiler flags" not in err


def test_import_tfmixprec_starts_tensorflow_without_the_lines_the_level_hides():
    """`import tfmixprec` first, with TF_CPP_MIN_LOG_LEVEL=2 as the examples set it: none of
    TensorFlow's start-up lines (absl's banner, INFO, cuInit's ERROR without a driver), and a
    program may still configure its logical devices after it."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    code = (
        "import tfmixprec, tensorflow as tf; cpu = tf.config.list_physical_devices('CPU')[0]; "
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()]"
        " * 2); print(len(tf.config.list_logical_devices('CPU')))"
    )
    status, out, err = _run_command([sys.executable, "-c", code], env=env)
    assert status == 0 and out == "2\n", err
    assert HIDDEN_TF_LINE.findall(err) == [] and "failed call to cuInit" not in err, err


# What TensorFlow 2.21 wrote to stderr while starting on a 2-core AMD EPYC without a GPU
# (tfmixprec doctor, no TF_CPP_MIN_LOG_LEVEL), then a line that is no log line.
STARTUP = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1795426153.792042    8858 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.\n"
    "W0000 00:00:1795426153.848108    8858 some_file.cc:12] a warning\n"
    "E0000 00:00:1795426166.116328    9042 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
    "/x/y.py:3: DeprecationWarning: not TensorFlow's to hide\n"
)


@pytest.mark.parametrize(
    "level, kept",
    [
        (0, ["WARNING: All log", "I0000", "W0000", "E0000", "/x/y.py"]),
        (1, ["W0000", "E0000", "/x/y.py"]),
        (2, ["/x/y.py"]),  # cuInit fails because there is no driver: hidden with that line
        (3, ["/x/y.py"]),
    ],
)
def test_drop_startup_noise_follows_the_log_level(level, kept):
    import _tfmixprec_args

    lines = _tfmixprec_args.drop_startup_noise(STARTUP, level).splitlines()
    assert [line for line in lines if not any(line.startswith(k) for k in kept)] == []
    assert len(lines) == len(kept)


def test_a_cuinit_error_with_a_driver_installed_is_kept():
    import _tfmixprec_args

    error = STARTUP.splitlines(keepends=True)[3]
    assert _tfmixprec_args.drop_startup_noise(error, 2) == error
    assert _tfmixprec_args.drop_startup_noise(error, 3) == ""


@pytest.mark.parametrize("users, expected", [(None, "2"), ("0", "0"), ("3", "3")])
def test_start_tensorflow_keeps_a_users_log_level(monkeypatch, users, expected):
    import _tfmixprec_args

    if users is None:
        monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", users)
    _tfmixprec_args.start_tensorflow()  # TensorFlow is imported here already: only the level
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == expected


def _remapping():
    return tf.config.optimizer.get_experimental_options().get("remapping", True)


@pytest.mark.parametrize(
    "change",
    [
        lambda: keras.config.set_dtype_policy("mixed_bfloat16"),
        lambda: warnings.simplefilter("ignore"),
        lambda: tf.get_logger().setLevel("ERROR"),
        lambda: tf.config.optimizer.set_experimental_options({"remapping": not _remapping()}),
    ],
    ids=["policy", "warning-filter", "log-level", "grappler"],
)
def test_run_here_sees_a_command_that_changes_the_process(monkeypatch, change):
    """The tests that run a command in this process (`run_here`) fail if it leaves the process
    changed."""
    from tfmixprec.tools import cli

    monkeypatch.setitem(cli.COMMANDS, "doctor", lambda args: change() or 0)
    level = tf.get_logger().level
    try:  # grappler's options put back as they were (an option never set unset again)
        with tfmixprec.cpu_float16.process_state_kept():
            with pytest.raises(AssertionError, match="tfmixprec doctor changed the process"):
                run_here("doctor")
    finally:
        tf.get_logger().setLevel(level)  # the policy: conftest's fixture


def test_cli_main_runs_in_process(capsys):
    from tfmixprec.tools.cli import main

    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensorflow_version"]
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--policy", "fp8"])
    assert exit_.value.code == 2


def test_python_dash_m_is_the_same_command():
    code, out, _ = _run_command([sys.executable, "-m", "tfmixprec", "--help"])
    assert code == 0 and "usage: tfmixprec [-h] COMMAND ..." in out


@pytest.mark.skipif(bool(tfmixprec.detect_hardware().gpus), reason="the warning is for no GPU")
def test_demo_with_float16_without_a_gpu_says_what_is_faster(tmp_path):
    # Without the story: that it says no such warning is `test_demo_tells_the_float16_story`'s.
    args = ["demo", "--policy", "mixed_float16", "--epochs", "1", "--quiet", "--no-story"]
    code, out, err = _run_command([str(SCRIPT), *args, "--logdir", str(tmp_path / "runs")])
    assert code == 0, err[-2000:]
    assert out.startswith("policy: mixed_float16\n")
    warning = "tfmixprec: UserWarning: mixed_float16 without a GPU trains at best as fast as"
    assert [line for line in err.splitlines() if "UserWarning" in line][0].startswith(warning)
    assert err.count(warning) == 1 and "cli.py" not in err  # one line, no source position
    faster = tfmixprec.choose_policy().name
    assert f"For speed use {faster!r}" in err
    assert "to keep float16, train a MixedPrecisionModel" in err
    assert HIDDEN_TF_LINE.findall(err) == []  # TensorFlow's ERROR lines may come (any CPU)


def test_bare_command_in_process_prints_the_help(capsys):
    from tfmixprec.tools.cli import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tfmixprec [-h] COMMAND ...")
    assert "demo" in out and "audit" in out


def test_audit_and_bench_help_describe_themselves(capsys):
    """Issue 47 item 16: audit's help says what it checks and its exit codes; bench's --size
    its default."""
    from _tfmixprec_args import build_parser

    for args in (["audit", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(args)
        assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Exit codes: 0 no error (warnings and info allowed), 1 an error found, 2 the file" in out
    assert "--size SIZE the built-in model's width (default: 1024)" in out
