"""Runs a benchmark script as a user would, for the smoke tests (`tools/test_benchmarks.py` and
`tools/test_benchmarks_zoo.py`: two files, so that pytest-xdist's `--dist loadfile` runs them in
both processes)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script, *args):
    """`benchmarks/<script> args...` in a fresh Python from the repository's root; its stdout,
    after checking that it exits 0 (its stderr's end in the message if not)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
