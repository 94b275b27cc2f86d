"""Re-executes the notebooks and saves them with fresh outputs, as the tests compare them.

    python notebooks/refresh.py            # both notebooks, in place

Each notebook runs top to bottom in a real IPython kernel (nbclient), from the repository's
root. What is saved is what a reader should see: the printed output, the figures and the
returned values; TensorFlow's start-up lines and warnings (stderr) and the execution
timestamps are left out, so a saved notebook does not depend on the machine's log lines.
`tests/test_notebooks.py` executes them again and compares each cell's printed output with
the saved one (`normalized`: numbers with a fraction, timings, the lines of `doctor`'s report
that describe the machine, and the cells tagged `machine` vary by CPU).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ("01_quickstart.ipynb", "02_why_loss_scaling.ipynb")
MACHINE_TAG = "machine"  # a cell whose whole output follows from the policy picked here


def execute(name: str) -> nbformat.NotebookNode:
    """The notebook `name`, executed, with only what a reader should see in its outputs."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError on any error
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = [out for out in cell.outputs if out.get("name") != "stderr"]
    notebook.metadata.pop("widgets", None)
    return notebook


def printed(cell: nbformat.NotebookNode) -> str:
    """What a code cell printed (stdout), and the text of its returned value."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream" and out.name == "stdout":
            parts.append(out.text)
        elif out.output_type == "execute_result":
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


_TIMING = re.compile(r"\d+s - \d+(?:ms|us|s)/step")
# The lines of `tfmixprec doctor`'s report whose text is this machine's (its devices, their
# instructions, the routes they get, the policy picked for them) or this installation's (the
# versions); its other lines (the title, the current policy, the warnings) are compared.
_MACHINE_LINE = re.compile(
    r"^(  (?:TensorFlow|Keras|CPU|CPU bfloat16|CPU float16|GPUs|GPU \d+|TPUs|float16 routes"
    r"|bfloat16 routes|recommended)) {2,}\S.*$",
    re.M,
)
_FRACTION = re.compile(r"-?\d+\.\d+(?:e[+-]\d+)?|-?\d+e[+-]\d+")


def normalized(cell: nbformat.NotebookNode) -> str:
    """A cell's printed output with what varies by CPU masked: timings, numbers with a
    fraction (losses, accuracies: `#`), and the text of `doctor`'s lines that describe the
    machine (`  CPU float16       M`: the label is kept); whole numbers, however printed
    (`1.0000`, `0.0000e+00`, step and overflow counts, loss scales), are kept as integers. A
    cell tagged `machine` (all it prints follows from the policy picked for this hardware)
    gives "": what it prints is this machine's."""
    if MACHINE_TAG in cell.metadata.get("tags", []):
        return ""
    text = _MACHINE_LINE.sub(lambda m: f"{m.group(1):<20}M", printed(cell))
    return _FRACTION.sub(_whole_or_masked, _TIMING.sub("T", text))


def _whole_or_masked(match: re.Match) -> str:
    value = float(match.group(0))
    return str(int(value)) if value.is_integer() else "#"


def main() -> int:
    for name in NOTEBOOKS:
        notebook = execute(name)
        nbformat.write(notebook, ROOT / "notebooks" / name)
        print(f"refreshed notebooks/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
