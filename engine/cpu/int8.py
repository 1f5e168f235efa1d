"""Quantized matmuls on int8 activations with the CPU's integer dot product (`--kernels cpu-int8`).

llama.cpp multiplies its quantized weights with activations quantized to int8 and sums the
products with VPDPBUSD (AVX-512 VNNI): 64 unsigned-byte x signed-byte products in one
instruction. The tiled layout (tiled.py: word i of 16 rows side by side) fits it without a
shuffle: at 8 bits a word of one row holds 4 consecutive values, so one 16-lane load is 16 rows x
4 values, and VPDPBUSD against those 4 x values (one int32, broadcast) adds each row's 4 products
into its own lane. At 4 bits a word holds 8 values: the low nibbles (w & 0x0F0F0F0F) are values
0, 2, 4, 6 and the high ones values 1, 3, 5, 7, so x is laid out in that order, once per call.

Per group of g values of x, two int8 terms (with VNNI; one int16 term elsewhere, see below):
dx0 = max|x| / 127, q0 = round(x / dx0) in [-127, 127]; then the same for what that left,
r = x - dx0 * q0 (dx1 = max|r| / 127, q1), so x ~ dx0 * q0 + dx1 * q1 to about 1/64000 of the
group's largest value; and the group's exact float sum xs. Row r's output is the sum over groups of
    scale[r, g] * (dx0 * dot(q, q0) + dx1 * dot(q, q1)) + bias[r, g] * xs,
the dots in integers. One term is what llama.cpp does (Q8 activations): 2-5% of the largest
output off when a channel is an outlier (SmolLM2's hidden state has some), which moved the top
token on 1 in 5 decode steps of the dense 4-bit model; the second term costs a quarter to a third
more time and brings the error to about 1e-4 (benchmarks/log/, indexed in benchmarks/README.md). It is still not the float
kernels' arithmetic, so greedy tokens may differ from mlx-lm's: an explicit option, never the
default (tests/test_int8.py holds the kernel to its definition and to the float product).

VPDPBUSD is emitted through an LLVM intrinsic (numba.extending.intrinsic). Without AVX-512 VNNI
(host_x()), x is rounded to one int16 term instead, dx = max|x| / 32767, to the same accuracy:
the weights' values are paired in the int16 halves of each 32-bit lane (w & 0x00FF00FF and
(w >> 8) & 0x00FF00FF at 8 bits: values 0 and 2, 1 and 3; at 4 bits (w >> 4p) & 0x000F000F:
p and p + 4), and VPMADDWD (SSE2/AVX2, what LLVM makes of the plain vector IR written here)
multiplies them by x's pairs and adds each pair into the lane: 16 products an instruction on
AVX2, where VPMADDUBSW's two int8 terms need more multiplies than that (they share one port on Zen
2). A lane's sum over a group is at most 128 x 255 x 32767 < 2^31.

The two int8 terms on AVX2 are still here, for a host that asks for them (kernel(..., xq=
"int8x2", dot="avx2")): VPMADDUBSW (unsigned byte x signed byte, adjacent products summed to
int16, saturating) and VPMADDWD against ones, as llama.cpp does; as few multiplies as the
integers allow:
- 4 bits: a weight byte is at most 15, so a pair sums to at most 15 x 127 x 2 = 3810 and both
  nibble passes' pair sums add in int16 before one VPMADDWD;
- 8 bits: a byte w up to 255 would saturate. The kernel multiplies w - 128 instead, as
  |w - 128| (unsigned, at most 128) times x with w - 128's sign (VPSIGNB; x is never -128), at
  most 128 x 127 x 2 = 32512 a pair, and adds back 128 x the group's sum of q, which quantize_x
  stores after the x words (layout()).
The "plain" kernel is generated from plain vector IR (widen, multiply, add each lane's 4
products): the same integers, the reference the others are tested against."""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import float32, int32, njit, prange
from numba.core import cgutils

from flashmoe.engine.cpu import numba_cache  # noqa: F401 - before any kernel is defined (see there)
from flashmoe.engine.cpu import tiled, vector_ir as vir

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# A call runs on every core from serial_factor() times the float kernels' size (qmm.SERIAL_BELOW).


def serial_factor() -> int:
    """How much more work than the float kernels a call takes before it uses every core. With
    VNNI 4: 3-4x faster per value, so a thread pool's start costs more of a call (measured on 4-bit
    g64, one row, TBB: 576 x 576 16 us on one thread, 32 on two; 960 x 576 23 / 20; 3072 x 576
    73 / 61). With int16, 1: its gain per value is smaller, and in a decode step, with the weights
    coming from RAM, two cores read them faster (the upcycled demo's step on a Zen 2 VM: 16.2-16.3
    ms against 16.6-16.8 with 4)."""
    return 4 if host_x() == "int8x2" else 1


ROWS = tiled.ROWS  # x rows per pass over a tile's words when a call has several (prefill)
MANY_ROWS = 16  # from how many rows a call quantizes them on every core
_I32, _V16 = vir.I32, vir.V16


DOTS = ("vnni", "avx2", "plain")  # how a kernel sums bytes' products: best first


@functools.cache
def host_dot() -> str:
    """The best of DOTS this CPU has (as LLVM sees the host)."""
    import llvmlite.binding as llb

    features = llb.get_host_cpu_features()
    if features.get("avx512vnni", False):
        return "vnni"
    return "avx2" if features.get("avx2", False) else "plain"


def dot_name() -> str:
    """host_dot() as printed: the vector instructions this CPU offers the kernels."""
    return {"vnni": "AVX-512 VNNI", "avx2": "AVX2", "plain": "plain vector code"}[host_dot()]


XS = ("int8x2", "int8x1", "int16")  # what x is rounded to: two int8 terms, one (llama.cpp's), one int16
_X_TERMS = {"int8x2": 2, "int8x1": 1, "int16": 1}


@functools.cache
def host_x() -> str:
    """cpu-int8's x format on this CPU: two int8 terms where VPDPBUSD sums 64 byte products at
    once (VNNI); elsewhere one int16 term, whose VPMADDWD beat VPMADDUBSW's two int8 terms on
    AVX2 (a Zen 2 VM, one thread, 4096 x 2048: 8-bit 308 against 448 us, 4-bit 261 against 293;
    the float kernels 488 and 449; benchmarks/log/, indexed in benchmarks/README.md) at the same accuracy."""
    return "int8x2" if host_dot() == "vnni" else "int16"


def x_name() -> str:
    """host_x() as printed."""
    return {"int8x2": "int8 activations", "int16": "int16 activations"}[host_x()]


def many_rows() -> bool:
    """Whether the int8 kernels take a prefill's many rows too, or leave them to the float path
    (dequantize + sgemm; grouped float kernels for experts). With VNNI they beat it at every row
    count; with AVX2 they did not (a Zen 2 VM, 1k-token prompt: the dense model 207.7 against 246.9
    tok/s, the demo 134.5 against 158.6; benchmarks/log/, indexed in benchmarks/README.md), so there cpu-int8 is the float
    path's prefill and int8 decode."""
    return host_dot() == "vnni"


def supports(bits: int, group_size: int) -> bool:
    return bits in BITS and group_size in GROUP_SIZES


def _dot_lanes(builder, acc, pairs, dot: str, bits: int):
    """acc[l] + for each (w, x) of pairs the sum over the 4 bytes b of lane l of unsigned w byte
    * signed x byte (VPDPBUSD); at 8 bits (avx2) w holds its bytes minus 128 (see the module's
    docstring: the caller adds the 128s back)."""
    if dot == "avx2":
        return _dot_lanes_avx2(builder, acc, pairs, bits)
    for w, x in pairs:
        if dot == "vnni":
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_V16, [_V16, _V16, _V16]), "llvm.x86.avx512.vpdpbusd.512"
            )
            acc = builder.call(fn, [acc, w, x])
            continue
        v64i8, v64i32 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(_I32, 64)
        prod = builder.mul(
            builder.zext(builder.bitcast(w, v64i8), v64i32), builder.sext(builder.bitcast(x, v64i8), v64i32)
        )
        for k in range(4):
            part = builder.shuffle_vector(
                prod, ir.Constant(v64i32, None), ir.Constant(_V16, [4 * l + k for l in range(16)])
            )
            acc = builder.add(acc, part)
    return acc


def _dot_lanes_avx2(builder, acc, pairs, bits: int):
    """_dot_lanes on each 256-bit half with VPMADDUBSW, the pairs' int16 sums added, one VPMADDWD."""
    v8, v32i8, v16i16 = ir.VectorType(_I32, 8), ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16)
    mod = builder.module
    ubsw = cgutils.get_or_insert_function(mod, ir.FunctionType(v16i16, [v32i8, v32i8]), "llvm.x86.avx2.pmadd.ub.sw")
    wd = cgutils.get_or_insert_function(mod, ir.FunctionType(v8, [v16i16, v16i16]), "llvm.x86.avx2.pmadd.wd")
    sign = cgutils.get_or_insert_function(mod, ir.FunctionType(v32i8, [v32i8, v32i8]), "llvm.x86.avx2.psign.b")
    absb = cgutils.get_or_insert_function(mod, ir.FunctionType(v32i8, [v32i8, ir.IntType(1)]), "llvm.abs.v32i8")
    assert len(pairs) <= (2 if bits == 4 else 1)  # int16 sums: two of at most 3810 (4 bits), one of 32512 (8)
    halves = []
    for h in range(2):
        lanes = ir.Constant(v8, list(range(8 * h, 8 * h + 8)))

        def half(v):
            return builder.bitcast(builder.shuffle_vector(v, ir.Constant(_V16, None), lanes), v32i8)

        sums = None
        for w, x in pairs:
            wb, xb = half(w), half(x)
            if bits == 8:  # |w - 128| times x with w - 128's sign
                wb, xb = builder.call(absb, [wb, ir.Constant(ir.IntType(1), 0)]), builder.call(sign, [xb, wb])
            part = builder.call(ubsw, [wb, xb])
            sums = part if sums is None else builder.add(sums, part)
        ones = ir.Constant(v16i16, [1] * 16)
        halves.append(
            builder.add(builder.shuffle_vector(acc, ir.Constant(_V16, None), lanes), builder.call(wd, [sums, ones]))
        )
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_V16, list(range(16))))


def _dot_lanes_wd(builder, acc, pairs):
    """acc[l] + for each (w, x) of pairs the sum over the 2 int16 halves h of lane l of w half *
    x half (VPMADDWD: written as plain vector IR, which LLVM turns into it; measured as fast as
    the intrinsic, and it runs on any CPU)."""
    v32i16, v32i32 = ir.VectorType(ir.IntType(16), 32), ir.VectorType(_I32, 32)
    for w, x in pairs:
        prod = builder.mul(
            builder.sext(builder.bitcast(w, v32i16), v32i32), builder.sext(builder.bitcast(x, v32i16), v32i32)
        )
        lo, hi = (
            builder.shuffle_vector(prod, ir.Constant(v32i32, None), ir.Constant(_V16, [2 * l + h for l in range(16)]))
            for h in range(2)
        )
        acc = builder.add(acc, builder.add(lo, hi))
    return acc


def layout(bits: int, xq: str, dot: str | None) -> int:
    """x words per weight word in quantize_x's layout: int8, the low and the high nibbles at 4
    bits, plus one row of 128 x each group's sum of q where the 8-bit AVX2 kernel needs it;
    int16, a word's values paired two by two (8 bits: 0 with 2, 1 with 3; 4 bits: k with k + 4)."""
    if xq == "int16":
        return 32 // bits // 2
    return 32 // bits // 4 + (bits == 8 and dot == "avx2")


def _tile_out(bits: int, xq: str, dot: str | None, rows: int):
    """The kernel as an intrinsic (vector_ir.tile_intrinsic): 16 outputs of one tile for `rows`
    x rows, each weight word loaded once for all of them. x row m's words are
    xw[m * terms * L * nw + (t * L + p) * nw + j] for term t and pass p (L = layout(bits, xq,
    dot) passes: int8, the low (0) or high (1) nibbles at 4 bits, the only pass at 8; int16, a
    pair of a word's values), its steps dx[m * terms * ng + t * ng + g]. out is

        sum over g of  st * (dx0 * dot0 + dx1 * dot1) + bt * xs

    (one term but for int8x2) with every product and sum a separate float32 operation in that
    order (no FMA), so a row gets the same floats however many rows share its call."""
    terms = _X_TERMS[xq]
    lay = layout(bits, xq, dot)
    offset = xq != "int16" and bits == 8 and dot == "avx2"  # w - 128 multiplied: 128 x sum(q) added per group

    def setup(rows_):  # where each row's x words and steps start
        e, b = rows_.e, rows_.e.b
        return [
            (b.mul(m, b.mul(rows_.nw, e.const(terms * lay))), b.mul(m, b.mul(rows_.ng, e.const(terms))))
            for m in rows_.xm
        ]

    def weights(b, w):  # what x words multiply: the word itself, its nibbles, or its values paired in int16
        if xq == "int16":  # values p and p + lay of each lane's word in its two int16 halves
            mask = ir.Constant(vir.V16, [(1 << bits) - 1 | ((1 << bits) - 1) << 16] * 16)
            return [b.and_(b.lshr(w, ir.Constant(vir.V16, [bits * p] * 16)) if p else w, mask) for p in range(lay)]
        if offset:
            return [b.xor(w, ir.Constant(vir.V16, [0x80808080] * 16))]
        return (
            [w]
            if bits == 8
            else [
                b.and_(b.lshr(w, ir.Constant(vir.V16, [4 * p] * 16)), ir.Constant(vir.V16, [0x0F0F0F0F] * 16))
                for p in range(2)
            ]
        )

    def word(rows_, j, w, dots):
        e, b = rows_.e, rows_.e.b
        ws = weights(b, w)
        for r, (xrow, _) in enumerate(rows_.state):
            for t in range(terms):
                xs = [
                    e.splat(e.load(rows_.xdata, b.add(e.at(xrow, (rows_.nw, t * lay + p)), j)), vir.V16)
                    for p in range(len(ws))
                ]
                pairs = list(zip(ws, xs))
                dots[r][t] = (
                    _dot_lanes_wd(b, dots[r][t], pairs)
                    if xq == "int16"
                    else _dot_lanes(b, dots[r][t], pairs, dot, bits)
                )
        return dots

    def group(rows_, r, g, dots, scale, bias, xsum, total):
        e, b = rows_.e, rows_.e.b
        xrow, drow = rows_.state[r]
        inner = None
        for t in range(terms):
            d = dots[t]
            if offset:
                d = b.add(d, e.splat(e.load(rows_.xdata, b.add(e.at(xrow, (rows_.nw, t * lay + 1)), g)), vir.V16))
            step = e.splat(e.load(rows_.dxdata, b.add(e.at(drow, (rows_.ng, t)), g)), vir.VF16)
            term = b.fmul(step, b.sitofp(d, vir.VF16))
            inner = term if inner is None else b.fadd(inner, term)
        return b.fadd(total, b.fadd(b.fmul(scale, inner), b.fmul(bias, xsum)))

    return vir.tile_intrinsic(rows, vir.V16, terms, setup, word, group)


@njit(cache=True, nogil=True)
def _pack4(b0, b1, b2, b3):
    """Four int8 values as the bytes of one int32 (little-endian)."""
    return int32((b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | ((b3 & 0xFF) << 24))


@njit(cache=True, nogil=True)
def _quantize_row(x, m, gs, terms, top, xw, dx, xs, q, r):
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
            d = amax / float32(top)
            dx[m, t, g] = d
            inv = float32(1.0) / d if d > 0 else float32(0.0)
            for k in range(g * gs, (g + 1) * gs):
                q[k] = int32(np.rint(r[k] * inv))
                r[k] = r[k] - d * float32(q[k])
        if top > 127:  # int16: a word's values k and k + L in the halves of x word k (L words)
            lay = xw.shape[2]
            vpw = 2 * lay
            for i in range(nw):
                for p in range(lay):
                    xw[m, t, p, i] = int32((q[vpw * i + p] & 0xFFFF) | (q[vpw * i + p + lay] << 16))
        elif nw == K // 4:  # int8, 8 bits: a word's 4 values in order
            for i in range(nw):
                xw[m, t, 0, i] = _pack4(q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3])
            if xw.shape[2] == 2:  # (layout) 128 x each group's sum of q
                for g in range(ng):
                    qs = int32(0)
                    for k in range(g * gs, (g + 1) * gs):
                        qs += q[k]
                    xw[m, t, 1, g] = 128 * qs
        else:  # int8, 4 bits: the even values (low nibbles), then the odd ones
            for i in range(nw):
                b = 8 * i
                xw[m, t, 0, i] = _pack4(q[b], q[b + 2], q[b + 4], q[b + 6])
                xw[m, t, 1, i] = _pack4(q[b + 1], q[b + 3], q[b + 5], q[b + 7])


@njit(cache=True, nogil=True)
def _quantized(M, K, bits, gs, terms, lay):
    nw = K * bits // 32
    return (
        np.empty((M, terms, lay, nw), np.int32),
        np.empty((M, terms, K // gs), np.float32),
        np.empty((M, K // gs), np.float32),
    )


@njit(cache=True, nogil=True)
def quantize_x(x, bits, gs, terms, top, lay):
    """x [M, K] float32 -> (xw [M, terms, lay, K*bits/32] int32: the rounded values in the
    order the weight words need them (layout(); int8 at 8 bits on AVX2, then 128 x each group's
    sum of them), dx [M, terms, K/gs] each group's step, xs [M, K/gs] each group's exact sum).
    Term 0 is x rounded to steps of 1/top of the group's largest value (top 127: int8; 32767:
    int16); term 1 (terms=2) what that left, rounded the same way: x ~ dx0 * q0 + dx1 * q1, to
    about 1/64000 of a group's peak, as one int16 term is."""
    M, K = x.shape
    xw, dx, xs = _quantized(M, K, bits, gs, terms, lay)
    q = np.empty(K, np.int32)
    r = np.empty(K, np.float32)
    for m in range(M):
        _quantize_row(x, m, gs, terms, top, xw, dx, xs, q, r)
    return xw, dx, xs


@njit(cache=True, nogil=True, parallel=True)
def quantize_rows(x, bits, gs, terms, top, lay):
    """quantize_x with the rows shared among the cores (prefill: hundreds of rows)."""
    M, K = x.shape
    xw, dx, xs = _quantized(M, K, bits, gs, terms, lay)
    for m in prange(M):
        _quantize_row(x, m, gs, terms, top, xw, dx, xs, np.empty(K, np.int32), np.empty(K, np.float32))
    return xw, dx, xs


_PREPARE = """
@njit(cache=True, nogil=True)
def _prepare(x):
    # x rounded (quantize_x), flat: one row on the calling thread, prefill's hundreds on every core
    if x.shape[0] >= MANY_ROWS:
        xw, dx, xs = quantize_rows(x, BITS, GS, TERMS, TOP, LAYOUT)
    else:
        xw, dx, xs = quantize_x(x, BITS, GS, TERMS, TOP, LAYOUT)
    return xw.reshape(-1), dx.reshape(-1), xs.reshape(-1)
"""


_compiled: dict = {}


def _resolve(xq: str | None, dot: str | None) -> tuple[str, str | None]:
    xq = host_x() if xq is None else xq
    if xq not in XS:
        raise ValueError(f"x format {xq!r}: not one of {', '.join(XS)}")
    if xq == "int16":
        if dot is not None:
            raise ValueError("int16 activations have one kernel (VPMADDWD from plain vector IR): dot= is for int8")
        return xq, None
    return xq, host_dot() if dot is None else dot


def kernel(bits: int, gs: int, xq: str | None = None, dot: str | None = None):
    """The compiled kernel for tiled matrices of `bits` and group size `gs`, x rounded to `xq`
    (one of XS; host_x() by default), int8 byte products summed by `dot` (one of DOTS; the
    host's best by default): fn(wt, st, bt, x [M, K] float32, parallel) -> [M, NB*16] float32."""
    xq, dot = _resolve(xq, dot)
    key = (bits, gs, xq, dot)
    fn = _compiled.get(key)
    if fn is None:
        ns = dict(
            globals(),
            tile_out1=_tile_out(bits, xq, dot, 1),
            tile_outs=_tile_out(bits, xq, dot, ROWS),
            BITS=bits,
            GS=gs,
            TERMS=_X_TERMS[xq],
            TOP=32767 if xq == "int16" else 127,
            LAYOUT=layout(bits, xq, dot),
        )
        fns = tiled.instantiate(_PREPARE, f"{bits}_{gs}_{xq}_{dot}", ns, __file__)
        fn = _compiled[key] = fns["run"]
        for what in tiled.ENTRIES[1:]:
            _compiled[(what, *key)] = fns[what]
    return fn


def gather_kernel(bits: int, gs: int, what: str = "gather", xq: str | None = None, dot: str | None = None):
    """A slot-bank entry point (tiled_experts.py) of `kernel`'s arithmetic: "gather",
    fn(wa, sa, ba, wb, sb, bb, x [R, K], xrow [P], slots [P], parallel) -> (out_a, out_b) (entry i
    reads x row xrow[i]), "swiglu", fn(gate, up and down banks, x, xrow, slots, parallel) ->
    down(silu(gate) * up) [P, N_down], or "grouped" (tiled.gather_kernel)."""
    xq, dot = _resolve(xq, dot)
    kernel(bits, gs, xq, dot)
    return _compiled[(what, bits, gs, xq, dot)]


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
        if (
            id(obj) in seen
            or isinstance(obj, (np.ndarray, mx.array, str, bytes, int, float, type(None)))
            or type(obj).__module__.startswith("numba.")
        ):  # (a compiled kernel held for later calls)
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
