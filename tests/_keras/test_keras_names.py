"""Every internal name `_keras/` uses exists in the Keras and TensorFlow installed, and the list
of them (`_keras/internals.py`) is exactly what the code of `_keras/` uses. `.ci/nightly` runs
this file against the newest Keras pre-release: a moved or renamed name fails here, by name,
the day it lands."""

import ast
import importlib
import inspect
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec._keras.float8 import float8_entry
from tfmixprec._keras.internals import INTERNALS, OWN, OWNERS

KERAS_DIR = pathlib.Path(tfmixprec.__file__).parent / "_keras"
_PRIVATE_MODULES = ("keras.src", "tensorflow.python")


def _dotted(node):
    """`a.b.c` for a chain of attributes over a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _imports(tree):
    """`{local name: import path}` of the names imported from Keras's or TF's internals."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_PRIVATE_MODULES):
            for alias in node.names:
                found[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return found


def _uses(tree):
    """The internal names one module's source uses (`Internal.key`s)."""
    imported = _imports(tree)
    uses, chains = set(imported.values()), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node) or ""
            head = dotted.split(".")[0]
            if dotted.startswith("tf.__internal__."):
                chains.add("tensorflow." + dotted[len("tf.") :])
            elif head in imported and dotted.count(".") == 1:
                uses.add(f"{imported[head]}.{node.attr}")  # a function of a private module
            if _private(node.attr):
                uses.add(node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "getattr",
            "hasattr",
            "setattr",
        ):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and _private(str(name.value)):
                uses.add(name.value)
        elif isinstance(node, ast.FunctionDef) and _reads_closures(node):
            uses.update(_constants(node))  # the names of Keras's closure variables it reads
        elif isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
            uses.update(m.name for m in methods if _private(m.name))  # overrides
    longest = {c for c in chains if not any(o.startswith(c + ".") for o in chains)}
    return (uses | longest) - set(OWN)


def _reads_closures(function):
    return any(getattr(n, "attr", None) == "getclosurevars" for n in ast.walk(function))


def _constants(function):
    """The string constants of a function, its docstring left out."""
    body = function.body[1:] if ast.get_docstring(function) else function.body
    return {
        n.value
        for statement in body
        for n in ast.walk(statement)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_the_list_is_what_the_code_of_keras_uses():
    """A use in `_keras/` without an entry (or an entry no code makes) fails here: add it to
    `_keras/internals.py` with its reason, or take it out."""
    found = {
        (path.stem, key)
        for path in sorted(KERAS_DIR.glob("*.py"))
        if path.stem not in ("internals", "__init__")
        for key in _uses(ast.parse(path.read_text()))
    }
    listed = {(use.module, use.key) for use in INTERNALS}
    assert sorted(found - listed) == [], "used in _keras/ but not listed in internals.py"
    assert sorted(listed - found) == [], "listed in internals.py but not used in _keras/"
    assert len(listed) == len(INTERNALS)  # one entry a use


def test_every_entry_has_an_owner_or_a_path_and_a_reason():
    for use in INTERNALS:
        owner = use.name.rpartition(".")[0]
        assert owner in OWNERS or use.name.startswith(("keras.src.", "tensorflow.")), use
        assert use.reason and use.module == use.module.strip(), use


def _resolve(path):
    """The object an import path names (a module's attribute chain), or raises."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


@pytest.fixture(scope="module")
def owners(tmp_path_factory):
    """One real object of each kind in `OWNERS`, built and used as tfmixprec meets them."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))
    model.compile(keras.optimizers.SGD(0.01), loss="mse")
    board = keras.callbacks.TensorBoard(str(tmp_path_factory.mktemp("board")))
    x = np.ones((4, 8), "float32")
    model.fit(x, np.ones((4, 2), "float32"), epochs=1, verbose=0, callbacks=[board])
    epochs = _EpochsSeen()
    epochs.compile(keras.optimizers.SGD(0.01), loss="mse")
    epochs.fit(x, np.ones((4, 2), "float32"), epochs=1, verbose=0)
    attention = keras.layers.MultiHeadAttention(2, 4)
    attention(np.ones((1, 3, 8), "float32"), np.ones((1, 3, 8), "float32"))
    function = tf.function(lambda v: v + 1)
    function(tf.constant(1.0))
    return {
        "Layer": model.get_layer("hidden"),
        "Dense": model.get_layer("hidden"),
        "MultiHeadAttention": attention,
        "KerasTensor": model.outputs[0],
        "Model": model,
        "Loss": keras.losses.MeanSquaredError(),
        "Optimizer": model.optimizer,
        "LossScaleOptimizer": keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
        "TensorBoard": board,
        "EpochIterator": epochs.seen[0],
        "tf.function": function,
        "EagerContext": _eager_context(),
        "train_function": _Closure(model.train_function),
        "one_step_on_data": _Closure(_closure(model.train_function)["one_step_on_data"]),
    }


def _closure(function):
    return inspect.getclosurevars(function).nonlocals


class _Closure:
    """A Python function's closure variables as attributes (`hasattr` finds them)."""

    def __init__(self, function):
        self.__dict__.update(_closure(function))


def _eager_context():
    from tensorflow.python.eager import context  # as _keras/settings.py reads it

    return context.context()


class _EpochsSeen(keras.Model):
    """Keeps the epoch iterators Keras's `fit` hands `_maybe_symbolic_build`, as
    `_keras/fit.py`'s `epochs_closed` meets them."""

    def __init__(self):
        super().__init__(name="epochs_seen")
        self.dense = keras.layers.Dense(2)
        self.seen = []

    def call(self, x):
        return self.dense(x)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None:
            self.seen.append(iterator)
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)


class _Subclassed(keras.Model):
    def call(self, x):
        return x


def _exists(name, owners):
    owner, _, attribute = name.rpartition(".")
    if owner in OWNERS:
        return hasattr(owners[owner], attribute)
    try:
        _resolve(name)
    except (ImportError, AttributeError):
        return False
    return True


@pytest.mark.parametrize("use", INTERNALS, ids=lambda use: f"{use.module}:{use.name}")
def test_each_internal_name_exists_in_the_installed_keras(use, owners):
    if use.name == "Model._build_shapes_dict":  # a subclassed model's, once built
        model = _Subclassed()
        model(np.ones((1, 2), "float32"))
        assert model._build_shapes_dict is not None
        return
    if use.instead and not _exists(use.name, owners):
        assert _exists(use.instead, owners), (
            f"Keras {keras.__version__} has neither {use.name} nor {use.instead}: "
            f"{use.module}.py ({use.reason}) needs another way"
        )
        return
    assert _exists(use.name, owners), (
        f"Keras {keras.__version__} / TensorFlow {tf.__version__} has no {use.name}: "
        f"_keras/{use.module}.py uses it ({use.reason})"
    )


def test_tfmixprec_own_private_methods_are_not_keras_names():
    """`OWN` names are tfmixprec's: a Keras that gave its optimizer one would be overridden
    without a word."""
    for name in OWN:
        assert not hasattr(keras.optimizers.LossScaleOptimizer, name), name


def test_float8_entry_is_the_method_keras_calls():
    """The one place that knows where this Keras runs a float8 forward names a method the
    layer has: `_float8_call` where Keras has it (3.12 to 3.15), else `quantized_call`."""
    layer = keras.layers.Dense(16)
    layer.build((None, 16))
    layer.quantize("float8")
    entry = float8_entry(layer)
    has_own = hasattr(keras.layers.Dense, "_float8_call")
    assert entry == ("_float8_call" if has_own else "quantized_call")
    assert callable(getattr(layer, entry))
