"""`tfmixprec bench --model FILE.py:FUNCTION` with the targets its loss takes
(`tools.targets`): a classifier compiled with a sparse loss gets integer labels, a categorical
one one-hot rows, a binary one 0/1; a loss that refuses the made-up targets is one line that
says how to fix it."""

import keras
import numpy as np
import pytest
from cli_runs import run_here

from tfmixprec.tools import bench


def _classifier(loss, units=5, activation="softmax"):
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(units, activation=activation)(inputs)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss=loss)
    return model


SPARSE = {
    "name": ("sparse_categorical_crossentropy", "softmax"),
    "object": (keras.losses.SparseCategoricalCrossentropy(), "softmax"),
    "from-logits": (keras.losses.SparseCategoricalCrossentropy(from_logits=True), None),
    "function": (keras.losses.sparse_categorical_crossentropy, "softmax"),
}


@pytest.mark.parametrize("kind", list(SPARSE))
def test_a_sparse_loss_gets_integer_labels_one_a_sample(kind):
    loss, activation = SPARSE[kind]
    model = _classifier(loss, activation=activation)
    x = np.ones((4, 3), "float32")
    outputs, y, what = bench.synthetic_targets(model, x)
    assert y.dtype == np.int32 and y.shape == (4,) and not y.any()
    assert what == "integer class labels (0), one a sample"
    assert np.isfinite(float(model.compute_loss(x, y, outputs)))


@pytest.mark.parametrize(
    "loss, expected, what",
    [
        ("categorical_crossentropy", [[1.0, 0.0, 0.0]] * 2, "one-hot rows (class 0)"),
        (keras.losses.BinaryCrossentropy(from_logits=False), [[0.0] * 3] * 2, "0/1 targets"),
        ("binary_focal_crossentropy", [[0.0] * 3] * 2, "0/1 targets"),
        ("mse", [[0.0] * 3] * 2, "float32 zeros shaped like the output"),
    ],
)
def test_other_losses_get_their_targets(loss, expected, what):
    model = _classifier(loss, units=3, activation="sigmoid")
    x = np.ones((2, 3), "float32")
    outputs, y, said = bench.synthetic_targets(model, x)
    assert y.dtype == np.float32 and y.tolist() == expected
    assert said.startswith(what)
    assert np.isfinite(float(model.compute_loss(x, y, outputs)))


def test_each_output_gets_the_targets_of_its_own_loss():
    inputs = keras.Input((3,))
    labels = keras.layers.Dense(4, activation="softmax", name="labels")(inputs)
    value = keras.layers.Dense(2, name="value")(inputs)
    model = keras.Model(inputs, {"labels": labels, "value": value})
    x = np.ones((2, 3), "float32")
    losses = {"labels": "sparse_categorical_crossentropy", "value": "mse"}
    model.compile(optimizer="sgd", loss=losses)
    outputs, y, what = bench.synthetic_targets(model, x)
    assert y["labels"].tolist() == [0, 0] and y["labels"].dtype == np.int32
    assert y["value"].tolist() == [[0.0, 0.0]] * 2
    assert what == "integer class labels (0), one a sample; float32 zeros shaped like the output"
    assert np.isfinite(float(model.compute_loss(x, y, outputs)))
    listed = keras.Model(inputs, [labels, value])
    listed.compile(optimizer="sgd", loss=["sparse_categorical_crossentropy", "mse"])
    _, y, _ = bench.synthetic_targets(listed, x)
    assert [t.shape for t in y] == [(2,), (2, 2)]


MODELS = """
import keras


def _dense(units, activation):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = keras.layers.Dense(units, activation=activation, dtype="float32")(hidden)
    return keras.Model(inputs, outputs)


def sparse():  # the most common classifier
    model = _dense(10, "softmax")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def sparse_logits():
    model = _dense(10, None)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    return model


def binary():
    model = _dense(1, "sigmoid")
    model.compile(optimizer="adam", loss="binary_crossentropy")
    return model


def my_loss(y_true, y_pred):  # a loss bench does not know, which takes integer labels
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred)


def custom():
    model = _dense(10, "softmax")
    model.compile(optimizer="adam", loss=my_loss)
    return model
"""


def _bench(folder, function):
    """`tfmixprec bench` on `models.py:function` in `folder`, run in this process (`run_here`:
    the command, not its process, is what these tests check)."""
    args = ["bench", "--model", f"models.py:{function}", "--steps", "2", "--repeats", "1"]
    return run_here(*args, "--policies", "float32", cwd=folder)


@pytest.mark.parametrize("function", ["sparse", "sparse_logits", "binary"])
def test_bench_times_a_classifier_through_the_command(tmp_path, function):
    """The command on a real file: each classifier trains on the targets its loss takes
    (`sparse` failed with the outputs' shape of zeros: "Arguments `target` and `output` must
    have the same shape up until the last dimension")."""
    (tmp_path / "models.py").write_text(MODELS)
    code, out, err = _bench(tmp_path, function)
    assert code == 0, err[-2000:]
    rows = [line.split() for line in out.splitlines() if line.startswith(f"{function} ")]
    assert [row[1:4] for row in rows] == [["float32", "keras", "32"]]


def test_a_loss_that_refuses_the_made_up_targets_says_how_in_one_line(tmp_path):
    (tmp_path / "models.py").write_text(MODELS)
    code, out, err = _bench(tmp_path, "custom")
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("tfmixprec bench: error:")]
    assert line.startswith(
        "tfmixprec bench: error: --model 'models.py:custom': computing its loss on made-up "
        "targets (float32 zeros shaped like the output) raised ValueError: "
    ), line
    assert line.endswith(" Return (model, x, y) from your function."), line
