"""Text the reports share: markdown tables (audit, overflow report, diagnosis), their JSON
form, and the links to the docs pages that warnings end with."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__: list[str] = []  # private module: nothing here is part of the package's API


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """The lines of a markdown table: the header, its rule, then one line a row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def docs_page(page: str) -> str:
    """The link a warning ends with: `See docs/<page>.md.` (the page in the repository's docs
    folder, which the docs site is built from)."""
    return f"See docs/{page}.md."


def jsonable(value: Any) -> Any:
    """`value` (dicts, lists and tuples of plain values) ready for JSON: tuples as lists,
    `inf`/`nan` as strings (the reports' `to_dict()`)."""
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
