"""Both notebooks execute top to bottom without error (nbclient, a real IPython kernel)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def _execute(name):
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()  # raises CellExecutionError on any error
    text = []
    images = 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream" and output.name == "stdout":
                text.append(output.text)
            elif output.output_type == "display_data" and "image/png" in output.data:
                images += 1
    return "".join(text), images


@pytest.mark.parametrize(
    "name, expected, images",
    [
        ("01_quickstart.ipynb", ["tfmixprec doctor", "test accuracy 0.9"], 1),
        (
            "02_why_loss_scaling.ipynb",
            [
                "2e-08 -> float16 0",
                "float16, no loss scaling       weights moved: False",
                "float16, dynamic loss scale    weights moved: True",
            ],
            2,
        ),
    ],
)
def test_notebook_runs(name, expected, images):
    text, count = _execute(name)
    for snippet in expected:
        assert snippet in text
    assert count == images  # the matplotlib figures were drawn
