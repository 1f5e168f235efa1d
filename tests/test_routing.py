"""The fused decode step's routing and weighted sum (engine/cpu/routing.py) against their numpy
definitions: the same experts, scores to float32 rounding, and the weighted sum bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from flashmoe.engine.cpu.routing import MODES, combine, route, route_slots


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


@pytest.mark.parametrize("routing", list(MODES))
def test_route_slots_routes_as_route_and_trusts_a_slot_only_while_it_holds_its_expert(routing):
    """route_slots (a decoding token's fast path, switch.route_cached) routes as `route`, and gives
    the slots its guesses name only while the pool says each holds that layer's expert, repacked:
    a slot now another layer's or another expert's, never known, or holding raw bytes is a miss."""
    rng = np.random.default_rng(7)
    E, k, layer, S = 16, 4, 3, 24
    logits = (rng.standard_normal((1, E)) * 3).astype(np.float32)
    want_ids, want_scores = route(logits, k, routing)
    slot_of = rng.permutation(S)[:E].astype(np.int64)  # expert e last seen in slot slot_of[e]
    layer_of, expert_of, raw = np.full(S, -1, np.int64), np.zeros(S, np.int64), np.zeros(S, bool)
    layer_of[slot_of], expert_of[slot_of] = layer, np.arange(E)

    def call():
        ids, scores, slots = np.empty((1, k), np.int64), np.empty((1, k), np.float32), np.full(k, -7, np.int64)
        hit = route_slots(logits, k, MODES[routing], slot_of, layer, layer_of, expert_of, raw, ids, scores, slots)
        assert np.array_equal(ids, want_ids) and np.array_equal(scores, want_scores)
        return hit, slots

    hit, slots = call()
    assert hit and np.array_equal(slots, slot_of[want_ids[0]])
    s = slot_of[want_ids[0, -1]]  # the last expert chosen: its slot changes hands
    for spoil, undo in (
        (lambda: layer_of.__setitem__(s, layer + 1), lambda: layer_of.__setitem__(s, layer)),
        (lambda: expert_of.__setitem__(s, (expert_of[s] + 1) % E), lambda: expert_of.__setitem__(s, want_ids[0, -1])),
        (lambda: raw.__setitem__(s, True), lambda: raw.__setitem__(s, False)),
        (lambda: slot_of.__setitem__(want_ids[0, -1], -1), lambda: slot_of.__setitem__(want_ids[0, -1], s)),
    ):
        spoil()
        assert call()[0] is False
        undo()
        assert call()[0] is True


@pytest.mark.parametrize("rows,k", [(1, 8), (1, 1), (7, 2)])
def test_combine_is_numpys_weighted_sum_bit_for_bit(rows, k):
    rng = np.random.default_rng(k)
    y = rng.standard_normal((rows, k, 96)).astype(np.float32)
    scores = rng.random((rows, k)).astype(np.float32)
    shared = rng.standard_normal((rows, 96)).astype(np.float32)
    want = (y * scores[..., None]).sum(axis=-2)
    assert np.array_equal(combine(y, scores), want)
    assert np.array_equal(combine(y, scores, shared), want + shared)
