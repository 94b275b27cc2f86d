"""What devices exist and what they are good at.

Detection reads TensorFlow's device list and, for the CPU, the flags in `/proc/cpuinfo`.
Everything downstream takes a `HardwareInfo`, so the decisions can be tested on described
hardware without touching TensorFlow.
"""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path

import tensorflow as tf

__all__ = ["GPUInfo", "HardwareInfo", "detect_hardware"]

# CPU flags (as Linux spells them in /proc/cpuinfo) that give native bfloat16 math.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
# ... and native float16 math (Sapphire Rapids has AVX512_FP16; Granite Rapids AMX_FP16 too).
FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    """One GPU.

    Args:
        name: String. The device name, e.g. "NVIDIA A100-SXM4-40GB".
        compute_capability: Tuple `(major, minor)`, or `None` when unknown (non-NVIDIA).
    """

    name: str
    compute_capability: tuple[int, int] | None = None

    @property
    def tensor_cores(self) -> bool:
        """True for NVIDIA compute capability >= 7.0 (Volta and later)."""
        return self.compute_capability is not None and self.compute_capability >= (7, 0)

    @property
    def bfloat16(self) -> bool:
        """True for compute capability >= 8.0 (Ampere and later): bfloat16 Tensor Cores."""
        return self.compute_capability is not None and self.compute_capability >= (8, 0)

    @property
    def float8(self) -> bool:
        """True for compute capability >= 8.9 (Ada, Hopper and later): float8 Tensor Cores."""
        return self.compute_capability is not None and self.compute_capability >= (8, 9)

    def describe(self) -> str:
        cc = self.compute_capability
        cc_text = f"compute capability {cc[0]}.{cc[1]}" if cc else "compute capability unknown"
        cores = "Tensor Cores" if self.tensor_cores else "no Tensor Cores"
        return f"{self.name} ({cc_text}, {cores})"


@dataclasses.dataclass(frozen=True)
class HardwareInfo:
    """The devices a policy decision is made for.

    Args:
        gpus: Tuple of `GPUInfo`. The visible GPUs.
        tpus: Int. The number of TPU devices.
        cpu_name: String. The CPU model name.
        cpu_flags: Frozenset of strings. CPU feature flags (lower case).
    """

    gpus: tuple[GPUInfo, ...] = ()
    tpus: int = 0
    cpu_name: str = ""
    cpu_flags: frozenset[str] = frozenset()

    @property
    def cpu_bfloat16(self) -> bool:
        """True when the CPU has AVX512_BF16 or AMX_BF16."""
        return any(flag in self.cpu_flags for flag in BF16_CPU_FLAGS)

    @property
    def cpu_amx(self) -> bool:
        """True when the CPU has AMX tiles for bfloat16."""
        return "amx_bf16" in self.cpu_flags

    @property
    def cpu_float16(self) -> bool:
        """True when the CPU has AVX512_FP16 or AMX_FP16: float16 matmuls run natively (a
        plain float16 `MatMul` at float32's speed on a Sapphire Rapids Xeon)."""
        return any(flag in self.cpu_flags for flag in FP16_CPU_FLAGS)


def _read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    name, flags = platform.processor() or platform.machine(), frozenset()
    try:
        text = path.read_text()
    except OSError:
        return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and value.strip():
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.lower().split())
    return name, flags


def detect_hardware() -> HardwareInfo:
    """Describes this machine's devices as TensorFlow and the OS report them.

    Returns:
        A `HardwareInfo`.

    Example:

    >>> tfmixprec.detect_hardware().cpu_bfloat16  # True with AVX512_BF16 or AMX_BF16
    """
    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        try:
            details = tf.config.experimental.get_device_details(device)
        except (ValueError, RuntimeError):  # pragma: no cover - depends on the driver
            details = {}
        cc = details.get("compute_capability")
        gpus.append(
            GPUInfo(
                name=details.get("device_name", device.name),
                compute_capability=tuple(cc) if cc else None,
            )
        )
    tpus = len(tf.config.list_physical_devices("TPU"))
    cpu_name, cpu_flags = _read_cpuinfo()
    return HardwareInfo(gpus=tuple(gpus), tpus=tpus, cpu_name=cpu_name, cpu_flags=cpu_flags)
