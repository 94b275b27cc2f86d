"""Tests of the package as a whole: its public API and the shape of its modules."""

import ast
import importlib.metadata
import re
from pathlib import Path

import tfmixprec

PACKAGE = Path(tfmixprec.__file__).resolve().parent


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
