"""What bench refuses before it runs, and how it says what failed: the memory free here
(`check_memory`: a size refused before it is allocated), running out of memory anyway
(`out_of_memory`), and a user's code failing (`user_code`), each as one line that names the
values, the work and the fix.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import tensorflow as tf

__all__: list[str] = []


def free_memory() -> int | None:
    """Bytes of memory free for new work here: Linux's MemAvailable (or the physical memory),
    at most what a cgroup v2 limit leaves; None where none of them can be read."""
    free = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    if free is None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):
        cgroup = Path("/sys/fs/cgroup")
        limit = int((cgroup / "memory.max").read_text())  # "max": no limit, a ValueError
        left = limit - int((cgroup / "memory.current").read_text())
        free = left if free is None else min(free, left)
    return free


def _bytes_text(count: float) -> str:
    """`22.9 GB`: a memory size for people (powers of 1000)."""
    for unit in ("bytes", "kB", "MB", "GB", "TB", "PB"):
        if count < 1000 or unit == "PB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def too_large(what: str, needed: int, free: int, fix: str) -> ValueError:
    return ValueError(
        f"{what} needs at least {_bytes_text(needed)} of memory, more than the "
        f"{_bytes_text(free)} free here. {fix}"
    )


def check_memory(needed: int, what: str, fix: str) -> None:
    """Raises `ValueError` when `needed` bytes are more than `free_memory()`: before bench
    allocates them, where running out would end the process or raise deep inside TensorFlow.

    Args:
        needed: Int. The bytes the work needs at least.
        what: String. The work and the values that size it, to start the message.
        fix: String. What to do instead, to end it.
    """
    free = free_memory()
    if free is not None and needed > free:
        raise too_large(what, needed, free, fix)


_FIX_THERE = "Fix it there (run it in Python for the traceback)."
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Keras's bold in its call errors
# TensorFlow's and Keras's wrapping around a message: the graph's traceback, the node and op.
_WRAPPING = re.compile(
    r"^(Graph execution error:|Detected at node |\s*File \"|Exception encountered when "
    r"calling |Arguments received by |\s+\u2022 |\s*\[\[\{\{node )"
)


_TF_NAMES = re.compile(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:[^\]]*\](\s*name:.*)?")


def _error_line(error: BaseException, limit: int = 300) -> str:
    """`error`'s message in one line: its first paragraph without TensorFlow's graph traceback,
    node and op names, Keras's call wrapping or terminal colours, cut at `limit` characters;
    "" if nothing is left."""
    text = _TF_NAMES.sub("", _ANSI.sub("", str(error)))
    paragraph: list[str] = []
    for line in text.splitlines():
        if _WRAPPING.match(line):
            continue
        if line.strip():
            paragraph.append(line.strip())
        elif paragraph:
            break
    line = " ".join(paragraph)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _raised(error: BaseException) -> str:
    """`RuntimeError: no GPU quota.`: what a user's code raised, as a sentence."""
    line = _error_line(error)
    text = f"{type(error).__name__}: {line}" if line else type(error).__name__
    return text if text.endswith(".") else text + "."


@contextlib.contextmanager
def out_of_memory(doing: str, fix: str) -> Iterator[None]:
    """TensorFlow or NumPy running out of memory in the block, as one `ValueError` that says
    what ran out (`doing`: the values that sized it, then the work) and what to do (`fix`)."""
    try:
        yield
    except (tf.errors.ResourceExhaustedError, MemoryError) as error:
        raise ValueError(f"{doing} ran out of memory ({_error_line(error)}). {fix}") from None


@contextlib.contextmanager
def user_code(spec: str, doing: str, fix: str = _FIX_THERE) -> Iterator[None]:
    """The user's code (their function, their model) failing, as a `ValueError` of one line
    that names it, says what it was doing and what to do (the traceback: run it in Python)."""
    smaller = "Build a smaller model, or pass a smaller --batch-size."
    with out_of_memory(f"--model {spec!r}: {doing}", smaller):
        try:
            yield
        except ModuleNotFoundError as error:
            raise ValueError(
                f"Cannot import {error.name!r} (from --model {spec!r}): {error}"
            ) from None
        except (tf.errors.ResourceExhaustedError, MemoryError):
            raise  # said by out_of_memory
        except Exception as error:  # noqa: BLE001 (the user's code may raise anything)
            raise ValueError(f"--model {spec!r}: {doing} raised {_raised(error)} {fix}") from None
