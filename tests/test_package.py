"""Tests of the package as a whole: its public API and the shape of its modules."""

import ast
import importlib.metadata
import re
from pathlib import Path

import tfmixprec

PACKAGE = Path(tfmixprec.__file__).resolve().parent
ENTRY = PACKAGE.parent / "_tfmixprec_cli.py"  # the console script's module, outside the package
ARGS = PACKAGE.parent / "_tfmixprec_args.py"  # its parser, read by tools.cli too
MAX_FUNCTION_LINES = 40  # docstrings not counted
# Every module, with no exceptions: a module that grows past it holds more than one concern and
# is split by concern (docs/ARCHITECTURE.md, "Small functions, one concern per module").
MAX_MODULE_LINES = 700
# The folders, lowest first: a module imports only from its own folder or a lower one.
FOLDERS = ("_keras", "_common", "scaling", "precision", "replay", "fit", "checks", "tools")
PRIVATE_FOLDERS = {"_keras", "_common"}
OUTSIDE = {"__init__", "__main__", "_version", "_moved"}  # the package's own files, on top
# Modules whose API is the module itself (`tfmixprec.cpu_float16.status()`): their names may
# repeat another module's, and their `__all__` need not be the package's.
MODULE_APIS = {
    "precision.cpu_bfloat16",
    "precision.cpu_float16",
    "precision.float8",
    "tools.datasets",
    "tools.testing",
    "tools.zoo",
}


def test_public_api_names_import():
    for name in set(tfmixprec.__all__) - {"__version__"}:
        value = getattr(tfmixprec, name)
        module = getattr(value, "__module__", None) or getattr(value, "__name__", "")
        assert module.startswith("tfmixprec"), (name, module)
    assert len(set(tfmixprec.__all__)) == len(tfmixprec.__all__)
    assert re.fullmatch(r"\d+\.\d+\.\d+", tfmixprec.__version__)
    assert tfmixprec.__version__ == importlib.metadata.version("tfmixprec")


def _modules():
    """{key: tree}: every module of the package by its dotted path inside it
    (`scaling.loss_scale`; a subpackage's `__init__` by the folder's name, `scaling`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if len(parts) > 1 and parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = ast.parse(path.read_text())
    return found


def _folder(key):
    return key.split(".")[0] if "." in key or key in FOLDERS else None


def _declared_all(tree):
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == "__all__" for t in targets):
                return ast.literal_eval(node.value)
    return None


def test_every_module_sits_in_a_folder_of_the_layout():
    modules = _modules()
    loose = {key for key in modules if _folder(key) is None} - OUTSIDE
    assert loose == set()
    assert {_folder(key) for key in modules} - {None} == set(FOLDERS)


def test_private_modules_export_nothing():
    """A private module's names are shared inside the package, never exported: its `__all__`
    is empty (a `from tfmixprec._common.x import *` gives nothing)."""
    exporting = {
        key: _declared_all(tree)
        for key, tree in _modules().items()
        if _folder(key) in PRIVATE_FOLDERS or key == "_moved"
    }
    assert {key: names for key, names in exporting.items() if names != []} == {}


def test_every_module_exports_only_what_the_package_exports():
    exported = set(tfmixprec.__all__)
    for key, tree in _modules().items():
        if _folder(key) in PRIVATE_FOLDERS or key in MODULE_APIS or key in OUTSIDE | set(FOLDERS):
            continue  # a folder's `__init__` lists its modules' (the next test)
        listed = set(_declared_all(tree) or ()) - {name.split(".")[-1] for name in MODULE_APIS}
        assert listed <= exported, (key, sorted(listed - exported))


def test_each_public_folder_lists_what_its_modules_offer():
    """A public folder's `__init__` imports and lists each of its modules' `__all__` (a module
    whose API is the module itself, by the module's name), as optax's `transforms` does."""
    modules = _modules()
    for folder in set(FOLDERS) - PRIVATE_FOLDERS:
        offered = []
        for key in sorted(k for k in modules if k.startswith(f"{folder}.")):
            if key in MODULE_APIS:
                offered.append(key.split(".")[1])
            if key not in MODULE_APIS or key == "precision.float8":
                offered += _declared_all(modules[key]) or []
        assert sorted(_declared_all(modules[folder])) == sorted(offered), folder
        package = importlib.import_module(f"tfmixprec.{folder}")
        assert all(hasattr(package, name) for name in offered), folder


def _package_imports(tree):
    """`(alias, base, inner)` for each name a module imports from the package, at any level:
    `base` the module or folder it names (`""`: the package), `inner` the name as a key."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfmixprec"):
            base = node.module.split(".", 1)[1] if "." in node.module else ""
            for alias in node.names:
                yield alias, base, f"{base}.{alias.name}" if base else alias.name


def _imports(tree, modules):
    """The modules of the package a module imports (by key; a folder's `__init__` by the
    folder's name), at any level."""
    return {
        inner if inner in modules else (base or "__init__")
        for _, base, inner in _package_imports(tree)
    }


def test_no_import_runs_back_up_the_folders():
    modules = _modules()
    back_up = []
    for key, tree in modules.items():
        if _folder(key) is None:
            continue  # the package's own files import from every folder
        for imported in _imports(tree, modules):
            here, there = FOLDERS.index(_folder(key)), FOLDERS.index(_folder(imported) or "tools")
            if there > here or imported in OUTSIDE:
                back_up.append(f"{key} imports {imported}")
    assert back_up == []


def test_no_underscore_name_crosses_a_module():
    """A name two modules share has no leading underscore: `from tfmixprec.x.y import _z` is
    not used, nor `y._z` of an imported module (dunders aside); and no module outside the
    private folders is imported across folders under an underscore name."""
    modules = _modules()
    found = []
    for key, tree in modules.items():
        bound = {}  # names of imported package modules in this module
        for alias, _, inner in _package_imports(tree):
            if _private(alias.name):
                found.append(f"{key}: {alias.name}")
            if inner in modules:
                bound[alias.asname or alias.name] = inner
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in bound and _private(node.attr):
                    found.append(f"{key}: {node.value.id}.{node.attr}")
    assert found == []


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _module_level_graph(modules):
    graph = {}
    for key, tree in modules.items():
        top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        graph[key] = _imports(ast.Module(body=top, type_ignores=[]), modules) - {key}
    return graph


def test_no_import_circle():
    """No module reaches itself through the imports that run when it is imported (the
    package's `__init__` and a folder's `__init__` list their modules, so they are left out
    as targets: a module imports from the module that defines a name)."""
    modules = _modules()
    inits = {key for key in modules if key in FOLDERS} | OUTSIDE
    graph = {k: v - inits for k, v in _module_level_graph(modules).items() if k not in inits}

    def reach(start, node, seen):
        for nxt in graph.get(node, ()):
            assert nxt != start, f"import circle through {start} and {node}"
            if nxt not in seen:
                seen.add(nxt)
                reach(start, nxt, seen)

    for key in graph:
        reach(key, key, set())


def test_modules_import_a_name_from_the_module_that_defines_it():
    """Inside the package, nothing imports from a folder's `__init__` or the package's: those
    list what is offered outside."""
    modules = _modules()
    inits = {key for key in modules if key in FOLDERS} | {"__init__"}
    leaning = {
        key: sorted(_imports(tree, modules) & inits)
        for key, tree in modules.items()
        if key not in inits | OUTSIDE
    }
    assert {key: names for key, names in leaning.items() if names} == {}


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


def test_every_module_stays_within_the_line_limit():
    """No module of the package is over MAX_MODULE_LINES lines, and none is excepted."""
    lengths = {}
    for path in PACKAGE.rglob("*.py"):
        key = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        lengths[key] = len(path.read_text().splitlines())
    assert {key: n for key, n in lengths.items() if n > MAX_MODULE_LINES} == {}


ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"


def _architecture_table():
    """`{module: (layer, [imports])}` from the module table in docs/ARCHITECTURE.md (a module
    written as its path, `scaling/loss_scale.py`; its imports as `scaling/optimizer`)."""
    rows = {}
    row = re.compile(r"^\| `([\w/]+)\.py` \| (\d+) \| .* \| (.*) \|$")
    for line in ARCHITECTURE.read_text().splitlines():
        match = row.match(line)
        if match:
            imports = re.findall(r"`([\w/]+)`", match.group(3))
            key = match.group(1).replace("/", ".")
            rows[key] = (int(match.group(2)), sorted(i.replace("/", ".") for i in imports))
    return rows


def test_architecture_doc_matches_the_imports():
    """Every module of the folders has a row; its imports are the row's, each on a lower
    layer (private modules included)."""
    table = _architecture_table()
    modules = _modules()
    laid_out = {key for key in modules if "." in key}  # the folders' modules, not `__init__`s
    assert sorted(table) == sorted(laid_out)
    for name, (layer, listed) in table.items():
        actual = sorted(_imports(modules[name], modules) - {name})
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
    """The console script reads the parser and `tfmixprec.tools.cli`, which reads the
    parser; the parser reads neither, at any level (no circle, lazy imports included)."""
    parser = _every_import(ast.parse(ARGS.read_text()))
    assert {m.split(".")[0] for m in parser} & {"tfmixprec", "_tfmixprec_cli"} == set()
    package = set().union(*(_every_import(tree) for tree in _modules().values()))
    assert "_tfmixprec_cli" not in package
    assert "_tfmixprec_args" in _every_import(_modules()["tools.cli"])
    assert {"_tfmixprec_args", "tfmixprec.tools"} <= _every_import(ast.parse(ENTRY.read_text()))


BOARD = PACKAGE.parent / "_tfmixprec_board"  # the "Mixed precision" tab, outside the package


def test_the_tab_imports_no_tfmixprec_and_tfmixprec_reads_its_names():
    """TensorBoard imports the tab's plugin in its own process: TensorBoard only, never
    tfmixprec, TensorFlow or Keras (at any level). The writer reads the names it shares."""
    for path in sorted(BOARD.glob("*.py")):
        imported = {name.split(".")[0] for name in _every_import(ast.parse(path.read_text()))}
        assert imported & {"tfmixprec", "tensorflow", "keras", "numpy"} == set(), path.name
    readers = {
        name for name, tree in _modules().items() if "_tfmixprec_board" in _every_import(tree)
    }
    assert readers == {"fit.board_events", "fit.layout", "fit.tensorboard"}
    entry = importlib.metadata.entry_points(group="tensorboard_plugins")
    assert [e.value for e in entry if e.name == "tfmixprec"] == [
        "_tfmixprec_board.plugin:MixedPrecisionPlugin"
    ]


def test_every_folder_that_ships_is_a_listed_package():
    """setuptools ships the folders of `packages` only; a folder with files and no
    `__init__.py` (the demo's digits, the tab's static files) is still a package to it, and one
    left out of the list is shipped with a warning that it "would be ignored"."""
    import tomllib

    root = Path(__file__).resolve().parent.parent  # the repository, with its pyproject.toml
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        ".".join(folder.relative_to(root).parts)
        for top in (root / "tfmixprec", root / "_tfmixprec_board")
        for folder in [top, *top.rglob("*")]
        if folder.is_dir()
        and folder.name != "__pycache__"
        and any(entry.is_file() for entry in folder.iterdir())
    }
    assert sorted(folders) == sorted(config["packages"])
    data = {
        name for name in folders if not (root.joinpath(*name.split("."), "__init__.py")).exists()
    }
    assert data == {"tfmixprec.tools.data", "_tfmixprec_board.static"}
    assert data <= set(config["package-data"])
