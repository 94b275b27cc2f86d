"""What devices exist and what they are good at, and the `doctor()` report built on it.

Detection reads TensorFlow's device list and, for the CPU, the flags in `/proc/cpuinfo`.
Everything downstream takes a `HardwareInfo`, so the decisions can be tested on described
hardware without touching TensorFlow.
"""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

__all__ = ["GPUInfo", "HardwareInfo", "DoctorReport", "detect_hardware", "doctor"]

# CPU flags (as Linux spells them in /proc/cpuinfo) that give native bfloat16 math.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


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

    >>> tfmixprec.detect_hardware().cpu_bfloat16
    True
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


@dataclasses.dataclass
class DoctorReport:
    """What `doctor()` found. `str(report)` is the printed text."""

    tensorflow_version: str
    keras_version: str
    hardware: HardwareInfo
    recommended_policy: str
    reason: str
    current_policy: str
    warnings: list[str]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["hardware"]["cpu_flags"] = sorted(self.hardware.cpu_flags & set(BF16_CPU_FLAGS))
        data["hardware"]["gpus"] = [
            {
                "name": g.name,
                "compute_capability": list(g.compute_capability) if g.compute_capability else None,
                "tensor_cores": g.tensor_cores,
            }
            for g in self.hardware.gpus
        ]
        return data

    def __str__(self) -> str:
        hw = self.hardware
        lines = [
            "tfmixprec doctor",
            f"  TensorFlow        {self.tensorflow_version}",
            f"  Keras             {self.keras_version}",
            f"  CPU               {hw.cpu_name or 'unknown'}",
            f"  CPU bfloat16      {'yes' if hw.cpu_bfloat16 else 'no'} "
            f"(AVX512_BF16: {'yes' if 'avx512_bf16' in hw.cpu_flags else 'no'}, "
            f"AMX_BF16: {'yes' if hw.cpu_amx else 'no'})",
        ]
        if hw.gpus:
            for index, gpu in enumerate(hw.gpus):
                lines.append(f"  GPU {index:<13} {gpu.describe()}")
        else:
            lines.append("  GPUs              none")
        lines.append(f"  TPUs              {hw.tpus}")
        lines.append(f"  current policy    {self.current_policy}")
        lines.append(f"  recommended       {self.recommended_policy}: {self.reason}")
        for warning in self.warnings:
            lines.append(f"  WARNING: {warning}")
        return "\n".join(lines)


def _cpu_float16_note(hardware: HardwareInfo, recommended: str) -> str:
    """What is slow for float16 on this CPU, and what tfmixprec does about it."""
    from tfmixprec import cpu_float16

    if not cpu_float16.applies("mixed_float16", hardware):
        return (
            "mixed_float16 without a GPU, and tfmixprec's CPU float16 workarounds are off "
            "(tfmixprec.cpu_float16.disable()): TensorFlow's float16 Conv2DBackpropFilter CPU "
            "kernel is up to ~600x slower than float32, the fused MatMul up to ~200x on some CPUs. "
            "Turn them on with tfmixprec.cpu_float16.enable()."
        )
    return (
        "mixed_float16 without a GPU: some of TensorFlow's float16 CPU kernels are slow, not "
        "float16: Conv2DBackpropFilter (up to ~600x float32), the _FusedMatMul that grappler's "
        "remapper makes on some CPUs (~200x on a Sapphire Rapids Xeon, TF 2.21), and float16 "
        "matmuls without AVX512_FP16 (1.1-3x). tfmixprec routes around them: the remapper is "
        "off for float16 (tfmixprec.set_policy, MixedPrecisionModel.compile, make_train_step), "
        "and float16 convolution, Dense and EinsumDense layers compute their products in "
        "float32 (MixedPrecisionModel.compile and make_train_step do it; for a plain "
        "keras.Model call tfmixprec.cpu_float16.fast_float16_layers(model)). For speed "
        f"on this machine use {recommended!r} (tfmixprec.set_policy('auto'))."
    )


def doctor(hardware: HardwareInfo | None = None, print_report: bool = True) -> DoctorReport:
    """Reports versions, devices, bfloat16/Tensor Core support and the policy to use.

    Args:
        hardware: `HardwareInfo`. The devices to report on; detected when `None`.
        print_report: Bool. Print the report as well as returning it.

    Returns:
        A `DoctorReport`.

    Example:

    >>> report = tfmixprec.doctor()
    """
    from tfmixprec.policy import choose_policy

    hardware = detect_hardware() if hardware is None else hardware
    choice = choose_policy(hardware)
    current = keras.config.dtype_policy().name
    warnings = []
    if current == "mixed_float16" and not hardware.gpus and not hardware.tpus:
        warnings.append(_cpu_float16_note(hardware, choice.name))
    if current == "mixed_bfloat16" and not hardware.gpus and hardware.cpu_bfloat16:
        warnings.append(
            "mixed_bfloat16 on this CPU: keep jit_compile off (Keras's default on CPUs). "
            "XLA's CPU backend does not use AMX/AVX512_BF16 (on a Sapphire Rapids Xeon a 4x2048 "
            "MLP measured 437 ms/step with jit_compile=True against 169 ms without)."
        )
    if current == "mixed_bfloat16" and not hardware.gpus and not hardware.cpu_bfloat16:
        warnings.append(
            "the global policy is mixed_bfloat16 but this CPU has no AVX512_BF16/AMX_BF16: "
            "bfloat16 is emulated and slower than float32. Use tfmixprec.set_policy('float32')."
        )
    report = DoctorReport(
        tensorflow_version=tf.__version__,
        keras_version=keras.__version__,
        hardware=hardware,
        recommended_policy=choice.name,
        reason=choice.reason,
        current_policy=current,
        warnings=warnings,
    )
    if print_report:
        print(report)
    return report
