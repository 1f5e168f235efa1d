"""Decode matmuls on int8 activations with the CPU's integer dot product (`--kernels cpu-int8`).

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
4 products): the same integers, about a quarter of the speed.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import float32, int32, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# A call runs on every core from SERIAL_FACTOR times the float kernels' size (qmm.SERIAL_BELOW):
# 3-4x faster per value, so a thread pool's start costs more of a call. Measured (4-bit g64, one
# row, TBB): 576 x 576 16 us on one thread, 32 on two; 960 x 576 23 / 20; 3072 x 576 73 / 61.
SERIAL_FACTOR = 4
_I32 = ir.IntType(32)
_V16 = ir.VectorType(_I32, 16)


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


def _tile_dot(bits: int, terms: int, vnni: bool):
    """An intrinsic: tile_dot(wt, w0, n, xw, x0, stride, acc) sets acc[16 t: 16 t + 16] (int32),
    for each term t < `terms`, to the integer dot products of 16 rows over n words: words
    wt[w0 + 16 j + l] (j < n) against x words xw[x0 + t * passes * stride + p * stride + j], where
    pass p is the low (0) or high (1) nibbles at 4 bits, and the only pass at 8."""
    passes = 32 // bits // 4  # x words per weight word

    @intrinsic
    def tile_dot(typingctx, wt, w0, n, xw, x0, stride, acc):
        sig = types.void(wt, w0, n, xw, x0, stride, acc)

        def codegen(context, builder, signature, args):
            wt_, w0_, n_, xw_, x0_, stride_, acc_ = args
            wdata = context.make_array(signature.args[0])(context, builder, wt_).data
            xdata = context.make_array(signature.args[3])(context, builder, xw_).data
            adata = context.make_array(signature.args[6])(context, builder, acc_).data
            totals = [cgutils.alloca_once_value(builder, ir.Constant(_V16, [0] * 16)) for _ in range(terms)]
            undef = ir.Constant(_V16, None)
            splat = ir.Constant(_V16, [0] * 16)
            with cgutils.for_range(builder, n_) as loop:
                j = loop.index
                at = builder.add(w0_, builder.mul(j, ir.Constant(j.type, 16)))
                w = builder.load(builder.bitcast(builder.gep(wdata, [at]), _V16.as_pointer()), align=4)
                accs = [builder.load(t) for t in totals]
                for p in range(passes):
                    wp = w if bits == 8 else builder.and_(builder.lshr(w, ir.Constant(_V16, [4 * p] * 16)),
                                                          ir.Constant(_V16, [0x0F0F0F0F] * 16))
                    for t in range(terms):
                        off = builder.mul(stride_, ir.Constant(stride_.type, t * passes + p))
                        xv = builder.load(builder.gep(xdata, [builder.add(builder.add(x0_, off), j)]))
                        xb = builder.shuffle_vector(builder.insert_element(undef, xv, ir.Constant(_I32, 0)), undef, splat)
                        accs[t] = _dot_lanes(builder, accs[t], wp, xb, vnni)
                for t in range(terms):
                    builder.store(accs[t], totals[t])
            for t in range(terms):
                dst = builder.gep(adata, [ir.Constant(_I32, 16 * t)])
                builder.store(builder.load(totals[t]), builder.bitcast(dst, _V16.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_dot


@njit(cache=True, nogil=True)
def _pack4(b0, b1, b2, b3):
    """Four int8 values as the bytes of one int32 (little-endian)."""
    return int32((b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | ((b3 & 0xFF) << 24))


@njit(cache=True, nogil=True)
def quantize_x(x, bits, gs, terms):
    """x [M, K] float32 -> (xw [M, terms, passes, K*bits/32] int32: the int8 values in the order
    the weight words need them, dx [M, terms, K/gs] each group's step, xs [M, K/gs] each group's
    exact sum). Term 0 is x rounded to int8 steps; term 1 (terms=2) what that left, rounded to
    steps 1/127 of its largest value: x ~ dx0 * q0 + dx1 * q1, to about 1/64000 of a group's peak."""
    M, K = x.shape
    ng = K // gs
    nw = K * bits // 32
    passes = 32 // bits // 4
    xw = np.empty((M, terms, passes, nw), np.int32)
    dx = np.empty((M, terms, ng), np.float32)
    xs = np.empty((M, ng), np.float32)
    q = np.empty(K, np.int32)
    r = np.empty(K, np.float32)
    for m in range(M):
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
            if bits == 8:
                for i in range(nw):
                    xw[m, t, 0, i] = _pack4(q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3])
            else:
                for i in range(nw):
                    b = 8 * i
                    xw[m, t, 0, i] = _pack4(q[b], q[b + 2], q[b + 4], q[b + 6])
                    xw[m, t, 1, i] = _pack4(q[b + 1], q[b + 3], q[b + 5], q[b + 7])
    return xw, dx, xs


_RUN_TEMPLATE = """
@njit(cache=True, fastmath=False, nogil=True)  # no FMA contraction: the same floats wherever it is inlined
def _row(flat, st, bt, xflat, dx, xs, t, nw, passes, m, out, acc):
    ng = st.shape[1]
    wpg = nw // ng
    for l in range(16):
        out[m, t * 16 + l] = float32(0.0)
    for g in range(ng):
        tile_dot(flat, (t * nw + g * wpg) * 16, wpg, xflat, m * TERMS * passes * nw + g * wpg, nw, acc)
        s = xs[m, g]
        d0 = dx[m, 0, g]
        if TERMS == 1:
            for l in range(16):
                out[m, t * 16 + l] += st[t, g, l] * (d0 * float32(acc[l])) + bt[t, g, l] * s
        else:
            d1 = dx[m, 1, g]
            for l in range(16):
                out[m, t * 16 + l] += st[t, g, l] * (d0 * float32(acc[l]) + d1 * float32(acc[16 + l])) \\
                    + bt[t, g, l] * s


@njit(cache=True, nogil=True, parallel=True)
def _run(wt, st, bt, x, parallel):
    NB, nw, _ = wt.shape
    xw, dx, xs = quantize_x(x, BITS, GS, TERMS)
    passes = xw.shape[2]
    flat = wt.reshape(-1)
    xflat = xw.reshape(-1)
    M = x.shape[0]
    out = np.empty((M, NB * 16), np.float32)
    acc = np.empty((NB, 16 * TERMS), np.int32)
    if parallel:
        for t in prange(NB):
            for m in range(M):
                _row(flat, st, bt, xflat, dx, xs, t, nw, passes, m, out, acc[t])
    else:
        for t in range(NB):
            for m in range(M):
                _row(flat, st, bt, xflat, dx, xs, t, nw, passes, m, out, acc[t])
    return out


@njit(cache=True, nogil=True)
def _gather_item(wa, sa, ba, wb, sb, bb, xflat, dx, xs, passes, slots, NT, it, acc, oa, ob):
    # work item it: tile it % NT (bank a's, then b's) of entry it // NT
    i = it // NT
    t = it % NT
    s = slots[i]
    if t < wa.shape[1]:
        _row(wa[s].reshape(-1), sa[s], ba[s], xflat, dx, xs, t, wa.shape[2], passes, i, oa, acc)
    else:
        _row(wb[s].reshape(-1), sb[s], bb[s], xflat, dx, xs, t - wa.shape[1], wa.shape[2], passes, i, ob, acc)


@njit(cache=True, nogil=True, parallel=True)
def _gather(wa, sa, ba, wb, sb, bb, x, slots, parallel):
    # entry i: x row i against slot slots[i] of two banks of tiled matrices (tiled_experts.py)
    P = x.shape[0]
    NT = wa.shape[1] + wb.shape[1]
    xw, dx, xs = quantize_x(x, BITS, GS, TERMS)
    passes = xw.shape[2]
    xflat = xw.reshape(-1)
    oa = np.empty((P, wa.shape[1] * 16), np.float32)
    ob = np.empty((P, wb.shape[1] * 16), np.float32)
    nit = P * NT
    acc = np.empty((nit, 16 * TERMS), np.int32)
    if parallel:
        for it in prange(nit):
            _gather_item(wa, sa, ba, wb, sb, bb, xflat, dx, xs, passes, slots, NT, it, acc[it], oa, ob)
    else:
        for it in range(nit):
            _gather_item(wa, sa, ba, wb, sb, bb, xflat, dx, xs, passes, slots, NT, it, acc[it], oa, ob)
    return oa, ob


@njit(cache=True, nogil=True)
def _swiglu(wa, sa, ba, wb, sb, bb, wd, sd, bd, x, slots, parallel):
    # a decode step's experts in one call: entry i, down(silu(gate(x[i])) * up(x[i])) of slot slots[i]
    g, u = _gather(wa, sa, ba, wb, sb, bb, x, slots, parallel)
    none = (np.empty((1, 0, wd.shape[2], 16), wd.dtype), np.empty((1, 0, sd.shape[2], 16), sd.dtype))
    y, _ = _gather(wd, sd, bd, none[0], none[1], none[1], silu_mul(g, u), slots, parallel)
    return y
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
        from flashmoe.engine.cpu.attn import silu_mul

        ns = dict(globals(), tile_dot=_tile_dot(bits, terms, vnni), BITS=bits, GS=gs, TERMS=terms, silu_mul=silu_mul)
        # numba caches by the function's qualified name and source: one name per variant
        tag = f"{bits}_{gs}_{terms}_{int(vnni)}"
        src = (_RUN_TEMPLATE.replace("_row(", f"_row{tag}(").replace("def _run(", f"def _run{tag}(")
               .replace("_gather(", f"_gather{tag}(").replace("_gather_item(", f"_gather_item{tag}(")
               .replace("def _swiglu(", f"def _swiglu{tag}("))
        exec(compile(src, __file__, "exec"), ns)  # noqa: S102 - our own template
        fn = _compiled[key] = ns[f"_run{tag}"]
        _compiled[("gather", *key)] = ns[f"_gather{tag}"]
        _compiled[("swiglu", *key)] = ns[f"_swiglu{tag}"]
    return fn


def gather_kernel(bits: int, gs: int, what: str = "gather", terms: int = 2, vnni: bool | None = None):
    """A slot-bank entry point (tiled_experts.py) of `kernel`'s arithmetic: "gather",
    fn(wa, sa, ba, wb, sb, bb, x [P, K], slots [P], parallel) -> (out_a, out_b), or "swiglu",
    fn(gate, up and down banks, x, slots, parallel) -> down(silu(gate) * up) [P, N_down]."""
    vnni = has_vnni() if vnni is None else vnni
    kernel(bits, gs, terms, vnni)
    return _compiled[(what, bits, gs, terms, vnni)]


def use_int8(model) -> int:
    """Switch every tiled matrix that `model` reaches (its modules, the fused blocks' stacked
    matrices, a tied head behind its embedding, the streamed experts' slot banks) and int8
    kernels support to them, for decode rows only (prefill keeps dequantize + sgemm); returns
    how many were switched (a bank counts once)."""
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
