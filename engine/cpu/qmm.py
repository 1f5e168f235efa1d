"""Fast CPU kernels (numba) for MLX's affine quantized matmul, on MLX's packed layout.

MLX on an x86 CPU runs `quantized_matmul` / `gather_qmm` as a scalar loop on one thread (~0.7 GB/s
of 4-bit weights). These kernels compute the same products from the same bytes -- the packed
uint32 weights, scales and biases exactly as MLX stores them, read in place (no repacked copy) --
with SIMD and both cores.

Layout (checked against mlx 0.32.4, see tests/test_kernels.py): a weight [out, in] quantized with
`mx.quantize(w, group_size, bits)` is `packed` uint32 [out, in*bits/32], `scales` and `biases`
[out, in/group_size]. Each row is one little-endian bit stream: value k of the row occupies bits
[k*bits, (k+1)*bits) of the row's bytes, least significant bit first. For bits 2, 4, 8 a value
never crosses a word; for 3 bits, values 10 and 21 of every 32 cross a uint32 boundary (32 values
fill exactly 3 words). Dequantized weight = scale * q + bias, per group of `group_size` values.

API (numpy in, numpy out; see `qmm_mx` / `gather_qmm_mx` for mx.array in and out):

    qmm(x, w, scales, biases, bits, group_size)                 x [..., in] -> [..., out]
        == x @ dequantize(w, scales, biases).T
    gather_qmm(x, w, scales, biases, indices, bits, group_size)
        w [E, out, in*bits/32], scales/biases [E, out, in/gs];
        x [P, in] with indices [P]          -> [P, out]      row p uses expert indices[p]
        x [T, in] with indices [T, k]       -> [T, k, out]   row t is used with each of its k experts
        (generally: indices.size must be a multiple of x.shape[0]; each x row is used for
        indices.size // x.shape[0] consecutive entries of the flattened indices)
    gather_qmm_pair(x, (w, s, b), (w2, s2, b2), indices, bits, group_size)
        two weight sets of one shape against the same x and indices in one call (a SwiGLU's
        gate and up) -> (gather_qmm of the first, gather_qmm of the second)

x is float32 (other float dtypes are converted), w uint32, scales/biases float32 (float16 is
converted, a copy of the scales and biases on every call; convert once at load time instead, see
`to_numpy`). Results equal the float32 reference up to float32 rounding of a different summation
order: out = sum over groups of (scale * sum(q * x) + bias * sum(x)).

How it is fast: a row is split in "chunks" of 32 values (`bits` words). The chunk's 32 values are
decoded with constant masks (most are left in place, scaled by a power of two that x carries:
see `_in_place_shift`) and multiplied by x in straight-line code, into four independent running
sums, and LLVM vectorises across 16 chunks at a time (one AVX-512 register holds the same value
position of 16 chunks). x is permuted once per call so these loads are contiguous. The chunk
dots are then scaled per group (vectorised across groups) and summed in 16 lanes. Two x rows
share one decode of a weight row (many-row calls: prefill, and experts chosen by several tokens).
Of fastmath only FMA contraction is on: no reassociation, so the summation order is the one
written here whatever the machine's vector width, and NaN/Inf behave as in numpy; the price is
that LLVM only vectorises loops written with explicit lanes, which is why the code has the shape
it has (see `_rows_source`). With FMA a product and its sum are rounded once instead of twice,
so the last bits can differ from a machine without FMA -- within float32 rounding either way.

The straight-line chunk code is generated from a template (`_kernel_source(bits)`) and compiled
with `compile(..., __file__)`, so numba's on-disk cache (cache=True) works for it like for any
function of this file. Print `_kernel_source(4)` to read what runs.

The entry points release the GIL (nogil). numba lets it go around a parallel loop by itself, but
a call on one thread (small calls; without TBB, every call below ~8 ms of work) held it throughout,
and the expert store's reader threads, which run Python between their reads, waited for it.

Threads: prange over work items of ROWS_PER_ITEM output rows of one expert, on all of numba's
threads (`numba.set_num_threads`) -- by default only with numba's TBB threading layer, which needs
the `tbb` wheel (see `numba_cache._preload_tbb`). With OpenMP (numba's layer without TBB) every call waits
for the pool's second thread, and whenever something else held a core at that moment (another
process; in the engine it would be its I/O threads) that wait was 5-16 ms on this 2-vCPU VM,
20-100x the call itself. So without TBB only calls above SERIAL_BELOW_WITHOUT_TBB multiply-adds
(~8 ms on one thread) use the pool and the rest run on the calling thread: ~11-12 GB/s of 4-bit
weights instead of ~20 on an idle machine, but never a stall. With TBB a worker that is not
running simply takes no part, so a call is never much slower than on one thread. Calls below
SERIAL_BELOW run on one thread either way. Set SERIAL_BELOW_WITHOUT_TBB = SERIAL_BELOW to use
OpenMP's pool anyway (fine on an otherwise idle machine). Calls from several Python threads at
once are safe with TBB and OpenMP, not with numba's "workqueue" fallback.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import float32, njit, prange

from flashmoe.engine.cpu import numba_cache  # noqa: F401 - before any kernel is defined (see there)
from flashmoe.engine.cpu.gemm import GEMM_ROWS, dequantize, gather_grouped, matmul_t

BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)
ROWS_PER_ITEM = 64  # output rows per parallel work item (weights of one item stay in L2)
MAX_CHUNKS = 2048  # longest row: 2048 chunks of 32 values (in <= 65536)
# Calls of fewer multiply-adds (rows * out * in) than these run on the calling thread only (see
# "Threads" above): with TBB, below ~5 us of work; without, below ~8 ms of work.
SERIAL_BELOW = 1 << 17
SERIAL_BELOW_WITHOUT_TBB = 1 << 28
PREP_PARALLEL_ABOVE = 1 << 16  # rows * in above which x is permuted by all threads
VIRTUAL_ROWS_MAX_X = 64  # calls with more (x row, expert) pairs than this do not use virtual rows
# Independent sums per chunk dot: one running sum of 32 products is a chain of 32 dependent adds,
# and its latency, not the arithmetic, bounded the kernel; four chains ran it 15-25% faster.
ACCUMULATORS = 4
# The generated kernels let LLVM fuse a multiply and its add (FMA): fewer instructions, one
# rounding instead of two. Nothing else of fastmath (no reassociation, NaN/Inf as in numpy).
KERNEL_FASTMATH = {"contract"}

# --------------------------------------------------------------------------------------------
# Code generation for the per-bits kernels.

for _v in (*range(32), 255):
    globals()[f"_U{_v}"] = np.uint32(_v)  # uint32 constants for the generated code (_U0.._U31, _U255)
del _v


def _in_place_shift(bits: int, j: int) -> int:
    """The bit position at which value j of a chunk is left in its word (0: shifted down).

    A value that neither crosses a word nor is the word's top value is masked where it lies
    (q * 2**sh, exact in float32 and below 2**31, so positive as an int32) instead of shifted
    down and masked: one instruction less per value. x is multiplied by 2**-sh once per call
    to make up for it (`_x_scales`); both scalings are by powers of two, so every product is the
    same float as q * x (short of |x| < 2**-98, where the scaled copy turns subnormal and the
    product, below 1e-29, can lose low bits)."""
    sh = (j * bits) & 31
    return sh if sh + bits < 32 else 0


def _x_scales(bits: int) -> np.ndarray:
    """Per value position j of a chunk, the factor x is multiplied by (see _in_place_shift)."""
    return np.array([2.0 ** -_in_place_shift(bits, j) for j in range(32)], np.float32)


for _b in BITS:
    globals()[f"_XSCALE{_b}"] = _x_scales(_b)  # read by the generated _run{bits}
del _b


def _sum_tree(terms: list[str]) -> str:
    """Source of the pairwise sum of `terms` ((a + b) + (c + d) ...)."""
    while len(terms) > 1:
        terms = [f"({terms[k]} + {terms[k + 1]})" for k in range(0, len(terms), 2)]
    return terms[0]


def _value_expr(bits: int, j: int) -> str:
    """Expression for value j (0..31) of a 32-value chunk whose words are in w0..w{bits-1}:
    the value times 2**_in_place_shift(bits, j).

    Shift amounts and masks are uint32 constants (_U0.._U31 are module constants), so that
    everything stays in 32-bit lanes (a plain int literal would promote the uint32 words to
    int64). The caller converts through int32: LLVM vectorises int32 -> float32 in one
    instruction, but uint32 -> float32 with a slow sequence (the kernel ran 1.6x slower)."""
    off = j * bits
    wi, sh = off >> 5, off & 31
    mask = f"_U{(1 << bits) - 1}"
    if _in_place_shift(bits, j):
        return f"(w{wi} & np.uint32({((1 << bits) - 1) << sh}))"
    if sh + bits <= 32:
        e = f"(w{wi} >> _U{sh})" if sh else f"w{wi}"
        return e if sh + bits == 32 else f"({e} & {mask})"
    # the value crosses into the next word (3 bits only)
    return f"(((w{wi} >> _U{sh}) | (w{wi + 1} << _U{32 - sh})) & {mask})"


def _rows_source(bits: int, rows: int) -> str:
    """Weight rows n0..n1-1 of one expert against x rows p..p+rows-1.

    wt [out, in*bits/32], st/bt [out, groups]: the expert's weights, scales, biases;
    xq [P, blocks*512]: x permuted so that xq[p, cb*512 + j*16 + l] is value j of chunk
    cb*16 + l; xs [P, groups]: x summed per group; out[dst[p], n]: the result;
    pb, gt: scratch of 2*MAX_CHUNKS floats each. Three loops per weight row:
      1. chunk dots pb[r*MAX_CHUNKS + c] = sum_j q_j(c) x_j(c), vectorised across 16 chunks;
      2. group terms gt[r*MAX_CHUNKS + g] = scale_g * (sum of the group's chunk dots)
         + bias_g * xs_g, vectorised across groups;
      3. their sum, in 16 lanes t{r}_{i} (group g goes to lane g % 16), then the lanes summed.
    No stores alias loads of the same loop except at constant distances, so LLVM vectorises
    loops 1 and 2 with cheap run-time checks, and loop 3 has no stores.
    A row whose chunk count is not a multiple of 16 ends in a partial block, which the vector
    loop would leave to its scalar remainder (rows of 768 values ran at half speed). Instead that
    block runs all 16 lanes, reading on into the next row of the (contiguous) weights: the extra
    lanes decode finite integers, multiply the zeros xq holds past the row, and land in pb slots
    past the row's chunks, which loops 2-3 never read. Only the very last row of the array
    (n >= nsafe) would read past its end, and it takes the short loop. One x row only: with the
    same bound the two-row variant stopped vectorising (prefill ran 6x slower)."""
    L = [
        "@njit(cache=True, fastmath=KERNEL_FASTMATH)",
        f"def _rows{bits}_{rows}(wt, st, bt, xq, xs, p, n0, n1, nsafe, cpg, pb, gt, out, dst):",
        f"    nc = wt.shape[1] // {bits}",
        "    ncb = (nc + 15) // 16",
        "    ng = st.shape[1]",
        "    ngb = ng // 16",
    ]
    L += [
        "    for n in range(n0, n1):",
        "        for cb in range(ncb):",
        "            nl = 16 if cb < ncb - 1 or n < nsafe else nc - cb * 16"
        if rows == 1
        else "            nl = min(16, nc - cb * 16)",
        "            for l in range(nl):",
    ]
    L += [f"                w{i} = wt[n, cb * {16 * bits} + l * {bits} + {i}]" for i in range(bits)]
    A = ACCUMULATORS
    L += [f"                a{r}_{i} = float32(0.0)" for r in range(rows) for i in range(A)]
    for j in range(32):
        L.append(f"                q = float32(np.int32({_value_expr(bits, j)}))")
        L += [f"                a{r}_{j % A} += q * xq[p + {r}, cb * 512 + {j * 16} + l]" for r in range(rows)]
    L += [
        f"                pb[{r} * MAX_CHUNKS + cb * 16 + l] = {_sum_tree([f'a{r}_{i}' for i in range(A)])}"
        for r in range(rows)
    ]
    for cpg, kw in ((1, "if"), (2, "elif"), (4, "else")):
        L.append(f"        {kw} cpg == {cpg}:" if cpg != 4 else "        else:")
        L.append("            for g in range(ng):")
        for r in range(rows):
            dot = " + ".join(f"pb[{r} * MAX_CHUNKS + {cpg} * g + {t}]" for t in range(cpg))
            L.append(f"                gt[{r} * MAX_CHUNKS + g] = st[n, g] * ({dot}) + bt[n, g] * xs[p + {r}, g]")
    for r in range(rows):
        L += [f"        t{r}_{i} = float32(0.0)" for i in range(16)]
    L.append("        for gb in range(ngb):")
    for r in range(rows):
        L += [f"            t{r}_{i} += gt[{r} * MAX_CHUNKS + gb * 16 + {i}]" for i in range(16)]
    L.append("        for g in range(ngb * 16, ng):")
    L += [f"            t{r}_0 += gt[{r} * MAX_CHUNKS + g]" for r in range(rows)]
    for r in range(rows):
        L.append(f"        out[dst[p + {r}], n] = {_sum_tree([f't{r}_{i}' for i in range(16)])}")
    return "\n".join(L) + "\n"


def _vrows_source(bits: int) -> str:
    """Weight rows n0..n1-1 (a multiple of rv) against one x row p, rv rows at a time as one
    "virtual row" of rv*nc chunks, rv*nc a multiple of 16: rows of 576 values (18 chunks) go 8 at
    a time, rows of 768 (24 chunks) 2 at a time, so that every block of 16 chunks is full and
    runs the vector loop (a row's own partial block wastes up to 15 of its 16 lanes). The rv rows
    are contiguous in wt, so indexing past row v reads rows v+1..v+rv-1; xt holds x tiled rv
    times in the chunk layout (see _prep_tiled), and pb the rv rows' chunk dots one after the
    other. Loops 2-3 are those of _rows_source, once per real row."""
    L = [
        "@njit(cache=True, fastmath=KERNEL_FASTMATH)",
        f"def _vrows{bits}(wt, st, bt, xt, xs, p, n0, n1, rv, cpg, pb, gt, out, dst):",
        f"    nc = wt.shape[1] // {bits}",
        "    ncb = rv * nc // 16",
        "    ng = st.shape[1]",
        "    ngb = ng // 16",
        "    lanes = min(16, ncb * 16)  # 16, left to run time as in _rows_source",
        "    for v in range(n0, n1, rv):",
        "        for cb in range(ncb):",
        "            for l in range(lanes):",
    ]
    L += [f"                w{i} = wt[v, cb * {16 * bits} + l * {bits} + {i}]" for i in range(bits)]
    A = ACCUMULATORS
    L += [f"                a0_{i} = float32(0.0)" for i in range(A)]
    for j in range(32):
        L.append(f"                q = float32(np.int32({_value_expr(bits, j)}))")
        L.append(f"                a0_{j % A} += q * xt[p, cb * 512 + {j * 16} + l]")
    L += [
        f"                pb[cb * 16 + l] = {_sum_tree([f'a0_{i}' for i in range(A)])}",
        "        for k in range(rv):",
        "            n = v + k",
        "            base = k * nc",
    ]
    for cpg, kw in ((1, "if"), (2, "elif"), (4, "else")):
        L.append(f"            {kw} cpg == {cpg}:" if cpg != 4 else "            else:")
        L.append("                for g in range(ng):")
        dot = " + ".join(f"pb[base + {cpg} * g + {t}]" for t in range(cpg))
        L.append(f"                    gt[g] = st[n, g] * ({dot}) + bt[n, g] * xs[p, g]")
    L += [f"            t{i} = float32(0.0)" for i in range(16)]
    L.append("            for gb in range(ngb):")
    L += [f"                t{i} += gt[gb * 16 + {i}]" for i in range(16)]
    L.append("            for g in range(ngb * 16, ng):")
    L.append("                t0 += gt[g]")
    L.append(f"            out[dst[p], n] = {_sum_tree([f't{i}' for i in range(16)])}")
    return "\n".join(L) + "\n"


_ITEM_TEMPLATE = """
@njit(cache=True, fastmath=False)
def _item{B}(w3, s3, b3, xq, xs, xt, rv, e, p0, p1, n0, n1, dst, out):
    # out[dst[p], n] for sorted pairs p in [p0, p1) (all on expert e) and rows n in [n0, n1)
    wt = w3[e]
    st = s3[e]
    bt = b3[e]
    cpg = (wt.shape[1] // {B}) // st.shape[1]
    # rows whose last, partial block of chunks may read on into the next row (see _rows_source)
    nsafe = wt.shape[0] if e < w3.shape[0] - 1 else wt.shape[0] - 1
    pb = np.empty(2 * MAX_CHUNKS, np.float32)
    gt = np.empty(2 * MAX_CHUNKS, np.float32)
    p = p0
    while p + 1 < p1:
        _rows{B}_2(wt, st, bt, xq, xs, p, n0, n1, nsafe, cpg, pb, gt, out, dst)
        p += 2
    if p < p1:
        if rv > 1:  # whole groups of rv rows as virtual rows, the rest as single rows
            nv = n0 + (n1 - n0) // rv * rv
            _vrows{B}(wt, st, bt, xt, xs, p, n0, nv, rv, cpg, pb, gt, out, dst)
            n0 = nv
        _rows{B}_1(wt, st, bt, xq, xs, p, n0, n1, nsafe, cpg, pb, gt, out, dst)


@njit(cache=True, fastmath=False, parallel=True, nogil=True)
def _run{B}(x, idx, k, w3, s3, b3, group_size, parallel):
    xrow, dst, seg_e, seg_p0, seg_p1 = _plan(idx, k, w3.shape[0])
    P = idx.shape[0]
    N = w3.shape[1]
    xq, xs = _prep(x, xrow, group_size, parallel, _XSCALE{B})
    rv = _virtual_rows(x.shape[1] // 32, P)
    xt = _prep_tiled(x, xrow, rv, _XSCALE{B}) if rv > 1 else np.empty((0, 0), np.float32)
    nblk = (N + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    out = np.empty((P, N), np.float32)
    if parallel:
        for it in prange(seg_e.shape[0] * nblk):
            s = it // nblk
            n0 = (it % nblk) * ROWS_PER_ITEM
            _item{B}(w3, s3, b3, xq, xs, xt, rv, seg_e[s], seg_p0[s], seg_p1[s], n0, min(N, n0 + ROWS_PER_ITEM), dst, out)
    else:
        for it in range(seg_e.shape[0] * nblk):
            s = it // nblk
            n0 = (it % nblk) * ROWS_PER_ITEM
            _item{B}(w3, s3, b3, xq, xs, xt, rv, seg_e[s], seg_p0[s], seg_p1[s], n0, min(N, n0 + ROWS_PER_ITEM), dst, out)
    return out


@njit(cache=True, fastmath=False, parallel=True, nogil=True)
def _run2{B}(x, idx, k, w3a, s3a, b3a, w3b, s3b, b3b, group_size, parallel):
    # _run{B} for two weight sets of the same shape and the same x and ids (a SwiGLU's gate and
    # up): one plan, one preparation of x, one parallel region
    xrow, dst, seg_e, seg_p0, seg_p1 = _plan(idx, k, w3a.shape[0])
    P = idx.shape[0]
    N = w3a.shape[1]
    xq, xs = _prep(x, xrow, group_size, parallel, _XSCALE{B})
    rv = _virtual_rows(x.shape[1] // 32, P)
    xt = _prep_tiled(x, xrow, rv, _XSCALE{B}) if rv > 1 else np.empty((0, 0), np.float32)
    nblk = (N + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    nit = seg_e.shape[0] * nblk
    outa = np.empty((P, N), np.float32)
    outb = np.empty((P, N), np.float32)
    if parallel:
        for it in prange(2 * nit):
            s = (it % nit) // nblk
            n0 = (it % nblk) * ROWS_PER_ITEM
            if it < nit:
                _item{B}(w3a, s3a, b3a, xq, xs, xt, rv, seg_e[s], seg_p0[s], seg_p1[s], n0, min(N, n0 + ROWS_PER_ITEM), dst, outa)
            else:
                _item{B}(w3b, s3b, b3b, xq, xs, xt, rv, seg_e[s], seg_p0[s], seg_p1[s], n0, min(N, n0 + ROWS_PER_ITEM), dst, outb)
    else:
        for it in range(2 * nit):
            s = (it % nit) // nblk
            n0 = (it % nblk) * ROWS_PER_ITEM
            if it < nit:
                _item{B}(w3a, s3a, b3a, xq, xs, xt, rv, seg_e[s], seg_p0[s], seg_p1[s], n0, min(N, n0 + ROWS_PER_ITEM), dst, outa)
            else:
                _item{B}(w3b, s3b, b3b, xq, xs, xt, rv, seg_e[s], seg_p0[s], seg_p1[s], n0, min(N, n0 + ROWS_PER_ITEM), dst, outb)
    return outa, outb
"""


def _kernel_source(bits: int) -> str:
    """The numba source of the kernels for one bit width (what `_kernel(bits)` compiles)."""
    return (
        _rows_source(bits, 1)
        + "\n"
        + _rows_source(bits, 2)
        + "\n"
        + _vrows_source(bits)
        + _ITEM_TEMPLATE.replace("{B}", str(bits))
    )


# --------------------------------------------------------------------------------------------
# Shared numba helpers.


@njit(cache=True, fastmath=False)
def _plan(idx, k, E):
    """Sort (x row, expert) pairs by expert (a stable counting sort). idx: expert of each pair;
    pair i uses x row i // k. Returns xrow[p] and dst[p] (x row and output row of sorted pair
    p) and the runs of sorted pairs that share an expert: seg_e, seg_p0, seg_p1."""
    P = idx.shape[0]
    start = np.zeros(E + 1, np.int64)
    for i in range(P):
        start[idx[i] + 1] += 1
    nseg = 0
    for e in range(E):
        if start[e + 1] > 0:
            nseg += 1
        start[e + 1] += start[e]
    seg_e = np.empty(nseg, np.int64)
    seg_p0 = np.empty(nseg, np.int64)
    seg_p1 = np.empty(nseg, np.int64)
    s = 0
    for e in range(E):
        if start[e + 1] > start[e]:
            seg_e[s] = e
            seg_p0[s] = start[e]
            seg_p1[s] = start[e + 1]
            s += 1
    dst = np.empty(P, np.int64)
    for i in range(P):
        dst[start[idx[i]]] = i
        start[idx[i]] += 1
    return dst // k, dst, seg_e, seg_p0, seg_p1


@njit(cache=True, fastmath=False)
def _prep_row(x, xrow, group_size, xq, xs, p, js):
    """Permute x row xrow[p] into the chunk layout (xq[p, cb*512 + j*16 + l] = value j of chunk
    cb*16 + l, times js[j]: see _in_place_shift; zero past the last chunk) and sum it per group
    (xs[p, g], unscaled)."""
    K = x.shape[1]
    nc = K // 32
    xr = x[xrow[p]]
    xo = xq[p]
    for cb in range((nc + 15) // 16):
        nl = min(16, nc - cb * 16)
        for j in range(32):
            for l in range(nl):
                xo[cb * 512 + j * 16 + l] = xr[(cb * 16 + l) * 32 + j] * js[j]
            for l in range(nl, 16):
                xo[cb * 512 + j * 16 + l] = float32(0.0)
    for g in range(K // group_size):
        a = float32(0.0)
        for i in range(g * group_size, (g + 1) * group_size):
            a += xr[i]
        xs[p, g] = a


@njit(cache=True, fastmath=False)
def _virtual_rows(nc, P):
    """How many weight rows make one virtual row (see _vrows_source): the fewest whose chunks
    fill whole blocks of 16; 1 (off) for rows that already do, for virtual rows longer than the
    scratch, and for calls of many x rows (prefill pairs rows of x instead)."""
    rv = 1
    while (rv * nc) % 16:
        rv *= 2
    return rv if rv * nc <= MAX_CHUNKS and P <= VIRTUAL_ROWS_MAX_X else 1


@njit(cache=True, fastmath=False)
def _prep_tiled(x, xrow, rv, js):
    """x rows xrow[p] tiled rv times, in the chunk layout of _prep_row: virtual chunk c holds
    chunk c % nc of the row."""
    P = xrow.shape[0]
    nc = x.shape[1] // 32
    xt = np.empty((P, rv * nc * 32), np.float32)
    for p in range(P):
        xr = x[xrow[p]]
        for c in range(rv * nc):
            src = (c % nc) * 32
            dst = (c // 16) * 512 + c % 16
            for j in range(32):
                xt[p, dst + j * 16] = xr[src + j] * js[j]
    return xt


@njit(cache=True, fastmath=False, parallel=True)
def _prep(x, xrow, group_size, parallel, js):
    P = xrow.shape[0]
    K = x.shape[1]
    xq = np.empty((P, ((K // 32 + 15) // 16) * 512), np.float32)
    xs = np.empty((P, K // group_size), np.float32)
    if not parallel or P * K < PREP_PARALLEL_ABOVE:
        for p in range(P):
            _prep_row(x, xrow, group_size, xq, xs, p, js)
    else:
        for p in prange(P):
            _prep_row(x, xrow, group_size, xq, xs, np.int64(p), js)
    return xq, xs


_compiled: dict = {}


def _kernel(bits: int):
    """The entry point for `bits`, compiled (or loaded from the disk cache) on first use."""
    fn = _compiled.get(bits)
    if fn is None:
        ns = dict(globals())
        exec(compile(_kernel_source(bits), __file__, "exec"), ns)  # noqa: S102 - our own template
        fn = _compiled[bits] = ns[f"_run{bits}"]
        _compiled[("pair", bits)] = ns[f"_run2{bits}"]
    return fn


def _kernel_pair(bits: int):
    """The two-weight-set entry point for `bits` (see gather_qmm_pair)."""
    _kernel(bits)
    return _compiled[("pair", bits)]


# --------------------------------------------------------------------------------------------
# Public API.


def _as_f32(a: np.ndarray, what: str) -> np.ndarray:
    if a.dtype != np.float32:
        if a.dtype.kind != "f":
            raise TypeError(f"{what} must be floating point, got {a.dtype}")
        a = a.astype(np.float32)
    return np.ascontiguousarray(a)


def _check(x, w, scales, biases, bits, group_size, expert_dims):
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if w.ndim != 2 + expert_dims or scales.shape != biases.shape or scales.shape[:-1] != w.shape[:-1]:
        raise ValueError(f"shapes do not match: w {w.shape}, scales {scales.shape}, biases {biases.shape}")
    K = x.shape[-1]
    if K > 32 * MAX_CHUNKS:
        raise ValueError(f"in = {K} features is more than the kernels support ({32 * MAX_CHUNKS})")
    if K % group_size or w.shape[-1] * 32 != K * bits or scales.shape[-1] * group_size != K:
        raise ValueError(
            f"x has {K} features but w {w.shape} / scales {scales.shape} are for "
            f"{w.shape[-1] * 32 // bits} at {bits} bits, group size {group_size}"
        )
    if w.dtype != np.uint32:
        if w.dtype.itemsize != 4 or w.dtype.kind not in "iu":
            raise TypeError(f"packed weights must be uint32, got {w.dtype}")
        w = w.view(np.uint32)
    return (np.ascontiguousarray(w), _as_f32(scales, "scales"), _as_f32(biases, "biases"))


_LAYER: list = []


def threading_layer() -> str:
    """numba's threading layer ("tbb", "omp" or "workqueue"), starting it if needed."""
    if not _LAYER:
        numba.get_num_threads()  # starts the layer
        _LAYER.append(numba.threading_layer())
    return _LAYER[0]


def _call(bits, x2, idx, k, w3, s3, b3, group_size):
    serial_below = SERIAL_BELOW if threading_layer() == "tbb" else SERIAL_BELOW_WITHOUT_TBB
    parallel = idx.shape[0] * w3.shape[1] * x2.shape[1] >= serial_below
    return _kernel(bits)(x2, idx, k, w3, s3, b3, group_size, parallel)


def qmm(x, w, scales, biases, bits: int = 4, group_size: int = 64) -> np.ndarray:
    """x @ dequantize(w, scales, biases).T for MLX affine-quantized w: x [..., in] -> [..., out]."""
    x = _as_f32(np.asarray(x), "x")
    w, scales, biases = _check(x, np.asarray(w), np.asarray(scales), np.asarray(biases), bits, group_size, 0)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return np.zeros((*x.shape[:-1], w.shape[0]), np.float32)
    if x2.shape[0] >= GEMM_ROWS:  # prefill: dequantize once, then sgemm (gemm.py)
        out = matmul_t(x2, w, scales, biases, bits, group_size)
    else:
        idx = np.zeros(x2.shape[0], np.int64)
        out = _call(bits, x2, idx, 1, w[None], scales[None], biases[None], group_size)
    return out.reshape(*x.shape[:-1], w.shape[0])


def gather_qmm(x, w, scales, biases, indices, bits: int = 4, group_size: int = 64) -> np.ndarray:
    """Per-row expert matmul on stacked experts w [E, out, in*bits/32].

    x [R, in]; indices [...] with indices.size = R * k: flattened entry i is x row i // k times
    expert indices.flat[i]. Returns indices.shape + (out,). (x [T, in] with indices [T, k] is the
    MoE up-projection; x [P, in] with indices [P] the down-projection.)"""
    x = _as_f32(np.asarray(x), "x")
    w, scales, biases = _check(x, np.asarray(w), np.asarray(scales), np.asarray(biases), bits, group_size, 1)
    indices = np.asarray(indices)
    x2 = x.reshape(-1, x.shape[-1])
    R = x2.shape[0]
    if indices.size == 0 or R == 0 or indices.size % R:
        raise ValueError(f"indices {indices.shape} do not fit x {x.shape}: need a multiple of {R} entries")
    idx = np.ascontiguousarray(indices.reshape(-1), dtype=np.int64)
    E = w.shape[0]
    if idx.min() < 0 or idx.max() >= E:
        raise IndexError(f"expert index out of range 0..{E - 1}")
    k = indices.size // R
    grouped = gather_grouped(
        x2,
        idx,
        k,
        [w.shape[1]],
        x2.shape[1],
        lambda j, e, out: dequantize(w[e], scales[e], biases[e], bits, group_size, out),
        lambda xr, ir, kr: _call(bits, xr, ir, kr, w, scales, biases, group_size),
    )
    out = grouped[0] if grouped is not None else _call(bits, x2, idx, k, w, scales, biases, group_size)
    return out.reshape(*indices.shape, w.shape[1])


def gather_qmm_pair(x, a, b, indices, bits: int = 4, group_size: int = 64):
    """gather_qmm of the same x and indices against two stacked weight sets of one shape,
    a = (w, scales, biases) and b likewise, in one call (a SwiGLU's gate and up projections):
    returns (out_a, out_b), each equal to what gather_qmm gives for its set."""
    x = _as_f32(np.asarray(x), "x")
    wa, sa, ba = _check(x, *(np.asarray(t) for t in a), bits, group_size, 1)
    wb, sb, bb = _check(x, *(np.asarray(t) for t in b), bits, group_size, 1)
    if wa.shape != wb.shape:
        raise ValueError(f"the two weight sets differ in shape: {wa.shape} and {wb.shape}")
    indices = np.asarray(indices)
    x2 = x.reshape(-1, x.shape[-1])
    R = x2.shape[0]
    if indices.size == 0 or R == 0 or indices.size % R:
        raise ValueError(f"indices {indices.shape} do not fit x {x.shape}: need a multiple of {R} entries")
    idx = np.ascontiguousarray(indices.reshape(-1), dtype=np.int64)
    if idx.min() < 0 or idx.max() >= wa.shape[0]:
        raise IndexError(f"expert index out of range 0..{wa.shape[0] - 1}")
    serial_below = SERIAL_BELOW if threading_layer() == "tbb" else SERIAL_BELOW_WITHOUT_TBB

    def kernel(xr, ir, kr):
        parallel = 2 * ir.shape[0] * wa.shape[1] * xr.shape[1] >= serial_below
        return _kernel_pair(bits)(xr, ir, kr, wa, sa, ba, wb, sb, bb, group_size, parallel)

    k = indices.size // R
    sets = ((wa, sa, ba), (wb, sb, bb))
    grouped = gather_grouped(
        x2,
        idx,
        k,
        [wa.shape[1]] * 2,
        x2.shape[1],
        lambda j, e, out: dequantize(*(t[e] for t in sets[j]), bits, group_size, out),
        kernel,
    )
    oa, ob = grouped if grouped is not None else kernel(x2, idx, k)
    shape = (*indices.shape, wa.shape[1])
    return oa.reshape(shape), ob.reshape(shape)


# --------------------------------------------------------------------------------------------
# MLX glue.


def to_numpy(a) -> np.ndarray:
    """numpy view of an mx.array (evaluates it). float32 / uint32 / int arrays: zero-copy.

    bfloat16 and float16 (scales and biases of most MLX checkpoints) come back as a float32 copy:
    convert them once when loading, not per call."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        u = np.asarray(memoryview(a.view(mx.uint16)))
        return (u.astype(np.uint32) << 16).view(np.float32)
    arr = np.asarray(memoryview(a))
    return arr.astype(np.float32) if arr.dtype == np.float16 else arr


def qmm_mx(x, w, scales, biases, bits: int = 4, group_size: int = 64):
    """`qmm` on mx.arrays, returning an mx.array (a drop-in for mx.quantized_matmul(transpose=True))."""
    import mlx.core as mx

    return mx.array(qmm(to_numpy(x), to_numpy(w), to_numpy(scales), to_numpy(biases), bits, group_size))


def gather_qmm_mx(x, w, scales, biases, indices, bits: int = 4, group_size: int = 64):
    """`gather_qmm` on mx.arrays, returning an mx.array."""
    import mlx.core as mx

    return mx.array(
        gather_qmm(to_numpy(x), to_numpy(w), to_numpy(scales), to_numpy(biases), to_numpy(indices), bits, group_size)
    )


def warmup(bits=BITS) -> None:
    """Compile (first run) or load from the disk cache the kernels for these bit widths."""
    for b in bits if isinstance(bits, (tuple, list)) else (bits,):
        x = np.zeros((1, 32), np.float32)
        s = np.zeros((1, 1, 1), np.float32)
        _kernel(b)(x, np.zeros(1, np.int64), 1, np.zeros((1, 1, b), np.uint32), s, s, 32, False)
