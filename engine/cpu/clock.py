"""The monotonic clock inside a kernel: a MoE layer's decode step in one call (layer_step.py's
`_moe_layer`) times its attention, routing and experts itself, so the per-layer figures stay what
the separate calls reported (ExpertStore's route_s, compute_s)."""

from __future__ import annotations

import time

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

CLOCK = time.CLOCK_MONOTONIC  # the platform's number for it (1 on Linux, 6 on macOS)


@intrinsic
def monotonic(typingctx):
    """Seconds on CLOCK_MONOTONIC (clock_gettime, from libc: a declared symbol, so the kernels
    that call it stay in numba's disk cache)."""

    def codegen(context, builder, signature, args):
        i32, i64, f64 = ir.IntType(32), ir.IntType(64), ir.DoubleType()
        spec = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))  # struct timespec {tv_sec, tv_nsec}
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i32, [i32, i64.as_pointer()]), "clock_gettime"
        )
        builder.call(fn, [ir.Constant(i32, CLOCK), builder.bitcast(spec, i64.as_pointer())])
        sec, nsec = (builder.load(builder.gep(spec, [ir.Constant(i32, 0), ir.Constant(i32, i)])) for i in (0, 1))
        return builder.fadd(builder.sitofp(sec, f64), builder.fmul(builder.sitofp(nsec, f64), ir.Constant(f64, 1e-9)))

    return types.float64(), codegen
