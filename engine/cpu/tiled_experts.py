"""Streamed experts in tiles: each expert in the slot bank is repacked, in place, into tiled.py's
layout once its read has landed, so the experts a token routes to run on the same kernels as the
resident matrices instead of qmm.py's row-layout ones (the upcycled demo's 8-bit experts, on two
cores: gate and up 213 -> 64-82 us per expert, down 70 -> 35-40 us; benchmarks/log/, indexed in benchmarks/README.md).

A slot holds an expert's parts as read: packed words [N, K*bits/32], scales and biases
[N, K/group]. With N a multiple of 16 the tiled form, [N/16, K*bits/32, 16] and [N/16, K/group,
16], has exactly as many elements, so it is written over the same bytes: the cache holds no
second copy. The pool marks the slots that still hold the bytes as read (SlotPool.raw, set on
every put, so a slot given to another expert is read and repacked again); the bank repacks those
before it multiplies them. The checksum of a read is checked before (engine/experts/store.py).

Scales and biases stored as bfloat16 (a real MLX checkpoint's; the slots hold them widened to
float32) are tiled back into bfloat16 bits, in the first half of the slot's own scale bytes: the
kernels then read half as many scale and bias bytes (the synthetic 4-bit model: 10% fewer bytes
a step) for the same floats.
"""

from __future__ import annotations

import threading

import numpy as np

from flashmoe.engine.cpu import int8, tiled
from flashmoe.engine.cpu.gemm import GEMM_ROWS


_NO_SHARED = np.zeros((0, 0), np.float32)  # swiglu_sum's `shared` when there is none (it reads no row)


class TiledBank:
    """The tiled view of one pool's expert projections; `parts[name] = (w, s, b, bits, gs)` are
    the pool's arrays as numpy views [S, N, ...] in MLX's layout. Scales and biases held as
    uint16 are bfloat16 bits (a pool that keeps them as stored: their tiles take the same bytes);
    held as float32 with `bf16`, every one is a bfloat16 value (widened on read) and the tiles
    keep their bfloat16 bits in the first half of the slot's scale bytes."""

    def __init__(self, parts: dict[str, tuple], raw: np.ndarray, bf16: bool = False):
        self._raw = raw
        self._mlx = {n: p[:3] for n, p in parts.items()}
        self.formats = {n: p[3:] for n, p in parts.items()}
        self.native16 = all(p[1].dtype == np.uint16 for p in parts.values())  # bfloat16 bits as held
        self.bf16 = bf16 or self.native16
        self.tiles = {}
        for n, (w, s, b, bits, gs) in parts.items():
            S, N, ng = *w.shape[:2], s.shape[2]
            if self.bf16 and not self.native16:  # uint16 over float32 bytes: 2 N/16 tiles a slot, the first N/16 used
                s, b = s.view(np.uint16), b.view(np.uint16)
            self.tiles[n] = (w.reshape(S, N // 16, w.shape[2], 16), s.reshape(S, -1, ng, 16), b.reshape(S, -1, ng, 16))
        self.n = {n: p[0].shape[1] for n, p in parts.items()}
        self.int8 = False  # entries on int8 activations (int8.py, --kernels cpu-int8)
        self._fns = {}
        self._sums = {}  # swiglu_sum's fixed arguments by (k, width, int8)
        self._scratch = threading.local()  # land()'s copies of a slot's bytes as read, per reader thread
        # gate and up in one call where they share format and size; all three where down does too
        f, n = self.formats, self.n
        self.pair = "gate_proj" in f and (f["gate_proj"], n["gate_proj"]) == (f.get("up_proj"), n.get("up_proj"))
        self.one_call = self.pair and f.get("down_proj") == f["gate_proj"]
        self.k = {n: p[0].shape[2] * 32 // p[3] for n, p in parts.items()}

    @staticmethod
    def supports(parts: dict[str, tuple]) -> bool:
        """Every part in a tiled format, N a multiple of 16, the arrays contiguous, weights uint32,
        scales and biases float32 (or uint16: bfloat16 bits)."""
        return all(
            tiled.supports(bits, gs)
            and w.shape[1] % 16 == 0
            and all(a.flags.c_contiguous for a in (w, s, b))
            and w.dtype == np.uint32
            and s.dtype == b.dtype
            and s.dtype in (np.float32, np.uint16)
            for w, s, b, bits, gs in parts.values()
        )

    def ready(self, slots: np.ndarray) -> None:
        """Repack the slots among these that still hold their bytes as read (a reader thread
        usually has: see land)."""
        raw = self._raw[slots]
        if not raw.any():  # the usual case: every one landed repacked, or an earlier token did it
            return
        for slot in np.unique(slots[raw]):
            self.land(int(slot))

    def land(self, slot: int) -> None:
        """Repack one slot, as read, into tiles over the same bytes; the expert store's landing
        step (SlotPool.land), run by the reader thread that landed the expert's last piece. The
        bytes as read are copied into this thread's scratch first (the tiles overwrite them)."""
        scratch = self._scratch.__dict__
        for name, (w, s, b) in self._mlx.items():
            wt, st, bt = self.tiles[name]
            copies = scratch.get(name)
            if copies is None:
                copies = scratch[name] = tuple(np.empty_like(a[0]) for a in (w, s, b))
            cw, cs, cb = copies
            np.copyto(cw, w[slot])
            if self.bf16 and not self.native16:  # float32 values that are bfloat16: their top halves
                nb = wt.shape[1]
                tiled._repack(
                    cw, tiled.to_bf16(s[slot]), tiled.to_bf16(b[slot]), wt[slot], st[slot, :nb], bt[slot, :nb]
                )
            else:
                np.copyto(cs, s[slot])
                np.copyto(cb, b[slot])
                tiled._repack(cw, cs, cb, wt[slot], st[slot], bt[slot])
        self._raw[slot] = False

    def gather(self, x2: np.ndarray, idx: np.ndarray, k: int, names: tuple[str, ...]) -> list[np.ndarray]:
        """For each entry i of idx (slots, flat): x2[i // k] @ W[idx[i]].T, for each projection
        named (one or two of one format and width): a list of [idx.size, N] arrays. Every slot
        in idx must have been made ready."""
        if idx.size >= GEMM_ROWS:  # a prefill: every expert's rows at once (a decode step never is)
            return list(self._grouped(x2, idx, k, names))
        return list(self._kernel(np.ascontiguousarray(x2), _entry_rows(idx, k), idx, names))

    def swiglu(self, x2: np.ndarray, idx: np.ndarray, k: int, parallel: bool = True) -> np.ndarray | None:
        """down(silu(gate(x)) * up(x)) for each entry of idx (as `gather`) in one kernel call:
        a decode step, with the three projections in one format and gate and up of one size.
        None where that does not hold (the caller gathers each projection then). `parallel`
        False keeps it on this thread (the other core is landing expert reads)."""
        if idx.size >= GEMM_ROWS or not self.one_call:
            return None
        names = ("gate_proj", "up_proj", "down_proj")
        fn, serial_below = self._fn(*self.formats["down_proj"], "swiglu")
        work = idx.size * (2 * self.n[names[0]] * x2.shape[1] + self.n[names[2]] * self.k[names[2]])
        return fn(
            *(t for n in names for t in self.tiles[n]),
            np.ascontiguousarray(x2),
            _entry_rows(idx, k),
            np.ascontiguousarray(idx, dtype=np.int64),
            parallel and work >= serial_below,
        )

    def swiglu_sum(
        self, x2: np.ndarray, slots: np.ndarray, scores: np.ndarray, shared: np.ndarray | None = None
    ) -> np.ndarray | None:
        """One token's experts, weighted and summed: x2 [1, D] through each of its k slots
        (ready), times scores [k], summed as routing.combine sums (plus `shared` [1, D]) in one
        kernel call, where the Python between `swiglu` and `combine` cost as much as the call.
        None where `swiglu` would be."""
        if not self.one_call:
            return None
        fn, tiles, parallel = self.sum_args(slots.size, x2.shape[1])
        return fn(
            *tiles,
            np.ascontiguousarray(x2),
            slots,
            np.ascontiguousarray(scores, dtype=np.float32).reshape(-1),
            _NO_SHARED if shared is None else np.ascontiguousarray(shared, dtype=np.float32),
            parallel,
        )

    def sum_args(self, k: int, width: int) -> tuple:
        """(swiglu_sum's kernel, its nine tile arrays, its parallel flag) for k experts of x rows
        `width` wide, in the kernels' current kind (float or int8): made once."""
        key = (k, width, self.int8)
        if key not in self._sums:
            fn, serial_below = self._fn(*self.formats["down_proj"], "swiglu_sum")
            work = k * (2 * self.n["gate_proj"] * width + self.n["down_proj"] * self.k["down_proj"])
            self._sums[key] = (
                fn,
                tuple(t for n in ("gate_proj", "up_proj", "down_proj") for t in self.tiles[n]),
                work >= serial_below,
            )
        return self._sums[key]

    def _fn(self, bits: int, gs: int, what: str):
        """(kernel, from how much work a call uses every core), found once per format."""
        from flashmoe.engine.cpu.qmm import SERIAL_BELOW, SERIAL_BELOW_WITHOUT_TBB, threading_layer

        key = (bits, gs, what, self.int8)
        if key not in self._fns:
            serial_below = SERIAL_BELOW if threading_layer() == "tbb" else SERIAL_BELOW_WITHOUT_TBB
            if self.int8 and (what != "grouped" or int8.many_rows()):  # (a prefill's entries: int8.many_rows)
                self._fns[key] = (int8.gather_kernel(bits, gs, what), serial_below * int8.serial_factor())
            else:
                self._fns[key] = (tiled.gather_kernel(bits, gs, what), serial_below)
        return self._fns[key]

    def _banks(self, names) -> tuple:
        """The tiles of the one or two projections named, as the kernels take them (a second bank
        with no tiles when there is one)."""
        a = self.tiles[names[0]]
        return (*a, *(self.tiles[names[1]] if len(names) > 1 else tuple(t[:, :0] for t in a)))

    def _kernel(self, x2: np.ndarray, xrow: np.ndarray, slots: np.ndarray, names) -> tuple[np.ndarray, ...]:
        fn, serial_below = self._fn(*self.formats[names[0]], "gather")
        work = xrow.shape[0] * sum(self.n[n] for n in names) * x2.shape[1]
        oa, ob = fn(*self._banks(names), x2, xrow, np.ascontiguousarray(slots, dtype=np.int64), work >= serial_below)
        return (oa, ob) if len(names) > 1 else (oa,)

    def _grouped(self, x2: np.ndarray, idx: np.ndarray, k: int, names) -> tuple[np.ndarray, ...]:
        """`gather` with the entries grouped by slot, so that each weight word of an expert is
        decoded once for up to ROWS of the rows routed to it. Each entry reads its token's row of
        x2 and writes its own output row: x2 is prepared once per token, not once per expert it
        chose. Against dequantize + sgemm per expert (what prefill did before): 1.1-1.3x on the
        demos' whole prefill; where experts get few rows each (512 tokens, 8 of 128 experts: 32),
        against a row per entry, 2.4x (benchmarks/log/, indexed in benchmarks/README.md)."""
        order = np.argsort(idx, kind="stable")
        slots, starts = np.unique(idx[order], return_index=True)
        fn, _ = self._fn(*self.formats[names[0]], "grouped")
        got = fn(
            *self._banks(names),
            np.ascontiguousarray(x2),
            order // k,
            order,
            slots.astype(np.int64),
            np.append(starts, idx.size).astype(np.int64),
            True,
        )
        return got[: len(names)]


def _entry_rows(idx: np.ndarray, k: int) -> np.ndarray:
    """Which x row each entry of idx reads: entry i, row i // k. The kernels prepare each x row
    once (int8: quantized), not once per expert that reads it: a decode step's 8 experts took
    the gate and up projections of the synthetic model's layer from 0.57 to 0.38 ms."""
    return np.arange(idx.size, dtype=np.int64) // k
