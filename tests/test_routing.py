"""The fused decode step's routing and weighted sum (engine/cpu/routing.py) against their numpy
definitions: the same experts, scores to float32 rounding, and the weighted sum bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from flashmoe.engine.cpu.routing import MODES, combine, route


def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reference(logits, k, routing):
    """mlx-lm's routings in numpy (what fused.route computed before it was a kernel)."""
    if routing == "topk_softmax":
        ids = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
        return ids, softmax(np.take_along_axis(logits, ids, axis=-1))
    probs = softmax(logits)
    ids = np.argpartition(-probs, k - 1, axis=-1)[:, :k]
    scores = np.take_along_axis(probs, ids, axis=-1)
    if routing == "softmax_topk_norm":
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return ids, scores


@pytest.mark.parametrize("routing", list(MODES))
@pytest.mark.parametrize("rows,experts,k", [(1, 16, 8), (1, 8, 2), (5, 128, 8), (3, 64, 1), (2, 10, 10), (64, 512, 10)])
def test_route_picks_numpys_experts_with_its_scores(routing, rows, experts, k):
    rng = np.random.default_rng(rows * 1000 + experts + k)
    logits = (rng.standard_normal((rows, experts)) * 3).astype(np.float32)
    ids, scores = route(logits, k, routing)
    want_ids, want_scores = reference(logits, k, routing)
    assert ids.dtype == np.int64 and scores.dtype == np.float32 and ids.shape == scores.shape == (rows, k)
    for r in range(rows):
        assert sorted(ids[r]) == sorted(want_ids[r])
        assert list(ids[r]) == sorted(ids[r], key=lambda e: -logits[r, e])  # best first
        by_id = dict(zip(want_ids[r], want_scores[r]))
        np.testing.assert_allclose(scores[r], [by_id[e] for e in ids[r]], rtol=2e-6, atol=1e-9)


def test_route_ties_masked_experts_and_nan():
    ids, scores = route(np.zeros((1, 16), np.float32), 4, "softmax_topk_norm")
    assert len(set(ids[0])) == 4 and np.allclose(scores, 0.25)  # equal logits: distinct experts
    masked = np.array([[0.5, -np.inf, 2.0, -np.inf, 1.0]], np.float32)  # -inf: an expert never to pick
    for routing in MODES:
        ids, scores = route(masked, 2, routing)
        assert list(ids[0]) == [2, 4] and np.isfinite(scores).all()
    with pytest.raises(ValueError, match="NaN"):
        route(np.array([[0.0, np.nan, 1.0, 2.0]], np.float32), 2, "topk_softmax")


@pytest.mark.parametrize("rows,k", [(1, 8), (1, 1), (7, 2)])
def test_combine_is_numpys_weighted_sum_bit_for_bit(rows, k):
    rng = np.random.default_rng(k)
    y = rng.standard_normal((rows, k, 96)).astype(np.float32)
    scores = rng.random((rows, k)).astype(np.float32)
    shared = rng.standard_normal((rows, 96)).astype(np.float32)
    want = (y * scores[..., None]).sum(axis=-2)
    assert np.array_equal(combine(y, scores), want)
    assert np.array_equal(combine(y, scores, shared), want + shared)
