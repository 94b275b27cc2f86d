"""The limits of the floating-point formats, in one place: what overflows and what flushes to
zero in float16, and the largest finite value of each compute dtype."""

from __future__ import annotations

__all__: list[str] = []  # private module: nothing here is part of the package's API

FLOAT16_MAX = 65504.0  # the largest finite float16: past it, inf
FLOAT16_SMALLEST_NORMAL = 2.0**-14  # below it, subnormal (fewer significant bits)
FLOAT16_TINIEST = 2.0**-24  # the smallest float16 subnormal: below it, values flush to zero
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 2.0**-126  # the smallest normal float32 (a loss scale below it: 0 on the device)
DTYPE_MAX = {"float16": FLOAT16_MAX, "bfloat16": 3.3895314e38, "float32": FLOAT32_MAX}
# float8 (Keras's `quantize("float8")`): e4m3 for the forward pass (inputs, kernels), e5m2 for
# the output gradients. Past the largest value Keras clips (saturates); below half the smallest
# subnormal the value rounds to zero.
FLOAT8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
