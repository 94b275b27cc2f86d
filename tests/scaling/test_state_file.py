"""The optimizer's state in files, by name (`scaling.state_file`): files and checkpoints that
tfmixprec 0.1, 0.2.0 and 0.3.0 wrote (checked out of git history and run here) load exactly;
today's files are by name with a format version; a state that does not fit is refused before
anything is assigned."""

import json
import os
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "workers"))
from legacy_state_worker import model_and_optimizer  # noqa: E402

# The last commit of each release: 0.1 to 0.3 saved the state by position, 0.4.0 by name, from
# the flat package of 0.4.0 (before its modules moved into subpackages, issue 38).
RELEASES = {"0.1.0": "559b46d", "0.2.0": "6c2656e", "0.3.0": "954899b", "0.4.0": "71c9978"}


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    """{release: folder}: each release's files, written by that release's own code."""
    folders, pairs = {}, []
    for release, commit in RELEASES.items():
        folder = tmp_path_factory.mktemp(f"v{release}")
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, "tfmixprec"],
            capture_output=True,
            timeout=60,
        )
        assert archive.returncode == 0, (
            f"the test checks tfmixprec {release} out of git history (commit {commit}); "
            f"run it in a clone with history: {archive.stderr.decode()[-500:]}"
        )
        (folder / "code.tar").write_bytes(archive.stdout)
        with tarfile.open(folder / "code.tar") as tar:
            tar.extractall(folder / "code", filter="data")
        folders[release] = folder
        pairs += ["--release", str(folder / "code"), str(folder)]
    # One process for every release, each imported in turn (one start of TensorFlow).
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "legacy_state_worker.py"), *pairs],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path_factory.getbasetemp(),
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return folders


def _by_name(variables):
    """{(name, occurrence): value} of an optimizer's own variables (up to its inner
    optimizer's `iteration`), and {("inner", position): value} of its inner optimizer's, whose
    slot names carry layer names that differ from process to process."""
    seen, values, inner = {}, {}, None
    for name, value in variables:
        if name == "iteration" and "iteration" in seen:
            inner = 0
        if inner is not None:
            values[("inner", inner)], inner = np.asarray(value), inner + 1
            continue
        values[(name, seen.get(name, 0))] = np.asarray(value)
        seen[name] = seen.get(name, 0) + 1
    return values


def _saved(folder, accumulation):
    saved = json.loads((folder / f"acc{accumulation}.json").read_text())
    return saved["version"], _by_name(saved["variables"])


def _today(opt):
    return _by_name((v.path.split("/")[-1], v.numpy()) for v in opt.variables)


def _assert_loaded_exactly(saved, opt, untouched):
    """Every value the release saved is in today's variable of its name (0.1's one window
    flag as today's per-variable flags); the variables it did not have are `untouched`."""
    today = _today(opt)
    for (name, k), value in saved.items():
        if name == "window_finite":
            flags = today[("window_nonfinite", 0)]
            assert (flags == 1 - int(value)).all()
            continue
        assert np.array_equal(today[(name, k)], value), (name, k)
    for key, value in untouched.items():
        if key not in saved:
            assert np.array_equal(today[key], value), key


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("release", list(RELEASES))
def test_a_keras_file_of_an_earlier_release_loads_exactly(legacy, release, accumulation):
    version, saved = _saved(legacy[release], accumulation)
    assert version == release
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Skipping variable loading": all of it loads
        model = keras.models.load_model(legacy[release] / f"acc{accumulation}.keras")
    fresh = {("min_scale_overflows", 0): 0, ("longest_overflow_run", 0): 0}
    _assert_loaded_exactly(saved, model.optimizer, fresh)
    assert model.optimizer.read_state()["overflow_steps"] == 1


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("release", list(RELEASES))
def test_a_checkpoint_of_an_earlier_release_restores_by_name(legacy, release, accumulation):
    """Restored by name (0.2.0's used to fail in 0.3.0 with a shape error): what the release
    had comes back; what it lacked stays as it was (77 here)."""
    _, saved = _saved(legacy[release], accumulation)
    model, opt = model_and_optimizer(accumulation)
    opt.build(model.trainable_variables)
    opt.min_scale_overflows.assign(77)
    tf.train.Checkpoint(model=model, optimizer=opt).restore(
        str(legacy[release] / f"acc{accumulation}-ckpt")
    ).expect_partial()
    _assert_loaded_exactly(saved, opt, {("min_scale_overflows", 0): 77})


def _trained(accumulation, steps):
    model, opt = model_and_optimizer(accumulation)
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(1).normal(size=(4 * steps, 3)).astype("float32")
    x[4, 0] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fit ending inside a window says so
        model.fit(x, np.ones((4 * steps, 2), "float32"), batch_size=4, shuffle=False, verbose=0)
    return model, opt


def test_todays_file_is_by_name_and_round_trips_exactly(tmp_path):
    model, opt = _trained(accumulation=3, steps=5)  # one window applied, two micro-batches summed
    store = {}
    opt.save_own_variables(store)
    assert store["tfmixprec_state_format"] == 2
    paths = bytes(store["tfmixprec_variable_paths"]).decode().split("\n")
    assert paths == [v.path for v in model.trainable_variables]
    names = {"micro_step", "accumulated_gradient_3", "min_scale_overflows", "inner_0"}
    assert names <= set(store)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert _today(loaded.optimizer).keys() == _today(opt).keys()
    for key, value in _today(opt).items():
        assert np.array_equal(_today(loaded.optimizer)[key], value), key


def test_a_state_that_does_not_fit_is_refused_before_anything_is_assigned():
    """An accumulating optimizer (2 + n variables more, n = 3 here: the count of a 0.2.0
    file's) and a file without accumulation: refused, naming why; nothing assigned, and with
    skip_mismatch Keras skips it."""
    model, opt = _trained(accumulation=1, steps=4)
    store = {}
    opt.save_own_variables(store)
    inputs = keras.Input((3,))
    other = keras.Model(
        inputs, keras.layers.Dense(2)(inputs)
    )  # 2 weights: 2 sums, n = 3 with micro
    accumulating = tfmixprec.LossScaleOptimizer("adam", accumulation_steps=2)
    accumulating.build(other.trainable_variables)
    before = [v.numpy().copy() for v in accumulating.variables]
    with pytest.raises(
        ValueError, match=r"this optimizer accumulates gradients and the file's did not"
    ):
        accumulating.load_own_variables(store)
    assert all((a == v.numpy()).all() for a, v in zip(before, accumulating.variables))
    positional = {str(i): value for i, value in enumerate(v.numpy() for v in opt.variables[:-1])}
    with pytest.raises(ValueError, match=r"matches no layout of tfmixprec 0.1 to 0.3"):
        opt.load_own_variables(positional)
    newer = {**store, "tfmixprec_state_format": np.array(9)}
    with pytest.raises(ValueError, match=r"format 9, written by a newer tfmixprec"):
        opt.load_own_variables(newer)


def test_a_format_1_file_loads_by_position():
    """A file of format 1 (tfmixprec 0.4 up to issue 30) has no variable paths: its
    per-variable state loads in the order it was saved."""
    model, opt = _trained(accumulation=3, steps=5)
    store = {}
    opt.save_own_variables(store)
    del store["tfmixprec_variable_paths"]
    store["tfmixprec_state_format"] = np.array(1)
    fresh = tfmixprec.LossScaleOptimizer(keras.optimizers.Adam(), accumulation_steps=3)
    fresh.build(model.trainable_variables)
    fresh.load_own_variables(store)
    for key, value in _today(opt).items():
        assert np.array_equal(_today(fresh)[key], value), key


def test_per_variable_state_follows_the_variables_of_a_reloaded_float8_model(tmp_path):
    """A float8 model loaded from its file lists the float8 scale variables before its kernel
    (Keras rebuilds them so): the overflow counts and the accumulated gradients of each
    variable come back to that variable, not to the one at its old position."""
    tfmixprec.set_policy("mixed_float16")
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(32, name="a")(inputs)
    hidden = keras.layers.Dense(32, name="b")(hidden)
    outputs = keras.layers.Dense(4, name="out", dtype="float32")(hidden)
    model = tfmixprec.MixedPrecisionModel(inputs, outputs)
    tfmixprec.float8_layers(model)
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.01), accumulation_steps=2)
    model.compile(opt, "mse")
    x = np.ones((24, 32), "float32")
    x[0, 0] = 1e30  # an overflow in the first window
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fit ending inside a window says so
        model.fit(x, np.zeros((24, 4)), batch_size=8, verbose=0, shuffle=False)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    before = [v.path for v in opt.tracked_variables()]
    after = [v.path for v in loaded.optimizer.tracked_variables()]
    assert sorted(before) == sorted(after)
    if hasattr(keras.layers.Dense, "_float8_call"):  # Keras 3.12 to 3.15 rebuild them so;
        assert before != after  # Keras 3.16 (float8 strategies) keeps the order

    def sums(optimizer):
        summed = [v for v in optimizer.variables if v.path.endswith("accumulated_gradient")]
        return {t.path: s.numpy().tobytes() for t, s in zip(optimizer.tracked_variables(), summed)}

    report = str(tfmixprec.overflow_report(loaded))
    assert report == str(tfmixprec.overflow_report(model))
    assert "b: the float8 inputs amax history, outputs_grad amax history was not finite" in report
    assert sums(loaded.optimizer) == sums(opt)
    assert any(np.any(v.numpy()) for v in loaded.optimizer.variables if "accumulated" in v.path)


def _compiled(kind, accumulation):
    """A tiny model of `kind` ("keras": a plain `keras.Model`; "mixed": a
    `MixedPrecisionModel`), compiled with a `LossScaleOptimizer` and built."""
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2)(inputs)
    cls = keras.Model if kind == "keras" else tfmixprec.MixedPrecisionModel
    model = cls(inputs, outputs)
    extra = {"accumulation_steps": accumulation} if accumulation > 1 else {}
    model.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.Adam(), **extra), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("skip_mismatch", [False, True])
@pytest.mark.parametrize("kind", ["keras", "mixed"])
def test_a_refused_load_weights_leaves_every_optimizer_variable_as_it_was(
    tmp_path, kind, skip_mismatch
):
    """A file whose optimizer state does not fit (saved without accumulation, loaded into an
    accumulating optimizer): Keras's saving walk loaded the inner optimizer again as a child
    after the refusal, moving `iterations` from 0 to 3. Every optimizer variable, the inner
    optimizer's included, is now bit-identical to before; a file that fits loads all of it."""
    saved = _compiled(kind, accumulation=1)
    saved.fit(np.ones((24, 3)), np.zeros((24, 2)), batch_size=8, verbose=0)
    path = tmp_path / "m.weights.h5"
    saved.save_weights(path)
    model = _compiled(kind, accumulation=2)
    before = [v.numpy().tobytes() for v in model.optimizer.variables]
    refusal = "this optimizer accumulates gradients and the file's did not"
    if skip_mismatch:
        with pytest.warns(UserWarning, match=refusal):
            model.load_weights(path, skip_mismatch=True)
    else:
        with pytest.raises(ValueError, match=refusal):
            model.load_weights(path)
    assert [v.numpy().tobytes() for v in model.optimizer.variables] == before
    assert int(model.optimizer.iterations) == 0
    fits = _compiled(kind, accumulation=1)
    fits.load_weights(path)
    for mine, theirs in zip(fits.optimizer.variables, saved.optimizer.variables):
        assert mine.numpy().tobytes() == theirs.numpy().tobytes(), mine.path
    assert int(fits.optimizer.iterations) == 3
