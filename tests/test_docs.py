"""The documentation runs: every code block of the README and of each page of the docs site
(docs/, see mkdocs.yml), in order, as a reader runs them (one session a page, like a
notebook), with every sample output compared to what the code prints; and every docstring
example of the package.

What a page may hold, so that nothing escapes a check:

- ```python blocks run, top to bottom, in one namespace per page (in a temporary folder).
- ```bash blocks: each command is checked without running it (`check_command`: the
  `tfmixprec` command's parser accepts it, a `python` script exists and takes the flags
  shown, an extra that `pip install` names exists, the test command is CI's) and the script
  passes `bash -n`.
- A ```text block right after one of those (blank lines between at most) is what it prints:
  the Python block's standard output, or the output of the `tfmixprec` command that ends the
  bash block (run in this process). `...` stands for any text (doctest's ELLIPSIS): where a
  number depends on the CPU, a version or the clock, the sample elides it.
- No other block: a fence without one of those languages fails the test.
"""

import contextlib
import dataclasses
import doctest
import importlib
import io
import os
import pkgutil
import re
import shlex
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# Pages with no samples of their own: the module map, and pages that include other files.
NOT_RUN = {"ARCHITECTURE.md"}
PAGES = [README, *sorted(p for p in DOCS.rglob("*.md") if p.name not in NOT_RUN)]


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: where it starts (1-based line), its language and its text
    (dedented, as inside a list item); `shown` is the ```text block right after it."""

    line: int
    lang: str
    source: str
    shown: str | None = None


_FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)


def fenced_blocks(text: str) -> list[tuple[int, int, int, str, str]]:
    """`(line, start, end, lang, source)` of every fenced block of a Markdown text."""
    found = []
    for match in _FENCE.finditer(text):
        indent = len(match.group(1))
        body = "".join(line[indent:] for line in match.group(3).splitlines(keepends=True))
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, match.start(), match.end(), match.group(2), body))
    return found


def page_blocks(path: Path) -> list[Block]:
    """The python and bash blocks of a page, each with the ```text block after it (if any).
    Raises AssertionError on a block no test checks."""
    text = path.read_text()
    blocks: list[Block] = []
    previous_end = None
    for line, start, end, lang, source in fenced_blocks(text):
        follows = previous_end is not None and not text[previous_end:start].strip()
        if lang == "text" and follows and blocks and blocks[-1].shown is None:
            blocks[-1] = dataclasses.replace(blocks[-1], shown=source)
        elif lang in ("python", "bash"):
            blocks.append(Block(line, lang, source))
        else:
            raise AssertionError(
                f"{path.name}, line {line}: a ```{lang} block that no test checks: use "
                "```python (it runs), ```bash (its commands are checked) or a ```text "
                "sample right after one of those"
            )
        previous_end = end
    return blocks


# ------------------------------------------------------------------------- shell commands


def _ci_test_command() -> list[str]:
    """The README's test command as `.ci/run` runs it, from `-m pytest` on."""
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^run_pytest \S+ (-m pytest -q -n 2[^\n]*)$", ci, re.M)
    assert match, ".ci/run no longer runs `python -m pytest -q -n 2 ...`"
    return match.group(1).split()


def _extras() -> set[str]:
    """The names in pyproject.toml's `[project.optional-dependencies]` (read without
    tomllib, which Python 3.10 lacks)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*=", section, re.M))


def _check_pip(words: list[str]) -> None:
    assert words[:1] == ["install"], words
    for spec in words[1:]:
        if spec.startswith("-"):
            continue
        match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec)
        assert match, f"pip install {spec}: the docs install this project only"
        missing = set((match.group(1) or "").split(",")) - {""} - _extras()
        assert not missing, f"pip install {spec}: no such extra {missing} in pyproject.toml"


def _check_python(words: list[str]) -> None:
    if words[:2] == ["-m", "pytest"]:
        assert words == _ci_test_command(), f"the test command differs from .ci/run's: {words}"
    elif words[:2] == ["-m", "tfmixprec"]:
        _parse_tfmixprec(words[2:])
    elif words[:2] == ["-m", "tensorboard.main"]:
        pass
    else:
        script = ROOT / words[0]
        assert script.suffix == ".py" and script.is_file(), f"python {words[0]}: no such script"
        source = script.read_text()
        for flag in (w.split("=")[0] for w in words[1:] if w.startswith("--")):
            assert f'"{flag}"' in source, f"python {words[0]}: it takes no {flag}"


def _parse_tfmixprec(words: list[str]) -> None:
    import _tfmixprec_args

    if "--help" in words or "-h" in words:
        return
    try:
        _tfmixprec_args.build_parser().parse_args(words)
    except SystemExit as err:
        raise AssertionError(f"tfmixprec {shlex.join(words)}: a usage error") from err


# Commands the docs show that belong to other tools: nothing of this project to check.
OTHER_TOOLS = {"tensorboard", "scontrol", "sed", "paste", "export", "cd", "mkdocs"}


def check_command(words: list[str]) -> None:
    """Checks one simple command of a bash block (see the module docstring)."""
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0], re.S):
        words = words[1:]  # VAR=value before the command
    if words[:1] == ["exec"]:
        words = words[1:]
    if not words:
        return
    name, rest = words[0], words[1:]
    if name == "tfmixprec":
        _parse_tfmixprec(rest)
    elif name in ("python", "python3"):
        _check_python(rest)
    elif name == "pip":
        _check_pip(rest)
    elif name == "bash" and rest[:1] == ["-c"]:
        check_script(rest[1])
    elif name.startswith(".ci/"):  # the project's own scripts (`.ci/nightly`)
        script = ROOT / name
        assert script.is_file() and os.access(script, os.X_OK), f"{name}: no such script"
        assert not rest, f"{name} takes no arguments (its settings are variables): {rest}"
    elif name == "srun":  # runs the command after its options on each node
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        check_command(rest)
    else:
        assert name in OTHER_TOOLS, f"a command the docs test does not know: {shlex.join(words)}"


def _without_comments(script: str) -> str:
    """`script` without its comments (a `#` that starts a word outside quotes, to the end of
    its line)."""
    out, quote, index = [], None, 0
    while index < len(script):
        char = script[index]
        if quote is None and char == "#" and (index == 0 or script[index - 1] in " \t\n"):
            end = script.find("\n", index)
            index = len(script) if end < 0 else end
            continue
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        out.append(char)
        index += 1
    return "".join(out)


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a script: split at `&&`, `||`, `;`, `|` and newlines, with
    comments and `$(...)` substitutions dropped (join `\\` line continuations first)."""
    lexer = shlex.shlex(_without_comments(script), posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace = " \t\r"  # newlines end a command: they come back as tokens
    lexer.wordchars += ":"  # in bash a word (`tfmixprec bench --model FILE.py:FUNCTION`)
    lexer.commenters = ""
    commands, words, depth, redirect = [], [], 0, False
    for token in lexer:
        if redirect:  # the file of `> file`
            redirect = False
        elif token in (">", ">>", "<", "&>"):
            redirect = True
        elif token == "(":
            depth += 1
        elif token == ")":
            depth -= 1
        elif depth:
            continue
        elif token in ("\n", "&&", "||", ";", "|", "&"):
            commands.append(words)
            words = []
        elif token != "\\\n" and not token.startswith("$"):
            words.append(token)
    commands.append(words)
    return [c for c in commands if c]


def check_script(script: str) -> None:
    """A bash block: bash's syntax check, then each command (`check_command`)."""
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    for words in shell_commands(script.replace("\\\n", " ")):
        check_command(words)


# Commands whose output depends on no file a page wrote: the README and docs/index.md both
# show `tfmixprec demo` (seconds of training) with a sample; both samples are compared with
# what one run of it printed in this process.
RUN_ONCE = {("tfmixprec", "demo")}
_printed_once: dict[tuple[str, ...], str] = {}


def run_tfmixprec(script: str) -> str:
    """What the last command of a bash block, a `tfmixprec` command, prints (run in this
    process, as the console script runs it; a command of `RUN_ONCE` once a process)."""
    from tfmixprec.tools import cli

    words = shell_commands(script.replace("\\\n", " "))[-1]
    assert words[0] == "tfmixprec", f"a sample output after a command other than tfmixprec: {words}"
    if tuple(words) in _printed_once:
        return _printed_once[tuple(words)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli.main(words[1:])
    if tuple(words) in RUN_ONCE:
        _printed_once[tuple(words)] = printed.getvalue()
    return printed.getvalue()


# ------------------------------------------------------------------------------ the pages


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_block_is_checked():
    names = {_name(p) for p in PAGES}
    assert "README.md" in names and "docs/index.md" in names
    assert len([n for n in names if n.startswith("docs/guides/")]) == 10
    for path in PAGES:  # every block is one that a test checks
        page_blocks(path)


def test_python_blocks_read_as_written_not_as_a_formatter_wrapped_them():
    """A comment too long for its line goes above the code: a formatter otherwise splits the
    call around it (`set_policy(\n    "auto"\n)  # ...`)."""
    for path in PAGES:
        for block in page_blocks(path):
            if block.lang != "python":
                continue
            for number, line in enumerate(block.source.splitlines()):
                assert not re.match(r"\s*[)\]}]+,?\s+#", line), (
                    f"{_name(path)}, line {block.line + 1 + number}: {line.strip()!r}"
                )


def test_pages_show_code_and_outputs():
    """Each guide shows code that runs and at least one output it prints."""
    for path in PAGES:
        blocks = page_blocks(path)
        if path.parent.name == "guides" or path in (README, DOCS / "index.md"):
            assert any(b.lang == "python" for b in blocks), _name(path)
            assert any(b.shown for b in blocks), _name(path)


def run_page(page: str) -> None:
    """Runs a page's blocks in order in the current folder (see the module docstring);
    raises AssertionError at the first block that fails or prints something else than its
    sample."""
    namespace = {"__name__": "__docs__"}
    checker = doctest.OutputChecker()
    for block in page_blocks(ROOT / page):
        where = f"{page}, block at line {block.line}"
        if block.lang == "bash":
            check_script(block.source)
            printed = run_tfmixprec(block.source) if block.shown is not None else ""
        else:
            code = compile(block.source, where, "exec")
            output = io.StringIO()
            with contextlib.redirect_stdout(output):
                try:
                    exec(code, namespace)
                except Exception as err:
                    raise AssertionError(f"{where} failed: {err!r}") from err
            printed = output.getvalue()
        if block.shown is not None:
            assert checker.check_output(block.shown, printed, doctest.ELLIPSIS), (
                f"{where} printed:\n{printed}"
            )


def needs_own_process(page: str) -> bool:
    """A page that creates a `MultiWorkerMirroredStrategy` runs in a Python process of its
    own, as its script would: the strategy configures collective ops for the whole process
    (a `MirroredStrategy` made after it in the same process fails)."""
    blocks = page_blocks(ROOT / page)
    return any("MultiWorkerMirroredStrategy(" in b.source for b in blocks if b.lang == "python")


@pytest.mark.parametrize("page", [_name(p) for p in PAGES])
def test_page_blocks_run_in_order(page, tmp_path, monkeypatch):
    """A page's Python blocks, top to bottom in one namespace: each defines what it uses or
    uses what an earlier block of the page defined, and prints what the ```text block after
    it shows; its bash blocks' commands are checked, and a `tfmixprec` command with a sample
    output is run. Files they write (TensorBoard runs, saved models) go to a temporary
    folder."""
    monkeypatch.chdir(tmp_path)
    if not needs_own_process(page):
        run_page(page)
        return
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = subprocess.run(
        [sys.executable, __file__, page], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{page} in its own process:\n{result.stderr[-6000:]}"


def test_shell_commands_are_split_as_bash_runs_them():
    script = (
        'pip install . && tfmixprec demo  # trains\nA=1 python x.py --out "a b" \\\n  --n 2'
        "\nw=$(scontrol x | sed y) && tfmixprec doctor --json > out.json"
    )
    assert shell_commands(script.replace("\\\n", " ")) == [
        ["pip", "install", "."],
        ["tfmixprec", "demo"],
        ["A=1", "python", "x.py", "--out", "a b", "--n", "2"],
        ["w="],
        ["tfmixprec", "doctor", "--json"],
    ]
    with pytest.raises(AssertionError, match="usage error"):
        check_command(["tfmixprec", "demo", "--policy", "float8"])
    with pytest.raises(AssertionError, match="no such extra"):
        check_command(["pip", "install", ".[nothing]"])
    with pytest.raises(AssertionError, match="takes no --nothing"):
        check_command(["python", "examples/multi_worker.py", "--nothing"])


# ----------------------------------------------------------------------------- docstrings


def _docstring_tests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = {}
    for info in pkgutil.walk_packages(tfmixprec.__path__, "tfmixprec."):
        if info.name == "tfmixprec.__main__":  # importing it runs the command
            continue
        module = importlib.import_module(info.name)
        for test in finder.find(module, info.name):
            if test.examples:
                found[test.name] = test
    return found


DOCSTRING_TESTS = _docstring_tests()


class _Checker(doctest.OutputChecker):
    """An example that shows no output may print anything (a progress bar, a `History`); one
    that shows output must match it."""

    def check_output(self, want, got, optionflags):
        return not want or super().check_output(want, got, optionflags)


def _context():
    """The names docstring examples use without defining: data, a compiled float32 model
    (784 -> 16 -> 10, mean squared error), a fresh optimizer, a loss, a dataset, gradients."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.random((128, 784), dtype=np.float32)
    y = rng.random((128, 10), dtype=np.float32)

    def build_model():
        inputs = keras.Input((784,))
        hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        outputs = keras.layers.Dense(10, dtype="float32", name="out")(hidden)
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse", jit_compile=False)
        return model

    return {
        "tfmixprec": tfmixprec,
        "keras": keras,
        "tf": tf,
        "np": np,
        "x": x,
        "y": y,
        "build_model": build_model,
        "model": build_model(),
        "opt": tfmixprec.LossScaleOptimizer(keras.optimizers.Adam()),
        "loss_fn": keras.losses.MeanSquaredError(),
        "dataset": tf.data.Dataset.from_tensor_slices((x, y)).batch(32),
        "grads": [tf.ones((784, 16)), tf.ones((16,))],
    }


def test_docstring_examples_are_collected():
    assert len(DOCSTRING_TESTS) >= 23
    assert "tfmixprec.scaling.optimizer.LossScaleOptimizer" in DOCSTRING_TESTS


@pytest.mark.parametrize("name", sorted(DOCSTRING_TESTS))
def test_docstring_example_runs(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write (TensorBoard) write here
    test = DOCSTRING_TESTS[name]
    test.globs = _context()
    runner = doctest.DocTestRunner(checker=_Checker(), optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        result = runner.run(test, out=report.write, clear_globs=True)
    assert result.failed == 0, report.getvalue()


if __name__ == "__main__":  # one page in this process (see needs_own_process)
    run_page(sys.argv[1])
