"""Resident quantized matrices repacked in tiles of 16 rows, and the decode kernels that read them.

qmm.py's kernels read MLX's own layout, where a row's values lie one after another; to use SIMD
they vectorise across the 32-value chunks of one row, which leaves a horizontal sum per group of
every row and, on AVX2, a shuffle-heavy load of the chunks (4 words apart at 4 bits). Measured on
this project's 2-core Zen 4 VM with AVX-512 masked off: 5-9 G values/s on one thread, well under
what it can multiply. A matrix that stays in memory (attention, dense MLPs, shared experts, the
routers, the output head) is read the same way every token, so at load time it is repacked once:

    words   [NB, K*bits/32, 16] uint32   word i of rows 16*t .. 16*t+15, side by side
    scales  [NB, K/group, 16]   float32  (biases alike; or bfloat16 bits, uint16, see below)

(rows past N are zero: NB = ceil(N / 16)). A kernel lane is then one output row: word i of 16
rows is one contiguous load, each of its values multiplies one x value broadcast to every lane,
and each group's sum is scaled and added per lane. No shuffle and no horizontal sum: 10-11 G
values/s on one thread, 1.1-1.8x the old kernels on the small matrices of a decode step
(benchmarks/bench_tiled.py; figures in benchmarks/log/, indexed in benchmarks/README.md). The kernel itself is an LLVM
intrinsic (`_tile_out`) that keeps every sum in a vector register across a row of groups, and
decodes each weight word once for up to ROWS x rows: 1.6-2.4x the same loops written in numba.

The values and their products are those of qmm.py: a value that does not end its word is masked
in place (q * 2**sh, exact) and x is multiplied by 2**-sh to make up for it; products are float32,
summed per group in a fixed order (the same on any vector width, since lanes are rows), then
out = sum over groups of (scale * group dot + bias * sum of the group's x). Only FMA contraction
of fastmath is on. Results equal x @ mx.dequantize(W).T to float32 rounding (tests/test_tiled.py
holds them to the same bounds as qmm.py's).

Scales and biases that are all bfloat16 values (a real MLX checkpoint's, widened to float32 on
load) are kept as their bfloat16 bits, uint16: the kernels widen them exactly as they load them,
so the results are the same floats, from 6-11% fewer bytes a matrix (4-bit and 8-bit, groups of
64) and as much less memory.

2, 4 and 8 bits (no value crosses a word) with groups of 32, 64 or 128; other widths keep
qmm.py's kernels. A resident matrix's many-row products (prefill) dequantize it and use sgemm
(gemm.py); a prefill's streamed experts run here, grouped by expert (`_grouped`).
"""

from __future__ import annotations

import re

import numpy as np
from llvmlite import ir
from numba import float32, njit, prange  # noqa: F401 - float32, prange: the generated loops use them

from flashmoe.engine.cpu import numba_cache  # noqa: F401 - before any kernel is defined (see there)
from flashmoe.engine.cpu import vector_ir as vir
from flashmoe.engine.cpu.attn import attend_steps, decode_qs, rms_norm_rows, silu_mul
from flashmoe.engine.cpu.gemm import GEMM_ROWS, _buffer, matmul_rows
from flashmoe.engine.cpu.routing import combine_rows

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
# The kernels: one intrinsic per (bits, x rows per pass), the loops around it per (bits, group size).


def _tile_out(bits: int, rows: int):
    """The float kernel as an intrinsic (vector_ir.tile_intrinsic: int8.py's argument list; dx,
    its steps, unused here): 16 outputs of one tile for `rows` x rows, each weight word decoded
    once for all of them. x row m's value k of word j (times 2**-_shift) is
    xk[m * vpw * nw + k * nw + j]; out = sum over groups of st * d + bt * xs, d the group's dot
    product, per word

        d += (q0 x0 + q4 x4) + (q1 x1 + q5 x5) + (q2 x2 + q6 x6) + (q3 x3 + q7 x7)

    (PARTIALS sums of every PARTIALS-th value; at 8 bits one product each). Only FMA contraction
    is allowed, so a row gets the same floats however many rows share its pass."""
    vpw = 32 // bits
    parts = min(PARTIALS, vpw)
    flags = tuple(KERNEL_FASTMATH)

    def setup(rows_):  # where each row's x values start
        b, e = rows_.e.b, rows_.e
        return [b.mul(m, b.mul(rows_.nw, e.const(vpw))) for m in rows_.xm]

    def word(rows_, j, w, dots):
        e, b = rows_.e, rows_.e.b
        q = []
        for k in range(vpw):  # value k of each lane's word, times 2**_shift (exact)
            sh = k * bits
            v = (
                b.and_(w, ir.Constant(vir.V16, [((1 << bits) - 1) << sh] * 16))
                if sh + bits < 32
                else b.lshr(w, ir.Constant(vir.V16, [sh] * 16))
            )
            q.append(b.sitofp(v, vir.VF16))
        for r, xrow in enumerate(rows_.state):
            xv = [e.splat(e.load(rows_.xdata, b.add(e.at(xrow, (rows_.nw, k)), j)), vir.VF16) for k in range(vpw)]
            total = None
            for p in range(parts):
                part = None
                for k in range(p, vpw, parts):
                    prod = b.fmul(q[k], xv[k], flags=flags)
                    part = prod if part is None else b.fadd(part, prod, flags=flags)
                total = part if total is None else b.fadd(total, part, flags=flags)
            dots[r] = [b.fadd(dots[r][0], total, flags=flags)]
        return dots

    def group(rows_, r, g, dots, scale, bias, xsum, total):
        b = rows_.e.b
        part = b.fadd(b.fmul(scale, dots[0], flags=flags), b.fmul(bias, xsum, flags=flags), flags=flags)
        return b.fadd(total, part, flags=flags)

    return vir.tile_intrinsic(rows, vir.VF16, 1, setup, word, group)


def _shift(bits: int, k: int) -> int:
    """Where value k of a word is left (see qmm._in_place_shift): in place unless it ends the word."""
    sh = k * bits
    return sh if sh + bits < 32 else 0


@njit(cache=True, nogil=True)
def arange(n):
    """np.arange(n) for a function compiled with parallel=True: numba makes its own np.arange a
    parallel loop there, and starting the thread pool for it cost a one-row call (a decode step's
    router, 8 x 576) 5.5 of its 8.7 us."""
    return np.arange(n)


ROWS = 4  # x rows per pass over a tile's words when a call has several

# The loops around a kernel set's intrinsics, shared by tiled.py (float) and int8.py: each
# instantiation supplies `_prepare(x)` -> (x values, their int8 steps, group sums), flat, and
# tile_out1 / tile_outs, the intrinsics for 1 and ROWS x rows, with one argument list.
SLOT_LOOPS = """
@njit(cache=True, nogil=True)
def _rows(wflat, sflat, bflat, tile, stile, nw, ng, xflat, dflat, xsflat, xrow, orow, r0, n, out, ostride, col):
    # tile `tile` of the words and `stile` of the scales and biases (counted over the flat
    # arrays) for pass rows r0 .. r0 + n - 1: x row xrow[r] into out row orow[r], columns
    # col .. col + 15; ROWS rows per pass over the tile's words
    r = r0
    while r < r0 + n:
        if r0 + n - r >= ROWS:
            tile_outs(wflat, tile * nw * 16, nw, ng, xflat, dflat, xsflat, xrow, orow, r, sflat, bflat,
                      stile * ng * 16, out, col, ostride)
            r += ROWS
        else:
            tile_out1(wflat, tile * nw * 16, nw, ng, xflat, dflat, xsflat, xrow, orow, r, sflat, bflat,
                      stile * ng * 16, out, col, ostride)
            r += 1


@njit(cache=True, nogil=True, parallel=True)
def _run(wt, st, bt, x, parallel):
    NB, nw, _ = wt.shape
    ng = st.shape[1]
    xflat, dflat, xsflat = _prepare(x)
    wflat, sflat, bflat = wt.reshape(-1), st.reshape(-1), bt.reshape(-1)
    M = x.shape[0]
    ids = arange(M)  # (not np.arange: here that is a parallel loop, a thread pool start even for one row)
    out = np.empty((M, NB * 16), np.float32)
    oflat = out.reshape(-1)
    if parallel:
        for t in prange(NB):
            _rows(wflat, sflat, bflat, t, t, nw, ng, xflat, dflat, xsflat, ids, ids, 0, M, oflat, NB * 16, t * 16)
    else:
        for t in range(NB):
            _rows(wflat, sflat, bflat, t, t, nw, ng, xflat, dflat, xsflat, ids, ids, 0, M, oflat, NB * 16, t * 16)
    return out


@njit(cache=True, nogil=True)
def _group_item(wa, sa, ba, wb, sb, bb, nw, ng, xflat, dflat, xsflat, xrow, orow, slots, starts, NA, NB, SA, SB, it,
                oa, ob):
    # work item it: tile it % (NA + NB) (bank a's NA tiles, then b's NB) of group it // (NA + NB),
    # entries starts[e] .. starts[e + 1] - 1 against slot slots[e]; a slot's scales and biases
    # take SA (SB) tiles of their arrays (twice NA where they are bfloat16 in float32 slots)
    e = it // (NA + NB)
    t = it % (NA + NB)
    r0, n = starts[e], starts[e + 1] - starts[e]
    if t < NA:
        _rows(wa, sa, ba, slots[e] * NA + t, slots[e] * SA + t, nw, ng, xflat, dflat, xsflat, xrow, orow, r0, n, oa,
              NA * 16, t * 16)
    else:
        _rows(wb, sb, bb, slots[e] * NB + t - NA, slots[e] * SB + t - NA, nw, ng, xflat, dflat, xsflat, xrow, orow,
              r0, n, ob, NB * 16, (t - NA) * 16)


@njit(cache=True, nogil=True, parallel=True)
def _grouped(wa, sa, ba, wb, sb, bb, x, xrow, orow, slots, starts, parallel):
    # P = xrow.size entries, grouped by slot: entries starts[e] .. starts[e + 1] - 1 take x row
    # xrow[i] against slot slots[e] of two banks of tiled matrices [S, NB, ., 16] (wb may have no
    # tiles) into output row orow[i]; each weight word decoded once for up to ROWS of a group's rows
    P = xrow.shape[0]
    NA, NB, nw, ng = wa.shape[1], wb.shape[1], wa.shape[2], sa.shape[2]
    SA, SB = sa.shape[1], sb.shape[1]
    xflat, dflat, xsflat = _prepare(x)
    a = (wa.reshape(-1), sa.reshape(-1), ba.reshape(-1))
    b = (wb.reshape(-1), sb.reshape(-1), bb.reshape(-1))
    oa = np.empty((P, NA * 16), np.float32)
    ob = np.empty((P, NB * 16), np.float32)
    oaf, obf = oa.reshape(-1), ob.reshape(-1)
    nit = slots.shape[0] * (NA + NB)
    if parallel:
        for it in prange(nit):
            _group_item(*a, *b, nw, ng, xflat, dflat, xsflat, xrow, orow, slots, starts, NA, NB, SA, SB, it, oaf, obf)
    else:
        for it in range(nit):
            _group_item(*a, *b, nw, ng, xflat, dflat, xsflat, xrow, orow, slots, starts, NA, NB, SA, SB, it, oaf, obf)
    return oa, ob


@njit(cache=True, nogil=True)
def _gather(wa, sa, ba, wb, sb, bb, x, xrow, slots, parallel):
    # entry i: x row xrow[i] against slot slots[i], into output row i (a decode step's experts:
    # each x row is prepared once, however many experts read it)
    ids = np.arange(slots.shape[0])
    return _grouped(wa, sa, ba, wb, sb, bb, x, xrow, ids, slots, np.arange(slots.shape[0] + 1), parallel)


@njit(cache=True, nogil=True)
def _swiglu(wa, sa, ba, wb, sb, bb, wd, sd, bd, x, xrow, slots, parallel):
    # a decode step's experts in one call: entry i, down(silu(gate(x[xrow[i]])) * up(..)) of slot slots[i]
    g, u = _gather(wa, sa, ba, wb, sb, bb, x, xrow, slots, parallel)
    none = (np.empty((1, 0, wd.shape[2], 16), wd.dtype), np.empty((1, 0, sd.shape[2], 16), sd.dtype))
    y, _ = _gather(wd, sd, bd, none[0], none[1], none[1], silu_mul(g, u), np.arange(slots.shape[0]), slots, parallel)
    return y


@njit(cache=True, nogil=True)
def _swiglu_sum(wa, sa, ba, wb, sb, bb, wd, sd, bd, x, slots, scores, shared, parallel):
    # one token x [1, D] through its k experts (slots [k]) in one call, weighted by scores [k] and
    # summed in routing.combine's order, plus shared [1, D] (or [0, D]: none)
    k = slots.shape[0]
    y = _swiglu(wa, sa, ba, wb, sb, bb, wd, sd, bd, x, np.zeros(k, np.int64), slots, parallel)
    out = np.empty((1, y.shape[1]), np.float32)
    combine_rows(y.reshape(1, k, y.shape[1]), scores.reshape(1, k), shared, out)
    return out


@njit(cache=True, nogil=True)
def _attn_half(x, w1, eps1, wq, sq, bq, bias_q, q0, k0, v0, H, Hk, hd, qn, qeps, q_per_head, kn, keps, k_per_head,
               a, b, partner, K, V, pos, scale, wo, so, bo, bias_o, w2, eps2, par_q, par_o):
    # a pre-norm decoder layer's attention block for one decoding token x [1, D] in one call
    # (fused.CpuDecoderLayer): h = x + o(attend(qkv(norm1(x)))), this position's k and v written
    # into K, V at pos; returns h and norm2(h). The arithmetic of CpuAttention.decode_np, op for op.
    n1 = x.copy()
    rms_norm_rows(n1, w1, eps1)
    row = _run(wq, sq, bq, n1, par_q)[0]
    if bias_q.shape[0]:
        row = row + bias_q
    qs = decode_qs(row, q0, k0, v0, H, Hk, hd, qn, qeps, q_per_head, kn, keps, k_per_head, a, b, partner, K, V, pos,
                   scale)
    o = _run(wo, so, bo, attend_steps(qs, K, V, pos + 1).reshape(1, -1), par_o)
    h = np.empty_like(x)
    for d in range(x.shape[1]):
        h[0, d] = x[0, d] + (o[0, d] + bias_o[d] if bias_o.shape[0] else o[0, d])
    n2 = h.copy()
    rms_norm_rows(n2, w2, eps2)
    return h, n2
"""


def tagged(src: str, tag: str) -> str:
    """src with every function it defines renamed name + tag: numba caches a function by its
    qualified name, so each instantiation of a template needs its own names."""
    for name in re.findall(r"^def (\w+)\(", src, flags=re.M):
        src = re.sub(rf"\b{name}\(", f"{name}{tag}(", src)
    return src


_PREPARE = """
@njit(cache=True, fastmath=False, nogil=True)
def _prepare(x):
    # x values laid out for the kernel: value k of word i of row m at [m, k, i], times 2**-_shift;
    # no int8 steps; each group's sum
    M, K = x.shape
    nw = K // VPW
    xk = np.empty((M, VPW, nw), np.float32)
    xs = np.empty((M, K // GS), np.float32)
    for m in range(M):
        for i in range(nw):
            for k in range(VPW):
                xk[m, k, i] = x[m, i * VPW + k] * XSCALE[k]
        for g in range(K // GS):
            a = float32(0.0)
            for j in range(g * GS, (g + 1) * GS):
                a += x[m, j]
            xs[m, g] = a
    return xk.reshape(-1), np.empty(0, np.float32), xs.reshape(-1)
"""


ENTRIES = ("run", "gather", "swiglu", "swiglu_sum", "grouped", "attn_half")


def instantiate(prepare: str, tag: str, ns: dict, filename: str) -> dict:
    """Compile SLOT_LOOPS after a kernel set's `_prepare` source, every name tagged, in ns (which
    holds the intrinsics and constants): the entry points ENTRIES."""
    # what the loops call besides their own
    ns.update(
        silu_mul=silu_mul,
        combine_rows=combine_rows,
        rms_norm_rows=rms_norm_rows,
        decode_qs=decode_qs,
        attend_steps=attend_steps,
        arange=arange,
    )
    exec(compile(tagged(prepare + SLOT_LOOPS, tag), filename, "exec"), ns)  # noqa: S102 - our own template
    return {what: ns[f"_{what}{tag}"] for what in ENTRIES}


def _kernel_source(bits: int, gs: int) -> str:
    """The numba source of the loops for one (bits, group size): print it to read what runs."""
    return tagged(_PREPARE + SLOT_LOOPS, f"{bits}_{gs}")


_compiled: dict = {}


def _kernel(bits: int, gs: int):
    fn = _compiled.get((bits, gs))
    if fn is None:
        ns = dict(
            globals(),
            tile_out1=_tile_out(bits, 1),
            tile_outs=_tile_out(bits, ROWS),
            VPW=32 // bits,
            GS=gs,
            XSCALE=np.array([2.0 ** -_shift(bits, k) for k in range(32 // bits)], np.float32),
        )
        fns = instantiate(_PREPARE, f"{bits}_{gs}", ns, __file__)
        fn = _compiled[(bits, gs)] = fns["run"]
        for what in ENTRIES[1:]:
            _compiled[(what, bits, gs)] = fns[what]
    return fn


def gather_kernel(bits: int, gs: int, what: str = "gather"):
    """An entry point of the slot-bank kernels (engine/cpu/tiled_experts.py) for one format:
    "gather" (one or two projections), "swiglu" (a decode step's gate, up, SiLU and down),
    "swiglu_sum" (the same, weighted and summed), "grouped" (a prefill's entries grouped by
    slot, each reading its token's row), or "attn_half" (a decode step's attention block)."""
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
            sc, bi = vir.as_f32(st[t, g, l]), vir.as_f32(bt[t, g, l])
            for i in range(g * words, (g + 1) * words):
                v = wt[t, i, l]
                for k in range(vpw):
                    out[j, i * vpw + k] = float32((v >> np.uint32(k * bits)) & mask) * sc + bi


def bf16_exact(a: np.ndarray) -> bool:
    """Whether every float32 value of `a` is a bfloat16 value (its low 16 bits are zero)."""
    return not (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) & 0xFFFF).any()


def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values that are bfloat16 values (bf16_exact) as their bfloat16 bits, uint16."""
    return (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def widened(a: np.ndarray) -> np.ndarray:
    """Scales or biases as float32, from float32 or bfloat16 bits."""
    return a if a.dtype == np.float32 else (a.astype(np.uint32) << 16).view(np.float32)


class Tiled:
    """A quantized matrix [N, K] (MLX's affine format) in tiles of 16 rows, for the CPU kernels.

    Build one with `Tiled.from_mlx` (several share one with `Tiled.stack`); `matmul(x2)` is
    x2 @ dequantize(W).T, `rows(ids)` the dequantized rows (an embedding lookup)."""

    def __init__(self, wt, st, bt, n: int, bits: int, gs: int):
        self.wt, self.st, self.bt = wt, st, bt
        self.n, self.bits, self.gs = n, bits, gs
        self.k = wt.shape[1] * 32 // bits
        self._fn = None  # the compiled kernel, found on first use
        self.int8 = False  # rows on int8 activations (int8.py, --kernels cpu-int8)

    @classmethod
    def from_mlx(
        cls, w: np.ndarray, s: np.ndarray, b: np.ndarray, bits: int, gs: int, bf16: bool | None = None
    ) -> "Tiled":
        """w uint32 [N, K*bits/32], s / b float32 [N, K/gs]: MLX's packed weights, scales, biases.
        Scales and biases are kept as bfloat16 bits when every one is a bfloat16 value (`bf16`
        None), or when `bf16` says so (they must then be)."""
        if not supports(bits, gs):
            raise ValueError(f"no tiled kernels for {bits}-bit, group size {gs}")
        s, b = (np.ascontiguousarray(a, dtype=np.float32) for a in (s, b))
        if bf16 is None:
            bf16 = bf16_exact(s) and bf16_exact(b)
        if bf16:
            s, b = to_bf16(s), to_bf16(b)
        nb = -(-w.shape[0] // TILE)
        wt = np.zeros((nb, w.shape[1], TILE), np.uint32)
        st = np.zeros((nb, s.shape[1], TILE), s.dtype)
        bt = np.zeros((nb, s.shape[1], TILE), s.dtype)
        _repack(np.ascontiguousarray(w).view(np.uint32), s, b, wt, st, bt)
        return cls(wt, st, bt, w.shape[0], bits, gs)

    @classmethod
    def stack(cls, parts: list["Tiled"]) -> tuple["Tiled", list["Tiled"], list[int]]:
        """Several tiled matrices of one width and format as one (each starts on a tile, so the
        rows between them are the parts' padding); returns it, a view of each part in it (the
        parts' own arrays can go), and the output column where each part starts."""
        first = parts[0]
        if any((p.k, p.bits, p.gs) != (first.k, first.bits, first.gs) for p in parts):
            raise ValueError("parts differ in width or format")
        same = len({p.st.dtype for p in parts}) == 1  # (else every part's scales as float32)
        wt, st, bt = (
            np.concatenate([getattr(p, a) if same or a == "wt" else widened(getattr(p, a)) for p in parts])
            for a in ("wt", "st", "bt")
        )
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
        """x2 [M, K] float32 -> [M, N]: the kernels below GEMM_ROWS rows, else dequantize + sgemm
        (int8 kernels take every row count where int8.many_rows()).
        The result may be a view with a row stride past N (its last tile's padding)."""
        self._setup()
        if x2.shape[0] >= GEMM_ROWS and not self._all_rows:
            return matmul_rows(x2, self.dequantize(out=_buffer(self.n, self.k)).T)
        out = self._fn(self.wt, self.st, self.bt, x2, x2.shape[0] >= self._parallel_rows)
        return out if out.shape[1] == self.n else out[:, : self.n]

    def _setup(self) -> None:
        if self._fn is None:  # once: the kernel, and from how many x rows a call uses every core
            from flashmoe.engine.cpu.qmm import SERIAL_BELOW, SERIAL_BELOW_WITHOUT_TBB, threading_layer

            serial_below = SERIAL_BELOW if threading_layer() == "tbb" else SERIAL_BELOW_WITHOUT_TBB
            if self.int8:
                from flashmoe.engine.cpu import int8

                serial_below *= int8.serial_factor()
                self._fn = int8.kernel(self.bits, self.gs)
                self._all_rows = int8.many_rows()  # the kernel takes a prefill's rows too
            else:
                self._fn = _kernel(self.bits, self.gs)
                self._all_rows = False
            self._parallel_rows = -(-serial_below // (self.wt.shape[0] * TILE * self.k))

    def run_kernel(self):
        """The kernel `matmul` calls for the rows it takes (float or int8, as switched):
        fn(wt, st, bt, x2, parallel) -> [M, tiles * 16]."""
        self._setup()
        return self._fn

    def entry(self, what: str):
        """Another entry point of the kernel set `matmul` runs on (gather_kernel's names): the
        float or the int8 one, as this matrix is switched."""
        if self.int8:
            from flashmoe.engine.cpu import int8

            return int8.gather_kernel(self.bits, self.gs, what)
        return gather_kernel(self.bits, self.gs, what)

    @property
    def one_row_parallel(self) -> bool:
        """Whether `matmul` of one x row runs on every core."""
        self._setup()
        return self._parallel_rows <= 1

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
        t = Tiled.from_mlx(
            np.zeros((1, gs * bits // 32), np.uint32),
            np.zeros((1, 1), np.float32),
            np.zeros((1, 1), np.float32),
            bits,
            gs,
        )
        t.matmul(np.zeros((1, gs), np.float32))
