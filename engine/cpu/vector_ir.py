"""LLVM IR helpers for the kernels written as numba intrinsics (tiled.py, int8.py).

Those kernels keep a tile's 16 sums in vector registers for a whole row of groups. Written as
numba loops over 16 lanes, the sums went through memory at every group (numba cannot show LLVM
that a scratch array aliases nothing), which cost 1.3-2.5x (benchmarks/RESULTS.md)."""
from __future__ import annotations

from llvmlite import ir

I32 = ir.IntType(32)
I64 = ir.IntType(64)
V16 = ir.VectorType(I32, 16)
VF16 = ir.VectorType(ir.FloatType(), 16)


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

    def splat(self, v, vt):
        """A scalar in all 16 lanes."""
        undef = ir.Constant(vt, None)
        return self.b.shuffle_vector(self.b.insert_element(undef, v, ir.Constant(I32, 0)), undef,
                                     ir.Constant(V16, [0] * 16))


def array_data(context, builder, signature, args, i):
    """The data pointer of array argument i of an intrinsic."""
    return context.make_array(signature.args[i])(context, builder, args[i]).data
