"""Smoke runs of the benchmark scripts at tiny sizes: they keep working. No timing is asserted.
Each runs in this process (`benchmark_runs.run_here`); `multi_worker.py`'s workers run in
processes of their own, which it starts (they set threads and `TF_CONFIG`). The scripts on
KerasHub's models are in `test_benchmarks_zoo.py` (two files, so that pytest-xdist's
`--dist loadfile` runs them in both processes)."""

import re

import pytest
from benchmark_runs import run_here

import tfmixprec


def test_overhead_smoke():
    out = run_here(
        "overhead.py",
        "--steps",
        "4",
        "--repeats",
        "1",
        "--width",
        "16",
        "--features",
        "8",
        "--batch",
        "8",
        "--policy",
        "float32",
        "--repair",
    )
    lines = out.splitlines()
    assert "repair=True" in out and "with PrecisionRepair armed: paired ratio" in out
    assert any(line.startswith("full ") and "host syncs per step" in line for line in lines)
    assert "full-stack median paired ratio:" in out


def test_speedup_smoke():
    out = run_here(
        "speedup.py",
        "--models",
        "mlp",
        "transformer",
        "--policies",
        "float32",
        "auto",
        "--steps",
        "3",
        "--repeats",
        "1",
        "--scale",
        "0.02",
        "--batch",
        "8",
    )
    assert "mlp (size 40, batch 8)" in out
    assert "transformer (size 10, batch 8)" in out
    assert out.count("1.00x") >= 4  # float32 rows of both stacks, both models


def test_parity_smoke():
    out = run_here("parity.py", "--quick", "--tasks", "underflow", "--train-size", "256")
    assert "| underflow | float32 | fp16 no scaling | fp16 fixed 128 | fp16 dynamic | bf16 |" in out
    assert "| test accuracy (mean ± sd over seeds) |" in out
    assert "| final loss scale | 1 | n/a | 128 | " in out


def test_step_ops_smoke():
    out = run_here("step_ops.py", "--variables", "2", "--calls", "3", "--repeats", "1")
    assert out.count("top level +") == 2 and "tfmixprec  ops:" in out


def test_cpu_kernels_smoke():
    out = run_here("cpu_kernels.py", "--size", "32", "--repeats", "1", "--steps", "1")
    assert "remapper on (default): ms per call (x float32)" in out
    assert "remapper off: ms per call (x float32)" in out
    ops = (
        "MatMul, transposed",
        "Dense forward",
        "attention einsum",
        "Conv2DBackpropFilter",
        "Conv2DBackpropInput",
        "DepthwiseConv2dNativeBackpropFilter",
    )
    for op in ops:
        assert out.count(op) == 2  # once per remapper setting
    assert out.count("(  1.00x)") >= 14  # the float32 column of every row
    # Each float16 route trained natively and routed, with whether this CPU takes it.
    here = {r.name for r in tfmixprec.cpu_float16.routes_on()}
    for name in ("float32 convolution", "float32 product", "float32 attention"):
        on = "yes" if name in here else "no"
        assert re.search(rf"^{name} +{on} +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+x$", out, re.M), out


def test_diagnosis_names_every_case():
    out = run_here("diagnosis.py")
    verdicts = [line for line in out.splitlines() if line.startswith("## ")]
    assert len(verdicts) == 4
    assert all(line.endswith("[OK]") for line in verdicts), verdicts
    assert "found forward-overflow in attention" in verdicts[0]


def test_multi_worker_smoke():
    out = run_here("multi_worker.py", "--smoke")
    rows = [line.split()[0] for line in out.splitlines() if "ms/step" in line]
    assert rows == ["plain", "mwms-1", "mwms-2"]
    assert "round 0: 2 workers' weights bit-identical: True;" in out
    # The tolerance follows from the compute dtype and the steps (multi_worker.tolerance).
    assert re.search(r"after 2 steps: mwms-2 \S+ \(allclose rtol \S+, atol \S+: True\)", out), out


def test_step_losses_needs_one_call_per_step():
    """tfmixprec.bench.StepLosses: each step's loss from Keras's running mean, exact for equal
    batches; with several steps per execution it cannot be, and says so."""
    import keras
    import numpy as np

    from tfmixprec.tools import bench

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.arange(16.0, dtype="float32").reshape(8, 2) / 16, np.ones((8, 1), "float32")
    truth = []

    class Truth(keras.callbacks.Callback):  # each step's loss, at the weights it starts from
        def on_train_batch_begin(self, batch, logs=None):
            rows = slice(2 * batch, 2 * batch + 2)
            truth.append(float(np.mean((model(x[rows]).numpy() - y[rows]) ** 2)))

    record = bench.StepLosses()
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[Truth(), record])
    np.testing.assert_allclose(record.losses, truth, rtol=1e-5)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    with pytest.raises(ValueError, match=r"steps_per_execution=1.*Received: batch 1 after 0"):
        model.fit(x, y, batch_size=2, shuffle=False, verbose=0, callbacks=[bench.StepLosses()])


def test_repair_smoke():
    out = run_here("repair.py", "--quick", "--models", "gelu-regression")
    assert "| gelu-regression | f16 keras | " in out and "| 8 of 8 | - | - |" in out
    repaired = (
        r"\| gelu-regression \| f16 repair \| [\d.]+ \| [\d.]+% \| 5 of 8 \| 1 \| `dense_0` \|"
    )
    assert re.search(repaired, out), out
    assert "| 0 of 8 | 0 | `dense_0` (calibrate) |" in out


def test_float8_quality_smoke():
    out = run_here("float8_quality.py", "--models", "mlp", "--steps", "4")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| mlp")]
    assert [(row[1], row[2]) for row in rows] == [
        ("bfloat16", "0"),
        ("float8_layers", "1"),
        ("model.quantize", "3"),
    ]
    assert rows[0][4] == "+0.0%" and all(float(row[3]) > 0 for row in rows)
    out = run_here("float8_quality.py", "--growth", "--steps", "7")
    steps = [line.split(" | ") for line in out.splitlines() if re.match(r"\| \d", line)]
    assert [int(row[0][2:]) for row in steps] == list(range(1, 8))
    assert [row[1] for row in steps] == ["1024"] * 4 + ["2048"] * 3  # grows after 5 steps
    assert all(row[4].strip(" |") == "8192" for row in steps)
