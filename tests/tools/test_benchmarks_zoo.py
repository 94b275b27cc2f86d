"""Smoke runs of the benchmark scripts that build KerasHub's models, at their tiny sizes: they
keep working, run in this process (`benchmark_runs.run_here`). No timing is asserted. The other
scripts are in `test_benchmarks.py` (two files, so that pytest-xdist's `--dist loadfile` runs
them in both processes)."""

import re

import pytest
from benchmark_runs import run_here


def test_softmax_precision_smoke():
    out = run_here("softmax_precision.py", "--quick")
    assert "| float16 | 64 | 4 | " in out and "| bfloat16 | 64 | 4 | " in out
    assert "| mixed_float16 | float32 (Softmax dtype='float32') | " in out
    assert "GPT-2 (1 layer, hidden 32, 4 heads, dropout 0.1, sequence 16, batch 8, " in out


def test_zoo_smoke():
    """float32's and bf16 tfmixprec's workers in this process (`--in-process`: a start of
    TensorFlow each saved); f16 tfmixprec's, which turns the remapper off, in its own."""
    stacks = ("float32", "bf16 tfmixprec", "f16 tfmixprec")
    here = ("--in-process", *stacks[:2])
    out = run_here("zoo.py", "--quick", "--models", "gpt2", "--stacks", *stacks, *here)
    assert "| gpt2 | float32 | " in out and " | 1.00x | " in out
    for stack in stacks[1:]:
        row = rf"\| gpt2 \| {stack} \| [\d.]+ \| [\d.]+x \| \d+ \| \d\.\de[-+]\d\d"
        row += r"( \(\d+ of them skipped\))? \|"
        assert re.search(row, out), out


def test_gpu_check_smoke():
    pytest.importorskip("keras_hub")
    out = run_here("gpu_check.py", "--smoke")
    header = r"^device: .+; TensorFlow [\d.]+, Keras [\d.]+; zoo size tiny: gpt2 .+; vit "
    assert re.search(header, out, re.M), out
    rows = {}
    for line in out.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] in ("gpt2", "vit"):
            rows[tuple(cells[:3])] = cells[3:]
    policies = ("float32", "mixed_bfloat16", "mixed_float16", "float8")
    expected = [(m, p, "off") for m in ("gpt2", "vit") for p in policies]
    expected.append(("gpt2", "mixed_float16, keras LSO", "off"))
    assert all(key in rows for key in expected), out
    for (model, policy, xla), (ms, speed, _) in rows.items():
        if xla == "on" and re.fullmatch(r"failed: \w+|skipped \(--smoke\)", ms):
            continue  # XLA may fail on a CPU; --smoke compiles one XLA row only
        assert (model, policy, xla) in expected or xla == "on", out
        assert float(ms) > 0 and re.fullmatch(r"\d+\.\d\dx", speed), out
        if policy == "float32":
            assert speed == "1.00x", out
    assert re.fullmatch(r"tfmixprec LSO / keras LSO: \d+\.\d\dx", rows[expected[-1]][2]), out
    assert "layers in float8" in rows[("gpt2", "float8", "off")][2], out


def test_op_profile_smoke():
    """The op table per stack, and the stacks timed in alternation (`--paired`): the
    element-wise route and the callbacks' adoption among them (one run: each run builds
    GPT-2 once per stack)."""
    pytest.importorskip("keras_hub")
    stacks = ["float32", "bf16 keras", "bf16 tfmixprec", "bf16 elementwise", "bf16 adopted"]
    out = run_here(
        "op_profile.py", "--quick", "--model", "gpt2", "--stacks", *stacks,
        "--paired", "2", "--versus", "bf16 tfmixprec",
    )  # fmt: skip
    assert f"| | {' | '.join(stacks)} |" in out
    cells = r" \| ".join([r"\*\*\d+\*\*"] * len(stacks))
    assert re.search(rf"\| step, wall ms \| {cells} \|", out), out
    for part in ("matmul", "loss and metrics", "dropout", "normalization", "all ops"):
        assert re.search(rf"\| {part}, op ms \|( \d+ \|){{{len(stacks)}}}", out), out
    assert re.search(rf"\| MatMul \(matmul\) \|( [\d.]+ \|){{{len(stacks)}}}", out), out
    head = "| stack | median ms/step | vs float32 | per round, vs float32 | per round, vs "
    assert f"{head}bf16 tfmixprec |" in out
    ratio, span = r"\d+\.\d\dx", r"\d+\.\d\d-\d+\.\d\dx"
    for stack in stacks:
        assert re.search(rf"\| {stack} \| [\d.]+ \| {ratio} \| {span} \| {span} \|", out), out
