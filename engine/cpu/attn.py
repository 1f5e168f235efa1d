"""Kernels for the small float32 steps of one decode token: RMS norm, rotary embedding from a
table and SiLU-gated products (numba), and attention of one query position over a KV cache.

MLX on the CPU spends 5-15 us of dispatch on each of these tiny ops and a sync on every eval, more
than the arithmetic; here they run on numpy views of the same buffers with no sync at all. Same
float32 arithmetic as MLX's ops (no fastmath: no reassociation, no FMA contraction), so results
agree to float32 rounding. Reductions keep 16 explicit partial sums so LLVM can vectorise them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import float32, int32, njit, prange, types
from numba.extending import intrinsic

from flashmoe.engine.cpu import numba_cache  # noqa: F401 - before any kernel is defined (see there)
from flashmoe.engine.cpu.attn_ir import LANES, dots16, half_rows, kv_f32, kv_pack, wsum


@njit(cache=True, fastmath=False, nogil=True)
def _dot(a, b, n):
    """sum(a[:n] * b[:n]) in float32 with 16 partial sums."""
    t0 = t1 = t2 = t3 = t4 = t5 = t6 = t7 = float32(0.0)
    t8 = t9 = t10 = t11 = t12 = t13 = t14 = t15 = float32(0.0)
    m = n - n % 16
    for i in range(0, m, 16):
        t0 += a[i] * b[i]
        t1 += a[i + 1] * b[i + 1]
        t2 += a[i + 2] * b[i + 2]
        t3 += a[i + 3] * b[i + 3]
        t4 += a[i + 4] * b[i + 4]
        t5 += a[i + 5] * b[i + 5]
        t6 += a[i + 6] * b[i + 6]
        t7 += a[i + 7] * b[i + 7]
        t8 += a[i + 8] * b[i + 8]
        t9 += a[i + 9] * b[i + 9]
        t10 += a[i + 10] * b[i + 10]
        t11 += a[i + 11] * b[i + 11]
        t12 += a[i + 12] * b[i + 12]
        t13 += a[i + 13] * b[i + 13]
        t14 += a[i + 14] * b[i + 14]
        t15 += a[i + 15] * b[i + 15]
    for i in range(m, n):
        t0 += a[i] * b[i]
    return (((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))) + (
        ((t8 + t9) + (t10 + t11)) + ((t12 + t13) + (t14 + t15))
    )


@njit(cache=True, fastmath=False, nogil=True)
def _sum(a, n):
    """sum(a[:n]) in float32 with 16 partial sums (as _dot)."""
    t = np.zeros(16, np.float32)
    m = n - n % 16
    for i in range(0, m, 16):
        for j in range(16):
            t[j] += a[i + j]
    for i in range(m, n):
        t[0] += a[i]
    return (((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]))) + (
        ((t[8] + t[9]) + (t[10] + t[11])) + ((t[12] + t[13]) + (t[14] + t[15]))
    )


@njit(cache=True, fastmath=False, nogil=True)
def rms_norm_rows(x, w, eps):
    """Each row of x [R, D] scaled to unit RMS, times w [D], in place (as mx.fast.rms_norm)."""
    R, D = x.shape
    for r in range(R):
        ss = _dot(x[r], x[r], D)
        n = float32(1.0) / np.sqrt(ss / float32(D) + eps)
        for d in range(D):
            x[r, d] = w[d] * (x[r, d] * n)


@njit(cache=True, fastmath=False, nogil=True)
def rope_rows(x, a, b, partner):
    """Rotary embedding of each row of x [R, D] at one position, in place:
    x[d] <- a[d] * x[d] + b[d] * x[partner[d]] (a, b: that position's table row)."""
    R, D = x.shape
    tmp = np.empty(D, np.float32)
    for r in range(R):
        for d in range(D):
            tmp[d] = a[d] * x[r, d] + b[d] * x[r, partner[d]]
        for d in range(D):
            x[r, d] = tmp[d]


@njit(cache=True, fastmath={"contract", "reassoc"}, nogil=True)
def _dots(q, Kh, t0, t1, out, o):
    """out[o + t - t0] = q . Kh[t] for t0 <= t < t1 (q [D], Kh [capacity, D]: one kv head's
    cache): 16 positions a call (attn_ir.dots16) while 16 are left and D is a multiple of 16,
    then one at a time, reassociated so that LLVM vectorises the sum over D (the order differs
    from BLAS's too; all are float32 sums)."""
    D = q.shape[0]
    t = t0
    if D % LANES == 0:
        while t + LANES <= t1:
            dots16(q, Kh, t, out, o + t - t0)
            t += LANES
    for t in range(t, t1):
        acc = float32(0.0)
        for d in range(D):
            acc += q[d] * kv_f32(Kh[t, d])
        out[o + t - t0] = acc


@njit(cache=True, nogil=True)
def _scores_block(qs, K, h, t0, t1, out):
    """out[h, j, t] = qs[h, j] . K[h, t] for t0 <= t < t1, every query head j of kv head h."""
    for j in range(qs.shape[1]):
        _dots(qs[h, j], K[h], t0, t1, out[h, j], t0)


@njit(cache=True, nogil=True)
def _scores(qs, K, T, out):
    """out[h, j, t] = qs[h, j] . K[h, t] for t < T: qs [Hk, g, D], K [Hk, capacity, D] (short
    caches: from ATTEND_BLOCKS_FROM positions `_attend_blocks` computes its scores itself)."""
    for h in range(qs.shape[0]):
        _scores_block(qs, K, h, 0, T, out)


@njit(cache=True, fastmath=False, nogil=True)
def decode_qs(row, q0, k0, v0, H, Hk, hd, qn, qeps, q_per_head, kn, keps, k_per_head, a, b, partner, K, V, pos, scale):
    """Everything of one decode step's attention between the fused q/k/v projection and the
    scores, in one call: q, k, v from `row` (the projection's output, bias added) at columns q0,
    k0, v0; the q and k RMS norms (empty weights: none; per head, or over all heads); the rotary
    embedding (a, b: this position's table row); this position's k and v written into K, V
    [Hk, capacity, hd] at `pos`; returns q * scale as [Hk, H // Hk, hd] (for `attend_qs` over
    positions 0 .. pos). The arithmetic of the separate steps (attend's), op for op."""
    q = row[q0 : q0 + H * hd].copy().reshape(H, hd)
    k = row[k0 : k0 + Hk * hd].copy().reshape(Hk, hd)
    if qn.shape[0]:
        rms_norm_rows(q if q_per_head else q.reshape(1, H * hd), qn, qeps)
    if kn.shape[0]:
        rms_norm_rows(k if k_per_head else k.reshape(1, Hk * hd), kn, keps)
    rope_rows(q, a, b, partner)
    rope_rows(k, a, b, partner)
    like = K[0, 0, 0]
    for h in range(Hk):
        for d in range(hd):
            K[h, pos, d] = kv_pack(k[h, d], like)
            V[h, pos, d] = kv_pack(row[v0 + h * hd + d], like)
    return (q * scale).reshape(Hk, H // Hk, hd)


@intrinsic
def _float_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits` (LLVM bitcast: vectorises with the loop)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@njit(inline="always", fastmath=False)
def _exp(x):
    """exp(x) in float32: Cephes' expf (range reduction by ln 2, degree-6 polynomial, 2**n from
    the exponent bits), within 1.4e-7 of the true value for x up to 88 (larger x: exp(88)); 0
    below -87.3 (also for -inf). Unlike a call to libm's expf, LLVM vectorises a loop over it:
    numba has no vector exp (no SVML). A softmax only ever passes x <= 0."""
    under = x < float32(-87.3)
    x = min(max(x, float32(-87.3)), float32(88.0))
    n = np.floor(x * float32(1.44269504088896341) + float32(0.5))
    r = x - n * float32(0.693359375) - n * float32(-2.12194440e-4)
    p = float32(1.9875691500e-4)
    p = p * r + float32(1.3981999507e-3)
    p = p * r + float32(8.3334519073e-3)
    p = p * r + float32(4.1665795894e-2)
    p = p * r + float32(1.6666665459e-1)
    p = p * r + float32(5.0000001201e-1)
    y = (p * r * r + r + float32(1.0)) * _float_from_bits(int32(n + float32(127.0)) << 23)
    return float32(0.0) if under else y


@njit(cache=True, fastmath=False, nogil=True)
def _softmax_row(x, n):
    """x[:n] to its softmax in place (one row: it stays in cache across the passes)."""
    m = x[0]
    for t in range(1, n):
        m = max(m, x[t])
    for t in range(n):
        x[t] = _exp(x[t] - m)
    total = _sum(x, n)
    for t in range(n):
        x[t] = x[t] / total


@njit(cache=True, fastmath=False, nogil=True)
def softmax_rows(s):
    """Each row of s [R, T] to its softmax, in place: max, exp and sum, divide, in one call where
    numpy took five (a decode step's 9 rows of 40 scores: 8.5 us in numpy, 2.1 here)."""
    for r in range(s.shape[0]):
        _softmax_row(s[r], s.shape[1])


def attend(q: np.ndarray, K: np.ndarray, V: np.ndarray, T: int, scale) -> np.ndarray:
    """Softmax attention of one position: q [H, D] over the first T positions of K, V
    [Hk, capacity, D] (grouped heads: head h reads kv head h // (H // Hk)). Returns [H, D].

    Short caches: scores, softmax and the weighted sum of V rows by the numba loops above and
    below; long ones in blocks (`attend_steps`). sgemm is slow on the scores' shape (K rows
    against 1-8 query rows, [T, D] x [D, g]): the loop halves attention at 1000 positions (0.21 ->
    0.09 ms for 9 heads of 64 over 3 kv heads; 1.1 -> 0.46 ms for 32 of 128 over 8;
    benchmarks/log/, indexed in benchmarks/README.md)."""
    Hk = K.shape[0]
    H, D = q.shape
    return attend_qs(np.ascontiguousarray(q * np.float32(scale)).reshape(Hk, H // Hk, D), K, V, T)


def attend_qs(qs: np.ndarray, K: np.ndarray, V: np.ndarray, T: int) -> np.ndarray:
    """`attend` of the scaled queries qs [Hk, g, D]: [Hk * g, D] (attend_steps; its 16-row
    kernels take contiguous arrays, as a KV cache's are)."""
    return attend_steps(*(np.ascontiguousarray(a) for a in (qs, K, V)), T)


@njit(cache=True, fastmath={"contract", "reassoc"}, nogil=True)
def _weighted(p, V, h, t0, n, out):
    """out[j] = sum over t < n of p[j, t] * V[h, t0 + t] for each of the g rows of p [g, >= n]
    (kv head h's query heads): a float16 cache by attn_ir.wsum (one V row of float16 fits a
    block in the L1 cache; float32 rows went slower through it than through this loop)."""
    g, D = p.shape[0], V.shape[2]
    a = np.zeros((g, D), np.float32)  # (contiguous: the sums over d vectorise, wsum takes its rows)
    if half_rows(V) and D % LANES == 0:
        for j in range(g):
            wsum(p[j], V[h], t0, n, a[j])
    else:
        for t in range(n):
            for j in range(g):
                w = p[j, t]
                for d in range(D):
                    a[j, d] += w * kv_f32(V[h, t0 + t, d])
    out[:] = a


@njit(cache=True, nogil=True)
def _values(s, V, h, T, out):
    """out[h * g + j] = sum over t < T of s[h, j, t] * V[h, t] (the softmaxed scores of kv head h's
    g query heads times its values, as `_attend_block` sums them)."""
    g = s.shape[1]
    _weighted(s[h], V, h, 0, T, out[h * g : (h + 1) * g])


@njit(cache=True, nogil=True)
def attend_steps(qs, K, V, T):
    """`attend_qs` as one numba call (the fused decode kernels call it too): from
    ATTEND_BLOCKS_FROM positions in blocks on every core (`_attend_blocks`), below it the
    scores, their softmax and the weighted sum of V's rows, one kv head at a time."""
    if T >= ATTEND_BLOCKS_FROM:
        return _attend_blocks(qs, K, V, T)
    Hk, g, D = qs.shape
    s = np.empty((Hk, g, T), np.float32)
    _scores(qs, K, T, s)
    out = np.empty((Hk * g, D), np.float32)
    for h in range(Hk):
        for j in range(g):
            _softmax_row(s[h, j], T)
        _values(s, V, h, T, out)
    return out


ATTEND_BLOCK = 256  # positions per work item of a long cache's attention
# From how many positions attention runs in blocks on every core: 9 heads of 64 over 3 kv heads,
# 300 positions 30 -> 23-32 us, 1,057: 110-113 -> 80-91 us, 4,117: 334-392 -> 274-283 us; 32 heads
# of 128 over 4, 1,057: 471-579 -> 313-344 us, 4,117: 2,029-2,237 -> 1,130-1,427 us (one call per
# layer of 30 cycled, as a decode step reads them).
ATTEND_BLOCKS_FROM = 2 * ATTEND_BLOCK


@njit(cache=True, fastmath={"contract", "reassoc"}, nogil=True)
def _attend_block(qs, K, V, h, b, t0, t1, s, m, l, acc):
    """Block b (positions t0 .. t1 - 1) of kv head h for its g query heads: the scores into s
    [g, ATTEND_BLOCK]; per query head the block's largest score m, sum of exp(score - m) l, and
    those exps times V's rows, summed, acc [D] (flash-decoding: `_attend_blocks` joins them)."""
    g = qs.shape[1]
    n = t1 - t0
    for j in range(g):
        _dots(qs[h, j], K[h], t0, t1, s[j], 0)
    for j in range(g):
        top = s[j, 0]
        for t in range(1, n):
            top = max(top, s[j, t])
        total = float32(0.0)
        for t in range(n):
            p = _exp(s[j, t] - top)
            s[j, t] = p
            total += p
        m[h, j, b] = top
        l[h, j, b] = total
    _weighted(s, V, h, t0, n, acc[h, :, b, :])


@njit(cache=True, nogil=True, parallel=True)
def _attend_blocks(qs, K, V, T):
    """attend_qs over a long cache: each (kv head, block of ATTEND_BLOCK positions) on any core,
    then per query head the blocks joined, weighted by exp(block max - overall max). Reads K and
    V once, in one pass; the sums are in another order than the softmax-then-matmul path's."""
    Hk, g, D = qs.shape
    nb = (T + ATTEND_BLOCK - 1) // ATTEND_BLOCK
    if (
        Hk * nb
    ) % 2:  # blocks of one size (a multiple of 16), an even count where it comes out so: two cores get as much
        nb += 1
    size = ((T + nb - 1) // nb + LANES - 1) // LANES * LANES
    nb = (T + size - 1) // size
    m = np.empty((Hk, g, nb), np.float32)
    l = np.empty((Hk, g, nb), np.float32)
    acc = np.empty((Hk, g, nb, D), np.float32)
    for it in prange(Hk * nb):
        h, b = it // nb, it % nb
        t0 = b * size
        _attend_block(qs, K, V, h, b, t0, min(T, t0 + size), np.empty((g, ATTEND_BLOCK), np.float32), m, l, acc)
    out = np.empty((Hk * g, D), np.float32)
    w = np.empty(nb, np.float32)
    for h in range(Hk):
        for j in range(g):
            top = m[h, j, 0]
            for b in range(1, nb):
                top = max(top, m[h, j, b])
            total = float32(0.0)
            for b in range(nb):
                w[b] = _exp(m[h, j, b] - top)
                total += w[b] * l[h, j, b]
            for d in range(D):
                a = float32(0.0)
                for b in range(nb):
                    a += w[b] * acc[h, j, b, d]
                out[h * g + j, d] = a / total
    return out


QUERY_TILE = 128  # query rows per block of the causal prefill: bounds the score matrix


@njit(cache=True, fastmath=False, nogil=True, parallel=True)
def softmax_causal(s, first):
    """In place, per row of s [N, tile, seen]: row t (absolute position first + t) sees keys
    0 .. first + t; softmax over those, zeros after. Row by row on every core: each row is read
    and written once, where numpy's five passes (mask, max, exp, sum, divide) each went over the
    whole block (9 heads x 128 rows x 1,500 keys: 7 MB, past the caches)."""
    N, tile, seen = s.shape
    for i in prange(N * tile):
        x = s[i // tile, i % tile]
        n = min(first + i % tile + 1, seen)
        _softmax_row(x, n)
        for t in range(n, seen):
            x[t] = float32(0.0)


def attend_causal(q: np.ndarray, K: np.ndarray, V: np.ndarray, scale) -> np.ndarray:
    """Causal softmax attention of a prefill chunk: q [H, T, D] are the last T of the S positions
    of K, V [Hk, S, D] (grouped heads as in `attend`). Returns [T, H, D].

    Batched matmuls (numpy's BLAS) per kv head group and tile of QUERY_TILE query rows: a tile's
    scores are [H, tile, keys it can see], so nothing T x S is held beyond one tile, and keys
    past a tile's last position are never multiplied. Each product's rows are split among the
    cores (gemm.by_rows)."""
    from flashmoe.engine.cpu.gemm import by_rows

    H, T, D = q.shape
    Hk, S = K.shape[0], K.shape[1]
    g = H // Hk
    qs = (q * np.float32(scale)).reshape(Hk, g, T, D)
    Kt = np.ascontiguousarray(K.transpose(0, 2, 1))[:, None]  # [Hk, 1, D, S]: BLAS reads it twice as fast as a view
    out = np.empty((T, H, D), np.float32)
    for t0 in range(0, T, QUERY_TILE):
        t1 = min(T, t0 + QUERY_TILE)
        first, seen = S - T + t0, S - T + t1  # absolute positions of the tile's first row, and past its last
        s = np.empty((Hk, g, t1 - t0, seen), np.float32)
        by_rows(t1 - t0, lambda a, b: np.matmul(qs[:, :, t0 + a : t0 + b], Kt[..., :seen], out=s[:, :, a:b]))
        softmax_causal(s.reshape(-1, t1 - t0, seen), first)
        o = np.empty((Hk, g, t1 - t0, D), np.float32)
        by_rows(t1 - t0, lambda a, b: np.matmul(s[:, :, a:b], V[:, None, :seen], out=o[:, :, a:b]))
        out[t0:t1] = o.reshape(H, t1 - t0, D).transpose(1, 0, 2)
    return out


@njit(cache=True, fastmath=False, nogil=True, error_model="numpy")  # (IEEE division: it vectorises)
def _silu_mul_row(g, u, out, r):
    for n in range(g.shape[1]):
        v = g[r, n]
        out[r, n] = v * (float32(1.0) / (float32(1.0) + _exp(-v))) * u[r, n]


@njit(cache=True, fastmath=False, nogil=True, parallel=True)
def _silu_mul_rows(g, u, out):
    for r in prange(g.shape[0]):
        _silu_mul_row(g, u, out, r)


SILU_ROWS_PARALLEL = 16  # from how many rows silu_mul shares them among the cores (prefill)


@njit(cache=True, fastmath=False, nogil=True)
def silu_mul(g, u):
    """silu(g) * u for g, u [R, N] (mlx-lm's SwiGLU; either may be a strided view), as a new
    contiguous array. exp is `_exp`, which LLVM vectorises (libm's expf made a prefill chunk's
    SwiGLU, 512 x 2 x 1536 values, cost 6 ms); many rows run on every core."""
    R, N = g.shape
    out = np.empty((R, N), np.float32)
    if R >= SILU_ROWS_PARALLEL:
        _silu_mul_rows(g, u, out)
    else:
        for r in range(R):
            _silu_mul_row(g, u, out, r)
    return out


def warmup() -> None:
    """Compile (first run) or load from numba's disk cache."""
    x = np.ones((1, 16), np.float32)
    rms_norm_rows(x, np.ones(16, np.float32), np.float32(1e-6))
    rope_rows(x, np.ones(16, np.float32), np.zeros(16, np.float32), np.arange(16))
    silu_mul(x, x.copy())
    softmax_rows(x.copy())
    softmax_causal(np.ones((1, 2, 4), np.float32), 2)
    _scores(np.ones((1, 1, 16), np.float32), np.ones((1, 2, 16), np.float32), 1, np.empty((1, 1, 1), np.float32))
    for kv in (np.float32, np.uint16):  # a float32 cache, and a float16 one's bits (--kv-cache float16)
        attend_steps(np.ones((1, 1, 16), np.float32), np.ones((1, 2, 16), kv), np.ones((1, 2, 16), kv), 2)
