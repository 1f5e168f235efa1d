"""Quantized matmuls on int8 activations with the CPU's integer dot product (`--kernels cpu-int8`).

llama.cpp multiplies its quantized weights with activations quantized to int8 and sums the
products with VPDPBUSD (AVX-512 VNNI): 64 unsigned-byte x signed-byte products in one
instruction. The tiled layout (tiled.py: word i of 16 rows side by side) fits it without a
shuffle: at 8 bits a word of one row holds 4 consecutive values, so one 16-lane load is 16 rows x
4 values, and VPDPBUSD against those 4 x values (one int32, broadcast) adds each row's 4 products
into its own lane. At 4 bits a word holds 8 values: the low nibbles (w & 0x0F0F0F0F) are values
0, 2, 4, 6 and the high ones values 1, 3, 5, 7, so x is laid out in that order, once per call.

Per group of g values of x, two int8 terms: dx0 = max|x| / 127, q0 = round(x / dx0) in
[-127, 127]; then the same for what that left, r = x - dx0 * q0 (dx1 = max|r| / 127, q1), so
x ~ dx0 * q0 + dx1 * q1 to about 1/64000 of the group's largest value; and the group's exact
float sum xs. Row r's output is the sum over groups of
    scale[r, g] * (dx0 * dot(q, q0) + dx1 * dot(q, q1)) + bias[r, g] * xs,
the dots in integers. One term is what llama.cpp does (Q8 activations): 2-5% of the largest
output off when a channel is an outlier (SmolLM2's hidden state has some), which moved the top
token on 1 in 5 decode steps of the dense 4-bit model; the second term costs a quarter to a third
more time and brings the error to about 1e-4 (benchmarks/RESULTS.md). It is still not the float
kernels' arithmetic, so greedy tokens may differ from mlx-lm's: an explicit option, never the
default (tests/test_int8.py holds the kernel to its definition and to the float product).

VPDPBUSD is emitted through an LLVM intrinsic (numba.extending.intrinsic). On a CPU without
AVX-512 VNNI the same kernel is generated from plain vector IR (widen, multiply, add each lane's
4 products): the same integers, about a quarter of the speed. The kernel keeps its sums in vector
registers and reads each weight word once for up to ROWS x rows (vector_ir.py), which made prefill
on int8 activations beat dequantize + sgemm: with `--kernels cpu-int8` every row count runs here.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import float32, int32, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from flashmoe.engine.cpu import tiled, vector_ir as vir
from flashmoe.engine.cpu.attn import silu_mul  # noqa: F401 - the loops call it

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# A call runs on every core from SERIAL_FACTOR times the float kernels' size (qmm.SERIAL_BELOW):
# 3-4x faster per value, so a thread pool's start costs more of a call. Measured (4-bit g64, one
# row, TBB): 576 x 576 16 us on one thread, 32 on two; 960 x 576 23 / 20; 3072 x 576 73 / 61.
SERIAL_FACTOR = 4
ROWS = tiled.ROWS  # x rows per pass over a tile's words when a call has several (prefill)
MANY_ROWS = 16  # from how many rows a call quantizes them on every core
_I32, _V16 = vir.I32, vir.V16


def has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (as LLVM sees the host)."""
    import llvmlite.binding as llb

    return bool(llb.get_host_cpu_features().get("avx512vnni", False))


def supports(bits: int, group_size: int) -> bool:
    return bits in BITS and group_size in GROUP_SIZES


def _dot_lanes(builder, acc, w, x, vnni: bool):
    """acc[l] + sum over the 4 bytes b of lane l: unsigned w byte * signed x byte (VPDPBUSD)."""
    if vnni:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16, _V16, _V16]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [acc, w, x])
    v64i8, v64i32 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(_I32, 64)
    prod = builder.mul(builder.zext(builder.bitcast(w, v64i8), v64i32), builder.sext(builder.bitcast(x, v64i8), v64i32))
    for k in range(4):
        part = builder.shuffle_vector(prod, ir.Constant(v64i32, None), ir.Constant(_V16, [4 * l + k for l in range(16)]))
        acc = builder.add(acc, part)
    return acc


def _tile_out(bits: int, terms: int, vnni: bool, rows: int):
    """An intrinsic: tile_out(wt, w0, nw, ng, xw, dx, xs, xrow, orow, r0, st, bt, sb0, out, col, ostride)
    writes the 16 outputs of one tile for `rows` x rows, all groups in one loop that keeps the
    sums in vector registers (vector_ir.py says why), each weight word loaded once for all the rows.

    Pass row r is x row m = xrow[r0 + r] into out row o = orow[r0 + r] (a prefill's expert entries
    read their token's row and write their own: no copies of either). The tile's words are
    wt[w0 + 16 j + l] (j < nw words per row, ng groups); x row m's words
    xw[m * terms * passes * nw + (t * passes + p) * nw + j] for term t and pass p (the low (0) or
    high (1) nibbles at 4 bits, the only pass at 8), its steps dx[m * terms * ng + t * ng + g], its
    group sums xs[m * ng + g]; the tile's scales and biases st / bt[sb0 + 16 g + l].
    out[o * ostride + col + l] is set to

        sum over g of  st * (dx0 * dot0 + dx1 * dot1) + bt * xs

    with every product and sum a separate float32 operation in that order (no FMA), so a row
    gets the same floats however many rows share its call."""
    passes = 32 // bits // 4  # x words per weight word

    @intrinsic
    def tile_out(typingctx, wt, w0, nw, ng, xw, dx, xs, xrow, orow, r0, st, bt, sb0, out, col, ostride):
        sig = types.void(wt, w0, nw, ng, xw, dx, xs, xrow, orow, r0, st, bt, sb0, out, col, ostride)

        def codegen(context, builder, signature, args):
            e = vir.Emitter(builder)
            wdata, xdata, dxdata, xsdata, xrdata, ordata, stdata, btdata, odata = (
                vir.array_data(context, builder, signature, args, i) for i in (0, 4, 5, 6, 7, 8, 10, 11, 13))
            w0_, nw_, ng_, r0_, sb0_, col_, ostride_ = (e.i64(args[i]) for i in (1, 2, 3, 9, 12, 14, 15))
            wpg = builder.sdiv(nw_, ng_)
            # where row r's x words, steps, sums and outputs start
            xm = [e.i64(e.load(xrdata, builder.add(r0_, e.const(r)))) for r in range(rows)]
            om = [e.i64(e.load(ordata, builder.add(r0_, e.const(r)))) for r in range(rows)]
            xrow = [builder.mul(m, builder.mul(nw_, e.const(terms * passes))) for m in xm]
            drow = [builder.mul(m, builder.mul(ng_, e.const(terms))) for m in xm]
            srow = [builder.mul(m, ng_) for m in xm]
            orow_ = [builder.add(builder.mul(o, ostride_), col_) for o in om]
            totals = [cgutils.alloca_once_value(builder, ir.Constant(vir.VF16, [0.0] * 16)) for _ in range(rows)]
            dots = [[cgutils.alloca_once(builder, vir.V16) for _ in range(terms)] for _ in range(rows)]
            with cgutils.for_range(builder, ng_) as groups:
                g = groups.index
                for d in (d for row in dots for d in row):
                    builder.store(ir.Constant(vir.V16, [0] * 16), d)
                with cgutils.for_range(builder, wpg) as words:
                    j = builder.add(builder.mul(g, wpg), words.index)
                    w = e.vload(wdata, e.at(w0_, (j, 16)), vir.V16)
                    accs = [[builder.load(d) for d in row] for row in dots]
                    for p in range(passes):
                        wp = w if bits == 8 else builder.and_(builder.lshr(w, ir.Constant(vir.V16, [4 * p] * 16)),
                                                              ir.Constant(vir.V16, [0x0F0F0F0F] * 16))
                        for r in range(rows):
                            for t in range(terms):
                                xv = e.load(xdata, builder.add(e.at(xrow[r], (nw_, t * passes + p)), j))
                                accs[r][t] = _dot_lanes(builder, accs[r][t], wp, e.splat(xv, vir.V16), vnni)
                    for row, acc in zip(dots, accs):
                        for d, a in zip(row, acc):
                            builder.store(a, d)
                at = e.at(sb0_, (g, 16))
                scale, bias = e.vload(stdata, at, vir.VF16), e.vload(btdata, at, vir.VF16)
                for r in range(rows):
                    inner = None
                    for t in range(terms):
                        step = e.splat(e.load(dxdata, builder.add(e.at(drow[r], (ng_, t)), g)), vir.VF16)
                        term = builder.fmul(step, builder.sitofp(builder.load(dots[r][t]), vir.VF16))
                        inner = term if inner is None else builder.fadd(inner, term)
                    xsum = e.splat(e.load(xsdata, builder.add(srow[r], g)), vir.VF16)
                    part = builder.fadd(builder.fmul(scale, inner), builder.fmul(bias, xsum))
                    builder.store(builder.fadd(builder.load(totals[r]), part), totals[r])
            for r in range(rows):
                e.vstore(builder.load(totals[r]), odata, orow_[r])
            return context.get_dummy_value()

        return sig, codegen

    return tile_out


@njit(cache=True, nogil=True)
def _pack4(b0, b1, b2, b3):
    """Four int8 values as the bytes of one int32 (little-endian)."""
    return int32((b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | ((b3 & 0xFF) << 24))


@njit(cache=True, nogil=True)
def _quantize_row(x, m, gs, terms, xw, dx, xs, q, r):
    """quantize_x for row m, with q / r scratch of K values."""
    K = x.shape[1]
    ng, nw = dx.shape[2], xw.shape[3]
    for k in range(K):
        r[k] = x[m, k]
    for g in range(ng):
        s = float32(0.0)
        for k in range(g * gs, (g + 1) * gs):
            s += r[k]
        xs[m, g] = s
    for t in range(terms):
        for g in range(ng):
            amax = float32(0.0)
            for k in range(g * gs, (g + 1) * gs):
                a = r[k] if r[k] >= 0 else -r[k]
                if a > amax:
                    amax = a
            d = amax / float32(127.0)
            dx[m, t, g] = d
            inv = float32(1.0) / d if d > 0 else float32(0.0)
            for k in range(g * gs, (g + 1) * gs):
                q[k] = int32(np.rint(r[k] * inv))
                r[k] = r[k] - d * float32(q[k])
        if xw.shape[2] == 1:  # 8 bits: a word's 4 values in order
            for i in range(nw):
                xw[m, t, 0, i] = _pack4(q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3])
        else:  # 4 bits: the even values (low nibbles), then the odd ones
            for i in range(nw):
                b = 8 * i
                xw[m, t, 0, i] = _pack4(q[b], q[b + 2], q[b + 4], q[b + 6])
                xw[m, t, 1, i] = _pack4(q[b + 1], q[b + 3], q[b + 5], q[b + 7])


@njit(cache=True, nogil=True)
def _quantized(M, K, bits, gs, terms):
    nw = K * bits // 32
    return (np.empty((M, terms, 32 // bits // 4, nw), np.int32), np.empty((M, terms, K // gs), np.float32),
            np.empty((M, K // gs), np.float32))


@njit(cache=True, nogil=True)
def quantize_x(x, bits, gs, terms):
    """x [M, K] float32 -> (xw [M, terms, passes, K*bits/32] int32: the int8 values in the order
    the weight words need them, dx [M, terms, K/gs] each group's step, xs [M, K/gs] each group's
    exact sum). Term 0 is x rounded to int8 steps; term 1 (terms=2) what that left, rounded to
    steps 1/127 of its largest value: x ~ dx0 * q0 + dx1 * q1, to about 1/64000 of a group's peak."""
    M, K = x.shape
    xw, dx, xs = _quantized(M, K, bits, gs, terms)
    q = np.empty(K, np.int32)
    r = np.empty(K, np.float32)
    for m in range(M):
        _quantize_row(x, m, gs, terms, xw, dx, xs, q, r)
    return xw, dx, xs


@njit(cache=True, nogil=True, parallel=True)
def quantize_rows(x, bits, gs, terms):
    """quantize_x with the rows shared among the cores (prefill: hundreds of rows)."""
    M, K = x.shape
    xw, dx, xs = _quantized(M, K, bits, gs, terms)
    for m in prange(M):
        _quantize_row(x, m, gs, terms, xw, dx, xs, np.empty(K, np.int32), np.empty(K, np.float32))
    return xw, dx, xs


_PREPARE = """
@njit(cache=True, nogil=True)
def _prepare(x):
    # x as int8 terms (quantize_x), flat: one row on the calling thread, prefill's hundreds on every core
    if x.shape[0] >= MANY_ROWS:
        xw, dx, xs = quantize_rows(x, BITS, GS, TERMS)
    else:
        xw, dx, xs = quantize_x(x, BITS, GS, TERMS)
    return xw.reshape(-1), dx.reshape(-1), xs.reshape(-1)
"""


_compiled: dict = {}


def kernel(bits: int, gs: int, terms: int = 2, vnni: bool | None = None):
    """The compiled kernel for tiled matrices of `bits` and group size `gs`, x in `terms` int8
    terms (1: x rounded to int8, as llama.cpp does; 2: plus what that left, rounded again):
    fn(wt, st, bt, x [M, K] float32, parallel) -> [M, NB*16] float32."""
    vnni = has_vnni() if vnni is None else vnni
    key = (bits, gs, terms, vnni)
    fn = _compiled.get(key)
    if fn is None:
        ns = dict(globals(), tile_out1=_tile_out(bits, terms, vnni, 1), tile_outs=_tile_out(bits, terms, vnni, ROWS),
                  BITS=bits, GS=gs, TERMS=terms)
        fns = tiled.instantiate(_PREPARE, f"{bits}_{gs}_{terms}_{int(vnni)}", ns, __file__)
        fn = _compiled[key] = fns["run"]
        for what in ("gather", "swiglu", "grouped"):
            _compiled[(what, *key)] = fns[what]
    return fn


def gather_kernel(bits: int, gs: int, what: str = "gather", terms: int = 2, vnni: bool | None = None):
    """A slot-bank entry point (tiled_experts.py) of `kernel`'s arithmetic: "gather",
    fn(wa, sa, ba, wb, sb, bb, x [R, K], xrow [P], slots [P], parallel) -> (out_a, out_b) (entry i
    reads x row xrow[i]), "swiglu", fn(gate, up and down banks, x, xrow, slots, parallel) ->
    down(silu(gate) * up) [P, N_down], or "grouped" (tiled.gather_kernel)."""
    vnni = has_vnni() if vnni is None else vnni
    kernel(bits, gs, terms, vnni)
    return _compiled[(what, bits, gs, terms, vnni)]


def use_int8(model) -> int:
    """Switch every tiled matrix that `model` reaches (its modules, the fused blocks' stacked
    matrices, a tied head behind its embedding, the streamed experts' slot banks) and int8
    kernels support to them, for every row count (decode and prefill); returns how many were
    switched (a bank counts once)."""
    import mlx.core as mx

    from flashmoe.engine.cpu.tiled import Tiled
    from flashmoe.engine.cpu.tiled_experts import TiledBank

    switched, seen, todo = set(), set(), [model]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (np.ndarray, mx.array, str, bytes, int, float, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, Tiled):
            if supports(obj.bits, obj.gs):
                obj.int8, obj._fn = True, None
                switched.add(id(obj))
            continue
        if isinstance(obj, TiledBank):  # streamed experts in tiles: every format of them or none
            if all(supports(*f) for f in obj.formats.values()):
                obj.int8 = True
                switched.add(id(obj))
            continue
        if isinstance(obj, dict):  # an mlx Module is one too: its children and parameters
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        if hasattr(obj, "__dict__") and not callable(getattr(obj, "__func__", None)):
            todo.extend(vars(obj).values())
    return len(switched)
