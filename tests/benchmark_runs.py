"""Runs a benchmark script as a user would, for the smoke tests (`tools/test_benchmarks.py` and
`tools/test_benchmarks_zoo.py`: two files, so that pytest-xdist's `--dist loadfile` runs them in
both processes).

`run_here` runs it in the test's process (`python benchmarks/<script>` as `runpy` runs it): no
second start of TensorFlow and KerasHub (5-10 s each on 2 cores), for the scripts that change
nothing of the process but what it puts back (the global policy, grappler's options and
tfmixprec's float16 switches, Python's warning filters). A script that sets what no test may
set (threads, logical devices, `TF_CONFIG`) does it in processes it starts itself
(`multi_worker.py`'s workers)."""

import contextlib
import io
import os
import runpy
import sys
import warnings
from pathlib import Path

import keras

from tfmixprec.precision import cpu_float16

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _process_kept():
    """The global policy, grappler's options, tfmixprec's float16 switches, the warning
    filters, `sys.argv` and the current folder: as they were after the block."""
    policy, argv, cwd = keras.config.dtype_policy(), sys.argv, os.getcwd()
    try:
        with cpu_float16.process_state_kept(), warnings.catch_warnings():
            yield
    finally:
        keras.config.set_dtype_policy(policy)
        sys.argv = argv
        os.chdir(cwd)


def run_here(script, *args):
    """`benchmarks/<script> args...` run in this process from the repository's root (as
    `python` runs a script: `__name__ == "__main__"`); its stdout. An exception it raises fails
    the test; so does an exit code other than 0."""
    path = ROOT / "benchmarks" / script
    out = io.StringIO()
    with _process_kept(), contextlib.redirect_stdout(out):
        os.chdir(ROOT)
        sys.argv = [str(path), *args]
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exit_:
            assert exit_.code in (None, 0), f"{script} exited {exit_.code}"
    return out.getvalue()
