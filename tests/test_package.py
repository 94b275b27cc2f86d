"""Tests of the package as a whole: its public API and the shape of its modules."""

import ast
import importlib.metadata
import re
from pathlib import Path

import tfmixprec

PACKAGE = Path(tfmixprec.__file__).resolve().parent
ENTRY = PACKAGE.parent / "_tfmixprec_cli.py"  # the console script's module, outside the package
ARGS = PACKAGE.parent / "_tfmixprec_args.py"  # its parser and start-up, read by tfmixprec.cli too
MAX_FUNCTION_LINES = 40  # docstrings not counted
MAX_MODULE_LINES = 600
# Modules longer than MAX_MODULE_LINES, each with the one concern it holds: a long module is
# allowed only for a concern that does not split (a module that mixes concerns is split).
ONE_LONG_CONCERN = {
    "optimizer": "the optimizer class Keras sees: knobs, state variables, step, saving",
    "loss_scale": "the loss-scale state machine: config, state, transition, scale and check",
    "bench": "timing one model under each policy, side by side in one process",
}
# Long modules that mix concerns, listed until the restructuring of issue 38 splits them.
TO_SPLIT = {"_keras_compat", "audit", "calibration", "diagnosis", "float8"}


def test_public_api_names_import():
    for name in set(tfmixprec.__all__) - {"__version__"}:
        value = getattr(tfmixprec, name)
        module = getattr(value, "__module__", None) or getattr(value, "__name__", "")
        assert module.startswith("tfmixprec"), (name, module)
    assert len(set(tfmixprec.__all__)) == len(tfmixprec.__all__)
    assert re.fullmatch(r"\d+\.\d+\.\d+", tfmixprec.__version__)
    assert tfmixprec.__version__ == importlib.metadata.version("tfmixprec")


def _modules():
    return {path.stem: ast.parse(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}


def _declared_all(tree):
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == "__all__" for t in targets):
                return ast.literal_eval(node.value)
    return None


def test_private_modules_export_nothing():
    """A private module's names are shared inside the package, never exported: its `__all__`
    is empty (a `from tfmixprec._x import *` gives nothing)."""
    exporting = {
        name: _declared_all(tree)
        for name, tree in _modules().items()
        if name.startswith("_") and not name.startswith("__") and name != "_version"
    }
    assert {name: names for name, names in exporting.items() if names != []} == {}


def test_every_module_exports_only_what_the_package_exports():
    exported = set(tfmixprec.__all__)
    for name, tree in _modules().items():
        if name.startswith("_") or name in (
            "cpu_bfloat16",
            "float8",
            "cpu_float16",
            "datasets",
            "testing",
            "zoo",
        ):
            continue
        listed = set(_declared_all(tree) or ())
        assert listed <= exported, (name, sorted(listed - exported))


def _imports(tree):
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tfmixprec"):
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:  # `from tfmixprec import cpu_float16`
                found.update(alias.name for alias in node.names)
    return found


def test_no_module_imports_another_modules_underscore_names():
    """A name two modules share is public inside its (private) module: `from tfmixprec.x
    import _y` and `x._y` of another tfmixprec module are not used (dunders aside)."""
    modules = _modules()
    found = []
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfmixprec"):
                found += [f"{name}: {a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                # _keras_compat reads Keras's private attributes, of objects whose variable
                # names (`optimizer`) can match a module's.
                if name != "_keras_compat" and node.value.id in modules and _private(node.attr):
                    found.append(f"{name}: {node.value.id}.{node.attr}")
    assert found == []


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(tree) & set(modules) - {name} for name, tree in modules.items()}
    graph.pop("__init__")
    for edges in graph.values():
        edges.discard("__init__")

    def reach(start, node, seen):
        for nxt in graph.get(node, ()):
            assert nxt != start, f"import circle through {start} and {node}"
            if nxt not in seen:
                seen.add(nxt)
                reach(start, nxt, seen)

    for name in graph:
        reach(name, name, set())


def _body_lines(node):
    body = node.body
    first = body[0] if body else None
    value = getattr(first, "value", None)
    docstring = isinstance(first, ast.Expr) and isinstance(value, ast.Constant)
    doc = (first.end_lineno - first.lineno + 1) if docstring else 0
    return node.end_lineno - node.lineno + 1 - doc


def test_functions_stay_small():
    too_big = []
    modules = dict(_modules(), _tfmixprec_cli=ast.parse(ENTRY.read_text()))
    modules["_tfmixprec_args"] = ast.parse(ARGS.read_text())
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _body_lines(node) > MAX_FUNCTION_LINES:
                    too_big.append(f"{name}.{node.name}: {_body_lines(node)} lines")
    assert too_big == []


def test_one_concern_per_module():
    """A module over MAX_MODULE_LINES holds one concern that does not split, named in
    ONE_LONG_CONCERN; the long modules that mix concerns are in TO_SPLIT until split."""
    lengths = {p.stem: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    long = {name for name, lines in lengths.items() if lines > MAX_MODULE_LINES}
    assert long - set(ONE_LONG_CONCERN) - TO_SPLIT == set(), {n: lengths[n] for n in long}
    # A listed module that is short again, or split away, comes off its list.
    assert (set(ONE_LONG_CONCERN) | TO_SPLIT) - long == set()


ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
OUTSIDE_LAYERS = {"__init__", "__main__", "_version"}


def _architecture_table():
    """`{module: (layer, [imports])}` from the module table in docs/ARCHITECTURE.md."""
    rows = {}
    row = re.compile(r"^\| `(\w+)\.py` \| (\d+) \| .* \| (.*) \|$")
    for line in ARCHITECTURE.read_text().splitlines():
        match = row.match(line)
        if match:
            imports = re.findall(r"`(\w+)`", match.group(3))
            rows[match.group(1)] = (int(match.group(2)), sorted(imports))
    return rows


def test_architecture_doc_matches_the_imports():
    table = _architecture_table()
    modules = _modules()
    assert sorted(table) == sorted(set(modules) - OUTSIDE_LAYERS)
    for name, (layer, listed) in table.items():
        actual = sorted(_imports(modules[name]) & set(modules) - {name, "__init__"})
        assert listed == actual, (name, listed, actual)
        for imported in actual:
            assert table[imported][0] < layer, f"{name} (layer {layer}) imports {imported}"


def _module_level_imports(tree):
    """Top names of the imports that run when the module is imported (not those in functions)."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # its imports run only when it is called
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_the_command_entry_imports_no_tensorflow_at_module_level():
    """`tfmixprec --help` must answer before TensorFlow loads (docs/ARCHITECTURE.md)."""
    for path in (ENTRY, ARGS):
        imported = _module_level_imports(ast.parse(path.read_text()))
        assert imported & {"tensorflow", "keras", "tfmixprec", "numpy"} == set(), imported
    lazily = _module_level_imports(ast.parse("def f():\n    import tensorflow\n"))
    assert lazily == set()  # the check itself: a function's imports are not module level
    assert "_tfmixprec_cli:main" in (PACKAGE.parent / "pyproject.toml").read_text()


def _every_import(tree):
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_command_modules_import_one_way():
    """The console script reads the parser and `tfmixprec.cli`; `tfmixprec.cli` reads the
    parser; the parser reads neither, at any level (no circle, lazy imports included)."""
    parser = _every_import(ast.parse(ARGS.read_text()))
    assert {m.split(".")[0] for m in parser} & {"tfmixprec", "_tfmixprec_cli"} == set()
    package = set().union(*(_every_import(tree) for tree in _modules().values()))
    assert "_tfmixprec_cli" not in package
    assert "_tfmixprec_args" in _every_import(_modules()["cli"])
    assert {"_tfmixprec_args", "tfmixprec"} <= _every_import(ast.parse(ENTRY.read_text()))
