"""StreamingSwitchGLU: a drop-in for mlx-lm's SwitchGLU whose experts come from the store.

It keeps mlx-lm's own (quantized) SwitchGLU as the compute, with its stacked [E, ...] parameters
replaced by the store's slot bank [S, ...]; only the expert ids change, mapped to slot ids. The
arithmetic is the resident model's, which is why the streamed logits match it exactly.
"""
from __future__ import annotations

from time import perf_counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from .store import ExpertStore


class _Hidden:
    """Holds a module outside the parent's parameter tree (the slot bank is not a weight)."""

    def __init__(self, module):
        self.module = module


class StreamingSwitchGLU(nn.Module):
    def __init__(self, inner: nn.Module, layer: int, store: ExpertStore, timing: list):
        super().__init__()
        pool = store.pool(layer)
        inner.update(tree_unflatten(list(pool.arrays.items())))
        self._inner = _Hidden(inner)
        self._layer = layer
        self._store = store
        self._timing = timing  # shared one-item list: the engine's current timing mode

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        store, layer = self._store, self._layer
        stats = store.stats[layer]
        inner = self._inner.module
        t0 = perf_counter()
        ids = np.array(indices)  # the one sync we cannot avoid: we must know what to read
        stats.route_s += perf_counter() - t0
        wanted = np.unique(ids)
        slots = store.pool(layer).slots
        if len(wanted) <= slots:
            lut = store.fetch(layer, wanted)
            y = inner(x, mx.array(lut[ids], dtype=indices.dtype))
        else:
            # More distinct experts than slots (long prefill, small budget): run them in
            # groups that fit, keeping each position's result from its own group.
            y = None
            for start in range(0, len(wanted), slots):
                group = wanted[start:start + slots]
                lut = store.fetch(layer, group)
                inside = np.isin(ids, group)
                yg = inner(x, mx.array(np.where(inside, lut[ids], 0), dtype=indices.dtype))
                y = yg if y is None else mx.where(mx.array(inside)[..., None], yg, y)
                mx.eval(y)  # the next group overwrites slots this one reads
        if self._timing[0] == "layer":
            t1 = perf_counter()
            mx.eval(y)
            stats.compute_s += perf_counter() - t1
        else:
            store.note_output(y)
        return y
