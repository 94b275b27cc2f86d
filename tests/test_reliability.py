"""Reliability: injected faults, SIGKILL and resume, replicas, bad input, bad data (workers:
tests/fit/test_multi_worker.py)."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec import LossScaleOptimizer, MixedPrecisionModel
from tfmixprec.tools.testing import FaultInjector

WORKERS = Path(__file__).resolve().parent / "workers"
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


def _snapshot(model, opt):
    """Bytes of every weight and inner optimizer variable (slots and iterations)."""
    return [v.numpy().tobytes() for v in model.weights + opt.inner_optimizer.variables]


def _tiny_regression(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs))
    return keras.Model(inputs, outputs)


# ------------------------------------------------------------------ fault injection
def _train_with_faults(faults, steps=1000):
    model = _tiny_regression()
    opt = LossScaleOptimizer(
        keras.optimizers.Adam(1e-2),
        initial_scale=2.0**10,
        growth_interval=10,
        on_min_scale="ignore",
    )
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype("float32")
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 256, 32)]

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        if faults is not None:
            grads = faults.corrupt_gradients(grads)
        opt.apply(grads, model.trainable_variables)

    corrupted = 0
    for i in range(steps):
        faulty = faults is not None and faults.is_faulty(i)
        before = _snapshot(model, opt) if faulty else None
        step(*batches[i % len(batches)])
        if faulty and _snapshot(model, opt) != before:
            corrupted += 1
    final_loss = float(np.mean((model.predict(x, verbose=0) - y) ** 2))
    return final_loss, opt, corrupted


def test_1000_steps_with_10_percent_injected_faults():
    faults = FaultInjector(1000, rate=0.1, seed=0)
    injected = len(faults.injected_steps)
    assert 80 <= injected <= 120
    clean_loss, clean_opt, _ = _train_with_faults(None)
    loss, opt, corrupted = _train_with_faults(faults)
    state = opt.read_state()
    assert corrupted == 0  # weights, slots and iterations bit-identical on every injected step
    assert state["overflow_steps"] == injected
    assert state["iterations"] == 1000 - injected
    assert clean_opt.read_state()["overflow_steps"] == 0
    assert np.isfinite(loss)
    assert loss == pytest.approx(clean_loss, rel=0.25, abs=2e-3)  # converges all the same
    assert loss < 0.05


def test_fault_injector_on_inputs_with_fit():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", loss_scaling="dynamic")
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(48, 4)).astype("float32"), rng.normal(size=(48, 1)).astype("float32"))
    ).batch(8)
    faults = FaultInjector(6, steps=[1, 4], value=float("inf"))
    model.fit(faults.corrupt_dataset(data), epochs=1, verbose=0)
    assert model.optimizer.read_state()["overflow_steps"] == 2
    assert model.optimizer.read_state()["iterations"] == 4
    assert faults.injected_steps == [1, 4]


# ------------------------------------------------------------------ kill and resume
def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_sigkill_mid_epoch_then_resume(tmp_path):
    backup, record = tmp_path / "backup", tmp_path / "record.jsonl"
    command = [
        sys.executable,
        str(WORKERS / "resume_worker.py"),
        "--backup",
        str(backup),
        "--record",
        str(record),
    ]
    first = subprocess.run(command + ["--kill-at", "14"], env=ENV, capture_output=True, timeout=300)
    assert first.returncode == -signal.SIGKILL, first.stderr.decode()[-2000:]
    records = _records(record)
    backups = [r for r in records if r["event"] == "backup"]
    assert [r["step"] for r in backups] == [4, 8, 12]  # step 14 is mid-epoch 2, after a backup
    last = backups[-1]
    assert last["state"]["overflow_steps"] == 2  # batches 2 and 6 of epoch 1 (steps 3 and 7)
    assert not any(r["event"] == "end" for r in records)

    second = subprocess.run(command, env=ENV, capture_output=True, timeout=300)
    assert second.returncode == 0, second.stderr.decode()[-2000:]
    resumed = _records(record)[len(records)]
    assert resumed["event"] == "begin"
    # Scale, clean-step counter, hysteresis, overflow counters, iterations, every weight and
    # optimizer variable: exactly where the last backup left them.
    assert resumed["state"] == last["state"]
    assert resumed["hash"] == last["hash"]
    end = _records(record)[-1]
    assert end["event"] == "end"
    assert end["state"]["overflow_steps"] > last["state"]["overflow_steps"]


def test_tf_checkpoint_restore_continues_identically(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    x_bad = x.copy()
    x_bad[3, 0] = np.inf

    def make():
        inputs = keras.Input((4,))
        model = MixedPrecisionModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(inputs)))
        model.compile(
            optimizer=LossScaleOptimizer(
                keras.optimizers.Adam(1e-2), initial_scale=64, growth_interval=2, hysteresis=2
            ),
            loss="mse",
        )
        return model

    keras.utils.set_random_seed(0)
    first = make()
    first.fit(x_bad, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "c"))
    keras.utils.set_random_seed(5)  # different initial weights: the restore must overwrite them
    second = make()
    second.optimizer.build(second.trainable_variables)
    tf.train.Checkpoint(model=second, optimizer=second.optimizer).restore(path).assert_consumed()
    assert second.optimizer.read_state() == first.optimizer.read_state()
    for model in (first, second):
        model.fit(x_bad, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert second.optimizer.read_state() == first.optimizer.read_state()
    assert _snapshot(second, second.optimizer) == _snapshot(first, first.optimizer)


# ------------------------------------------------------------------ replicas
def test_mirrored_custom_loop_one_replica_overflow(two_cpu_strategy):
    strategy = two_cpu_strategy
    with strategy.scope():
        model = _tiny_regression()
        opt = LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=8)
        opt.build(model.trainable_variables)

    @tf.function
    def step(dist_batch):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb)) / 2
            grads, _ = tfmixprec.compute_unscaled_gradients(
                tape, loss, model.trainable_variables, opt
            )
            opt.apply(grads, model.trainable_variables)

        strategy.run(replica_fn, args=dist_batch)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    clean = next(
        iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x, y))))
    )
    step(clean)
    before = _snapshot(model, opt)
    x_bad = x.copy()
    x_bad[12] = np.inf  # in the second half of the global batch: replica 1's shard
    bad = next(
        iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors((x_bad, y))))
    )
    step(bad)
    assert _snapshot(model, opt) == before
    for weight in model.weights:
        copies = [t.numpy().tobytes() for t in weight.value.values]
        assert copies[0] == copies[1]
    assert opt.read_state()["overflow_steps"] == 1
    assert opt.read_state()["loss_scale"] == 4.0


# ------------------------------------------------------------------ bad input catalog
class CLIError(Exception):
    """A CLI call that did not succeed: its exit code and what it printed to stderr."""

    def __init__(self, code, stderr):
        super().__init__(f"exit {code}: {stderr}")
        self.code = code


def _cli(*args):
    from tfmixprec.tools.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    if code != 0:
        raise CLIError(code, err.getvalue())


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Objects the catalog's calls may touch, and files for the CLI."""
    folder = tmp_path_factory.mktemp("bad")
    (folder / "notes.txt").write_text("hello")
    with zipfile.ZipFile(folder / "corrupt.keras", "w") as archive:
        archive.writestr("config.json", "{not json")
    for name, config in MALFORMED.items():  # JSON, but no model config
        with zipfile.ZipFile(folder / f"{name}.keras", "w") as archive:
            archive.writestr("config.json", config)
    with tfmixprec.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2, activation="softmax")]
        )
    opt = LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=64)
    opt.build(model.trainable_variables)
    return {"folder": folder, "model": model, "opt": opt}


# config.json files that parse but hold no model: each is a file that cannot be audited (a
# ValueError, exit 2), never a traceback or an AttributeError/RecursionError/TypeError.
MALFORMED = {
    "list": "[]",
    "text": '"a model"',
    "number": "3",
    "deep": "[" * 900 + "]" * 900,
    "deep_object": '{"config": ' + '{"a": ' * 900 + "1" + "}" * 901,
    "compile_list": '{"class_name": "Sequential", "config": {}, "compile_config": []}',
}


def _unbuilt():
    return keras.Sequential([keras.layers.Dense(2)], name="unbuilt_model")


CATALOG = [
    # optimizer knobs (the constructor's own checks are in test_optimizer.py)
    (
        "accumulation 0",
        lambda s: LossScaleOptimizer("sgd", accumulation_steps=0),
        ValueError,
        r"accumulation_steps=0",
    ),
    # policy names and models of the wrong kind
    (
        "policy typo",
        lambda s: tfmixprec.set_policy("mixed_flaot16"),
        ValueError,
        r"'mixed_flaot16'.*|Did you mean 'mixed_float16'",
    ),
    ("policy None", lambda s: tfmixprec.set_policy(None), TypeError, r"name=None"),
    ("scope typo", lambda s: tfmixprec.policy_scope("fp16").__enter__(), ValueError, r"'fp16'"),
    (
        "outputs of str",
        lambda s: tfmixprec.float32_outputs("model.keras"),
        TypeError,
        r"builtins.str",
    ),
    (
        "outputs unbuilt",
        lambda s: tfmixprec.float32_outputs(_unbuilt()),
        ValueError,
        r"'unbuilt_model' is not built",
    ),
    ("audit layer", lambda s: tfmixprec.audit(keras.layers.Dense(2)), TypeError, r"Dense"),
    ("audit policy", lambda s: tfmixprec.audit(s["model"], policy="half"), ValueError, r"'half'"),
    # training
    (
        "loss_scaling",
        lambda s: tfmixprec.training._ensure_loss_scale_optimizer("sgd", True, "maybe"),
        ValueError,
        r"'maybe'",
    ),
    ("loss_fn", lambda s: tfmixprec.make_train_step(s["model"], 3, "sgd"), TypeError, r"loss_fn=3"),
    (
        "loss_fn name",
        lambda s: tfmixprec.make_train_step(s["model"], "mse!", "sgd"),
        ValueError,
        r"loss_fn='mse!'",
    ),
    (
        "step optimizer",
        lambda s: tfmixprec.make_train_step(s["model"], "mse", 3),
        TypeError,
        r"Received: optimizer=3 ",
    ),
    (
        "helper optimizer",
        lambda s: tfmixprec.compute_unscaled_gradients(None, None, [], keras.optimizers.SGD()),
        TypeError,
        r"type SGD",
    ),
    # callback arguments
    (
        "monitor update_freq",
        lambda s: tfmixprec.LossScaleMonitor(update_freq=0),
        ValueError,
        r"update_freq=0",
    ),
    ("guard patience", lambda s: tfmixprec.OverflowGuard(patience=-1), ValueError, r"patience=-1"),
    (
        "guard raise_error",
        lambda s: tfmixprec.OverflowGuard(raise_error="no"),
        TypeError,
        r"raise_error='no'",
    ),
    ("gradient data", lambda s: tfmixprec.GradientRangeMonitor("batch"), ValueError, r"type str"),
    (
        "tensorboard freq",
        lambda s: tfmixprec.TensorBoard("logs", update_freq="hourly"),
        ValueError,
        r"'hourly'",
    ),
    (
        "tensorboard log_dir",
        lambda s: tfmixprec.TensorBoard(123),
        TypeError,
        r"log_dir=123 of type int",
    ),
    (
        "tensorboard monitor",
        lambda s: tfmixprec.TensorBoard("logs", gradient_monitor=3),
        TypeError,
        r"type int",
    ),
    (
        "percentile",
        lambda s: tfmixprec.gradient_range_stats([np.ones(2)]).recommend_loss_scale(-5),
        ValueError,
        r"percentile=-5",
    ),
    # fault injection
    ("faults total", lambda s: FaultInjector(0, rate=0.1), ValueError, r"total_steps=0"),
    ("faults step", lambda s: FaultInjector(10, steps=[11]), ValueError, r"containing 11"),
    ("faults rate", lambda s: FaultInjector(10, rate=2.0), ValueError, r"rate=2.0"),
    ("faults value", lambda s: FaultInjector(10, steps=[1], value=3.0), ValueError, r"value=3.0"),
    # CLI arguments and files
    ("cli epochs", lambda s: _cli("demo", "--epochs", "-3"), CLIError, r"(?s)exit 2: .*got '-3'"),
    ("cli model kind", lambda s: _cli("bench", "--model", "rnn"), CLIError, r"(?s)exit 2: .*'rnn'"),
    (
        "cli policy",
        lambda s: _cli("audit", "m.keras", "--policy", "fp8"),
        CLIError,
        r"(?s)exit 2: .*'fp8'",
    ),
    (
        "cli missing file",
        lambda s: _cli("audit", str(s["folder"] / "nope.keras")),
        CLIError,
        r"(?s)exit 2: .*nope.keras",
    ),
    (
        "cli not a model",
        lambda s: _cli("audit", str(s["folder"] / "notes.txt")),
        CLIError,
        r"(?s)exit 2: .*notes.txt'? is not a Keras model",
    ),
    (
        "cli corrupt keras",
        lambda s: _cli("audit", str(s["folder"] / "corrupt.keras")),
        CLIError,
        r"(?s)exit 2: .*could not load .*corrupt.keras",
    ),
    *[
        (
            f"cli malformed {name}",
            lambda s, name=name: _cli("audit", str(s["folder"] / f"{name}.keras")),
            CLIError,
            rf"(?s)exit 2: tfmixprec audit: error: .*{name}.keras",
        )
        for name in MALFORMED
    ],
    *[
        (
            f"audit malformed {name}",
            lambda s, name=name: tfmixprec.audit(s["folder"] / f"{name}.keras"),
            ValueError,
            rf"{name}.keras'? (is not a Keras model file|has a compile config|as a Keras model: "
            "its config is nested too deeply)",
        )
        for name in MALFORMED
    ],
]


def _world(shared):
    model, opt = shared["model"], shared["opt"]
    return (
        keras.config.dtype_policy().name,
        [(layer.name, layer.dtype_policy.name) for layer in model.layers],
        [w.numpy().tobytes() for w in model.weights],
        opt.read_state(),
        [v.numpy().tobytes() for v in opt.variables],
    )


@pytest.mark.parametrize("name, call, exc, match", CATALOG, ids=[c[0] for c in CATALOG])
def test_bad_input_catalog(shared, name, call, exc, match):
    tfmixprec.set_policy("mixed_bfloat16")
    before = _world(shared)
    with pytest.raises(exc, match=match):
        call(shared)
    assert _world(shared) == before  # nothing half-changed


# ------------------------------------------------------------------ persistent bad data
def _nan_everywhere(batches=20):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * 4, 4)).astype("float32")
    y = rng.normal(size=(batches * 4, 1)).astype("float32")
    x[::4, 0] = np.nan  # one NaN in every batch of 4
    return x, y


def _nan_model(on_min_scale):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(
        optimizer=LossScaleOptimizer(
            keras.optimizers.SGD(), initial_scale=4.0, on_min_scale=on_min_scale
        ),
        loss="mse",
    )
    return model


def test_persistent_nan_stopped_by_guard():
    x, y = _nan_everywhere()
    model = _nan_model("ignore")
    guard = tfmixprec.OverflowGuard(max_consecutive=10, verbose=0)
    model.fit(x, y, batch_size=4, epochs=5, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.stopped_step == 10
    assert "stopped training at step 10: 10 consecutive overflow steps" in guard.stop_message
    state = model.optimizer.read_state()
    assert state["overflow_steps"] == 10 and state["iterations"] == 0
    assert state["loss_scale"] == 1.0


def test_persistent_nan_without_guard_warns_once():
    x, y = _nan_everywhere()
    model = _nan_model("warn")
    with pytest.warns(RuntimeWarning) as record:
        model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
    messages = [str(w.message) for w in record if "min_scale" in str(w.message)]
    assert len(messages) == 1
    assert "not finite at step 2 " in messages[0]  # scale 4 -> 2 -> 1, then at min


def test_persistent_nan_without_guard_raises_promptly():
    x, y = _nan_everywhere(batches=20)
    model = _nan_model("raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FloatingPointError, match=r"not finite at step 2 .*min_scale=1.0"):
            model.fit(x, y, batch_size=4, epochs=10, shuffle=False, verbose=0)
    # Raised at the first check (the end of epoch 1), not after all 200 batches.
    assert model.optimizer.read_state()["overflow_steps"] == 20
