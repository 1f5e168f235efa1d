"""A MoE block's routing and weighted sum for the fused decode step (numba): each is one call
instead of the 6-10 small numpy ops it took (softmax, argpartition, take_along_axis, a product and
a sum: 25-40 us a layer on this machine, a millisecond and more of a 30-layer step).

`route` reproduces mlx-lm's three routings (fused.ROUTINGS); the experts it picks are the same as
numpy's, the scores agree to float32 rounding (its exp is libm's, numpy's its own SIMD one).
`combine` adds the weighted expert outputs in the order numpy's sum over the k axis does, so its
result is numpy's bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import float32, njit

from flashmoe.engine.cpu import numba_cache  # noqa: F401 - before any kernel is defined (see there)

MODES = {"topk_softmax": 0, "softmax_topk_norm": 1, "softmax_topk": 2}


@njit(cache=True, fastmath=False, nogil=True)
def _top(z, k, ids, vals):
    """The k largest of z, largest first, into ids / vals (insertion into a short sorted list)."""
    n = 0
    for e in range(z.shape[0]):
        v = z[e]
        if n == k and not v > vals[k - 1]:
            continue
        j = n if n < k else k - 1
        while j > 0 and vals[j - 1] < v:
            vals[j] = vals[j - 1]
            ids[j] = ids[j - 1]
            j -= 1
        vals[j] = v
        ids[j] = e
        if n < k:
            n += 1


@njit(cache=True, fastmath=False, nogil=True)
def _route(logits, k, mode, ids, scores):
    R, E = logits.shape
    p = np.empty(E, np.float32)
    vals = np.empty(k, np.float32)
    for r in range(R):
        z = logits[r]
        for e in range(E):
            if z[e] != z[e]:  # numpy's argpartition would pick any expert; say what went wrong
                raise ValueError("router logits are NaN")
        if mode == 0:  # the top k logits, softmaxed among themselves
            _top(z, k, ids[r], vals)
            s = float32(0.0)
            for j in range(k):
                scores[r, j] = np.exp(vals[j] - vals[0])
                s += scores[r, j]
            for j in range(k):
                scores[r, j] = scores[r, j] / s
            continue
        m = z[0]
        for e in range(1, E):
            m = max(m, z[e])
        s = float32(0.0)
        for e in range(E):
            p[e] = np.exp(z[e] - m)
            s += p[e]
        for e in range(E):
            p[e] = p[e] / s
        _top(p, k, ids[r], vals)
        t = float32(0.0)
        for j in range(k):
            scores[r, j] = vals[j]
            t += vals[j]
        if mode == 1:  # renormalised over the k picked (norm_topk_prob)
            for j in range(k):
                scores[r, j] = scores[r, j] / t


def route(logits: np.ndarray, k: int, routing: str) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids [R, k] int64, scores [R, k] float32) of logits [R, E] (float32), as mlx-lm's MoE
    blocks route: Mixtral takes the top k logits and softmaxes those; Qwen3-MoE and OLMoE softmax
    all, take the top k and (norm_topk_prob) renormalise them."""
    R = logits.shape[0]
    ids = np.empty((R, k), np.int64)
    scores = np.empty((R, k), np.float32)
    _route(np.ascontiguousarray(logits, dtype=np.float32), k, MODES[routing], ids, scores)
    return ids, scores


@njit(cache=True, fastmath=False, nogil=True)
def route_slots(logits, k, mode, slot_of, layer, layer_of, expert_of, raw, ids, scores, slots):
    """One decoding token's routing (`route` of logits [1, E] into ids, scores [1, k]) and the
    slots of its k experts (slots [k]) from slot_of [E], the slot each expert last had (-1: none):
    whether every one still holds its expert (the pool's layer_of / expert_of) repacked (not raw)."""
    _route(logits, k, mode, ids, scores)
    for j in range(k):
        e = ids[0, j]
        s = slot_of[e]
        if s < 0 or layer_of[s] != layer or expert_of[s] != e or raw[s]:
            return False
        slots[j] = s
    return True


@njit(cache=True, fastmath=False, nogil=True)
def gate_rows(out, g):
    """out[r] *= sigmoid(g[r, 0]) in place (a shared expert behind its gate, Qwen2-MoE's): one
    function for the separate calls and the one-call layer, so both take the same exp."""
    for r in range(out.shape[0]):
        s = float32(1.0) / (float32(1.0) + np.exp(-g[r, 0]))
        for d in range(out.shape[1]):
            out[r, d] = out[r, d] * s


@njit(cache=True, fastmath=False, nogil=True)
def combine_rows(y, scores, shared, out):
    R, k, D = y.shape
    for r in range(R):
        for d in range(D):
            acc = y[r, 0, d] * scores[r, 0]
            for j in range(1, k):
                acc += y[r, j, d] * scores[r, j]
            out[r, d] = acc + shared[r, d] if shared.shape[0] else acc


def combine(y: np.ndarray, scores: np.ndarray, shared: np.ndarray | None = None) -> np.ndarray:
    """sum over j of y[:, j] * scores[:, j] (y [R, k, D], scores [R, k]), plus `shared` [R, D]:
    numpy's (y * scores[..., None]).sum(axis=-2) + shared, bit for bit."""
    R, _, D = y.shape
    out = np.empty((R, D), np.float32)
    none = np.zeros((0, D), np.float32)
    combine_rows(
        np.ascontiguousarray(y, dtype=np.float32),
        np.ascontiguousarray(scores, dtype=np.float32),
        none if shared is None else np.ascontiguousarray(shared, dtype=np.float32),
        out,
    )
    return out
