"""Tests that start worker processes: `MultiWorkerMirroredStrategy` across 2 workers on
127.0.0.1 (through `tfmixprec.testing.run_workers`), and `run_workers`/`local_cluster`
themselves (with workers that need no TensorFlow)."""

import glob
import importlib.util
import json
import re
import signal
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import tfmixprec
from tfmixprec.tools.testing import local_cluster, run_workers

WORKERS = Path(__file__).resolve().parents[1] / "workers"


def _load_worker_module(name):
    spec = importlib.util.spec_from_file_location(name, WORKERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fit_worker = _load_worker_module("fit_worker")


def _assert_all_ok(results):
    failed = [r for r in results if r.returncode != 0]
    tails = "\n".join(f"--- worker {r.index} ({r.returncode}):\n{r.stderr[-3000:]}" for r in failed)
    assert not failed, tails


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# ------------------------------------------------------------------ fit, evaluate, predict
@pytest.fixture(scope="module")
def fit_run(tmp_path_factory):
    """One 2-worker run of tests/workers/fit_worker.py: its folder, JSON records and arrays.
    The same workers then run multiworker_worker's custom loop into <folder>/loop (starting 2
    workers is most of what a run costs)."""
    out = tmp_path_factory.mktemp("fit")
    (out / "loop").mkdir()
    command = [sys.executable, str(WORKERS / "fit_worker.py"), "--out", str(out)]
    command += ["--loop-out", str(out / "loop")]
    _assert_all_ok(run_workers(command, num_workers=2, timeout=240))
    records = [json.loads((out / f"fit-{i}.json").read_text()) for i in range(2)]
    arrays = [dict(np.load(out / f"fit-{i}.npz")) for i in range(2)]
    return out, records, arrays


@pytest.fixture(scope="module")
def one_process():
    """The same model, data and global batch, fit in this process without a strategy."""
    x_bad, y, x = fit_worker.data()
    model = fit_worker.build_model()
    history = model.fit(
        fit_worker.dataset(x_bad, y), epochs=fit_worker.EPOCHS, shuffle=False, verbose=0
    )
    evaluated = model.evaluate(fit_worker.dataset(x, y), verbose=0, return_dict=True)
    predicted = model.predict(fit_worker.dataset(x), verbose=0)
    weights = [np.asarray(w.numpy()) for w in model.weights]
    return history.history, evaluated, predicted, weights


def _weights(arrays):
    return [arrays[f"weight_{i}"] for i in range(sum(k.startswith("weight_") for k in arrays))]


@pytest.mark.slow
def test_fit_across_workers_equals_one_process(fit_run, one_process):
    _, (first, second), arrays = fit_run
    history, evaluated, predicted, weights = one_process
    # Every weight and optimizer variable (loss-scale state included) equal after each epoch.
    assert len(first["epochs"]) == fit_worker.EPOCHS
    assert first["epochs"] == second["epochs"]
    assert first["history"] == second["history"]
    assert first["state"] == second["state"]
    np.testing.assert_allclose(first["history"]["loss"], history["loss"], rtol=1e-5)
    for key in ("loss_scale", "overflow", "overflow_steps"):
        assert first["history"][key] == history[key], key
    for mine, theirs in zip(_weights(arrays[0]), _weights(arrays[1])):
        assert mine.tobytes() == theirs.tobytes()
    assert len(_weights(arrays[0])) == len(weights) == 4
    for mine, single in zip(_weights(arrays[0]), weights):
        np.testing.assert_allclose(mine, single, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_evaluate_and_predict_across_workers(fit_run, one_process):
    _, (first, second), arrays = fit_run
    _, evaluated, predicted, _ = one_process
    assert first["evaluate"] == second["evaluate"]
    assert first["evaluate"].keys() == evaluated.keys()
    np.testing.assert_allclose(first["evaluate"]["loss"], evaluated["loss"], rtol=1e-5)
    for worker in arrays:
        # The whole dataset, in order, on every worker: each worker predicted half of it.
        assert worker["predicted"].shape == (fit_worker.STEPS * fit_worker.GLOBAL_BATCH, 1)
        np.testing.assert_allclose(worker["predicted"], worker["direct"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(worker["predicted"], predicted, rtol=1e-4, atol=1e-5)
    assert arrays[0]["predicted"].tobytes() == arrays[1]["predicted"].tobytes()


@pytest.mark.slow
def test_tensorboard_writes_on_the_chief_only(fit_run):
    out, (first, second), _ = fit_run
    events = sorted(glob.glob(str(out / "logs" / "**" / "events.out.tfevents*"), recursive=True))
    assert [Path(e).parent for e in events] == [out / "logs" / "train"]
    assert Path(events[0]).name.split(".")[-3] == str(first["pid"])  # the chief's process
    # Worker 1 wrote its run into a temporary folder during fit, removed when fit ended.
    assert first["tb_dirs"] == [{"dirs": 0, "event_files": 0}] * fit_worker.EPOCHS
    assert second["tb_dirs"] == [{"dirs": 1, "event_files": 1}] * fit_worker.EPOCHS
    assert list((out / "tmp-0").iterdir()) == list((out / "tmp-1").iterdir()) == []

    acc = event_accumulator.EventAccumulator(
        str(out / "logs" / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()

    def series(tag):
        return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]

    scales = series("mixed_precision/loss_scale")
    # At the 0-based number of the step just taken (skipped steps counted), over both fits.
    assert [step for step, _ in scales] == list(range(2 * fit_worker.STEPS))
    assert scales[-1][1] == first["state"]["loss_scale"]
    overflow_at = [fit_worker.INF_STEP, fit_worker.STEPS + fit_worker.INF_STEP]
    assert series("mixed_precision/overflow") == [(step, 1.0) for step in overflow_at]


@pytest.mark.slow
def test_model_checkpoint_on_the_chief_has_the_final_weights(fit_run):
    out, (first, second), arrays = fit_run
    assert (first["checkpointed"], second["checkpointed"]) == (True, False)
    model = keras.models.load_model(out / "model.keras")
    assert isinstance(model, tfmixprec.MixedPrecisionModel)
    final = _weights(arrays[0])
    assert len(model.weights) == len(final)
    for loaded, worker in zip(model.weights, final):
        assert np.asarray(loaded.numpy()).tobytes() == worker.tobytes()


@pytest.mark.slow
def test_inf_on_one_workers_shard_skips_the_step_on_both(fit_run):
    _, (first, second), _ = fit_run
    # The Inf is in worker 1's half of global step INF_STEP only.
    assert first["local_finite"] == [True] * fit_worker.STEPS
    assert second["local_finite"] == [i != fit_worker.INF_STEP for i in range(fit_worker.STEPS)]
    skipped = {fit_worker.INF_STEP, fit_worker.STEPS + fit_worker.INF_STEP}
    for worker in (first, second):
        batches = worker["batches"]
        assert len(batches) == fit_worker.EPOCHS * fit_worker.STEPS
        assert [b["overflow"] for b in batches] == [float(i in skipped) for i in range(16)]
        # Weights, slots and iterations bit-identical across each skipped step only.
        assert [b["before"] == b["after"] for b in batches] == [i in skipped for i in range(16)]
        assert worker["epochs"][0]["state"]["overflow_steps"] == 1
        assert worker["state"]["overflow_steps"] == 2
        assert worker["history"]["overflow"] == [1.0, 1.0]
    assert first["batches"] == second["batches"]
    assert first["state"] == second["state"]


@pytest.mark.slow
def test_custom_loop_overflow_on_one_worker(fit_run):
    """`strategy.run(model.train_step)` per batch, each worker with its own data; then a plain
    keras.Model's own fit under the same strategy (which fails upstream). Run by the workers
    of `fit_run` after their fit (tests/workers/multiworker_worker.py, `custom_loop`)."""
    tmp_path = fit_run[0] / "loop"
    states = [json.loads((tmp_path / f"state-{i}.json").read_text()) for i in range(2)]
    # Each worker's batches of 8 are split into global steps of 4 per worker; worker 1's Inf
    # batch (samples 16-23) falls into steps 4 and 5, on worker 1 only.
    for state in states:
        assert state["state"]["overflow_steps"] == 2  # both workers skipped both steps
        assert state["state"]["iterations"] == 8
        assert state["overflow_log"] == [0.0] * 4 + [1.0, 1.0] + [0.0] * 4
    assert states[0]["state"] == states[1]["state"]
    # A plain keras.Model's fit under the same strategy: the upstream failure tfmixprec works
    # around (keras-team/keras#20585). If this fails, Keras fixed it: update the README.
    for state in states:
        assert state["keras_fit"].startswith("fit failed: Attempt to convert a value (PerReplica:{")
        assert (
            "<class 'tensorflow.python.distribute.values.PerReplica'>) to a Tensor"
            in (state["keras_fit"])
        )
    weights = [np.load(tmp_path / f"weights-{i}.npz") for i in range(2)]
    assert len(weights[0].files) == 4
    for name in weights[0].files:
        assert weights[0][name].tobytes() == weights[1][name].tobytes()


# ------------------------------------------------------------------ kill and resume
@pytest.mark.slow
def test_sigkill_one_worker_then_resume(tmp_path):
    command = [sys.executable, str(WORKERS / "mw_resume_worker.py"), "--out", str(tmp_path)]
    # Worker 0 cannot pass step 14 without worker 1, and it wrote its backups up to step 12
    # before step 14 could start: nothing is left for it to do once worker 1 is gone.
    killed = run_workers(command + ["--kill-at", "14"], num_workers=2, timeout=240, grace=1)
    assert killed[1].returncode == -signal.SIGKILL, killed[1].stderr[-3000:]
    assert killed[0].returncode != 0  # blocked in a collective, then killed
    first = [_records(tmp_path / f"record-{i}.jsonl") for i in range(2)]
    backups = [[r for r in records if r["event"] == "backup"] for records in first]
    # Step 14 is mid-epoch 2 (steps 11-20), after the backup at step 12 on both workers.
    assert [r["step"] for r in backups[1]] == [4, 8, 12]
    assert backups[0][:3] == backups[1]  # worker 0 may have reached no further backup
    last = backups[1][-1]
    assert last["state"]["overflow_steps"] == 2  # batches 2 and 6 of epoch 1
    assert last["state"]["loss_scale"] != 256.0  # the scale moved
    assert not any(r["event"] == "end" for records in first for r in records)

    _assert_all_ok(run_workers(command, num_workers=2, timeout=240))
    second = [_records(tmp_path / f"record-{i}.jsonl")[len(first[i]) :] for i in range(2)]
    for records in second:
        begin, end = records[0], records[-1]
        assert begin["event"] == "begin"
        # Scale, counters, iterations, every weight and optimizer variable: exactly where
        # the last backup left them, on every worker.
        assert begin["state"] == last["state"]
        assert begin["hash"] == last["hash"]
        assert end["event"] == "end"
        assert end["epoch"] == 2  # it resumed in epoch 2 and finished epoch 3
        assert end["state"]["overflow_steps"] == 2 + 4
    assert second[0] == second[1]


# ------------------------------------------------------------------ run_workers itself
def _python(code):
    return [sys.executable, "-c", code]


REPORT = (
    "import os\n"
    "print(os.environ['TF_CONFIG'])\n"
    "print(os.environ['TF_CPP_MIN_LOG_LEVEL'])\n"
    "print(os.getcwd())\n"
)


def test_local_cluster_gives_each_worker_its_task_and_distinct_ports():
    configs = local_cluster(3)
    workers = configs[0]["cluster"]["worker"]
    assert len(set(workers)) == 3
    assert all(address.startswith("127.0.0.1:") for address in workers)
    for index, config in enumerate(configs):
        assert config == {
            "cluster": {"worker": workers},
            "task": {"type": "worker", "index": index},
        }


def test_run_workers_sets_tf_config_and_log_level_per_worker(tmp_path):
    results = run_workers(_python(REPORT), num_workers=3, timeout=60, cwd=str(tmp_path))
    _assert_all_ok(results)
    configs = [json.loads(r.stdout.splitlines()[0]) for r in results]
    assert [r.index for r in results] == [c["task"]["index"] for c in configs] == [0, 1, 2]
    assert all(c["cluster"] == configs[0]["cluster"] for c in configs)
    assert len(set(configs[0]["cluster"]["worker"])) == 3
    assert [r.stdout.splitlines()[1:] for r in results] == [["2", str(tmp_path)]] * 3
    env = {"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "1"}
    results = run_workers(_python(REPORT), num_workers=1, timeout=60, env=env)
    assert results[0].stdout.splitlines()[1] == "1"  # the caller's setting wins


def test_run_workers_kills_the_others_after_grace_when_one_fails():
    code = (
        "import json, os, sys, time\n"
        "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "if index == 1:\n"
        "    print('worker 1 fails', file=sys.stderr); sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    results = run_workers(_python(code), num_workers=2, timeout=60, grace=1)
    assert time.monotonic() - start < 20
    assert [r.returncode for r in results] == [-signal.SIGKILL, 3]
    assert "worker 1 fails" in results[1].stderr


def test_run_workers_raises_timeout_error_with_the_workers_stderr():
    code = "import sys, time; print('still busy', file=sys.stderr, flush=True); time.sleep(60)"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"(?s)timeout=2\b.*still busy"):
        run_workers(_python(code), num_workers=2, timeout=2)
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("call", [local_cluster, lambda n: run_workers(_python("0"), n)])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_num_workers_must_be_an_integer_at_least_one(call, bad):
    message = re.escape(f"num_workers must be an integer >= 1. Received: num_workers={bad!r}")
    with pytest.raises(ValueError, match=message):
        call(bad)
