"""The docs site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, its nav holds
every page, its API reference names every public name, and the README, its front page, links
to pages that exist. The pages' code blocks run in tests/test_docs.py."""

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tfmixprec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The pages other places link to by path (the code's warnings among them): they must exist.
GUIDES = (
    "fit-and-callbacks",
    "custom-loops",
    "tensorboard",
    "why-overflow",
    "float16-on-cpus",
    "distributed",
    "audit-in-ci",
)


def _mkdocs_or_skip() -> None:
    """Skips without mkdocs, except in CI (`CI_DOCS=1`, set by .ci/run), where it fails."""
    if importlib.util.find_spec("mkdocs") is not None:
        return
    message = 'mkdocs is not installed: pip install ".[docs]"'
    if os.environ.get("CI_DOCS") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`mkdocs build --strict` into a temporary folder, once for this file: the folder and the
    finished process."""
    _mkdocs_or_skip()
    site = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return site, result


def test_mkdocs_build_strict(built_site):
    """`mkdocs build --strict` (any warning fails it), into a temporary folder; every page of
    the nav is built and the API reference holds every public name."""
    site, result = built_site
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    # The docs extra's formatter (ruff) is installed with mkdocstrings: signatures formatted.
    assert "Formatting signatures requires" not in result.stderr, result.stderr
    assert 'href="../stylesheets/extra.css"' in (site / "reference" / "index.html").read_text()
    for page in ("", "benchmarks/", "reference/", "ARCHITECTURE/", "changelog/"):
        assert (site / page / "index.html").is_file(), page
    for guide in GUIDES:
        assert (site / "guides" / guide / "index.html").is_file(), guide
    reference = (site / "reference" / "index.html").read_text()
    for path in _reference_paths():
        assert f'id="{path}"' in reference, path
    # The comparison table comes from the README (pymdownx.snippets), the figures from
    # benchmarks/RESULTS.md: included, not a link.
    assert "Keras 3 <code>LossScaleOptimizer</code>" in (site / "index.html").read_text()
    assert "Benchmark results" in (site / "benchmarks" / "index.html").read_text()


def test_the_docs_extra_installs_a_signature_formatter():
    """mkdocstrings formats signatures with Black or Ruff only: the docs extra holds one."""
    text = (ROOT / "pyproject.toml").read_text()
    docs = text.split("\ndocs = [\n", 1)[1].split("\n]", 1)[0]
    assert re.search(r'^\s*"(ruff|black)\b', docs, re.M), docs


def test_code_blocks_wrap_long_lines_instead_of_scrolling():
    """The site's CSS (mkdocs.yml's extra_css) wraps code lines longer than the column: the
    docs' 100-character lines kept their end-of-line comments behind a scrollbar."""
    text = (ROOT / "mkdocs.yml").read_text()
    assert "extra_css:\n  - stylesheets/extra.css\n" in text
    css = (DOCS / "stylesheets" / "extra.css").read_text()
    assert re.search(r"\.md-typeset pre > code \{[^}]*white-space: pre-wrap;", css)


def _nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    return re.findall(r":\s*(\S+\.md)\s*$", nav, re.M)


def test_nav_holds_every_page():
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert sorted(_nav_pages()) == sorted(pages)
    assert {f"guides/{guide}.md" for guide in GUIDES} <= pages
    assert {"index.md", "reference.md", "benchmarks.md", "ARCHITECTURE.md"} <= pages


def _reference_paths() -> list[str]:
    """The objects of the `::: path` blocks of docs/reference.md."""
    return re.findall(r"^::: (\S+)\s*$", (DOCS / "reference.md").read_text(), re.M)


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:  # a module of the package: tfmixprec.zoo
        return importlib.import_module(path)


def test_reference_names_every_public_name():
    """One `::: path` block for each name of `tfmixprec.__all__` (the public modules
    cpu_float16, datasets, testing and zoo among them), and nothing else. A function that
    shares its module's name (`tfmixprec.audit`) is named by its module's path
    (`tfmixprec.audit.audit`), which is what the docs tools resolve."""
    paths = _reference_paths()
    assert len(paths) == len(set(paths))
    documented = [_resolve(path) for path in paths]
    public = [getattr(tfmixprec, name) for name in tfmixprec.__all__]
    # An old name of a type (`Float8Quantized`, 0.4.0's) is the type itself: one block.
    assert len(documented) == len({id(value) for value in public})
    for name, value in zip(tfmixprec.__all__, public):
        assert any(value is d for d in documented), f"tfmixprec.{name} is not in reference.md"
    for module in ("cpu_float16", "datasets", "testing", "zoo"):
        assert f"tfmixprec.{module}" in paths


def test_readme_is_the_front_page():
    """At most ~250 lines; the two commands, the test command as .ci/run runs it; every
    relative link points to a file that exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "pip install . && tfmixprec demo" in readme
    assert 'pip install ".[test]" && python -m pytest -q -n 2 --dist loadfile' in readme
    assert "-m pytest -q -n 2 --dist loadfile" in (ROOT / ".ci" / "run").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert {f"docs/guides/{guide}.md" for guide in GUIDES} <= set(local)
    for link in local:
        assert (ROOT / link).exists(), link


def test_ci_builds_the_docs():
    """.ci/run installs the docs extra and runs `mkdocs build --strict` with CI_DOCS=1."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert '".[test,dev,docs]"' in ci
    assert re.search(r"^export CI_DOCS=1\b", ci, re.M)
    assert re.search(r'mkdocs" build --strict --site-dir "\$SITE"', ci)
    assert "docs = [" in (ROOT / "pyproject.toml").read_text()


# What Keras calls on a subclass (building, config, saving, callback hooks) is left out of the
# API reference; an override a user calls is shown, each with why.
USER_OVERRIDES = {
    "apply": "a GradientTape loop passes its gradients to it",
    "compile": "takes tfmixprec's optimizer and loss-scale arguments",
    "scale_loss": "a GradientTape loop scales its loss with it (Keras 3's name)",
    "fit": "adds the epoch's overflow count to the logs",
    "train_step": "a custom train_step calls it through super()",
}


def _reference_objects(site: Path) -> dict[str, tuple[object, object]]:
    """Each object the built API reference shows, by its id: (its owner, the object)."""
    html = (site / "reference" / "index.html").read_text()
    shown = {}
    for path in dict.fromkeys(re.findall(r'id="(tfmixprec(?:\.\w+)+)"', html)):
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
            try:
                owner = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        value, owner_of_value = owner, None
        for part in parts[cut:]:
            owner_of_value = value
            value = inspect.getattr_static(value, part)
        shown[path] = (owner_of_value, value)
    return shown


def test_reference_leaves_out_keras_plumbing(built_site):
    """No member the API reference shows is one Keras defines on the base class (what Keras
    calls: `build`, `get_config`, `finalize_variable_values`, `save_own_variables`, callback
    hooks), except an override a user calls (USER_OVERRIDES); nor the state the step keeps
    for itself (`hysteresis_tracker`)."""
    import keras

    bases = [keras.optimizers.Optimizer, keras.layers.Layer, keras.callbacks.Callback]
    shown = _reference_objects(built_site[0])
    plumbing = [
        path
        for path, (owner, _) in shown.items()
        if inspect.isclass(owner)
        and any(hasattr(base, path.rpartition(".")[2]) for base in bases if issubclass(owner, base))
        and path.rpartition(".")[2] not in USER_OVERRIDES
    ]
    assert plumbing == []
    assert "tfmixprec.LossScaleOptimizer.hysteresis_tracker" not in shown
    assert "tfmixprec.LossScaleOptimizer.scale_loss" in shown


def test_reference_signatures_name_their_return_types(built_site):
    """Every function, method and property the API reference shows says what it returns, and
    not `Any`."""
    untyped = []
    for path, (_, value) in _reference_objects(built_site[0]).items():
        function = value.fget if isinstance(value, property) else value
        function = getattr(function, "__func__", function)  # classmethod, staticmethod
        if not inspect.isfunction(function):
            continue
        returns = inspect.signature(function).return_annotation
        if returns is inspect.Signature.empty or str(returns) in ("Any", "typing.Any"):
            untyped.append(path)
    assert untyped == [], "\n".join(untyped)
