"""A Griffe extension for the API reference (mkdocs.yml): reads tfmixprec's docstrings as
they are written.

- The examples follow an `Example:` line, unindented, as doctest (`tests/test_docs.py` runs
  them). Markdown would read `>>>` as nested quotes and a line like `['probs']` as a link, so
  each run of doctest lines becomes a fenced `pycon` block.
- An `Args:` entry may name several arguments at once (`a, b, c: what they are`, the names
  possibly wrapped over two lines); Google style takes one name an entry, so it becomes one
  entry a name, each with the description.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_NAME = r"\*{0,2}[A-Za-z_]\w*"
_SEVERAL = re.compile(rf"^(\s*)({_NAME}(?:,\s*{_NAME})+):\s*(.*)$")


def fence_doctests(text: str) -> str:
    """`text` with each doctest example (a `>>>` line after a blank line, through the next
    blank line) inside a ```pycon fence at its indentation."""
    lines, out = text.splitlines(), []
    inside: str | None = None  # the open fence's indentation
    for index, line in enumerate(lines):
        stripped = line.lstrip()
        previous_blank = index == 0 or not lines[index - 1].strip()
        if inside is None and stripped.startswith(">>>") and previous_blank:
            inside = line[: len(line) - len(stripped)]
            out.append(f"{inside}```pycon")
        elif inside is not None and not stripped:
            out.append(f"{inside}```")
            inside = None
        out.append(line)
    if inside is not None:
        out.append(f"{inside}```")
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_shared_args(text: str) -> str:
    """`text` with each `Args:` entry that names several arguments repeated once a name."""
    lines, out, index, section = text.splitlines(), [], 0, None
    while index < len(lines):
        line = lines[index]
        index += 1
        if line.strip() and section is not None and _indent(line) <= section:
            section = None  # a line at the title's indentation ends the section
        if line.strip() in ("Args:", "Arguments:"):
            section = _indent(line)
        if section is None or _indent(line) != section + 4:
            out.append(line)
            continue
        # An entry whose names wrap: it ends with a comma and has no colon yet.
        while line.rstrip().endswith(",") and ":" not in line and index < len(lines):
            line = f"{line.rstrip()} {lines[index].strip()}"
            index += 1
        match = _SEVERAL.match(line)
        if match is None:
            out.append(line)
            continue
        body = []  # the entry's continuation lines: indented deeper than its names
        while index < len(lines) and lines[index].strip() and _indent(lines[index]) > section + 4:
            body.append(lines[index])
            index += 1
        for name in re.split(r",\s*", match.group(2)):
            out.extend([f"{match.group(1)}{name}: {match.group(3)}", *body])
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fences the doctest examples and splits shared `Args:` entries of every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_shared_args(fence_doctests(obj.docstring.value))
