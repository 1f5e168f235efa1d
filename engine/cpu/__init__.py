"""The CPU fast path: numba kernels that replace MLX's on a CPU, and their install.

`install` swaps every affine quantized matmul for the kernels (chosen at load, `--kernels`),
`fused` runs whole one-token decoder layers in one CPU step where a probe shows it is exact.
`qmm` holds numba kernels for MLX's affine quantized matmul on x86/ARM CPUs, where MLX's own
CPU kernel is a scalar single-thread loop. It needs numba; `cpu_qmm_available()` says whether it
can be imported without importing it (importing numba costs ~0.3 s).
"""

from __future__ import annotations

import importlib.util


def cpu_qmm_available() -> bool:
    """True when numba is installed, so `flashmoe.engine.cpu.qmm` can be imported."""
    return importlib.util.find_spec("numba") is not None
