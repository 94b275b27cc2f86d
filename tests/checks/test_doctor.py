"""Tests of the doctor report (on described hardware, so the same on any machine)."""

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
    assert "routes around TensorFlow's slow float16 CPU kernels" in report.warnings[0]
    assert "for speed on this machine use 'mixed_bfloat16'" in report.warnings[0].lower()
    assert f"TensorFlow        {tf.__version__}" in out
    assert "CPU bfloat16      yes (AVX512_BF16: no, AMX_BF16: yes)" in out
    assert "GPUs              none" in out
    assert "recommended       mixed_bfloat16: no GPU" in out
    assert "WARNING: mixed_float16 without a GPU is at best about as fast as float32" in out
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
    assert "slow float16 CPU kernels are off" in report.warnings[0]


def test_doctor_warns_xla_with_bfloat16_on_amx():
    keras.config.set_dtype_policy("mixed_bfloat16")
    hw = HardwareInfo(cpu_name="Test CPU", cpu_flags=frozenset({"amx_bf16"}))
    report = tfmixprec.doctor(hw, print_report=False)
    assert report.warnings == [
        "mixed_bfloat16 on this CPU: keep jit_compile off (Keras's default on CPUs). XLA's CPU "
        "backend does not use AMX/AVX512_BF16 (on a Sapphire Rapids Xeon a 4x2048 MLP measured "
        "437 ms/step with jit_compile=True against 169 ms without)."
    ]
