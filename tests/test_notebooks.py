"""Both notebooks execute top to bottom (nbclient, a real IPython kernel), and what each cell
prints now is what the saved notebook shows (`notebooks/refresh.py` saves them)."""

import importlib.util
from pathlib import Path

import keras
import nbformat
import pytest

import tfmixprec
from tfmixprec import HardwareInfo

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("refresh", ROOT / "notebooks" / "refresh.py")
refresh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refresh)


def _images(notebook):
    return sum(
        1
        for cell in notebook.cells
        for out in cell.get("outputs", [])
        if out.output_type == "display_data" and "image/png" in out.data
    )


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
def test_notebook_outputs_are_what_the_code_prints(name, expected, images):
    saved = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    fresh = refresh.execute(name)
    code = [c for c in saved.cells if c.cell_type == "code"]
    for cell in code:  # saved without TensorFlow's start-up lines and warnings
        assert all(out.get("name") != "stderr" for out in cell.outputs), cell.source[:60]
    ran = [c for c in fresh.cells if c.cell_type == "code"]
    assert [c.source for c in ran] == [c.source for c in code]
    for now, before in zip(ran, code):
        assert refresh.normalized(now) == refresh.normalized(before), now.source[:60]
        if refresh.MACHINE_TAG in now.metadata.get("tags", []):
            assert refresh.printed(now) and refresh.printed(before)
    text = "".join(refresh.printed(c) for c in ran)
    for snippet in expected:
        assert snippet in text
    assert _images(fresh) == _images(saved) == images  # the matplotlib figures were drawn


def test_normalized_masks_what_varies_by_cpu_and_keeps_counts():
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output(
            "stream",
            name="stdout",
            text="23/23 - 2s - 72ms/step - loss: 1.5405 - overflow: 1.0000 - scale: 0.0000e+00\n"
            "{'good_steps': 21}",
        )
    ]
    assert refresh.normalized(cell) == (
        "23/23 - T - loss: # - overflow: 1 - scale: 0\n{'good_steps': 21}"
    )
    cell.metadata["tags"] = [refresh.MACHINE_TAG]
    assert refresh.normalized(cell) == ""  # all it prints follows from this machine's policy


def test_normalized_masks_only_the_doctor_lines_that_describe_the_machine():
    """The quickstart's doctor cell is compared: its title, its labels in their order and
    the current policy; the devices, their instructions and routes, the versions and the
    policy recommended for them are this machine's."""
    report = tfmixprec.doctor(
        HardwareInfo(cpu_name="Xeon", cpu_flags=frozenset({"avx512_fp16", "amx_bf16"})),
        print_report=False,
    )
    cell = nbformat.v4.new_code_cell("report = tfmixprec.doctor()")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{report}\n")]
    assert refresh.normalized(cell).splitlines() == [
        "tfmixprec doctor",
        "  TensorFlow        M",
        "  Keras             M",
        "  CPU               M",
        "  CPU bfloat16      M",
        "  CPU float16       M",
        "  GPUs              M",
        "  TPUs              M",
        "  float16 routes    M",
        "  bfloat16 routes   M",
        f"  current policy    {keras.config.dtype_policy().name}",
        "  recommended       M",
    ]
    saved = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    doctor_cell = next(c for c in saved.cells if "tfmixprec.doctor()" in c.source)
    assert refresh.MACHINE_TAG not in doctor_cell.metadata.get("tags", [])  # compared
    assert "  CPU float16       M" in refresh.normalized(doctor_cell)
