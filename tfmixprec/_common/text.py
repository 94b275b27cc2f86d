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


# The title (the H1) of each guide a warning may name. A pip install has no docs folder, so
# a warning names the guide by its title as well as by its path in the repository (the docs
# site, built from that folder, has no address of its own yet). tests/test_warnings.py checks
# each title against its page.
GUIDE_TITLES = {
    "guides/audit-in-ci": "The audit in CI",
    "guides/bfloat16-on-cpus": "bfloat16 on CPUs",
    "guides/custom-loops": "Custom loops and the TF-2 API",
    "guides/distributed": "Several replicas and workers",
    "guides/fit-and-callbacks": "Fit and callbacks",
    "guides/float16-on-cpus": "float16 on CPUs",
    "guides/float8": "float8",
    "guides/repair": "When float16 overflows: repair it",
    "guides/tensorboard": "The TensorBoard dashboard",
    "guides/why-overflow": "Why a step overflowed",
}


def first_few(names: Sequence[str], most: int = 3) -> str:
    """The first `most` of `names`, comma-separated, with `, ...` when there are more (the
    layers a finding names)."""
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def docs_page(page: str) -> str:
    """The sentence a warning ends with: the guide's title and its path in the repository,
    `See the tfmixprec guide "Fit and callbacks" (docs/guides/fit-and-callbacks.md in the
    tfmixprec repository).`"""
    if page not in GUIDE_TITLES:
        raise ValueError(f"page must be one of {sorted(GUIDE_TITLES)}. Received: page={page!r}")
    return (
        f'See the tfmixprec guide "{GUIDE_TITLES[page]}" (docs/{page}.md in the tfmixprec '
        "repository)."
    )


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
