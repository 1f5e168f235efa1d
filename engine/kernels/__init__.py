"""Compute kernels that can replace MLX's on a given platform.

`cpu_qmm` holds numba kernels for MLX's affine quantized matmul on x86/ARM CPUs, where MLX's own
CPU kernel is a scalar single-thread loop. It needs numba; `cpu_qmm_available()` says whether it
can be imported without importing it (importing numba costs ~0.3 s).
"""
from __future__ import annotations

import importlib.util


def cpu_qmm_available() -> bool:
    """True when numba is installed, so `engine.kernels.cpu_qmm` can be imported."""
    return importlib.util.find_spec("numba") is not None
