"""Tests of hardware detection."""

import re
from pathlib import Path

import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec import GPUInfo, HardwareInfo
from tfmixprec.precision.hardware import _read_cpuinfo

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""


def test_read_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    name, flags = _read_cpuinfo(path)
    assert name == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"avx512_bf16", "amx_bf16", "avx2"} <= flags
    assert _read_cpuinfo(tmp_path / "missing")[1] == frozenset()


def test_detect_hardware_matches_this_machine():
    """Checked against /proc/cpuinfo read here with a regex, not with the code's parser."""
    hw = tfmixprec.detect_hardware()
    assert len(hw.gpus) == len(tf.config.list_physical_devices("GPU"))
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo on this machine")
    text = cpuinfo.read_text()
    name = re.search(r"^model name\s*:\s*(.+?)\s*$", text, re.M)
    flags = set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split())
    assert hw.cpu_name == (name.group(1) if name else hw.cpu_name)
    assert hw.cpu_bfloat16 is bool({"avx512_bf16", "amx_bf16"} & flags)
    assert hw.cpu_amx is ("amx_bf16" in flags)
    assert hw.cpu_float16 is bool({"avx512_fp16", "amx_fp16"} & flags)


def test_gpu_info_tensor_cores():
    assert GPUInfo("V100", (7, 0)).tensor_cores and not GPUInfo("V100", (7, 0)).bfloat16
    assert GPUInfo("A100", (8, 0)).bfloat16
    assert not GPUInfo("P100", (6, 0)).tensor_cores
    assert not GPUInfo("unknown").tensor_cores
    assert GPUInfo("L4", (8, 9)).float8 and GPUInfo("H100", (9, 0)).float8
    assert not GPUInfo("A100", (8, 0)).float8 and not GPUInfo("unknown").float8
    assert GPUInfo("T4", (7, 5)).describe() == "T4 (compute capability 7.5, Tensor Cores)"


@pytest.mark.parametrize(
    "flags, float16",
    [
        (set(), False),
        ({"avx512f", "avx512_bf16"}, False),  # the AMD EPYC: bfloat16, no float16
        ({"avx512_bf16", "avx512_fp16", "amx_bf16"}, True),  # Sapphire Rapids
        ({"amx_fp16"}, True),
    ],
)
def test_cpu_float16_reads_avx512_fp16_and_amx_fp16(flags, float16):
    assert HardwareInfo(cpu_flags=frozenset(flags)).cpu_float16 is float16
