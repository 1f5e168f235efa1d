#!/usr/bin/env python3
"""The tiled kernels (engine/cpu/tiled.py, resident weights) against the kernels that read MLX's
layout (engine/cpu/qmm.py), on the matrix shapes of a decode step, same sitting.

For each shape (out x in), bit width and number of x rows M, both are called on the same random
weights and x, interleaved (one call of each in turn, after a warm-up), on numba's default
threads; figures are medians in microseconds, "Gval/s" counts weight values multiplied per
second (out * in * M / time), "x" is MLX-layout time / tiled time. The results are checked to
agree (max |diff| relative to max |ref|). A benchmark, not a test.

    python benchmarks/bench_tiled.py [--calls 200] [--bits 4,8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (1024, 4096), (49152, 576)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--bits", default="4,8")
    p.add_argument("--group-size", type=int, default=64)
    a = p.parse_args(argv)
    from flashmoe.engine.benchmark import cpu_model
    from flashmoe.engine.cpu import qmm
    from flashmoe.engine.cpu.tiled import Tiled

    gs = a.group_size
    print(
        f"machine: {cpu_model()}; numba threads {qmm.numba.get_num_threads()}, layer {qmm.threading_layer()}; "
        f"group size {gs}; medians of {a.calls} interleaved calls"
    )
    print(
        f"{'out x in':>12} {'bits':>4} {'M':>2} | {'MLX layout us':>13} {'Gval/s':>6} | {'tiled us':>9} {'Gval/s':>6} | {'x':>5} | max|diff|/max|ref|"
    )
    rng = np.random.default_rng(0)
    for bits in (int(b) for b in a.bits.split(",")):
        for out, inn in SHAPES:
            w = rng.integers(0, 2**32, (out, inn * bits // 32), dtype=np.uint32)
            s = (rng.random((out, inn // gs), dtype=np.float32) * 0.01).astype(np.float32)
            b = -s * 2 ** (bits - 1)
            t = Tiled.from_mlx(w, s, b, bits, gs)
            for m in (1, 2, 4):
                x = rng.standard_normal((m, inn)).astype(np.float32)
                ref, got = qmm.qmm(x, w, s, b, bits, gs), t.matmul(x)
                err = float(np.abs(got - ref).max() / np.abs(ref).max())
                times = {"mlx": [], "tiled": []}
                calls = max(5, min(a.calls, int(2e9 / (out * inn * m))))
                for _ in range(calls):
                    for name, fn in (("mlx", lambda: qmm.qmm(x, w, s, b, bits, gs)), ("tiled", lambda: t.matmul(x))):
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
                ms, ts = statistics.median(times["mlx"]), statistics.median(times["tiled"])
                n = out * inn * m
                print(
                    f"{out:>5} x {inn:<5} {bits:>4} {m:>2} | {ms * 1e6:>13.1f} {n / ms / 1e9:>6.1f} | "
                    f"{ts * 1e6:>9.1f} {n / ts / 1e9:>6.1f} | {ms / ts:>5.2f} | {err:.1e}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
