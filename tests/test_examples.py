"""Each example runs with small sizes: its `main(argv)` in this process, as its command line
calls it, with what it prints captured. `multi_worker.py` and `distributed_mirrored.py` run
as a user runs them (a subprocess): the one starts its workers, the other makes a strategy of
its own; those processes also show that the examples start TensorFlow without its start-up
lines, which only a fresh process can show."""

import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import tfmixprec

ROOT = Path(__file__).resolve().parent.parent
# What TensorFlow prints while it starts (absl's banner, INFO/WARNING lines, cuInit's ERROR
# without a driver); a oneDNN ERROR line on some CPUs is TensorFlow's own, not start-up.
STARTUP_LINE = re.compile(
    r"^[IW]\d{4} [\d:.]+\s+\d+ \S+:\d+\] .*|.*absl::InitializeLog.*|.*failed call to cuInit.*",
    re.M,
)


def _run_process(script, *args, timeout=300):
    """The example as a command in a fresh Python process; its standard output."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # tfmixprec, imported first, starts TensorFlow without the start-up lines level 2 hides
    assert STARTUP_LINE.findall(result.stderr) == [], result.stderr[-3000:]
    return result.stdout


@pytest.fixture
def run(capsys, monkeypatch):
    """Runs an example's `main(argv)` in this process (the module loaded from its file, as
    `python examples/NAME.py ARGS` loads it, but not as `__main__`); returns what it printed.
    The global policy it sets is put back by conftest's `_restore_global_policy`, and
    `set_policy`'s once-a-process float16 warning is left as it was."""
    warned = tfmixprec.policy._WARNED
    monkeypatch.setitem(warned, "float16_without_gpu", warned["float16_without_gpu"])

    def run_example(script, *args):
        module = runpy.run_path(str(ROOT / "examples" / script), run_name="example")
        capsys.readouterr()
        module["main"](list(args))
        return capsys.readouterr().out

    return run_example


def test_custom_training_loop_example(run):
    out = run("custom_training_loop.py", "--policy", "mixed_float16", "--steps", "12")
    lines = out.strip().splitlines()
    assert lines[0] == "policy: mixed_float16"
    assert len(lines) == 4
    for name, line in zip(
        ["make_train_step", "compute_unscaled_gradients", "tf2_guide_loop"], lines[1:]
    ):
        assert line.startswith(name)
        assert "overflow_steps=1 applied_steps=11" in line  # the Inf batch was skipped
        assert "loss_scale=16384" in line


def test_custom_training_loop_example_under_bfloat16(run):
    """bfloat16 has float32's range: no loss scale to print, the Inf step still skipped."""
    out = run("custom_training_loop.py", "--policy", "mixed_bfloat16", "--steps", "12")
    lines = out.strip().splitlines()
    assert lines[0] == "policy: mixed_bfloat16"
    assert len(lines) == 4
    for name, line in zip(
        ["make_train_step", "compute_unscaled_gradients", "tf2_guide_loop"], lines[1:]
    ):
        assert line.startswith(name)
        assert (
            "loss_scale=none (bfloat16 needs no loss scaling) overflow_steps=1 applied_steps=11"
        ) in line


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_fit_with_callbacks_example(policy, run):
    out = run("fit_with_callbacks.py", "--epochs", "2", "--policy", policy)
    assert "overflow steps 2 (the NaN batch, once per epoch)" in out
    if policy == "mixed_bfloat16":  # float32's range: no loss scale, none recommended
        assert "once per epoch), no loss scale, guard stopped" in out
        assert out.rstrip().endswith("zero; no loss scale needed (bfloat16 has float32's range)")
    else:
        assert re.search(r"once per epoch\), loss scale \d+, guard stopped", out)
        scale = re.search(r"once per epoch\), loss scale (\d+),", out).group(1)
        assert re.search(
            r"zero; smallest sufficient loss scale \d+ \(lifts 99% of them into float16's normal "
            rf"range; training at {scale}\)$",
            out.rstrip(),
        )
    assert "guard stopped: False" in out
    accuracy = float(out.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.8


def test_tensorboard_dashboard_example(tmp_path, run):
    out = run("tensorboard_dashboard.py", "--logdir", str(tmp_path), "--epochs", "2")
    assert f"open the dashboard: tensorboard --logdir {tmp_path}" in out
    overflow, total = out.split("overflow steps ")[1].split()[0::2][:2]
    assert int(overflow) >= 1 and int(total) == 64  # 2 epochs x 32 batches
    assert list(tmp_path.rglob("events.out.tfevents.*"))


def test_distributed_mirrored_example():
    """A command of its own: the example makes its own `MirroredStrategy` over the two CPU
    devices, whose collective ops would collide with the suite's (`two_cpu_strategy`) in the
    test's process: the next two-replica test there fails ("Shape mismatch in the collective
    instance")."""
    out = _run_process("distributed_mirrored.py", "--epochs", "2")
    assert out.startswith("replicas: 2")
    assert "overflow steps 2 (skipped on every replica)" in out
    assert "weights identical across replicas: True" in out
    # Every epoch has a skipped batch; its loss is the mean over the applied steps.
    losses = re.findall(r"loss: ([^ ]+)", out) + re.findall(r"final epoch's loss ([^ ]+)", out)
    assert len(losses) == 3 and all(math.isfinite(float(v)) for v in losses)


def test_multi_worker_example(tmp_path):
    out = _run_process(
        "multi_worker.py",
        "--local",
        "2",
        "--epochs",
        "2",
        "--policy",
        "mixed_float16",
        "--out",
        str(tmp_path),
        timeout=600,
    )
    assert "--- worker 0 (exit code 0)" in out and "--- worker 1 (exit code 0)" in out
    chief = [line for line in out.splitlines() if line.startswith("chief: ")]
    assert len(chief) == 1  # printed by worker 0 only
    assert chief[0].startswith(
        "chief: 2 replicas, policy mixed_float16, loss scale 32768, overflow steps 0, "
    )
    assert float(chief[0].split("test accuracy ")[1]) > 0.7
    workers = [line for line in out.splitlines() if line.startswith("worker ")]
    assert [line.split(":")[0] for line in workers] == ["worker 0", "worker 1"]
    accuracies = {line.split("test accuracy ")[1].split(",")[0] for line in workers}
    fingerprints = {line.split("weights sha256 ")[1] for line in workers}
    assert len(accuracies) == 1 and len(fingerprints) == 1  # the workers agree
    assert len(fingerprints.pop()) == 64
    assert (tmp_path / "model.keras").is_file()  # written by the chief's ModelCheckpoint
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))


def test_float8_dashboard_example(tmp_path, run):
    out = run("float8_dashboard.py", "--logdir", str(tmp_path), "--epochs", "2")
    lines = out.strip().splitlines()
    assert lines[:2] == [
        "hidden_1: mixed_bfloat16 -> float8_from_mixed_bfloat16 (matmul (128, 128))",
        "hidden_2: mixed_bfloat16 -> float8_from_mixed_bfloat16 (matmul (128, 128))",
    ]
    start, end = map(float, re.fullmatch(r"loss: (\S+) -> (\S+)", lines[-7]).groups())
    assert end < start
    tensors = [line.split(":")[0] for line in lines[-6:]]
    assert tensors == [
        f"hidden_{i} {t}" for i in (1, 2) for t in ("inputs", "kernel", "outputs_grad")
    ]
    assert list((tmp_path / "train").iterdir())  # the run TensorBoard reads
