"""LLVM IR helpers for the kernels written as numba intrinsics (tiled.py, int8.py).

Those kernels keep a tile's 16 sums in vector registers for a whole row of groups. Written as
numba loops over 16 lanes, the sums went through memory at every group (numba cannot show LLVM
that a scratch array aliases nothing), which cost 1.3-2.5x (benchmarks/log/, indexed in benchmarks/README.md)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
V16 = ir.VectorType(I32, 16)
VF16 = ir.VectorType(ir.FloatType(), 16)
VH16 = ir.VectorType(I16, 16)
# How far ahead of the word it decodes a kernel asks for the weights (llvm.prefetch), in 64-byte
# lines (one word of a tile's 16 rows): the hardware prefetchers alone left a decode step's
# experts, read from RAM, at 7 GB/s a core. Swept on the upcycled demo's experts, every one
# cached, two cores, on 2 MiB pages: 8 lines 282, 16 272, 32 313, 64 294 us a
# layer, none 325 (benchmarks/log/, indexed in benchmarks/README.md).
PREFETCH_LINES = 16


def _bf16_bits(t) -> bool:
    """Whether an array or scalar type holds scales as bfloat16 bits (uint16) rather than float32."""
    return getattr(t, "dtype", t) == types.uint16


@intrinsic
def as_f32(typingctx, v):
    """A scale or bias as float32: a float32 as it is, a uint16 as the bfloat16 it holds (the top
    half of a float32, so widening is exact)."""

    def codegen(context, builder, signature, args):
        if not _bf16_bits(signature.args[0]):
            return args[0]
        return builder.bitcast(builder.shl(builder.zext(args[0], I32), ir.Constant(I32, 16)), ir.FloatType())

    return types.float32(v), codegen


class Emitter:
    """A builder's common steps: i64 constants and indices, 16-lane loads, splats."""

    def __init__(self, builder: ir.IRBuilder):
        self.b = builder

    def const(self, v: int) -> ir.Constant:
        return ir.Constant(I64, v)

    def i64(self, v):
        """An integer argument as i64 (numba passes int64, but an int32 may come)."""
        return self.b.sext(v, I64) if v.type.width < 64 else v

    def at(self, base, *terms):
        """base + sum of (value * constant) pairs, as i64: an element index."""
        out = base
        for value, scale in terms:
            out = self.b.add(out, self.b.mul(value, self.const(scale)))
        return out

    def load(self, ptr, index):
        return self.b.load(self.b.gep(ptr, [index]))

    def vload(self, ptr, index, vt):
        """16 lanes from ptr[index] on (4-byte alignment: the arrays are numpy's)."""
        return self.b.load(self.b.bitcast(self.b.gep(ptr, [index]), vt.as_pointer()), align=4)

    def vstore(self, value, ptr, index):
        self.b.store(value, self.b.bitcast(self.b.gep(ptr, [index]), value.type.as_pointer()), align=4)

    def vload_scales(self, ptr, index, bf16: bool):
        """16 scales (or biases) from ptr[index] on, as float32: bfloat16 bits widened exactly."""
        if not bf16:
            return self.vload(ptr, index, VF16)
        half = self.b.load(self.b.bitcast(self.b.gep(ptr, [index]), VH16.as_pointer()), align=2)
        return self.b.bitcast(self.b.shl(self.b.zext(half, V16), ir.Constant(V16, [16] * 16)), VF16)

    def prefetch(self, ptr, index):
        """Ask for the line of ptr[index] (past the array's end is harmless: a prefetch never faults)."""
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(
            self.b.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]), "llvm.prefetch.p0i8"
        )
        # read, keep in every cache level, data
        self.b.call(
            fn,
            [
                self.b.bitcast(self.b.gep(ptr, [index]), i8p),
                ir.Constant(I32, 0),
                ir.Constant(I32, 3),
                ir.Constant(I32, 1),
            ],
        )

    def splat(self, v, vt):
        """A scalar in all 16 lanes."""
        undef = ir.Constant(vt, None)
        return self.b.shuffle_vector(
            self.b.insert_element(undef, v, ir.Constant(I32, 0)), undef, ir.Constant(V16, [0] * 16)
        )


def array_data(context, builder, signature, args, i):
    """The data pointer of array argument i of an intrinsic."""
    return context.make_array(signature.args[i])(context, builder, args[i]).data


class Rows:
    """What a tile kernel's callbacks see of one pass: the emitter, nw (words per row), ng
    (groups), xm (each pass row's x row, i64), the data pointers of xk (x values or int8 words),
    dx (int8 steps) and the kernel's own per-row state (from its `setup`)."""

    def __init__(self, e, nw, ng, xm, xdata, dxdata):
        self.e, self.nw, self.ng, self.xm, self.xdata, self.dxdata = e, nw, ng, xm, xdata, dxdata
        self.state = None


def tile_intrinsic(rows: int, dot_type, dots_per_row: int, setup, word, group):
    """An intrinsic tile_out(wt, w0, nw, ng, xk, dx, xs, xrow, orow, r0, st, bt, sb0, out, col,
    ostride) that writes the 16 outputs of one tile for `rows` x rows: pass row r is x row
    xrow[r0 + r] into out row orow[r0 + r]; the tile's words are wt[w0 + 16 j + l] (j < nw, ng
    groups), its scales and biases st / bt[sb0 + 16 g + l] (float32, or bfloat16 bits as uint16:
    both the same type), x row m's group sums xs[m * ng + g];
    out[o * ostride + col + l] gets the sum over groups. Every sum stays in a vector register.

    The kernel set (tiled.py: float; int8.py: VNNI) gives the arithmetic:
    - setup(rows_) -> per-row state (where each x row's values start), kept in rows_.state;
    - word(rows_, j, w, dots) -> dots: word j (w, 16 lanes) added into each row's `dots_per_row`
      sums of `dot_type`, for every pass row;
    - group(rows_, r, g, dots, scale, bias, xsum, total) -> total: group g's part of row r added."""

    @intrinsic
    def tile_out(typingctx, wt, w0, nw, ng, xk, dx, xs, xrow, orow, r0, st, bt, sb0, out, col, ostride):
        sig = types.void(wt, w0, nw, ng, xk, dx, xs, xrow, orow, r0, st, bt, sb0, out, col, ostride)

        def codegen(context, builder, signature, args):
            e = Emitter(builder)
            wdata, xdata, dxdata, xsdata, xrdata, ordata, stdata, btdata, odata = (
                array_data(context, builder, signature, args, i) for i in (0, 4, 5, 6, 7, 8, 10, 11, 13)
            )
            w0_, nw_, ng_, r0_, sb0_, col_, ostride_ = (e.i64(args[i]) for i in (1, 2, 3, 9, 12, 14, 15))
            wpg = builder.sdiv(nw_, ng_)
            xm = [e.i64(e.load(xrdata, builder.add(r0_, e.const(r)))) for r in range(rows)]
            om = [e.i64(e.load(ordata, builder.add(r0_, e.const(r)))) for r in range(rows)]
            rows_ = Rows(e, nw_, ng_, xm, xdata, dxdata)
            rows_.state = setup(rows_)
            srow = [builder.mul(m, ng_) for m in xm]
            orow_ = [builder.add(builder.mul(o, ostride_), col_) for o in om]
            totals = [cgutils.alloca_once_value(builder, ir.Constant(VF16, [0.0] * 16)) for _ in range(rows)]
            dots = [[cgutils.alloca_once(builder, dot_type) for _ in range(dots_per_row)] for _ in range(rows)]
            zero = ir.Constant(dot_type, [0] * 16)
            with cgutils.for_range(builder, ng_) as groups:
                g = groups.index
                for d in (d for row in dots for d in row):
                    builder.store(zero, d)
                with cgutils.for_range(builder, wpg) as words:
                    j = builder.add(builder.mul(g, wpg), words.index)
                    w = e.vload(wdata, e.at(w0_, (j, 16)), V16)
                    e.prefetch(wdata, e.at(w0_, (j, 16), (e.const(1), 16 * PREFETCH_LINES)))
                    sums = word(rows_, j, w, [[builder.load(d) for d in row] for row in dots])
                    for row, acc in zip(dots, sums):
                        for d, a in zip(row, acc):
                            builder.store(a, d)
                at = e.at(sb0_, (g, 16))
                bf16 = _bf16_bits(signature.args[10])
                scale, bias = e.vload_scales(stdata, at, bf16), e.vload_scales(btdata, at, bf16)
                for r in range(rows):
                    xsum = e.splat(e.load(xsdata, builder.add(srow[r], g)), VF16)
                    total = group(
                        rows_, r, g, [builder.load(d) for d in dots[r]], scale, bias, xsum, builder.load(totals[r])
                    )
                    builder.store(total, totals[r])
            for r in range(rows):
                e.vstore(builder.load(totals[r]), odata, orow_[r])
            return context.get_dummy_value()

        return sig, codegen

    return tile_out
