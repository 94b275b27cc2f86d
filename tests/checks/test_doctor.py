"""Tests of the doctor report (on described hardware, so the same on any machine)."""

from pathlib import Path

import keras
import tensorflow as tf

import tfmixprec
from tfmixprec import GPUInfo, HardwareInfo


def test_doctor_report_prints_and_warns(capsys):
    hw = HardwareInfo(cpu_name="Test CPU", cpu_flags=frozenset({"amx_bf16"}))
    keras.config.set_dtype_policy("mixed_float16")
    report = tfmixprec.doctor(hw)
    out = capsys.readouterr().out
    assert report.recommended_policy == "mixed_bfloat16"
    assert report.current_policy == "mixed_float16"
    assert len(report.warnings) == 1
    assert "MixedPrecisionModel, which routes around the slow kernels" in report.warnings[0]
    assert "For speed use 'mixed_bfloat16'" in report.warnings[0]
    assert f"TensorFlow        {tf.__version__}" in out
    assert "CPU bfloat16      yes (AVX512_BF16: no, AMX_BF16: yes)" in out
    assert "CPU float16       no (AVX512_FP16: no, AMX_FP16: no)" in out
    assert "GPUs              none" in out
    assert (
        "float16 routes    the fused MatMul off, float32 convolution, float32 product, "
        "float32 attention (tfmixprec.cpu_float16)"
    ) in out
    assert "recommended       mixed_bfloat16: no GPU" in out
    assert "WARNING: mixed_float16 without a GPU trains at best as fast as float32" in out
    assert '"float16 on CPUs" (docs/guides/float16-on-cpus.md in the tfmixprec repository).' in out
    # One message: doctor says what set_policy("mixed_float16") warns on this hardware.
    assert report.warnings[0] == tfmixprec.policy.float16_without_gpu_note(hw)
    data = report.to_dict()
    assert data["hardware"]["cpu_flags"] == ["amx_bf16"]


def test_doctor_gpus_and_no_warning(capsys):
    hw = HardwareInfo(gpus=(GPUInfo("Tesla T4", (7, 5)),))
    keras.config.set_dtype_policy("mixed_float16")
    report = tfmixprec.doctor(hw, print_report=False)
    assert capsys.readouterr().out == ""
    assert report.warnings == []
    assert report.recommended_policy == "mixed_float16"
    assert "GPU 0             Tesla T4 (compute capability 7.5, Tensor Cores)" in str(report)
    assert report.to_dict()["hardware"]["gpus"][0]["tensor_cores"] is True


def test_doctor_warns_bfloat16_without_cpu_support():
    keras.config.set_dtype_policy("mixed_bfloat16")
    report = tfmixprec.doctor(HardwareInfo(), print_report=False)
    assert report.recommended_policy == "float32"
    assert "bfloat16 is emulated" in report.warnings[0]


def test_doctor_says_when_the_cpu_float16_workarounds_are_off():
    keras.config.set_dtype_policy("mixed_float16")
    tfmixprec.cpu_float16.disable()
    try:
        report = tfmixprec.doctor(HardwareInfo(cpu_name="Test CPU"), print_report=False)
    finally:
        tfmixprec.cpu_float16.enable()
    assert (
        "tfmixprec's routes around them are off: tfmixprec.cpu_float16.enable()."
        in (report.warnings[0])
    )


def test_doctor_warns_xla_with_bfloat16_on_amx():
    keras.config.set_dtype_policy("mixed_bfloat16")
    hw = HardwareInfo(cpu_name="Test CPU", cpu_flags=frozenset({"amx_bf16"}))
    report = tfmixprec.doctor(hw, print_report=False)
    assert report.warnings == [
        "mixed_bfloat16 on this CPU: keep jit_compile off (Keras's default on CPUs). XLA's CPU "
        "backend does not use AMX/AVX512_BF16 (on a Sapphire Rapids Xeon a 4x2048 MLP measured "
        "437 ms/step with jit_compile=True against 169 ms without)."
    ]


def test_doctor_says_which_float16_routes_a_cpu_with_avx512_fp16_gets():
    keras.config.set_dtype_policy("float32")
    flags = frozenset({"avx512_bf16", "avx512_fp16", "amx_bf16"})
    report = tfmixprec.doctor(HardwareInfo(cpu_name="Xeon", cpu_flags=flags), print_report=False)
    lines = str(report).splitlines()
    assert "  CPU float16       yes (AVX512_FP16: yes, AMX_FP16: no)" in lines
    assert (
        "  float16 routes    the fused MatMul off, float32 convolution, float32 attention, "
        "float16 matmuls native (AVX512_FP16) (tfmixprec.cpu_float16)"
    ) in lines
    assert report.float16_routes == [
        "the fused MatMul off",
        "float32 convolution",
        "float32 attention",
    ]
    data = report.to_dict()  # doctor --json says what the text says
    assert data["float16_routes"] == report.float16_routes
    assert data["hardware"]["cpu_float16_matmuls_native"] is True
    assert data["hardware"]["cpu_flags"] == ["amx_bf16", "avx512_bf16", "avx512_fp16"]


def test_doctor_float16_routes_off_and_on_a_gpu():
    keras.config.set_dtype_policy("float32")
    tfmixprec.cpu_float16.disable()
    try:
        report = tfmixprec.doctor(HardwareInfo(), print_report=False)
    finally:
        tfmixprec.cpu_float16.enable()
    assert "float16 routes    off (tfmixprec.cpu_float16.enable() turns them on)" in str(report)
    report = tfmixprec.doctor(HardwareInfo(gpus=(GPUInfo("A100", (8, 0)),)), print_report=False)
    assert "float16 routes    none on this machine" in str(report)
    assert report.float16_routes == []


def test_doctor_agrees_with_the_readme_on_mobilenet():
    report = tfmixprec.doctor(
        HardwareInfo(cpu_flags=frozenset({"avx512_bf16"})), print_report=False
    )
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "MobileNetV3 measured 0.68-1.10x float32" in report.reason
    assert "to 0.68-1.10x" in " ".join(readme.split())


def test_doctor_reads_an_unset_global_policy_without_setting_it():
    """A reader reads: after doctor(), set_floatx("float64") still builds float64 layers."""
    from tfmixprec._keras.settings import global_policy, restore_global_policy

    restore_global_policy(None)  # unset, as in a fresh process
    try:
        report = tfmixprec.doctor(print_report=False)
        assert global_policy() is None
        assert report.current_policy == "float32"  # Keras's default, from floatx
        keras.config.set_floatx("float64")
        assert keras.layers.Dense(2).dtype_policy.name == "float64"
    finally:
        keras.config.set_floatx("float32")
        restore_global_policy(None)
