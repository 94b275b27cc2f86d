"""Reading a saved model file for `audit`: as it was saved, and without running code from it.

Private: used by `audit` when it is given a path. A `.keras` file is a zip archive whose
`config.json` says what the model is (each layer's dtype policy, the compile arguments) and
whose `model.weights.h5` holds the variables, the optimizer's included. A legacy `.h5` file
keeps the config in an HDF5 attribute.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import keras

from tfmixprec._common.layers import iter_layers
from tfmixprec._common.observe import UNKNOWN_SIZE, call_bytes, tensor_bytes
from tfmixprec._keras.saving import (
    ARCHIVE_CONFIG,
    ARCHIVE_WEIGHTS,
    declared_model,
    saved_optimizer_wrapped,
)
from tfmixprec._keras.settings import global_policy, restore_global_policy

__all__: list[str] = []  # private module: nothing here is part of the package's API

# Packages whose classes a file may name: Keras imports these itself (and only these).
TRUSTED_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp", "tfmixprec", "builtins")


def load_model_file(
    path: str | os.PathLike,
) -> tuple[keras.Model, frozenset[int], str | None]:
    """Loads a saved model as it was saved, for `audit`.

    The model is loaded under its own saved policy (Keras gives a loaded Sequential or
    functional model the global policy, not the saved one) and compiled as Keras compiled it:
    its saved optimizer state says whether Keras wrapped the optimizer in a
    `LossScaleOptimizer` (the compile config names only the optimizer passed to `compile`).
    The optimizer's saved variables are not loaded: the audit reads none. Before anything is
    built, what the config declares is measured against `DECLARED_BUDGET` (`_declared_costs`).

    Returns:
        `(model, followers, unobserved)`: the `id()`s of the policy objects of the layers that
        follow the model's own policy in the file (see `_saved_policies`), and why the audit
        must not call the model (None when it may).

    Raises:
        ValueError: If the path is missing, a directory or not a model file, if the file holds
            code or needs classes from outside Keras and tfmixprec, if it declares more
            weights than it holds and `DECLARED_BUDGET` allows, or if it does not load.
    """
    path = Path(path)
    with _load_errors(path):  # a malformed config fails in many ways: one ValueError
        config, compile_config, wrapped = _read(path)
        _refuse_code(path, config)
        policy, follow = _saved_policies(config.get("config"))
    with _global_policy(policy), _load_errors(path):
        unobserved = _declared_costs(path, config)
    with _global_policy(policy), _load_errors(path), warnings.catch_warnings():
        # The optimizer's saved variables are not the audit's to load: a KerasHub task, which
        # compiles itself when built, makes Keras say it skips them.
        warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
        model = keras.models.load_model(path, compile=False, safe_mode=True)
        if compile_config:
            _compile(model, compile_config, wrapped)
    layers = iter_layers(model)
    followers = frozenset(id(lyr.dtype_policy) for lyr in layers if lyr.name in follow)
    return model, followers, unobserved


# What a file may make the audit allocate beyond the bytes it holds, for the weights its config
# declares and for the tensors of the one call on zeros: loading builds what the config
# declares (a 1 kB file can declare a 6000 x 6000 input or a Dense of 10^9 units), and the
# call makes a batch of zeros of the declared input shapes. 256 MiB holds the call of a
# ResNet-50 at 224 x 224 in float16 (142 MiB: its batch and its layers' outputs, batch 2)
# and not the batch of zeros alone of a 6000 x 6000 float32 input (275 MiB); a fixed size, so
# a file gets the same verdict on every machine. Past it:
# - weights the file does not hold are refused (exit 2): loading allocates them, and nothing
#   of the model can be audited without loading it. Keras stores the weights uncompressed,
#   so a file Keras wrote holds all of its weights, however large;
# - a call is not made: the model is audited from its graph, as one that cannot take zeros,
#   and the report says so (an `unobserved` info). A large declared input is a real model's
#   (a 3-D volume, a large image): refusing it would leave it without an audit, while
#   Keras's symbolic dtypes still show most findings.
DECLARED_BUDGET = 256 << 20


def _declared_costs(path: Path, config: dict[str, Any]) -> str | None:
    """Measures what `config` declares before anything of it is built (`declared_model`: a
    model built in a graph that never runs, whose variables hold no memory and whose tensors
    are symbolic): raises for weights past `DECLARED_BUDGET` beyond those the file holds, and
    returns why the audit must not call the model when that call's tensors are past it (None
    when it may)."""
    legacy = not zipfile.is_zipfile(path)
    declared = config if legacy else dict(config, compile_config=None)
    with declared_model(declared, legacy) as model:
        weights = _declared_weights(model)
        call, inputs = call_bytes(model)
    held = path.stat().st_size if legacy else _held_weights(path)
    if sum(size for _, _, size in weights) > DECLARED_BUDGET + held:
        raise ValueError(_too_many_weights(path, weights, held))
    if call <= DECLARED_BUDGET:
        return None
    return (
        f"the audit did not call the model on a batch of zeros: for its declared inputs "
        f"{inputs}, that call would hold {_mib(call)} of tensors (the batch and its layers' "
        f"outputs, unknown sizes {UNKNOWN_SIZE}), past the {_mib(DECLARED_BUDGET)} the audit "
        "spends on a file's call"
    )


def _declared_weights(model: keras.Model) -> list[tuple[str, Any, int]]:
    """`(layer name, variable, bytes)` for each variable of a declared model, named by the
    innermost layer that holds it (a nested layer is walked after the layer around it)."""
    owners = {}
    for layer in [model, *iter_layers(model)]:
        for variable in layer.weights:
            owners[id(variable)] = (layer.name, variable)
    return [(name, v, tensor_bytes(v.shape, v.dtype)) for name, v in owners.values()]


def _too_many_weights(path: Path, weights: list[tuple[str, Any, int]], held: int) -> str:
    """The one line that refuses a file declaring more weights than `_declared_costs` allows."""
    layer, variable, size = max(weights, key=lambda weight: weight[2])
    total = sum(size for _, _, size in weights)
    return (
        f"{str(path)!r} declares {_mib(total)} of weights (the largest: the {variable.name} of "
        f"layer {layer!r}, shape {tuple(variable.shape)} {variable.dtype}, {_mib(size)}) but "
        f"holds {_mib(held)}: loading it would allocate the rest, past the "
        f"{_mib(DECLARED_BUDGET)} the audit allocates for a file beyond the bytes it holds. If "
        "you trust the file, audit it in Python: tfmixprec.audit(keras.models.load_model(path))."
    )


def _held_weights(path: Path) -> int:
    """The bytes a .keras file stores of its weights (its `model.weights.*` members, as stored,
    compressed or not)."""
    with zipfile.ZipFile(path) as archive:
        infos = archive.infolist()
    return sum(info.compress_size for info in infos if info.filename.startswith("model.weights."))


def _mib(size: int) -> str:
    """`"448.0 MiB"` (`"9.8 KiB"` under 1 MiB)."""
    return f"{size / 1024:.1f} KiB" if size < 1 << 20 else f"{size / (1 << 20):.1f} MiB"


def _read(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None, bool | None]:
    """`(model config, compile config or None, optimizer wrapped for loss scaling or None)`."""
    if not path.exists():
        raise ValueError(f"no such file: {str(path)!r}")
    if path.is_dir():
        kind = "a TensorFlow SavedModel" if (path / "saved_model.pb").exists() else "a"
        raise ValueError(
            f"{str(path)!r} is {kind} directory, not a model file. tfmixprec audit reads a "
            "model saved by Keras 3 in one .keras file (model.save('model.keras')) or a "
            "legacy .h5 file; Keras 3 cannot load a SavedModel as a model with layers "
            "(keras.layers.TFSMLayer only runs it). Save the model from the code that builds "
            "it with model.save('model.keras')."
        )
    if zipfile.is_zipfile(path):
        with _load_errors(path), zipfile.ZipFile(path) as archive:
            _refuse_bombs(path, archive)
            config = _json_object(path, ARCHIVE_CONFIG, archive.read(ARCHIVE_CONFIG))
        compile_config = config.get("compile_config")
        if not isinstance(compile_config, (dict, type(None))):
            raise ValueError(
                f"{str(path)!r} has a compile config that is a {type(compile_config).__name__}, "
                "not a JSON object: not a file Keras wrote. Save the model again with "
                "model.save('model.keras')."
            )
        return config, compile_config, _wrapped_optimizer(path)
    if h5py.is_hdf5(path):
        return *_read_h5(path), None
    raise ValueError(
        f"{str(path)!r} is not a Keras model file (.keras is a zip archive; save the model "
        "with model.save('model.keras'))."
    )


# What a model file's members may declare before any is read: a model's config is small, and a
# member far larger uncompressed than stored is a decompression bomb (Keras's own guard, with
# the same ratio, starts at 4 GiB and runs after a first read of the config).
CONFIG_LIMIT = 64 << 20
EXPANSION_LIMIT, EXPANSION_FLOOR = 100, 256 << 20


def _refuse_bombs(path: Path, archive: zipfile.ZipFile) -> None:
    """Raises for a member whose declared size would cost the audit memory or time it should
    not spend: a `config.json` over `CONFIG_LIMIT`, or any member that declares over
    `EXPANSION_FLOOR` and over `EXPANSION_LIMIT` times what it stores."""
    for info in archive.infolist():
        mib = info.file_size / (1 << 20)
        if info.filename == ARCHIVE_CONFIG and info.file_size > CONFIG_LIMIT:
            raise ValueError(
                f"{str(path)!r} declares a config.json of {mib:.1f} MiB; a model's config is "
                f"far smaller (the audit reads at most {CONFIG_LIMIT >> 20} MiB): not a file "
                "Keras wrote."
            )
        if info.file_size > EXPANSION_FLOOR and info.file_size > EXPANSION_LIMIT * max(
            info.compress_size, 1
        ):
            raise ValueError(
                f"{str(path)!r} holds {info.filename!r}, which declares {mib:.1f} MiB but "
                f"stores {info.compress_size / (1 << 20):.1f} MiB: a decompression bomb, "
                "not a file Keras wrote."
            )


def _json_object(path: Path, member: str, text: Any) -> dict[str, Any]:
    """`text` parsed as JSON, which must be an object (Keras writes a model's config as one)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(
            f"{str(path)!r} is not a Keras model file: its {member} is a "
            f"{type(value).__name__}, not a JSON object. Save the model with "
            "model.save('model.keras')."
        )
    return value


def _read_h5(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`(model config, compile config)` of a legacy HDF5 model file. The compile config is
    `{"legacy_optimizer": config}`: the audit needs the optimizer only, and Keras 3.15's own
    legacy compile fails on the losses and metrics it saved itself ("mse")."""
    with _load_errors(path), h5py.File(path, "r") as file:
        text, training = file.attrs.get("model_config"), file.attrs.get("training_config")
        if text is not None:
            training = _json_object(path, "training_config", training) if training else {}
            # A loss or metric stored as a lambda's bytecode.
            _refuse_code(path, training, "an entry of its training config (loss, metrics)")
            optimizer = training.get("optimizer_config")
            compile_config = {"legacy_optimizer": optimizer} if optimizer else None
            return _json_object(path, "model_config", text), compile_config
    raise ValueError(
        f"{str(path)!r} is an HDF5 file without a model (weights only, e.g. from "
        "model.save_weights): audit the model itself, saved with model.save('model.keras')."
    )


def _wrapped_optimizer(path: Path) -> bool | None:
    """Whether the saved optimizer was a loss-scale wrapper (its state has an inner
    optimizer), or None when the archive keeps no optimizer state."""
    try:
        with zipfile.ZipFile(path) as archive, archive.open(ARCHIVE_WEIGHTS) as weights:
            with h5py.File(weights, "r") as file:
                return saved_optimizer_wrapped(file)
    except (KeyError, OSError):  # no (readable) weights file: Keras's default decides
        return None


@contextlib.contextmanager
def _load_errors(path: Path) -> Iterator[None]:
    """Any failure inside is a file that does not load: one `ValueError` naming it."""
    try:
        yield
    except ValueError as err:
        if str(err).startswith((repr(str(path)), _cannot_load(path, None))):  # already ours
            raise
        raise ValueError(_cannot_load(path, err)) from err
    except Exception as err:  # a corrupt or foreign file fails in many ways
        raise ValueError(_cannot_load(path, err)) from err


def _cannot_load(path: Path, err: BaseException | None) -> str:
    """The message for a file that does not load (its start alone for `err=None`)."""
    head = f"could not load {str(path)!r} as a Keras model: "
    if err is None:
        return head
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    if isinstance(err, RecursionError):
        first = "its config is nested too deeply"
    return head + first


def _refuse_code(path: Path, config: Any, where: str = "the model") -> None:
    """Raises if the config holds code (a lambda's bytecode) or names a class or function
    from outside Keras and tfmixprec that this process has not registered."""
    found = _code_in(config, where)
    if found is None:
        return
    where, problem, is_bytecode = found
    if is_bytecode:
        raise ValueError(
            f"{str(path)!r} holds code: {where} is {problem}, which runs when the model is "
            "loaded or called. tfmixprec audit never runs code from a model file. If you "
            "trust the file, audit it in Python: "
            "tfmixprec.audit(keras.models.load_model(path, safe_mode=False))."
        )
    raise ValueError(
        f"{str(path)!r} needs code from outside Keras and tfmixprec: {where} is {problem}. "
        "tfmixprec audit imports no code a model file names. If you trust that code, import "
        "it and audit the model in Python: tfmixprec.audit(keras.models.load_model(path))."
    )


def _code_in(node: Any, where: str) -> tuple[str, str, bool] | None:
    """The first piece of code in a config: `(where, what, is bytecode)`, or None."""
    if isinstance(node, list):
        return next(filter(None, (_code_in(item, where) for item in node)), None)
    if not isinstance(node, dict):
        return None
    inner = node.get("config")
    if "class_name" in node and isinstance(inner, dict) and isinstance(inner.get("name"), str):
        where = f"layer {inner['name']!r} ({node['class_name']})"
    problem = _code_problem(node, inner)
    if problem is not None:
        return where, *problem
    return next(filter(None, (_code_in(value, where) for value in node.values())), None)


def _code_problem(node: dict[str, Any], inner: Any) -> tuple[str, bool] | None:
    class_name = node.get("class_name")
    if class_name == "__lambda__":
        return "a Python lambda stored as bytecode", True
    if class_name == "Lambda" and isinstance(inner, dict) and inner.get("function_type"):
        if inner["function_type"] == "lambda":  # the legacy .h5 format
            return "a Python lambda stored as bytecode", True
    module = node.get("module")
    if not isinstance(module, str) or not isinstance(class_name, str):
        return None
    if module.split(".")[0] in TRUSTED_PACKAGES:
        where = _not_installed(module.split(".")[0])
        return None if where is None else (f"module {module!r} {where}", False)
    if keras.saving.get_registered_object(node.get("registered_name") or class_name):
        return None  # code this process imported itself, not code from the file
    name = inner if class_name == "function" and isinstance(inner, str) else class_name
    kind = "function" if class_name == "function" else "class"
    return f"{kind} {name!r} from module {module!r}", False


def _not_installed(package: str) -> str | None:
    """Why importing `package` could run code that is not an installed distribution's (a
    folder of that name next to the model, say), or None when it is imported already or its
    import comes from the distribution that installed it."""
    if package in sys.modules or package == "builtins":
        return None
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return f"({package!r} is not installed)"
    origin = Path(spec.origin).resolve()
    for name in importlib.metadata.packages_distributions().get(package, []):
        dist = importlib.metadata.distribution(name)
        if any(Path(dist.locate_file(file)).resolve() == origin for file in dist.files or []):
            return None
    return f"(importing {package!r} would run {str(origin)!r}, which no installed package holds)"


def _saved_policies(config: Any) -> tuple[str | None, frozenset[str]]:
    """The model's own policy in a saved config, and the names of the layers following it.

    Keras saves each layer's policy; a layer built without `dtype=` shares the model's policy
    object, which Keras marks with one `shared_object_id` on every use but the first. A layer
    built with `dtype=` has an object of its own: no mark, or another one. The first use is a
    layer without a mark before the first marked one, with the same policy name; where that
    leaves several layers, all of them count as following. With no mark at all (one layer
    follows, or none), layers with the model's policy name follow.
    """
    model_entry = _policy_entry(config.get("dtype")) if isinstance(config, dict) else None
    entries = list(_layer_policies(config))
    marks = collections.Counter(mark for _, _, mark in entries if mark is not None)
    mark = model_entry[1] if model_entry and model_entry[1] is not None else None
    if mark is None and marks:
        mark = marks.most_common(1)[0][0]
    if mark is None:
        names = collections.Counter(policy for _, policy, _ in entries)
        policy = model_entry[0] if model_entry else (names.most_common(1) or [(None, 0)])[0][0]
        return policy, frozenset(name for name, p, _ in entries if p == policy)
    first = next((i for i, (_, _, m) in enumerate(entries) if m == mark), len(entries))
    policy = model_entry[0] if model_entry and model_entry[1] == mark else entries[first][1]
    follow = {name for name, _, m in entries if m == mark}
    follow |= {name for name, p, m in entries[:first] if m is None and p == policy}
    return policy, frozenset(follow)


def _layer_policies(node: Any) -> Iterator[tuple[str, str, Any]]:
    """`(layer name, policy name, shared_object_id or None)` of each saved layer, in order."""
    if isinstance(node, list):
        for item in node:
            yield from _layer_policies(item)
    elif isinstance(node, dict):
        inner = node.get("config")
        if isinstance(inner, dict) and "dtype" in inner and node.get("class_name") != "InputLayer":
            entry = _policy_entry(inner["dtype"])
            if entry is not None and isinstance(inner.get("name"), str):
                yield inner["name"], *entry
        for value in node.values():
            yield from _layer_policies(value)


def _policy_entry(dtype: Any) -> tuple[str, Any] | None:
    if isinstance(dtype, str):
        return dtype, None
    if isinstance(dtype, dict) and isinstance(dtype.get("config"), dict):
        name = dtype["config"].get("name")
        return (name, dtype.get("shared_object_id")) if isinstance(name, str) else None
    return None


@contextlib.contextmanager
def _global_policy(name: str | None) -> Iterator[None]:
    """Keras's global policy set to `name` inside the block (unchanged for None or a name
    Keras does not take), the previous one back after it (unset where it was unset)."""
    previous = global_policy()
    try:
        if name is not None:
            with contextlib.suppress(ValueError, TypeError):
                keras.config.set_dtype_policy(name)
        yield
    finally:
        restore_global_policy(previous)


def _compile(model: keras.Model, compile_config: dict[str, Any], wrapped: bool | None) -> None:
    """Compiles a loaded model from its saved compile config as Keras compiled it.

    Keras saves the optimizer passed to `compile`, not the `LossScaleOptimizer` it wrapped it
    in for a `mixed_float16` model (and not `auto_scale_loss`): a saved optimizer state
    without an inner optimizer means it was not wrapped.
    """
    if "legacy_optimizer" in compile_config:
        model.compile(optimizer=keras.optimizers.deserialize(compile_config["legacy_optimizer"]))
    elif type(model).compile_from_config is not keras.Model.compile_from_config:
        model.compile_from_config(compile_config)  # the class recompiles itself (tfmixprec's)
    else:
        # What Keras's own `compile_from_config` does, also for a class with its own
        # `compile` (a KerasHub task), which Keras skips with a warning: that task would keep
        # the default compile its constructor made, not the file's.
        config = keras.saving.deserialize_keras_object(compile_config)
        if wrapped is False:
            config["auto_scale_loss"] = False
        model.compile(**config)
