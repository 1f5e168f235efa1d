"""Resident quantized matrices repacked in tiles of 16 rows, and the decode kernels that read them.

qmm.py's kernels read MLX's own layout, where a row's values lie one after another; to use SIMD
they vectorise across the 32-value chunks of one row, which leaves a horizontal sum per group of
every row and, on AVX2, a shuffle-heavy load of the chunks (4 words apart at 4 bits). Measured on
this project's 2-core Zen 4 VM with AVX-512 masked off: 5-9 G values/s on one thread, well under
what it can multiply. A matrix that stays in memory (attention, dense MLPs, shared experts, the
routers, the output head) is read the same way every token, so at load time it is repacked once:

    words   [NB, K*bits/32, 16] uint32   word i of rows 16*t .. 16*t+15, side by side
    scales  [NB, K/group, 16]   float32  (biases alike)

(rows past N are zero: NB = ceil(N / 16)). A kernel lane is then one output row: word i of 16
rows is one contiguous load, each of its values multiplies one x value broadcast to every lane,
and each group's sum is scaled and added per lane. No shuffle and no horizontal sum: 10-11 G
values/s on one thread, 1.1-1.8x the old kernels on the small matrices of a decode step
(benchmarks/bench_tiled.py; figures in benchmarks/RESULTS.md).

The values and their products are those of qmm.py: a value that does not end its word is masked
in place (q * 2**sh, exact) and x is multiplied by 2**-sh to make up for it; products are float32,
summed per group in a fixed order (the same on any vector width, since lanes are rows), then
out = sum over groups of (scale * group dot + bias * sum of the group's x). Only FMA contraction
of fastmath is on. Results equal x @ mx.dequantize(W).T to float32 rounding (tests/test_tiled.py
holds them to the same bounds as qmm.py's).

2, 4 and 8 bits (no value crosses a word) with groups of 32, 64 or 128; other widths keep
qmm.py's kernels. Many-row products (prefill) dequantize a tiled matrix and use sgemm (gemm.py).
"""
from __future__ import annotations

import numpy as np
from numba import float32, njit, prange

from flashmoe.engine.cpu.attn import silu_mul  # noqa: F401 - the generated kernels call it
from flashmoe.engine.cpu.gemm import GEMM_ROWS, _buffer, all_cores

TILE = 16
BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)
KERNEL_FASTMATH = {"contract"}  # FMA only: no reassociation, NaN/Inf as in numpy
# Independent partial sums per word: the values of one word are split over these, so that one
# word's products are not one chain of dependent adds.
PARTIALS = 4


def supports(bits: int, group_size: int) -> bool:
    return bits in BITS and group_size in GROUP_SIZES


# --------------------------------------------------------------------------------------------
# Generated kernels: one per (bits, group size, x rows per tile pass).


def _shift(bits: int, k: int) -> int:
    """Where value k of a word is left (see qmm._in_place_shift): in place unless it ends the word."""
    sh = k * bits
    return sh if sh + bits < 32 else 0


def _value(bits: int, k: int) -> str:
    """Value k of word w, times 2**_shift(bits, k), as a uint32 expression."""
    sh = k * bits
    if sh + bits < 32:
        return f"(w & np.uint32({((1 << bits) - 1) << sh}))"
    return f"(w >> np.uint32({sh}))"


def _tile_source(bits: int, gs: int, rows: int) -> str:
    """One tile (16 weight rows) against x rows m0 .. m0+rows-1.

    xk [M, vpw, nw]: value k of word i of x row m at xk[m, k, i] (times 2**-_shift); xs [M, ng]:
    the sum of each group of x; acc, d [rows, 16] scratch; out [M, NB*16]."""
    vpw = 32 // bits
    words = gs // vpw  # words per group
    name = f"_tile{bits}_{gs}_{rows}"
    L = ["@njit(cache=True, fastmath=KERNEL_FASTMATH, nogil=True)",
         f"def {name}(wt, st, bt, xk, xs, t, m0, acc, d, out):",
         "    ng = st.shape[1]",
         "    for l in range(16):"]
    L += [f"        acc[{r}, l] = float32(0.0)" for r in range(rows)]
    L += ["    for g in range(ng):",
          "        for l in range(16):"]
    L += [f"            d[{r}, l] = float32(0.0)" for r in range(rows)]
    L += [f"        for i in range(g * {words}, (g + 1) * {words}):"]
    L += [f"            x{r}_{k} = xk[m0 + {r}, {k}, i]" for r in range(rows) for k in range(vpw)]
    L += ["            for l in range(16):",
          "                w = wt[t, i, l]"]
    L += [f"                q{k} = float32(np.int32({_value(bits, k)}))" for k in range(vpw)]
    parts = min(PARTIALS, vpw)
    for r in range(rows):
        sums = [" + ".join(f"q{k} * x{r}_{k}" for k in range(p, vpw, parts)) for p in range(parts)]
        L.append(f"                d[{r}, l] += " + " + ".join(f"({s})" for s in sums))
    L += ["        for l in range(16):"]
    L += [f"            acc[{r}, l] += st[t, g, l] * d[{r}, l] + bt[t, g, l] * xs[m0 + {r}, g]" for r in range(rows)]
    L += ["    for l in range(16):"]
    L += [f"        out[m0 + {r}, t * 16 + l] = acc[{r}, l]" for r in range(rows)]
    return "\n".join(L) + "\n"


_RUN_TEMPLATE = """
@njit(cache=True, fastmath=False, nogil=True)
def _prep{B}_{G}(x):
    M, K = x.shape
    nw = K // {VPW}
    xk = np.empty((M, {VPW}, nw), np.float32)
    xs = np.empty((M, K // {G}), np.float32)
    for m in range(M):
        for i in range(nw):
            for k in range({VPW}):
                xk[m, k, i] = x[m, i * {VPW} + k] * _XSCALE{B}[k]
        for g in range(K // {G}):
            a = float32(0.0)
            for j in range(g * {G}, (g + 1) * {G}):
                a += x[m, j]
            xs[m, g] = a
    return xk, xs


@njit(cache=True, fastmath=False, nogil=True)
def _item{B}_{G}(wt, st, bt, xk, xs, t, m0, rows, sc, out):
    if rows == 4:
        _tile{B}_{G}_4(wt, st, bt, xk, xs, t, m0, sc[0:4], sc[4:8], out)
    elif rows == 2:
        _tile{B}_{G}_2(wt, st, bt, xk, xs, t, m0, sc[0:2], sc[2:4], out)
    else:
        _tile{B}_{G}_1(wt, st, bt, xk, xs, t, m0, sc[0:1], sc[1:2], out)


@njit(cache=True, fastmath=False, parallel=True, nogil=True)
def _run{B}_{G}(wt, st, bt, x, parallel):
    M = x.shape[0]
    NB = wt.shape[0]
    xk, xs = _prep{B}_{G}(x)
    # x rows in passes of 4, then 2, then 1: each decoded weight serves a pass's rows
    n4 = M // 4
    n2 = (M - 4 * n4) // 2
    npass = n4 + n2 + (M - 4 * n4 - 2 * n2)
    starts = np.empty(npass, np.int64)
    sizes = np.empty(npass, np.int64)
    m = 0
    for p in range(npass):
        sizes[p] = 4 if p < n4 else (2 if p < n4 + n2 else 1)
        starts[p] = m
        m += sizes[p]
    out = np.empty((M, NB * 16), np.float32)
    nit = NB * npass
    sc = np.empty((nit, 8, 16), np.float32)
    if parallel:
        for it in prange(nit):
            p = it // NB
            _item{B}_{G}(wt, st, bt, xk, xs, it % NB, starts[p], sizes[p], sc[it], out)
    else:
        for it in range(nit):
            p = it // NB
            _item{B}_{G}(wt, st, bt, xk, xs, it % NB, starts[p], sizes[p], sc[it], out)
    return out


@njit(cache=True, fastmath=False, nogil=True)
def _gather_item{B}_{G}(wa, sa, ba, wb, sb, bb, xk, xs, slots, NT, it, sc, oa, ob):
    # work item it: tile it % NT (bank a's, then b's) of entry it // NT
    i = it // NT
    t = it % NT
    s = slots[i]
    if t < wa.shape[1]:
        _tile{B}_{G}_1(wa[s], sa[s], ba[s], xk, xs, t, i, sc[0:1], sc[1:2], oa)
    else:
        _tile{B}_{G}_1(wb[s], sb[s], bb[s], xk, xs, t - wa.shape[1], i, sc[0:1], sc[1:2], ob)


@njit(cache=True, fastmath=False, parallel=True, nogil=True)
def _gather{B}_{G}(wa, sa, ba, wb, sb, bb, x, slots, parallel):
    # entry i: x row i against slot slots[i] of two banks of tiled matrices [S, NB, ., 16]
    # (wb may have no tiles): one tile of one entry per work item
    P = x.shape[0]
    NT = wa.shape[1] + wb.shape[1]
    xk, xs = _prep{B}_{G}(x)
    oa = np.empty((P, wa.shape[1] * 16), np.float32)
    ob = np.empty((P, wb.shape[1] * 16), np.float32)
    nit = P * NT
    sc = np.empty((nit, 2, 16), np.float32)
    if parallel:
        for it in prange(nit):
            _gather_item{B}_{G}(wa, sa, ba, wb, sb, bb, xk, xs, slots, NT, it, sc[it], oa, ob)
    else:
        for it in range(nit):
            _gather_item{B}_{G}(wa, sa, ba, wb, sb, bb, xk, xs, slots, NT, it, sc[it], oa, ob)
    return oa, ob


@njit(cache=True, fastmath=False, nogil=True)
def _swiglu{B}_{G}(wa, sa, ba, wb, sb, bb, wd, sd, bd, x, slots, parallel):
    # a decode step's experts in one call: entry i, down(silu(gate(x[i])) * up(x[i])) of slot slots[i]
    g, u = _gather{B}_{G}(wa, sa, ba, wb, sb, bb, x, slots, parallel)
    none = (np.empty((1, 0, wd.shape[2], 16), wd.dtype), np.empty((1, 0, sd.shape[2], 16), sd.dtype))
    y, _ = _gather{B}_{G}(wd, sd, bd, none[0], none[1], none[1], silu_mul(g, u), slots, parallel)
    return y
"""


for _b in BITS:
    globals()[f"_XSCALE{_b}"] = np.array([2.0 ** -_shift(_b, k) for k in range(32 // _b)], np.float32)
del _b


def _kernel_source(bits: int, gs: int) -> str:
    """The numba source of the kernels for one (bits, group size): print it to read what runs."""
    return ("\n".join(_tile_source(bits, gs, r) for r in (1, 2, 4))
            + _RUN_TEMPLATE.replace("{B}", str(bits)).replace("{G}", str(gs)).replace("{VPW}", str(32 // bits)))


_compiled: dict = {}


def _kernel(bits: int, gs: int):
    fn = _compiled.get((bits, gs))
    if fn is None:
        ns = dict(globals())
        exec(compile(_kernel_source(bits, gs), __file__, "exec"), ns)  # noqa: S102 - our own template
        fn = _compiled[(bits, gs)] = ns[f"_run{bits}_{gs}"]
        _compiled[("gather", bits, gs)] = ns[f"_gather{bits}_{gs}"]
        _compiled[("swiglu", bits, gs)] = ns[f"_swiglu{bits}_{gs}"]
    return fn


def gather_kernel(bits: int, gs: int, what: str = "gather"):
    """An entry point of the slot-bank kernels (engine/cpu/tiled_experts.py) for one format:
    "gather" (one or two projections) or "swiglu" (a decode step's gate, up, SiLU and down)."""
    _kernel(bits, gs)
    return _compiled[(what, bits, gs)]


# --------------------------------------------------------------------------------------------
# Repacking, dequantizing, looking rows up.


@njit(cache=True, fastmath=False, nogil=True)
def _repack(w, s, b, wt, st, bt):
    N = w.shape[0]
    for n in range(N):
        t, l = n // 16, n % 16
        for i in range(w.shape[1]):
            wt[t, i, l] = w[n, i]
        for g in range(s.shape[1]):
            st[t, g, l] = s[n, g]
            bt[t, g, l] = b[n, g]


@njit(cache=True, fastmath=False, parallel=True, nogil=True)
def _dequantize(wt, st, bt, bits, gs, rows, out):
    """Rows `rows` of the tiled matrix as float32 [len(rows), K]: q * scale + bias, rounded as
    mx.dequantize rounds it (no FMA)."""
    vpw = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    words = gs // vpw
    for j in prange(rows.shape[0]):
        t, l = rows[j] // 16, rows[j] % 16
        for g in range(st.shape[1]):
            sc, bi = st[t, g, l], bt[t, g, l]
            for i in range(g * words, (g + 1) * words):
                v = wt[t, i, l]
                for k in range(vpw):
                    out[j, i * vpw + k] = float32((v >> np.uint32(k * bits)) & mask) * sc + bi


class Tiled:
    """A quantized matrix [N, K] (MLX's affine format) in tiles of 16 rows, for the CPU kernels.

    Build one with `Tiled.from_mlx` (several share one with `Tiled.stack`); `matmul(x2)` is
    x2 @ dequantize(W).T, `rows(ids)` the dequantized rows (an embedding lookup)."""

    def __init__(self, wt, st, bt, n: int, bits: int, gs: int):
        self.wt, self.st, self.bt = wt, st, bt
        self.n, self.bits, self.gs = n, bits, gs
        self.k = wt.shape[1] * 32 // bits
        self._fn = None  # the compiled kernel, found on first use
        self.int8 = False  # decode rows on int8 activations (int8.py, --kernels cpu-int8)

    @classmethod
    def from_mlx(cls, w: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int, gs: int) -> "Tiled":
        """w uint32 [N, K*bits/32], s / b float32 [N, K/gs]: MLX's packed weights, scales, biases."""
        if not supports(bits, gs):
            raise ValueError(f"no tiled kernels for {bits}-bit, group size {gs}")
        nb = -(-w.shape[0] // TILE)
        wt = np.zeros((nb, w.shape[1], TILE), np.uint32)
        st = np.zeros((nb, s.shape[1], TILE), np.float32)
        bt = np.zeros((nb, s.shape[1], TILE), np.float32)
        _repack(np.ascontiguousarray(w).view(np.uint32), np.ascontiguousarray(s, dtype=np.float32),
                np.ascontiguousarray(b, dtype=np.float32), wt, st, bt)
        return cls(wt, st, bt, w.shape[0], bits, gs)

    @classmethod
    def stack(cls, parts: list["Tiled"]) -> tuple["Tiled", list["Tiled"], list[int]]:
        """Several tiled matrices of one width and format as one (each starts on a tile, so the
        rows between them are the parts' padding); returns it, a view of each part in it (the
        parts' own arrays can go), and the output column where each part starts."""
        first = parts[0]
        if any((p.k, p.bits, p.gs) != (first.k, first.bits, first.gs) for p in parts):
            raise ValueError("parts differ in width or format")
        wt, st, bt = (np.concatenate([getattr(p, a) for p in parts]) for a in ("wt", "st", "bt"))
        whole = cls(wt, st, bt, wt.shape[0] * TILE, first.bits, first.gs)
        views, starts, t0 = [], [], 0
        for p in parts:
            t1 = t0 + p.wt.shape[0]
            views.append(cls(wt[t0:t1], st[t0:t1], bt[t0:t1], p.n, p.bits, p.gs))
            starts.append(t0 * TILE)
            t0 = t1
        return whole, views, starts

    @property
    def nbytes(self) -> int:
        return self.wt.nbytes + self.st.nbytes + self.bt.nbytes

    def matmul(self, x2: np.ndarray) -> np.ndarray:
        """x2 [M, K] float32 -> [M, N]: the kernels below GEMM_ROWS rows, else dequantize + sgemm.
        The result may be a view with a row stride past N (its last tile's padding)."""
        if x2.shape[0] >= GEMM_ROWS:
            wf = self.dequantize(out=_buffer(self.n, self.k))
            with all_cores():
                return x2 @ wf.T
        if self._fn is None:  # once: the kernel, and from how many x rows a call uses every core
            from flashmoe.engine.cpu.qmm import SERIAL_BELOW, SERIAL_BELOW_WITHOUT_TBB, threading_layer

            serial_below = SERIAL_BELOW if threading_layer() == "tbb" else SERIAL_BELOW_WITHOUT_TBB
            if self.int8:
                from flashmoe.engine.cpu import int8

                serial_below *= int8.SERIAL_FACTOR
                self._fn = int8.kernel(self.bits, self.gs)
            else:
                self._fn = _kernel(self.bits, self.gs)
            self._parallel_rows = -(-serial_below // (self.wt.shape[0] * TILE * self.k))
        out = self._fn(self.wt, self.st, self.bt, x2, x2.shape[0] >= self._parallel_rows)
        return out if out.shape[1] == self.n else out[:, :self.n]

    def dequantize(self, rows: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The float32 rows (all N, or those asked for), as mx.dequantize gives them."""
        rows = np.arange(self.n) if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
        if out is None:
            out = np.empty((rows.shape[0], self.k), np.float32)
        _dequantize(self.wt, self.st, self.bt, self.bits, self.gs, rows, out)
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` (any shape) dequantized: ids.shape + (K,) (an embedding lookup)."""
        ids = np.asarray(ids)
        return self.dequantize(ids.reshape(-1)).reshape(*ids.shape, self.k)


def warmup(pairs=((4, 64), (8, 64))) -> None:
    """Compile (first run) or load from numba's disk cache."""
    for bits, gs in pairs:
        t = Tiled.from_mlx(np.zeros((1, gs * bits // 32), np.uint32), np.zeros((1, 1), np.float32),
                           np.zeros((1, 1), np.float32), bits, gs)
        t.matmul(np.zeros((1, gs), np.float32))
