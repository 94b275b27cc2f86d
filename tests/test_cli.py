"""The `tfmixprec` command, run as a user runs it: a subprocess, exit codes, key output."""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import pytest

import tfmixprec

SCRIPT = Path(sys.executable).parent / "tfmixprec"


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
    code, out, _ = run("doctor")
    assert code == 0
    assert out.startswith("tfmixprec doctor")
    assert re.search(r"recommended\s+(mixed_float16|mixed_bfloat16|float32): ", out)
    code, out, _ = run("doctor", "--json")
    data = json.loads(out)
    assert code == 0 and data["recommended_policy"] in (
        "mixed_float16",
        "mixed_bfloat16",
        "float32",
    )


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
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    plain.save(folder / "float32.keras")
    (folder / "notes.txt").write_text("not a model")
    with zipfile.ZipFile(folder / "broken.keras", "w") as archive:
        archive.writestr("config.json", "{this is not json")
    return folder


def test_audit_exit_codes(saved_models):
    code, out, _ = run("audit", str(saved_models / "bad.keras"))
    assert code == 1
    assert "ERROR   low-precision-softmax" in out
    code, out, _ = run("audit", str(saved_models / "clean.keras"))
    assert code == 0, out
    assert "ERROR" not in out and "WARNING" not in out
    if not tfmixprec.detect_hardware().gpus:  # what is slow here is said, as information
        assert "INFO    cpu-float16-kernels" in out
    code, out, _ = run("audit", str(saved_models / "float32.keras"))
    assert code == 0
    code, out, _ = run("audit", str(saved_models / "float32.keras"), "--policy", "mixed_float16")
    assert code == 1 and "low-precision-output" in out
    code, out, _ = run("audit", str(saved_models / "bad.keras"), "--json")
    assert code == 1 and json.loads(out)["ok"] is False


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing.keras", "no such file: "),
        ("notes.txt", "is not a Keras model file"),
        ("broken.keras", "could not load"),
    ],
)
def test_audit_bad_files(saved_models, name, message):
    code, out, err = run("audit", str(saved_models / name))
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
        (["bench", "--model", "rnn"], "invalid choice: 'rnn'"),
    ],
)
def test_bad_arguments_are_usage_errors(args, message):
    code, _, err = run(*args)
    assert code == 2
    usage = err[err.index("usage: tfmixprec") :]  # TensorFlow's start-up log lines come first
    assert message in usage.strip().splitlines()[-1]


def test_demo_trains_and_reports(tmp_path):
    code, out, err = run("demo", "--epochs", "8", "--logdir", str(tmp_path / "runs"), cwd=tmp_path)
    assert code == 0, err[-2000:]
    assert "loss_scale" in out  # in Keras's progress output
    accuracy = float(re.search(r"test accuracy\s+([0-9.]+)", out).group(1))
    assert accuracy > 0.90
    assert re.search(r"overflow steps\s+\d+ of \d+", out)
    assert f"tensorboard --logdir {tmp_path / 'runs'}" in out
    events = list((tmp_path / "runs").rglob("events.out.tfevents.*"))
    assert events, "the demo writes TensorBoard logs"


def test_bench_table():
    code, out, err = run(
        "bench",
        "--size",
        "64",
        "--batch-size",
        "32",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--policies",
        "float32",
        "mixed_bfloat16",
    )
    assert code == 0, err[-2000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("machine: ")
    assert "vs float32" in lines[1]
    rows = [line for line in lines if line.startswith("mlp")]
    assert len(rows) == 2
    assert rows[0].split()[1] == "float32" and rows[0].endswith("1.00x")
    assert rows[1].split()[1] == "mixed_bfloat16"
