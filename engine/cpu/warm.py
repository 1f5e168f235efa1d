"""Compile the CPU kernels ahead of their first use (numba keeps them in its disk cache).

A fresh install compiles each kernel the first time a model needs it: about 40 s before the
first token of the demo on this project's 2-core VM, spent inside whatever command came first,
and paid again by every process that needs the same kernel before one has written it to the
cache (a test suite's workers, say). `python -m flashmoe.engine.cpu.warm` compiles them all
once, the families split over two processes, and `flashmoe demo` runs it after building the
demo. Each call below is shaped like the engine's own calls, so the disk cache holds the
specialisations the engine asks for.
"""

from __future__ import annotations

import sys
import time

import numpy as np

# (what, bits, group size): qmm = MLX's layout (other widths), tiled = resident matrices and the
# streamed experts' slot banks (decode SwiGLU, grouped prefill), tiled-bf16 the same with
# bfloat16 scales (real MLX checkpoints': their usual formats)
JOBS = (
    [("qmm", b, 64) for b in (8, 4, 3, 2)]
    + [("tiled", b, g) for b, g in ((8, 64), (4, 64), (2, 64), (4, 32), (8, 128), (2, 32))]
    + [("tiled-bf16", b, 64) for b in (4, 8)]
    + [("small", 0, 0)]
)


def jobs_for(bits: int, group_size: int = 64) -> list:
    """What a model of these bits needs (the demo: 8-bit, groups of 64)."""
    return [("qmm", bits, group_size), ("tiled", bits, group_size), ("small", 0, 0)]


def _run(job) -> None:
    what, bits, gs = job
    if what == "qmm":
        from flashmoe.engine.cpu import qmm

        rng = np.random.default_rng(0)
        w = rng.integers(0, 2**32, (2, 32, 2 * gs * bits // 32), dtype=np.uint32)
        s = np.ones((2, 32, 2), np.float32)
        for rows in (1, 3):
            x = np.ones((rows, 2 * gs), np.float32)
            idx = np.zeros((rows, 2), np.int64)
            qmm.gather_qmm(x, w, s, s, idx, bits, gs)
            qmm.gather_qmm_pair(x, (w, s, s), (w, s, s), idx, bits, gs)
            qmm.qmm(x, w[0], s[0], s[0], bits, gs)
    elif what in ("tiled", "tiled-bf16"):
        from flashmoe.engine.cpu.tiled import Tiled

        bf16 = what == "tiled-bf16"
        t = Tiled.from_mlx(
            np.zeros((20, gs * bits // 32), np.uint32),
            np.zeros((20, 1), np.float32),
            np.zeros((20, 1), np.float32),
            bits,
            gs,
            bf16=bf16,
        )
        for rows in (1, 2, 7):
            t.matmul(np.zeros((rows, gs), np.float32))
        t.rows(np.zeros((1, 1), np.int64))
        _bank_calls(bits, gs, bf16)
        for kv in (np.float32, np.uint16):  # a float32 KV cache, and a float16 one's bits (--kv-cache float16)
            _attention_block(bits, gs, bf16, kv)
    else:
        from flashmoe.engine.cpu import attn, gemm, routing

        attn.warmup()
        for mode in routing.MODES:
            routing.route(np.zeros((1, 4), np.float32), 2, mode)
        routing.combine(np.zeros((1, 2, 4), np.float32), np.zeros((1, 2), np.float32))
        for bits in (8, 4, 3, 2):
            gemm.dequantize(
                np.zeros((1, 2 * bits), np.uint32), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), bits, 64
            )


def _bank_calls(bits: int, gs: int, bf16: bool = False) -> None:
    """A streamed-expert slot bank's calls (tiled_experts.py): a decode step's SwiGLU (weighted
    and summed, or not), a prefill's grouped gate / up and down."""
    from flashmoe.engine.cpu.gemm import GEMM_ROWS
    from flashmoe.engine.cpu.tiled_experts import TiledBank

    S, inter, hidden = 2, gs, 2 * gs

    def part(n, k):
        return (
            np.zeros((S, n, k * bits // 32), np.uint32),
            np.zeros((S, n, k // gs), np.float32),
            np.zeros((S, n, k // gs), np.float32),
            bits,
            gs,
        )

    bank = TiledBank(
        {"gate_proj": part(inter, hidden), "up_proj": part(inter, hidden), "down_proj": part(hidden, inter)},
        np.zeros(S, dtype=bool),
        bf16,
    )
    bank.swiglu(np.zeros((1, hidden), np.float32), np.array([0, 1]), 2)
    bank.swiglu_sum(np.zeros((1, hidden), np.float32), np.array([0, 1]), np.zeros(2, np.float32))
    idx = np.zeros(GEMM_ROWS, np.int64)
    bank.gather(np.zeros((GEMM_ROWS // 2, hidden), np.float32), idx, 2, ("gate_proj", "up_proj"))
    bank.gather(np.zeros((GEMM_ROWS, inter), np.float32), idx, 1, ("down_proj",))


def _attention_block(bits: int, gs: int, bf16: bool = False, kv=np.float32) -> None:
    """A decode step's attention block in one call (fused.CpuAttention.block_np), argument for
    argument as it passes them: 2 heads of gs over 1 kv head, hidden 2 * gs, the cache's
    elements kv (float32, or uint16: float16 bits)."""
    from flashmoe.engine.cpu.tiled import Tiled

    H, Hk, hd = 2, 1, gs
    D = 2 * gs

    def tiles(n, k):
        t = Tiled.from_mlx(
            np.zeros((n, k * bits // 32), np.uint32),
            np.zeros((n, k // gs), np.float32),
            np.zeros((n, k // gs), np.float32),
            bits,
            gs,
            bf16=bf16,
        )
        return t.wt, t.st, t.bt

    norm = (np.ones(hd, np.float32), np.float32(1e-6), True)
    rope = np.zeros((2, hd), np.float32)
    K, V = np.zeros((Hk, 4, hd), kv), np.zeros((Hk, 4, hd), kv)
    fn = Tiled(*tiles(D, D), D, bits, gs).entry("attn_half")
    fn(
        np.zeros((1, D), np.float32),
        np.ones(D, np.float32),
        np.float32(1e-6),
        *tiles((H + 2 * Hk) * hd, D),
        np.zeros(0, np.float32),
        0,
        H * hd,
        (H + Hk) * hd,
        H,
        Hk,
        hd,
        *norm,
        *norm,
        rope[1],
        rope[1],
        np.arange(hd, dtype=np.int64),
        K,
        V,
        0,
        np.float32(1.0),
        *tiles(D, H * hd),
        np.zeros(0, np.float32),
        np.ones(D, np.float32),
        np.float32(1e-6),
        True,
        True,
    )


def _run_all(jobs) -> None:
    for job in jobs:
        _run(job)


def warm(jobs=JOBS, processes: int = 2) -> float:
    """Compile these kernel families (or load them from the cache); returns the seconds taken."""
    import multiprocessing

    t0 = time.perf_counter()
    shares = [jobs[i::processes] for i in range(processes)]
    if processes <= 1:
        _run_all(jobs)
    else:
        ctx = multiprocessing.get_context("spawn")  # no MLX or numba state inherited
        procs = [ctx.Process(target=_run_all, args=(share,)) for share in shares]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError("compiling the CPU kernels failed (see above)")
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"CPU kernels compiled or found in numba's cache in {warm():.1f} s", file=sys.stderr)
