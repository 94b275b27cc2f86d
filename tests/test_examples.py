"""Each example runs as a user would run it (a subprocess), with small sizes."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(script, *args, timeout=300):
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
    return result.stdout


def test_custom_training_loop_example():
    out = _run("custom_training_loop.py", "--policy", "mixed_float16", "--steps", "12")
    lines = out.strip().splitlines()
    assert lines[0] == "policy: mixed_float16"
    assert len(lines) == 4
    for name, line in zip(
        ["make_train_step", "compute_unscaled_gradients", "tf2_guide_loop"], lines[1:]
    ):
        assert line.startswith(name)
        assert "overflow_steps=1 applied_steps=11" in line  # the Inf batch was skipped
        assert "loss_scale=16384" in line
