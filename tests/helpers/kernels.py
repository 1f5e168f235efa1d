"""The CPU kernels' checks against MLX: quantizing random weights MLX's way, and the two bounds a
product is held to (tests/test_kernels.py's docstring derives them).

check(): max|ours - ref| <= 1e-4 * (1 + max|ref|), ref = x @ mx.dequantize(W).T in float32, and
|ours - ref64| <= (K + 8) * 2^-24 * |x| @ (|s| q + |b|).T against a float64 reference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from flashmoe.engine.cpu import qmm as K


def quantize(w: np.ndarray, bits: int, gs: int):
    """MLX-quantize float32 w [..., out, in]; returns numpy (packed, scales, biases, dequantized)."""
    wq, s, b = mx.quantize(mx.array(w), group_size=gs, bits=bits)
    dq = mx.dequantize(wq, s, b, group_size=gs, bits=bits)
    mx.eval(wq, s, b, dq)
    return K.to_numpy(wq), K.to_numpy(s), K.to_numpy(b), np.array(dq)


def quantize_bf16(w: np.ndarray, bits: int, gs: int):
    """As a real MLX checkpoint is: w rounded to bfloat16, quantized there (bfloat16 scales and
    biases), then widened to float32 as the loader gives them; (packed, scales, biases)."""
    wq, s, b = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=gs, bits=bits)
    return np.array(wq), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))


def unpack_reference(packed: np.ndarray, bits: int, k: int) -> np.ndarray:
    """Our reading of MLX's layout: each row a little-endian bit stream, value i at bits [i*bits, (i+1)*bits)."""
    bitstream = np.unpackbits(packed.view(np.uint8).reshape(*packed.shape[:-1], -1), axis=-1, bitorder="little")
    return bitstream.reshape(*packed.shape[:-1], k, bits).astype(np.int64) @ (1 << np.arange(bits))


def abs_bound(x: np.ndarray, q: np.ndarray, s: np.ndarray, b: np.ndarray, gs: int) -> np.ndarray:
    """(K + 8) * 2^-24 * |x| @ (|s| q + |b|).T, per output (float64)."""
    k = x.shape[-1]
    a = np.abs(np.repeat(s, gs, axis=-1).astype(np.float64)) * q + np.abs(np.repeat(b, gs, axis=-1))
    return (k + 8) * 2.0**-24 * (np.abs(x.astype(np.float64)) @ a.T)


def check(got, x, wq, s, b, dq, bits, gs):
    ref32 = np.array(mx.array(x) @ mx.array(dq).T)
    ref64 = x.astype(np.float64) @ dq.astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == ref32.shape
    assert np.abs(got - ref32).max(initial=0) <= 1e-4 * (1 + np.abs(ref32).max(initial=0))
    q = unpack_reference(wq, bits, x.shape[-1])
    assert np.all(np.abs(got - ref64) <= abs_bound(x, q, s, b, gs))
