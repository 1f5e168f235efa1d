"""Quantized matmuls of many rows (prefill chunks, an expert many tokens chose) as dequantize +
BLAS sgemm.

The kernels of qmm.py decode every weight once per pair of x rows: right for decoding, where a
weight is used by one or two rows, but at 256 rows the decode costs more than the arithmetic.
Here a weight matrix is dequantized once (numba, both cores, ~1 ns per value), into the same
float32 values mx.dequantize gives bit for bit, and numpy's BLAS (OpenBLAS sgemm, ~130 GFLOP/s
on this machine's two cores) multiplies every row by it. Measured (benchmarks/bench_kernels.py
--rows): the sgemm route wins from about GEMM_ROWS rows up, 2.5x at 256 rows.

BLAS runs on one thread for the whole process (engine/cpu/install.py says why), and a product
of many rows is split by rows among our own threads (`matmul_rows`), each calling it on one.
Raising BLAS's own thread count for the product, as this module did first, woke OpenBLAS's
worker thread, which polls for work (sched_yield) before it sleeps. On two cores, in some
processes, it held a whole core beside numba's kernel threads, through the MoE kernels that
follow each layer's attention and the decode after the prompt (the upcycled demo's 1k-token
prefill: 130 instead of 170 tok/s, process by process; benchmarks/log/, indexed in benchmarks/README.md).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from numba import float32, njit, prange, uint32, uint64

from flashmoe.engine.cpu import numba_cache  # noqa: F401 - before any kernel is defined (see there)

GEMM_ROWS = 64  # rows from which dequantize + sgemm beats the decode-per-row-pair kernels

_scratch = threading.local()  # one dequantized-weight buffer per thread, grown as needed


@njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _dequantize_words(w, s, b, bits, group_size, out):
    """bits 2, 4, 8: no value crosses a uint32 word, so each word is decoded with fixed shifts."""
    O, W = w.shape
    per = 32 // bits
    mask = uint32((1 << bits) - 1)
    words = group_size // per
    for o in prange(O):
        for g in range(W // words):
            sc, bi = s[o, g], b[o, g]
            for j in range(g * words, (g + 1) * words):
                v = w[o, j]
                for t in range(per):
                    out[o, j * per + t] = float32((v >> uint32(t * bits)) & mask) * sc + bi


@njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _dequantize_stream(w, s, b, bits, group_size, out):
    """Any width (3, 5, 6 bits): value i of a row is bits [i*bits, (i+1)*bits) of its words."""
    O, n = out.shape
    mask = uint64((1 << bits) - 1)
    for o in prange(O):
        for i in range(n):
            bit = i * bits
            j, shift = bit >> 5, bit & 31
            v = uint64(w[o, j]) >> uint64(shift)
            if shift + bits > 32:
                v |= uint64(w[o, j + 1]) << uint64(32 - shift)
            g = i // group_size
            out[o, i] = float32(v & mask) * s[o, g] + b[o, g]


def dequantize(
    w: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int, group_size: int, out: np.ndarray | None = None
) -> np.ndarray:
    """w uint32 [O, in*bits/32], scales / biases float32 [O, in/group_size] -> float32 [O, in],
    equal to mx.dequantize's values."""
    n = w.shape[1] * 32 // bits
    if out is None:
        out = np.empty((w.shape[0], n), np.float32)
    (_dequantize_words if 32 % bits == 0 else _dequantize_stream)(w, s, b, bits, group_size, out)
    return out


def _buffer(rows: int, cols: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < rows * cols:
        buf = _scratch.buf = np.empty(rows * cols, np.float32)
    return buf[: rows * cols].reshape(rows, cols)


_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (process id, threads) the pool was made for: a forked child makes its own


def by_rows(n: int, fn) -> None:
    """fn(start, stop) over row ranges that cover 0 .. n, one on each of numba's threads (every
    core): the calling thread takes the first, a pool thread each other. numpy releases the GIL
    inside BLAS, so the ranges' products run side by side, each on one BLAS thread."""
    global _pool, _pool_key
    parts = max(1, min(numba.get_num_threads(), n))
    if parts == 1:
        fn(0, n)
        return
    if _pool_key[0] != os.getpid() or _pool_key[1] < parts - 1:  # (a fork leaves the pool without its threads)
        _pool, _pool_key = ThreadPoolExecutor(parts - 1, thread_name_prefix="flashmoe-rows"), (os.getpid(), parts - 1)
    bounds = [n * i // parts for i in range(parts + 1)]
    later = [_pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    try:
        fn(bounds[0], bounds[1])
    finally:
        for f in later:
            f.result()


def matmul_rows(x2: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """x2 [R, K] @ wt [K, N] (a transposed view is fine) as a new [R, N] array, its rows split
    among the cores (by_rows)."""
    out = np.empty((x2.shape[0], wt.shape[1]), np.float32)
    by_rows(x2.shape[0], lambda a, b: np.matmul(x2[a:b], wt, out=out[a:b]))
    return out


def matmul_t(x2: np.ndarray, w: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """x2 [R, in] @ dequantize(w).T -> [R, O] through a scratch buffer and sgemm."""
    wf = dequantize(w, s, b, bits, group_size, _buffer(w.shape[0], w.shape[1] * 32 // bits))
    return matmul_rows(x2, wf.T)


def gather_grouped(
    x2: np.ndarray, idx: np.ndarray, k: int, sizes: list[int], n_in: int, dequant, kernel
) -> list[np.ndarray] | None:
    """A gather matmul against stacked experts (one or more weight sets of `sizes` outputs each,
    `n_in` inputs: a SwiGLU's gate and up), with every expert that GEMM_ROWS or more entries of
    idx chose computed as one sgemm over its rows; `dequant(j, e, out)` writes expert e of set j
    as float32 [sizes[j], n_in]. The other entries go to `kernel(x_rows, idx_rows, 1)` (the decode
    kernels; returns one array per weight set, or one array). None when no expert has that many
    rows: the kernels take all of it."""
    big = np.nonzero(np.bincount(idx) >= GEMM_ROWS)[0]
    if big.size == 0:
        return None
    outs = [np.empty((idx.size, n), np.float32) for n in sizes]
    for e in big:
        entries = np.nonzero(idx == e)[0]
        # every weight set of this expert in one matrix (a SwiGLU's gate and up): one sgemm
        wf = _buffer(sum(sizes), n_in)
        start = 0
        for j, n in enumerate(sizes):
            dequant(j, e, wf[start : start + n])
            start += n
        y = matmul_rows(x2[entries // k], wf.T)
        start = 0
        for out, n in zip(outs, sizes):
            out[entries] = y[:, start : start + n]
            start += n
    rest = np.nonzero(~np.isin(idx, big))[0]
    if rest.size:
        got = kernel(np.ascontiguousarray(x2[rest // k]), np.ascontiguousarray(idx[rest]), 1)
        for out, part in zip(outs, got if isinstance(got, tuple) else (got,)):
            out[rest] = part
    return outs
