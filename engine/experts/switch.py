"""StreamingSwitchGLU: a drop-in for mlx-lm's switch layers (SwitchGLU, SwitchMLP) whose experts
come from the store.

It keeps mlx-lm's own (quantized) block as the compute, with its stacked [E, ...] parameters
replaced by the store's slot bank [S, ...]; only the expert ids change, mapped to slot ids. The
arithmetic is the resident model's, which is why the streamed logits match it exactly.
"""

from __future__ import annotations

from time import perf_counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from flashmoe.engine.experts.blocks import expert_children
from flashmoe.engine.experts.store import ExpertStore
from flashmoe.engine.hidden import Hidden
from flashmoe.engine.telemetry import Telemetry


# Experts read ahead for the next layer (--prefetch slots), its likeliest not cached: as many as
# the drive reads while it would otherwise sit idle, between the last of a layer's reads landing
# and the next layer's routing (the miss computation, the next attention: 2-3 ms, 1-2 experts).
READ_AHEAD = 2


class StreamingSwitchGLU(nn.Module):
    def __init__(self, inner: nn.Module, layer: int, store: ExpertStore, telemetry: Telemetry):
        super().__init__()
        pool = store.pool(layer)
        inner.update(tree_unflatten(list(pool.arrays.items())))
        self._inner = Hidden(inner)
        for name in set(inner.children()) - set(expert_children(inner)):
            setattr(self, name, getattr(inner, name))  # resident parts a model keeps on the block
        self._layer = layer
        self._store = store
        self._telemetry = telemetry  # the engine's: its timing mode, read per call
        self._cpu = _CpuExperts(inner, pool) if store.cpu_kernels and _CpuExperts.supports(inner, pool) else None
        self._side = None  # Hidden(shared expert with run_ahead(x, x2)): computed while experts load
        self._pool = pool
        # the slot each expert had when decode_cached last found it (-1: never): route_cached's
        # guess, checked against the pool's owners (an array: mlx's Module keeps lists as children)
        self._slot_of = np.full(store.layers[layer].num_experts, -1, dtype=np.int64) if self._cpu else None

    # -- what the CPU fast path (engine/cpu/fused.py) asks of a streamed block ----------------
    @property
    def on_cpu_kernels(self) -> bool:
        """Its experts are computed by the numba kernels (as each read lands)."""
        return self._cpu is not None

    @property
    def tiled_bank(self):
        """The slot bank in tiles (engine/cpu/tiled_experts.py), or None."""
        return self._cpu.bank if self._cpu is not None else None

    @property
    def num_experts(self) -> int:
        return self._store.layers[self._layer].num_experts

    def expert_input_dim(self) -> int:
        """The width of the hidden state the experts take (from the packed gate projection)."""
        w, _, _, bits, _ = self._cpu.w["gate_proj"]
        return w.shape[-1] * 32 // bits

    def compute_beside(self, module) -> None:
        """Run module.run_ahead(x, x2) (a shared expert) while this block's experts are read."""
        self._side = Hidden(module)

    def add_route_time(self, seconds: float) -> None:
        """Routing done outside this block (a fused MoE's router) counts as this layer's."""
        self._store.stats[self._layer].route_s += seconds

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        store, layer = self._store, self._layer
        stats = store.stats[layer]
        inner = self._inner.module
        t0 = perf_counter()
        ids = np.array(indices)  # the one sync we cannot avoid: we must know what to read
        stats.route_s += perf_counter() - t0
        if self._cpu is not None:
            from flashmoe.engine.cpu.qmm import to_numpy

            mx.eval(x)
            x2 = to_numpy(x).reshape(-1, x.shape[-1])
            side = self._side.module if self._side is not None else None
            during = (lambda: side.run_ahead(x, x2)) if side is not None else None
            y = mx.array(self.experts_np(x2, ids, during=during))
            return y if x.dtype == mx.float32 else y.astype(x.dtype)
        wanted = np.unique(ids)
        slots = store.pool(layer).slots
        if store.routers and ids.size == ids.shape[-1]:  # decoding one token: read the next layer ahead
            self._read_ahead(x, set(int(e) for e in wanted))
        if len(wanted) <= slots:
            lut = store.fetch(layer, wanted)
            y = inner(x, mx.array(lut[ids], dtype=indices.dtype))
        else:
            y = self._in_groups(x, ids, wanted, slots, indices.dtype)
        if self._telemetry.mode == "layer":
            t1 = perf_counter()
            mx.eval(y)
            stats.compute_s += perf_counter() - t1
        else:
            store.note_output(y)
        return y

    def experts_np(self, x2: np.ndarray, ids: np.ndarray, during=None) -> np.ndarray:
        """The CPU kernel path on numpy: x2 [R, D] float32, ids [..., k] with ids.size = R * k
        -> expert outputs ids.shape + (D_out,) (not yet weighted by the router's scores).
        `during()` runs once while the misses are read (see ExpertStore.fetch)."""
        store, layer = self._store, self._layer
        stats = store.stats[layer]
        wanted = np.unique(ids)
        landed = None
        if store.routers and ids.size == ids.shape[-1]:  # decoding one token: once this layer's reads

            def landed():  # have landed (the drive is idle), read the next layer's likely experts
                self._read_ahead(x2, set(int(e) for e in wanted))

        t1 = perf_counter()
        y = self._cpu(x2, ids, wanted, store.pool(layer).slots, store, layer, during, landed)
        stats.compute_s += perf_counter() - t1 - (stats.io_wait_s - self._cpu.wait_before)
        return y

    def route_cached(self, logits: np.ndarray, k: int, mode: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A decoding token's routing (routing.route, `mode` one of its MODES' values) of logits
        [1, E]: (ids [1, k], scores [1, k], slots [k]), slots None unless every expert chosen is
        still in the slot decode_cached last found it in, ready to compute (see decode_slots)."""
        from flashmoe.engine.cpu.routing import route_slots

        ids, scores, slots = np.empty((1, k), np.int64), np.empty((1, k), np.float32), np.empty(k, np.int64)
        hit = route_slots(
            np.ascontiguousarray(logits, dtype=np.float32), k, mode, *self.slot_args(), ids, scores, slots
        )
        return ids, scores, (slots if hit else None)

    def slot_args(self) -> tuple:
        """route_slots' arguments after the routing's own: (slot_of, layer, layer_of, expert_of,
        raw), arrays the pool changes in place."""
        pool = self._pool
        return self._slot_of, self._layer, pool.layer_of, pool.expert_of, pool.raw

    def fusable(self) -> bool:
        """Whether a decoding token's whole layer may be one kernel call (fused.CpuDecoderLayer):
        always (read-ahead starts after the call, from its feed-forward input); the tests turn
        it off to compare the call with the separate ones."""
        return True

    def fused_done(self, ids: np.ndarray, slots: np.ndarray | None, times: np.ndarray, n2=None) -> None:
        """The books of a fused layer call (fused.CpuDecoderLayer): its routing time, and where
        it computed the experts (slots given), their hits and compute time, as decode_slots keeps
        them. times: the call's seconds of attention, routing, experts. With read-ahead, a call
        that computed its experts (no read: the drive is idle) starts reading the next layer's
        likely ones from n2, the feed-forward input."""
        stats = self._store.stats[self._layer]
        stats.route_s += times[1]
        if slots is not None:
            self._store.note_hits(self._layer, ids.reshape(-1).tolist(), slots)
            stats.compute_s += times[2]
            if self._store.routers and n2 is not None:
                self._read_ahead(n2, set(ids.reshape(-1).tolist()))

    def decode_slots(
        self, x2: np.ndarray, ids: np.ndarray, slots: np.ndarray, scores: np.ndarray, shared=None
    ) -> np.ndarray:
        """decode_cached for experts route_cached found in their slots: the cache's bookkeeping of
        those hits (store.note_hits, as fetch keeps it) without fetch's lookups."""
        store, layer = self._store, self._layer
        flat = ids.reshape(-1)
        if store.routers:
            self._read_ahead(x2, set(flat.tolist()))
        store.note_hits(layer, flat.tolist(), slots)
        t1 = perf_counter()
        y = self._cpu.bank.swiglu_sum(x2, slots, scores, shared() if shared is not None else None)
        store.stats[layer].compute_s += perf_counter() - t1
        return y

    def decode_cached(self, x2: np.ndarray, ids: np.ndarray, scores: np.ndarray, shared=None) -> np.ndarray | None:
        """One decoding token's experts when every one it routes to is cached: x2 [1, D], ids and
        scores [1, k] -> the weighted sum of their outputs plus shared() [1, D] (when given), in
        one kernel call (TiledBank.swiglu_sum). None when an expert must be read, or the bank
        cannot (the caller takes experts_np then, which reads). The cache's bookkeeping is
        fetch's, as for any hit."""
        bank = self.tiled_bank
        flat = ids.reshape(-1)
        store, layer = self._store, self._layer
        if bank is None or not bank.one_call or not store.holds(layer, flat):
            return None
        if store.routers:  # decoding one token: read the next layer ahead
            self._read_ahead(x2, set(int(e) for e in flat))
        slots = store.fetch(layer, flat)[flat].astype(np.int64)
        bank.ready(slots)
        held = self._pool.layer_of == layer  # where every expert of this layer is now (a vector op)
        self._slot_of[self._pool.expert_of[held]] = np.flatnonzero(held)
        t1 = perf_counter()
        y = bank.swiglu_sum(x2, slots, scores, shared() if shared is not None else None)
        store.stats[layer].compute_s += perf_counter() - t1
        return y

    def _read_ahead(self, x, wanted: set[int]) -> None:
        """Guess the next MoE layer's experts from its router applied to this layer's input (the
        hidden state it will see differs by one layer's update) and start reading them."""
        store = self._store
        nxt = store.next_layer.get(self._layer)
        w = store.routers.get(nxt)
        if w is None:
            return
        if isinstance(x, mx.array):
            mx.eval(x)
        h = np.array(x, copy=False).reshape(-1)
        guess = np.argpartition(-(w @ h), len(wanted) - 1)[: len(wanted)]
        if store.prefetch_mode == "slots":  # the likeliest not cached, as many as the drive reads while idle
            logits = w[guess] @ h
            table = store.pool(nxt).table
            guess = [int(e) for e in guess[np.argsort(-logits)] if (nxt, int(e)) not in table][:READ_AHEAD]
        if store.guesses is not None:
            store.guesses.append((len(store.trace or ()), nxt, tuple(sorted(int(e) for e in guess))))
        if store.prefetch_mode == "hint":
            store.hint(nxt, guess)
        else:
            store.prefetch(nxt, guess, protect=(self._layer, wanted))

    def _in_groups(self, x, ids, wanted, slots, dtype):
        """More distinct experts than slots (a long prefill under a small budget): load them a
        group at a time and run each group only on the (token, k) pairs that chose it."""
        store, inner = self._store, self._inner.module
        k = ids.shape[-1]
        flat_ids = ids.reshape(-1)
        x_flat = x.reshape(-1, x.shape[-1])
        y = None
        for start in range(0, len(wanted), slots):
            group = wanted[start : start + slots]
            lut = store.fetch(self._layer, group)
            pairs = np.nonzero(np.isin(flat_ids, group))[0]
            rows = x_flat[mx.array(pairs // k)]
            out = inner(rows, mx.array(lut[flat_ids[pairs]][:, None], dtype=dtype))[:, 0]
            if y is None:
                y = mx.zeros((flat_ids.size, out.shape[-1]), dtype=out.dtype)
            y = y.at[mx.array(pairs)].add(out)  # each pair belongs to one group: add onto zero
            mx.eval(y)  # the next group overwrites slots this one reads
        return y.reshape(*ids.shape, -1)


class _CpuExperts:
    """The experts of one layer on the CPU kernels (numba), reading the slot bank through
    zero-copy numpy views. Each expert is computed as soon as its read has landed, while the
    reads of the others are still in flight."""

    PROJS = ("gate_proj", "up_proj", "down_proj")

    @staticmethod
    def _computes(inner) -> bool:
        """A plain SwiGLU block of affine quantized projections without biases."""
        from mlx_lm.models.switch_layers import SwiGLU

        projs = [getattr(inner, p, None) for p in _CpuExperts.PROJS]
        return (
            type(getattr(inner, "activation", None)) is SwiGLU  # not a clamped or scaled variant
            and all(getattr(p, "mode", None) == "affine" and "bias" not in p and "biases" in p for p in projs)
        )

    @staticmethod
    def supports(inner, pool) -> bool:
        held = {p.name: p.dtype for p in pool.held}
        return _CpuExperts._computes(inner) and all(held[f"{n}.scales"] in ("F32", "BF16") for n in _CpuExperts.PROJS)

    @staticmethod
    def tileable(inner, parts) -> bool:
        """Whether experts of this block with these parts (layout.Part) run on the tiled kernels
        (engine/cpu/tiled_experts.py): then `flashmoe convert` stores them in tiles
        (LayerExperts.layout), and a read lands ready to compute."""
        from flashmoe.engine.cpu import tiled

        parts = {p.name: p for p in parts}
        names = {f"{n}.{a}" for n in _CpuExperts.PROJS for a in ("weight", "scales", "biases")}
        if not _CpuExperts._computes(inner) or set(parts) != names:
            return False
        return all(
            tiled.supports(getattr(inner, n).bits, getattr(inner, n).group_size)
            and parts[f"{n}.weight"].shape[0] % 16 == 0
            and parts[f"{n}.weight"].dtype == "U32"
            and parts[f"{n}.scales"].dtype == parts[f"{n}.biases"].dtype in ("F32", "BF16")
            for n in _CpuExperts.PROJS
        )

    @staticmethod
    def keeps_bf16(inner, layer) -> bool:
        """Whether the slots of these experts (LayerExperts) can keep bfloat16 scales and biases
        as stored: their tiles (tiled_experts.py) take the bits as they are, so nothing is widened
        on read and the cache holds 10-15% more experts."""
        return _CpuExperts.tileable(inner, layer.parts) and all(
            p.dtype == "BF16" for p in layer.parts if p.name.endswith((".scales", ".biases"))
        )

    def __init__(self, inner, pool):
        from flashmoe.engine.cpu.tiled_experts import TiledBank

        self.w = {}
        for n in self.PROJS:
            proj = getattr(inner, n)
            self.w[n] = (
                pool.numpy(f"{n}.weight"),
                pool.numpy(f"{n}.scales"),
                pool.numpy(f"{n}.biases"),
                proj.bits,
                proj.group_size,
            )
        # Where the format allows, slots are repacked into tiles as they land (tiled_experts.py),
        # by the reader thread that landed them. Scales and biases stored as bfloat16 stay so in
        # the tiles, for half their bytes (held so, or widened on read and narrowed back).
        bf16 = all(p.dtype == "BF16" for p in pool.parts if p.name.endswith((".scales", ".biases")))
        self.bank = TiledBank(self.w, pool.raw, bf16) if TiledBank.supports(self.w) else None
        if self.bank is None and any(w[1].dtype != np.float32 for w in self.w.values()):
            raise ValueError("experts held with bfloat16 scales need the tiled kernels (keeps_bf16 said they would)")
        if self.bank is not None and pool.layout == "tiles":  # stored in tiles: used as read
            pool.land, pool.reads_tiles = None, True
        elif self.bank is not None:
            pool.land = self.bank.land
        self.wait_before = 0.0

    def _swiglu(self, rows, slots, parallel: bool = True):
        """down(silu(gate(x)) * up(x)) of each x row with its slot: rows [R, D] with slots [R]
        (or [R, k]: each row with each of its k slots). `parallel` False: a decode step's call
        stays on this thread while reads land on the other core."""
        from flashmoe.engine.cpu.attn import silu_mul
        from flashmoe.engine.cpu.qmm import gather_qmm, gather_qmm_pair

        if self.bank is not None:
            bank, flat = self.bank, slots.reshape(-1)
            k = flat.size // rows.shape[0]
            bank.ready(flat)
            y = bank.swiglu(rows, flat, k, parallel)  # a decode step: one kernel call
            if y is not None:
                return y
            if bank.pair:
                g, u = bank.gather(rows, flat, k, ("gate_proj", "up_proj"))
            else:
                (g,), (u,) = bank.gather(rows, flat, k, ("gate_proj",)), bank.gather(rows, flat, k, ("up_proj",))
            return bank.gather(silu_mul(g, u), flat, 1, ("down_proj",))[0]
        gate, up = self.w["gate_proj"], self.w["up_proj"]
        if gate[3:] == up[3:] and gate[0].shape == up[0].shape:  # one kernel call for both
            g, u = gather_qmm_pair(rows, gate[:3], up[:3], slots, *gate[3:])
        else:
            g = gather_qmm(rows, *gate[:3], slots, *gate[3:])
            u = gather_qmm(rows, *up[:3], slots, *up[3:])
        h = silu_mul(g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1]))
        return gather_qmm(h, *self.w["down_proj"][:3], slots.reshape(-1), *self.w["down_proj"][3:])

    def __call__(self, x2, ids, wanted, slots, store, layer, during=None, landed=None):
        """The experts' outputs for x2 routed to ids; `landed()` runs once every read has landed
        (the caller's read-ahead: the drive is idle then), before the last computation."""
        flat = ids.reshape(x2.shape[0], -1)
        out = np.empty((flat.size, x2.shape[1]), dtype=np.float32)
        self.wait_before = store.stats[layer].io_wait_s

        decoding = x2.shape[0] == 1
        calls, arrived = [0], []

        def ready(lut, experts, more=False):
            calls[0] += 1
            if not more and landed is not None:
                landed()
            if len(experts) == len(wanted):  # all at once (all cached): x rows are prepared once
                out[:] = self._swiglu(x2, lut[flat].astype(np.int64))
                return
            if decoding and calls[0] > 1:  # a decode step's misses: one call once the last has landed
                arrived.extend(experts)
                if more:
                    return
                experts = arrived
            pairs = np.nonzero(np.isin(flat.reshape(-1), experts))[0]
            if pairs.size:
                out[pairs] = self._swiglu(x2[pairs // flat.shape[1]], lut[flat].reshape(-1)[pairs].astype(np.int64))

        for start in range(0, len(wanted), slots):  # more distinct experts than slots: in groups
            calls[0], arrived[:] = 0, []  # (a group's slots are the next group's: each computes in its own fetch)
            store.fetch(layer, wanted[start : start + slots], ready=ready, during=during if start == 0 else None)
        return out.reshape(*ids.shape, -1)
