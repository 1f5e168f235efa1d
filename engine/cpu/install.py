"""The CPU kernel path: every affine-quantized matmul the model runs goes through numba kernels
(engine/cpu/qmm.py) instead of MLX's scalar CPU loop. Metal and CUDA keep MLX's kernels.

Each replaced module evaluates its input (a sync: the kernel runs outside MLX's graph), reads the
weights through zero-copy numpy views, and hands the result back as an MLX array. Whole attention,
MLP and MoE blocks are then fused on top of these (engine/cpu/fused.py), one sync per block.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from flashmoe.engine.hidden import Hidden
from flashmoe.engine.options import KERNELS


def resolve(kernels: str) -> str:
    """'auto' -> 'cpu' when MLX runs on the CPU and numba is installed, else 'mlx'."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels != "auto":
        return kernels
    from flashmoe.engine.cpu import cpu_qmm_available

    return "cpu" if mx.default_device() == mx.cpu and cpu_qmm_available() else "mlx"


def _f32_view(a: mx.array) -> np.ndarray:
    from flashmoe.engine.cpu.qmm import to_numpy

    mx.eval(a)
    return to_numpy(a) if a.dtype != mx.bfloat16 else to_numpy(a.astype(mx.float32))


class CpuQuantizedLinear(nn.Module):
    """nn.QuantizedLinear (affine) computed by the CPU kernels: repacked in tiles of 16 rows
    (engine/cpu/tiled.py) at 2, 4 and 8 bits, read in MLX's own layout (qmm.py) otherwise."""

    def __init__(self, ql: nn.QuantizedLinear):
        from flashmoe.engine.cpu import tiled

        super().__init__()
        w = _f32_view(ql["weight"]).view(np.uint32)
        s = np.ascontiguousarray(_f32_view(ql["scales"]), dtype=np.float32)
        b = np.ascontiguousarray(_f32_view(ql["biases"]), dtype=np.float32)
        self._bias = _f32_view(ql["bias"]) if "bias" in ql else None
        self._bits, self._gs = ql.bits, ql.group_size
        self.in_features, self.out_features = w.shape[1] * 32 // ql.bits, w.shape[0]
        if tiled.supports(ql.bits, ql.group_size):
            self._t = tiled.Tiled.from_mlx(w, s, b, ql.bits, ql.group_size)
            self._w = self._s = self._b = None
            self._keep = None  # the tiles are a copy: MLX's arrays can go
        else:
            self._t = None
            self._w, self._s, self._b = w, s, b
            self._keep = Hidden(ql)  # its arrays back the views above

    @property
    def tiled(self):
        """The weights as tiles (engine/cpu/tiled.py), or None (read in MLX's layout)."""
        return self._t

    def rebind(self, w: np.ndarray, s: np.ndarray, b: np.ndarray) -> None:
        """Use these (equal) arrays instead, e.g. rows of a fused matrix; frees the originals."""
        self._w, self._s, self._b = w, s, b
        self._own_bias()

    def rebind_tiled(self, t) -> None:
        """Use this (equal) tiled matrix instead, e.g. a view of a fused one; frees the original."""
        self._t = t
        self._own_bias()

    def _own_bias(self) -> None:
        if self._bias is not None:
            self._bias = self._bias.copy()
        self._keep = None

    head = False  # the output head: in a prefill (last_logits_only) it computes the last row only

    def matmul(self, x2: np.ndarray) -> np.ndarray:
        """x2 [R, in] float32 -> [R, out], with the bias."""
        from flashmoe.engine.cpu.qmm import qmm

        out = self._t.matmul(x2) if self._t is not None else qmm(x2, self._w, self._s, self._b, self._bits, self._gs)
        return out + self._bias if self._bias is not None else out

    def __call__(self, x: mx.array) -> mx.array:
        from flashmoe.engine.cpu.qmm import to_numpy

        if self.head and _LAST_ONLY.on and x.ndim == 3 and x.shape[1] > 1:
            x = x[:, -1:]
        mx.eval(x)
        xn = to_numpy(x)
        out = self.matmul(np.ascontiguousarray(xn.reshape(-1, xn.shape[-1]), dtype=np.float32))
        out = mx.array(np.ascontiguousarray(out).reshape(*xn.shape[:-1], -1))
        return out.astype(x.dtype) if x.dtype != mx.float32 else out


class _LastOnly(threading.local):
    on = False


_LAST_ONLY = _LastOnly()


@contextmanager
def last_logits_only():
    """Within it, the output head computes the logits of each call's last position only (a
    prefill uses no other): a tenth of a 1k-token prefill of SmolLM2 went into the 49k-row head.
    The call's logits then have one position, the last."""
    _LAST_ONLY.on = True
    try:
        yield
    finally:
        _LAST_ONLY.on = False


class CpuQuantizedEmbedding(nn.Module):
    """Looks rows up as MLX does; `as_linear` (a tied lm_head) runs on the CPU kernels. Where the
    head is tiled, the rows are looked up in the tiles too, so the weights are held once."""

    def __init__(self, qe: nn.QuantizedEmbedding):
        super().__init__()
        head = CpuQuantizedLinear(qe)
        head.head = True  # called only as a tied output head
        self._linear = Hidden(head)
        self._inner = Hidden(qe) if head.tiled is None else None

    @property
    def tiled(self):
        """The table as tiles (engine/cpu/tiled.py), or None (looked up by MLX)."""
        return self._linear.module.tiled

    def __call__(self, x):
        if self._inner is not None:
            return self._inner.module(x)
        return mx.array(self._linear.module.tiled.rows(np.array(x)))

    def as_linear(self, x):
        return self._linear.module(x)


def install(model: nn.Module) -> int:
    """Replace every affine QuantizedLinear / QuantizedEmbedding; returns how many were replaced.

    Also holds numpy's BLAS (OpenBLAS) to one thread for the process: the fused blocks use it for
    small products (router, attention), and its pool's threads, spinning after each call,
    took the cores from numba's kernel threads (the demo decoded 10-20% slower)."""
    from threadpoolctl import threadpool_limits

    try:  # numba's np.dot calls scipy's own OpenBLAS, loaded only when a kernel using it loads:
        import scipy.linalg.cython_blas  # noqa: F401  load it now, so the limit reaches it too
    except ImportError:
        pass
    threadpool_limits(1, user_api="blas")
    count = 0
    replacements = []
    for name, m in model.named_modules():
        if getattr(m, "mode", "affine") != "affine":
            continue
        if isinstance(m, nn.QuantizedEmbedding):
            replacements.append((name, CpuQuantizedEmbedding(m)))
        elif isinstance(m, nn.QuantizedLinear):
            new = CpuQuantizedLinear(m)
            new.head = name.split(".")[-1] == "lm_head"
            replacements.append((name, new))
    for name, new in replacements:
        set_module(model, name, new)
        count += 1
    return count


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the module named `name` (as named_modules() names it) is."""
    *path, last = name.split(".")
    parent = model
    for part in path:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    if isinstance(parent, list):
        parent[int(last)] = new
    else:
        parent[last] = new
