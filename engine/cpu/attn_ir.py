"""Attention's inner loops over a KV cache as numba intrinsics (LLVM IR), for attn.py.

A KV cache row is float32, or with --kv-cache float16 the bits of a float16 as uint16 (numba has
no float16 type; LLVM's fpext widens them, vcvtph2ps). Two loops are written in vector IR because
numba's loops left them at about half speed (one 256-position block of 9 heads of 64 over 3 kv
heads, float16, one core: scores 2.75 -> 1.96 us, the weighted sum of V's rows 2.45 -> 1.62 us):

- `dots16`: 16 positions' scores at once. As a loop, each score was a dot product ending in a
  horizontal sum of its vector; here 16 dot products end in one transposing tree of adds.
- `wsum`: the weighted sum of V's rows, its sums held in registers across the rows (numba kept
  them in memory: it cannot show LLVM that its scratch array aliases nothing).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from flashmoe.engine.cpu.vector_ir import I32, VF16, VH16, Emitter, array_data

LANES = 16


@intrinsic
def kv_f32(typingctx, x):
    """A KV cache element as float32: a float32 as it is, a uint16 as the float16 it holds."""
    if x == types.float32:
        return types.float32(x), lambda context, builder, signature, args: args[0]
    if x == types.uint16:

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(x), codegen
    return None


@intrinsic
def kv_pack(typingctx, x, like):
    """The float32 x as an element of a KV cache whose elements are like `like`: itself, or the
    bits of float16(x), rounded to nearest even as numpy's and MLX's casts round."""
    if like == types.float32:
        return types.float32(x, like), lambda context, builder, signature, args: args[0]
    if like == types.uint16:

        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

        return types.uint16(x, like), codegen
    return None


@intrinsic
def half_rows(typingctx, a):
    """Whether the cache array a holds float16 bits (uint16): a constant where it is compiled."""

    def codegen(context, builder, signature, args):
        return context.get_constant(types.boolean, a.dtype == types.uint16)

    return types.boolean(a), codegen


def _fma(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(VF16, [VF16] * 3), "llvm.fma.v16f32")


def _row_lanes(e: Emitter, data, index, half: bool):
    """16 cache elements from data[index] on, as float32."""
    if not half:
        return e.vload(data, index, VF16)
    b = e.b
    bits = b.load(b.bitcast(b.gep(data, [index]), VH16.as_pointer()), align=2)
    return b.fpext(b.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), VF16)


def _lane_sums(b, vs: list):
    """16 vectors -> one whose lane i is the sum of vs[i]'s lanes: pairs of vectors are halved and
    added (lane order kept) until one is left, 15 adds where one sum each took four."""
    width = LANES
    while len(vs) > 1:
        half = width // 2
        lo = [i for block in range(0, 2 * LANES, width) for i in range(block, block + half)]
        hi = [i + half for i in lo]
        vs = [
            b.fadd(
                b.shuffle_vector(x, y, ir.Constant(ir.VectorType(I32, LANES), lo)),
                b.shuffle_vector(x, y, ir.Constant(ir.VectorType(I32, LANES), hi)),
            )
            for x, y in zip(vs[0::2], vs[1::2])
        ]
        width = half
    return vs[0]


def _contiguous_rows(vec, rows, out) -> bool:
    """The typing both kernels ask for: a vector, a cache's rows [rows, D] and an output, all C-contiguous."""
    return vec.layout == rows.layout == out.layout == "C" and rows.ndim == 2


def _begin(context, builder, signature, args, data: tuple):
    """What both kernels' code starts with: the emitter, the data pointers of the arguments at
    `data`, D (the width of the rows, argument 1, as i64) and the 16-lane FMA."""
    e = Emitter(builder)
    pointers = [array_data(context, builder, signature, args, i) for i in data]
    rows = context.make_array(signature.args[1])(context, builder, args[1])
    D = e.i64(cgutils.unpack_tuple(builder, rows.shape)[1])
    return e, pointers, D, _fma(builder)


@intrinsic
def dots16(typingctx, q, K, t, out, o):
    """out[o + i] = q . K[t + i] for i < 16: q [D] float32, K [rows, D] a cache's rows (float32 or
    float16 bits), D a multiple of 16, all C-contiguous."""
    if not _contiguous_rows(q, K, out):
        return None
    half = K.dtype == types.uint16

    def codegen(context, builder, signature, args):
        e, (qd, kd, od), D, fma = _begin(context, builder, signature, args, (0, 1, 3))
        t_, o_ = e.i64(args[2]), e.i64(args[4])
        sums = [cgutils.alloca_once_value(builder, ir.Constant(VF16, [0.0] * LANES)) for _ in range(LANES)]
        with cgutils.for_range(builder, builder.sdiv(D, e.const(LANES))) as chunks:
            c = builder.mul(chunks.index, e.const(LANES))
            qv = e.vload(qd, c, VF16)
            for i, s in enumerate(sums):
                kv = _row_lanes(e, kd, builder.add(builder.mul(builder.add(t_, e.const(i)), D), c), half)
                builder.store(builder.call(fma, [qv, kv, builder.load(s)]), s)
        e.vstore(_lane_sums(builder, [builder.load(s) for s in sums]), od, o_)
        return context.get_dummy_value()

    return types.void(q, K, t, out, o), codegen


@intrinsic
def wsum(typingctx, p, V, t0, n, out):
    """out[d] = sum over t < n of p[t] * V[t0 + t, d]: p [>= n] float32, V [rows, D] a cache's rows
    (float32 or float16 bits), D a multiple of 16, all C-contiguous. Four sums per 16 columns,
    rows t, t+1, t+2, t+3 on separate ones (an FMA waits four cycles for its sum)."""
    if not _contiguous_rows(p, V, out):
        return None
    half = V.dtype == types.uint16

    def codegen(context, builder, signature, args):
        e, (pd, vd, od), D, fma = _begin(context, builder, signature, args, (0, 1, 4))
        t0_, n_ = e.i64(args[2]), e.i64(args[3])
        zero = ir.Constant(VF16, [0.0] * LANES)
        sums = [cgutils.alloca_once(builder, VF16) for _ in range(4)]

        def add_row(t, s):  # s += p[t] * V[t0 + t, c:c+16]
            v = _row_lanes(e, vd, builder.add(builder.mul(builder.add(t0_, t), D), c), half)
            builder.store(builder.call(fma, [e.splat(e.load(pd, t), VF16), v, builder.load(s)]), s)

        with cgutils.for_range(builder, builder.sdiv(D, e.const(LANES))) as chunks:
            c = builder.mul(chunks.index, e.const(LANES))
            for s in sums:
                builder.store(zero, s)
            quads = builder.sdiv(n_, e.const(4))
            with cgutils.for_range(builder, quads) as rows:
                for k, s in enumerate(sums):
                    add_row(builder.add(builder.mul(rows.index, e.const(4)), e.const(k)), s)
            with cgutils.for_range(builder, builder.sub(n_, builder.mul(quads, e.const(4)))) as rest:
                add_row(builder.add(builder.mul(quads, e.const(4)), rest.index), sums[0])
            a, b, c2, d = (builder.load(s) for s in sums)
            e.vstore(builder.fadd(builder.fadd(a, b), builder.fadd(c2, d)), od, c)
        return context.get_dummy_value()

    return types.void(p, V, t0, n, out), codegen
