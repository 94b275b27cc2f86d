"""Runs the `tfmixprec` command in the test's process, for the tests whose subject is what the
command does, not the process it runs in (`tools/test_cli.py`, `tools/test_bench.py`,
`checks/test_training_call.py`): no second start of TensorFlow and KerasHub (5-10 s each on 2
cores). Each run checks that the command left the process as it found it."""

import contextlib
import io
import logging
import os
import sys
import warnings

import absl.logging
import keras
import tensorflow as tf

import tfmixprec


def _process_globals():
    """What a command run in this process could leave changed: the global policy and floatx,
    grappler's options, tfmixprec's CPU routes, Python's warning filters and format, the log
    levels (Python's, TensorFlow's, absl's, TensorFlow's C++ variable), `sys.path` and the
    current folder."""
    return (
        keras.config.dtype_policy().name,
        keras.config.floatx(),
        tf.config.optimizer.get_experimental_options(),
        tfmixprec.cpu_float16.status(),
        tfmixprec.cpu_bfloat16.status(),
        list(warnings.filters),
        warnings.formatwarning,
        logging.getLogger().level,
        tf.get_logger().level,
        absl.logging.get_verbosity(),
        os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
        list(sys.path),
        os.getcwd(),
    )


def run_here(*args, cwd=None):
    """`tfmixprec args...` run in this process by `tfmixprec.tools.cli.main` from `cwd`: its
    exit code (a usage error's too), stdout and stderr, each Python warning it raised at the
    end of stderr as the console script writes it (one line); and the process as it was."""
    from _tfmixprec_cli import _format_warning
    from tfmixprec.tools.cli import main

    out, err, folder = io.StringIO(), io.StringIO(), os.getcwd()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, where the console shows a place's first
        before = _process_globals()
        try:
            os.chdir(cwd or folder)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
        finally:
            os.chdir(folder)
        after = _process_globals()  # the warning filters too, before the block restores them
    assert after == before, f"tfmixprec {' '.join(args)} changed the process"
    shown = "".join(_format_warning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return code, out.getvalue(), err.getvalue() + shown
