"""engine/cpu/qmm.py: the numba kernels against MLX's own quantize / dequantize / matmul.

Bounds. Both sides compute in float32 and sum in different orders. The brief's bound is
max|ours - ref| <= 1e-4 * (1 + max|ref|), ref = x @ mx.dequantize(W).T in float32. We also check a
bound that follows from the arithmetic: every output is a sum of K products q*s*x plus K terms
b*x; float32 summation of n terms errs by at most (n - 1) * 2^-24 * (sum of |terms|), so
|ours - exact| <= (K + 8) * 2^-24 * A with A = |x| @ (|s| q + |b|).T, and the same holds for the
reference. We test |ours - ref64| <= (K + 8) * 2^-24 * A against a float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba  # noqa: E402,F401 - required: a missing one fails here, never skips
import mlx.core as mx  # noqa: E402

from flashmoe.engine.cpu import qmm as K
from tests.helpers.kernels import check, quantize, unpack_reference

RNG = np.random.default_rng(1234)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_mlx_layout_is_a_little_endian_bit_stream(bits):
    """The layout the kernels assume, checked on random words (3 bits: values straddle words)."""
    k = 128
    packed = RNG.integers(0, 2**32, size=(3, k * bits // 32), dtype=np.uint64).astype(np.uint32)
    ones = np.ones((3, k // 32), np.float32)
    q = np.array(mx.dequantize(mx.array(packed), mx.array(ones), mx.array(0 * ones), group_size=32, bits=bits))
    assert np.array_equal(q.astype(np.int64), unpack_reference(packed, bits, k))


@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_qmm_matches_mlx(bits, gs):
    # in: one group, three groups, 20 chunks (a full block of 16 chunks and a partial one)
    for out, k in ((1, gs), (7, 3 * gs), (33, 640), (40, 1024)):
        wq, s, b, dq = quantize(RNG.standard_normal((out, k)).astype(np.float32), bits, gs)
        for m in (1, 5, 64):
            x = RNG.standard_normal((m, k)).astype(np.float32)
            check(K.qmm(x, wq, s, b, bits, gs), x, wq, s, b, dq, bits, gs)


@pytest.mark.parametrize("threads", ["serial", "parallel"])
def test_serial_and_parallel_paths(monkeypatch, threads):
    for name in ("SERIAL_BELOW", "SERIAL_BELOW_WITHOUT_TBB"):
        monkeypatch.setattr(K, name, 1 << 62 if threads == "serial" else 0)
    bits, gs = 4, 64
    wq, s, b, dq = quantize(RNG.standard_normal((100, 1024)).astype(np.float32), bits, gs)
    for m in (1, 2, 3, 17):
        x = RNG.standard_normal((m, 1024)).astype(np.float32)
        check(K.qmm(x, wq, s, b, bits, gs), x, wq, s, b, dq, bits, gs)


def test_qmm_shapes_and_dtypes():
    bits, gs = 4, 32
    wq, s, b, dq = quantize(RNG.standard_normal((9, 64)).astype(np.float32), bits, gs)
    x = RNG.standard_normal((2, 3, 64)).astype(np.float32)
    got = K.qmm(x, wq, s, b, bits, gs)
    assert got.shape == (2, 3, 9)
    check(got.reshape(6, 9), x.reshape(6, 64), wq, s, b, dq, bits, gs)
    assert K.qmm(x[0, 0], wq, s, b, bits, gs).shape == (9,)  # one vector in, one vector out
    assert K.qmm(np.zeros((0, 64), np.float32), wq, s, b, bits, gs).shape == (0, 9)
    # float16 scales / x, int32-typed packed words: converted
    got16 = K.qmm(x.astype(np.float16), wq.view(np.int32), s.astype(np.float16), b.astype(np.float16), bits, gs)
    x16 = x.astype(np.float16).astype(np.float32)
    s16, b16 = s.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32)
    ref = x16 @ (np.repeat(s16, gs, -1) * unpack_reference(wq, bits, 64) + np.repeat(b16, gs, -1)).T
    np.testing.assert_allclose(got16, ref, rtol=1e-5, atol=1e-4)


def test_qmm_mx_matches_quantized_matmul():
    bits, gs = 4, 64
    w = mx.array(RNG.standard_normal((48, 256)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.array(RNG.standard_normal((3, 256)).astype(np.float32)) * 2  # lazy: to_numpy evaluates it
    got = K.qmm_mx(x, wq, s, b, bits, gs)
    assert isinstance(got, mx.array) and got.dtype == mx.float32
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
    assert np.abs(np.array(got) - np.array(ref)).max() <= 1e-4 * (1 + np.abs(np.array(ref)).max())


def test_to_numpy_converts_half_scales():
    a = mx.array(RNG.standard_normal((4, 8)).astype(np.float32))
    for dt in (mx.bfloat16, mx.float16):
        h = a.astype(dt)
        got = K.to_numpy(h)
        assert got.dtype == np.float32
        assert np.array_equal(got, np.array(h.astype(mx.float32)))
    f = K.to_numpy(a)
    assert f.dtype == np.float32 and np.shares_memory(f, K.to_numpy(a))  # float32: a view of the mx buffer


@pytest.mark.parametrize("bits,gs", [(4, 64), (3, 32), (8, 128), (2, 64)])
def test_gather_qmm_matches_mlx(bits, gs):
    E, out, k = 5, 24, 2 * gs
    wq, s, b, dq = quantize(RNG.standard_normal((E, out, k)).astype(np.float32), bits, gs)
    # MoE up-projection: x [T, in], indices [T, top] (unsorted, repeated experts across tokens)
    x = RNG.standard_normal((6, k)).astype(np.float32)
    idx = np.array([[3, 1], [1, 3], [0, 4], [4, 4], [2, 0], [1, 1]], dtype=np.uint32)
    got = K.gather_qmm(x, wq, s, b, idx, bits, gs)
    assert got.shape == (6, 2, out)
    for t in range(6):
        for j in range(2):
            e = idx[t, j]
            check(got[t, j][None], x[t][None], wq[e], s[e], b[e], dq[e], bits, gs)
    ref = mx.gather_qmm(
        mx.array(x)[:, None, None, :],
        mx.array(wq),
        mx.array(s),
        mx.array(b),
        rhs_indices=mx.array(idx),
        transpose=True,
        group_size=gs,
        bits=bits,
    )
    ref = np.array(ref).reshape(6, 2, out)
    assert np.abs(got - ref).max() <= 1e-4 * (1 + np.abs(ref).max())
    # down-projection: one x row per (token, expert) pair, indices [P]
    xp = RNG.standard_normal((7, k)).astype(np.float32)
    idx_p = np.array([4, 0, 4, 2, 2, 2, 1])
    got_p = K.gather_qmm(xp, wq, s, b, idx_p, bits, gs)
    assert got_p.shape == (7, out)
    for p in range(7):
        e = idx_p[p]
        check(got_p[p][None], xp[p][None], wq[e], s[e], b[e], dq[e], bits, gs)


@pytest.mark.parametrize("threads", ["serial", "parallel"])
def test_gather_qmm_many_rows(monkeypatch, threads):
    """Prefill-like: 40 tokens x top-4 of 8 experts (odd and even numbers of rows per expert)."""
    for name in ("SERIAL_BELOW", "SERIAL_BELOW_WITHOUT_TBB"):
        monkeypatch.setattr(K, name, 1 << 62 if threads == "serial" else 0)
    bits, gs, E, out, k = 4, 64, 8, 64, 512
    wq, s, b, dq = quantize(RNG.standard_normal((E, out, k)).astype(np.float32), bits, gs)
    x = RNG.standard_normal((40, k)).astype(np.float32)
    idx = np.stack([RNG.permutation(E)[:4] for _ in range(40)])
    got = K.gather_qmm(x, wq, s, b, idx, bits, gs)
    ref = np.einsum("tk,tjok->tjo", x.astype(np.float64), dq[idx].astype(np.float64))
    assert np.abs(got - ref).max() <= 1e-4 * (1 + np.abs(ref).max())
    mx_ref = K.gather_qmm_mx(mx.array(x), mx.array(wq), mx.array(s), mx.array(b), mx.array(idx), bits, gs)
    assert np.array_equal(np.array(mx_ref), got)


def test_errors():
    wq, s, b, _ = quantize(RNG.standard_normal((4, 64)).astype(np.float32), 4, 32)
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="bits"):
        K.qmm(x, wq, s, b, 5, 32)
    with pytest.raises(ValueError, match="group_size"):
        K.qmm(x, wq, s, b, 4, 16)
    with pytest.raises(ValueError, match="features"):
        K.qmm(np.zeros((1, 32), np.float32), wq, s, b, 4, 32)
    with pytest.raises(ValueError, match="features"):
        K.qmm(x, wq, s, b, 8, 32)  # wrong bits for these words
    with pytest.raises(IndexError):
        K.gather_qmm(x, wq[None], s[None], b[None], np.array([1]), 4, 32)
    with pytest.raises(ValueError, match="indices"):
        K.gather_qmm(np.zeros((2, 64), np.float32), wq[None], s[None], b[None], np.array([0, 0, 0]), 4, 32)


@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("bits,gs,k,rows", [(4, 64, 768, 1), (8, 64, 576, 1), (3, 32, 320, 5), (2, 128, 1024, 12)])
def test_gather_qmm_pair_equals_two_calls(monkeypatch, threads, bits, gs, k, rows):
    """The gate/up pair in one call gives exactly what two gather_qmm calls give (one row: the
    virtual-row path for 576 and 768 values; several rows: pairs of x rows)."""
    for name in ("SERIAL_BELOW", "SERIAL_BELOW_WITHOUT_TBB"):
        monkeypatch.setattr(K, name, 1 << 62 if threads == "serial" else 0)
    E, out = 6, 40
    a = quantize(RNG.standard_normal((E, out, k)).astype(np.float32), bits, gs)[:3]
    b = quantize(RNG.standard_normal((E, out, k)).astype(np.float32), bits, gs)[:3]
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    idx = np.stack([RNG.permutation(E)[:3] for _ in range(rows)])
    ga, gb = K.gather_qmm_pair(x, a, b, idx, bits, gs)
    assert np.array_equal(ga, K.gather_qmm(x, *a, idx, bits, gs))
    assert np.array_equal(gb, K.gather_qmm(x, *b, idx, bits, gs))
    with pytest.raises(ValueError, match="differ in shape"):
        K.gather_qmm_pair(x, a, tuple(t[:, :8] for t in b), idx, bits, gs)


@pytest.mark.parametrize("threads", ["serial", "parallel"])
def test_kernel_calls_release_the_gil(monkeypatch, threads):
    """While one thread is inside a long kernel call, another thread keeps running Python (the
    expert store's readers must not wait for a matmul to end). numba releases the GIL around a
    parallel loop by itself, but a call on one thread (small calls; every call below ~8 ms of
    work without TBB) held it for the whole call before the entry points were marked nogil."""
    import threading
    import time

    for name in ("SERIAL_BELOW", "SERIAL_BELOW_WITHOUT_TBB"):
        monkeypatch.setattr(K, name, 1 << 62 if threads == "serial" else 0)
    wq, s, b, _ = quantize(RNG.standard_normal((2048, 4096)).astype(np.float32), 4, 64)
    x = RNG.standard_normal((512, 4096)).astype(np.float32)  # a call of ~0.1 s
    K.qmm(x[:1], wq, s, b, 4, 64)  # compiled or loaded before timing
    t = time.perf_counter()
    K.qmm(x, wq, s, b, 4, 64)
    call = time.perf_counter() - t
    done = threading.Event()
    worker = threading.Thread(target=lambda: (K.qmm(x, wq, s, b, 4, 64), done.set()))
    gaps, last = [], time.perf_counter()
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    worker.join()
    assert max(gaps) < 0.25 * call, (max(gaps), call)
