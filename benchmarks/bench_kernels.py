#!/usr/bin/env python3
"""MLX's CPU quantized matmul vs the numba kernels of engine/cpu/qmm.py.

For each weight shape (out x in), bit width and number of x rows M it times:

  mlx      mx.quantized_matmul(x, w, scales, biases, transpose=True) on float32 x / scales /
           biases, then mx.eval (x is evaluated beforehand);
  ours     flashmoe.engine.cpu.qmm.qmm_mx: numpy views of the four mx.arrays, the kernel, and
           mx.array(out) around the result -- the whole cost of the drop-in -- with the module's
           choice of threads (all of numba's threads with the TBB layer, else one thread for
           all but huge calls; see the cpu_qmm docstring);
  all thr  the same forced onto all of numba's threads;
  1 thr    the same forced onto one thread;
  kernel   cpu_qmm.qmm on numpy arrays prepared beforehand (the kernel alone, default choice).

The variants run interleaved (one call of each in turn, after a warm-up call each) so that load
from other processes hits them alike; each figure is the median over the calls, "min" the fastest.
GB/s counts the packed weight bytes only (out * in * bits / 8) per call; "x" is mlx median / ours
median. Then the same for gather_qmm (MoE: one token with top-8 of 16 stacked experts, and 32
tokens), and the per-call overhead for a tiny matrix (a decode step makes hundreds of small
matmuls).

--startup measures, in fresh processes with an empty numba cache directory, the time to import
the module and run the first 4-bit call: once compiling, then loading from the cache.

The weights here (at most 8 MB packed) stay in the 32 MiB L3 cache: these are cache-resident
figures, like the MLX ones in /work/shared/reference/machine-limits.md section 3.
This is a benchmark, not a test: it asserts only that the results agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def interleaved(fns: dict, calls: int, min_s: float = 0.0) -> dict:
    """{name: (median s, min s)} over `calls` rounds (or min_s seconds) of one call of each fn."""
    for fn in fns.values():
        fn()  # warm-up (and compile / cache load)
    ts: dict = {name: [] for name in fns}
    t_end = time.perf_counter() + min_s
    while len(ts[next(iter(fns))]) < calls or time.perf_counter() < t_end:
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    return {name: (statistics.median(v), min(v)) for name, v in ts.items()}


def forced(fn, parallel: bool):
    """fn with cpu_qmm's serial/parallel choice forced: all of numba's threads, or one."""
    from flashmoe.engine.cpu import qmm as K

    def run():
        saved = K.SERIAL_BELOW, K.SERIAL_BELOW_WITHOUT_TBB
        K.SERIAL_BELOW = K.SERIAL_BELOW_WITHOUT_TBB = 0 if parallel else 1 << 62
        try:
            return fn()
        finally:
            K.SERIAL_BELOW, K.SERIAL_BELOW_WITHOUT_TBB = saved

    return run


def us(t: float) -> str:
    return f"{t * 1e6:8.0f}" if t >= 1e-3 else f"{t * 1e6:8.1f}"


def bench_qmm(shapes, bits_list, ms, group_size, calls):
    import mlx.core as mx

    from flashmoe.engine.cpu import qmm as K

    print(
        f"\nqmm: x [M, in] @ dequantize(W [out, in]).T, group size {group_size}, float32 x/scales/biases; "
        "times in us (median, min)"
    )
    print(
        f"{'out x in':>11} {'bits':>4} {'M':>3} | {'mlx':>8} {'GB/s':>5} | {'ours':>8} {'min':>8} {'GB/s':>5} | "
        f"{'all thr':>8} {'GB/s':>5} | {'1 thr':>8} {'GB/s':>5} | {'kernel':>8} | {'x':>5} | max|diff|/max|ref|"
    )
    rng = np.random.default_rng(0)
    for n, k in shapes:
        w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        for bits in bits_list:
            wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
            mx.eval(wq, s, b)
            wn, sn, bn = K.to_numpy(wq), K.to_numpy(s), K.to_numpy(b)
            packed = wn.nbytes
            for m in ms:
                x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
                mx.eval(x)
                xn = K.to_numpy(x)
                args = {"group_size": group_size, "bits": bits}

                def run_mlx(x=x, wq=wq, s=s, b=b, args=args):
                    mx.eval(mx.quantized_matmul(x, wq, s, b, transpose=True, **args))

                def run_ours(x=x, wq=wq, s=s, b=b, bits=bits):
                    return K.qmm_mx(x, wq, s, b, bits, group_size)

                def run_kernel(xn=xn, wn=wn, sn=sn, bn=bn, bits=bits):
                    return K.qmm(xn, wn, sn, bn, bits, group_size)

                r = interleaved(
                    {
                        "mlx": run_mlx,
                        "ours": run_ours,
                        "all": forced(run_ours, True),
                        "one": forced(run_ours, False),
                        "kernel": run_kernel,
                    },
                    calls if m == 1 else max(3, calls // 4),
                    min_s=0.3,
                )
                ref = np.array(mx.quantized_matmul(x, wq, s, b, transpose=True, **args))
                got = np.array(run_ours())
                rel = float(np.abs(got - ref).max() / np.abs(ref).max())
                (t_mlx, _), (t_ours, t_min), (t_k, _) = r["mlx"], r["ours"], r["kernel"]
                t_all, t_one = r["all"][0], r["one"][0]
                print(
                    f"{n:>5}x{k:<5} {bits:>4} {m:>3} | {us(t_mlx)} {packed / t_mlx / 1e9:5.2f} | {us(t_ours)} "
                    f"{us(t_min)} {packed / t_ours / 1e9:5.2f} | {us(t_all)} {packed / t_all / 1e9:5.2f} | "
                    f"{us(t_one)} {packed / t_one / 1e9:5.2f} | {us(t_k)} | {t_mlx / t_ours:5.1f} | {rel:.1e}",
                    flush=True,
                )


def bench_gather(group_size, calls, bits=4, n=768, k=2048, experts=16, top=8):
    import mlx.core as mx

    from flashmoe.engine.cpu import qmm as K

    print(
        f"\ngather_qmm: {experts} stacked experts of {n}x{k} (out x in), {bits}-bit, group size {group_size}, "
        f"top-{top}; times in us (median, min); GB/s: packed bytes of the distinct experts used"
    )
    print(
        f"{'tokens':>6} | {'mlx':>8} | {'ours':>8} {'min':>8} {'GB/s':>5} | {'all thr':>8} | {'1 thr':>8} | "
        f"{'x':>5} | max|diff|/max|ref|"
    )
    rng = np.random.default_rng(1)
    w = mx.array(rng.standard_normal((experts, n, k)).astype(np.float32) * 0.05)
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    mx.eval(wq, s, b)
    per_expert = wq.nbytes // experts
    for t in (1, 32):
        x = mx.array(rng.standard_normal((t, 1, 1, k)).astype(np.float32))
        idx = mx.array(np.stack([rng.permutation(experts)[:top] for _ in range(t)]).astype(np.uint32))
        mx.eval(x, idx)
        used = len(np.unique(np.array(idx))) * per_expert
        args = {"transpose": True, "group_size": group_size, "bits": bits}

        def run_mlx(x=x, idx=idx, args=args):
            mx.eval(mx.gather_qmm(x, wq, s, b, rhs_indices=idx, **args))

        def run_ours(x=x, idx=idx, t=t):
            return K.gather_qmm_mx(x.reshape(t, k), wq, s, b, idx, bits, group_size)

        r = interleaved(
            {"mlx": run_mlx, "ours": run_ours, "all": forced(run_ours, True), "one": forced(run_ours, False)},
            calls if t == 1 else max(3, calls // 4),
            min_s=0.3,
        )
        ref = np.array(mx.gather_qmm(x, wq, s, b, rhs_indices=idx, **args)).reshape(t, top, n)
        got = np.array(run_ours())
        rel = float(np.abs(got - ref).max() / np.abs(ref).max())
        (t_mlx, _), (t_ours, t_min), (t_all, _), (t_one, _) = r["mlx"], r["ours"], r["all"], r["one"]
        print(
            f"{t:>6} | {us(t_mlx)} | {us(t_ours)} {us(t_min)} {used / t_ours / 1e9:5.2f} | {us(t_all)} | "
            f"{us(t_one)} | {t_mlx / t_ours:5.1f} | {rel:.1e}",
            flush=True,
        )


def bench_overhead(calls):
    import mlx.core as mx

    from flashmoe.engine.cpu import qmm as K

    print("\nper-call cost, tiny matrix (out 64 x in 64, 4-bit, group 64, M = 1), us (median, min):")
    rng = np.random.default_rng(2)
    wq, s, b = mx.quantize(mx.array(rng.standard_normal((64, 64)).astype(np.float32)), group_size=64, bits=4)
    x = mx.array(rng.standard_normal((1, 64)).astype(np.float32))
    mx.eval(wq, s, b, x)
    xn, wn, sn, bn = (K.to_numpy(a) for a in (x, wq, s, b))
    kern = K._kernel(4)
    x2, idx = xn.reshape(1, 64), np.zeros(1, np.int64)
    w3, s3, b3 = wn[None], sn[None], bn[None]
    cases = {
        "mlx: quantized_matmul + mx.eval": lambda: mx.eval(
            mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4)
        ),
        "mlx: mx.eval of a lazy x + 0 (the sync alone)": lambda: mx.eval(x + 0),
        "ours: qmm_mx (views + qmm + mx.array(out))": lambda: K.qmm_mx(x, wq, s, b, 4, 64),
        "ours: qmm on numpy arrays": lambda: K.qmm(xn, wn, sn, bn, 4, 64),
        "ours: numba entry point alone, all threads": lambda: kern(x2, idx, 1, w3, s3, b3, 64, True),
        "ours: numba entry point alone, one thread": lambda: kern(x2, idx, 1, w3, s3, b3, 64, False),
        "4 x np.asarray(memoryview(mx.array))": lambda: [np.asarray(memoryview(a)) for a in (x, wq, s, b)],
        "mx.array(numpy [1, 64])": lambda: mx.array(xn),
    }
    for name, (med, mn) in interleaved(cases, calls).items():
        print(f"  {name:<48} {med * 1e6:7.1f}  (min {mn * 1e6:.1f})")


STARTUP_SNIPPET = r"""
import time
t0 = time.perf_counter()
import numpy as np
from flashmoe.engine.cpu import qmm as K
t1 = time.perf_counter()
rng = np.random.default_rng(0)
w = rng.integers(0, 2**32, (1024, 512), dtype=np.uint64).astype(np.uint32)
s = rng.standard_normal((1024, 64)).astype(np.float32)
x = rng.standard_normal((1, 4096)).astype(np.float32)
K.qmm(x, w, s, s, 4, 64)
t2 = time.perf_counter()
K.warmup((2, 3, 8))
t3 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f}")
"""


def bench_startup():
    print("\nstart-up in fresh processes sharing one new numba cache directory (NUMBA_CACHE_DIR):")
    print(
        "  import = import of flashmoe.engine.cpu.qmm (numpy + numba); first call = first 4-bit qmm "
        "(compiles, or loads from the cache); other bits = warmup((2, 3, 8))"
    )
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        for label in ("empty cache (compiles)", "cached", "cached again"):
            t = time.perf_counter()
            r = subprocess.run(
                [sys.executable, "-c", STARTUP_SNIPPET], cwd=ROOT, env=env, capture_output=True, text=True, check=True
            )
            wall = time.perf_counter() - t
            imp, first, others = (float(v) for v in r.stdout.split())
            print(
                f"  {label:<24} import {imp:5.2f} s | first call {first:6.2f} s | other bits {others:6.2f} s | "
                f"process wall {wall:6.2f} s"
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20, help="minimum calls per figure for M = 1 (default 20)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="one shape, 4-bit only")
    ap.add_argument("--startup", action="store_true", help="also measure compile and cache-load times")
    args = ap.parse_args()

    import mlx.core as mx
    import numba

    from flashmoe.engine.cpu import qmm as K

    mx.set_default_device(mx.cpu)
    K.warmup(4 if args.quick else (4, 8))
    print(
        f"mlx {mx.__version__}, numba {numba.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
        f"numba threads {numba.get_num_threads()}, threading layer {numba.threading_layer()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    shapes = [(1024, 4096)] if args.quick else [(1024, 4096), (4096, 1024), (576, 1536)]
    bits_list = [4] if args.quick else [4, 8]
    t0 = time.perf_counter()
    bench_qmm(shapes, bits_list, [1, 32], args.group_size, args.calls)
    bench_gather(args.group_size, args.calls)
    bench_overhead(max(args.calls, 300))
    if args.startup:
        bench_startup()
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
