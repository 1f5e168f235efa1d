"""bench cache's replay of the expert cache: Belady's rule is the optimum (never beaten by LRU or
LFU, and equal to an exhaustive search on small traces), and the LRU / LFU replays count the hits
the real ExpertStore counts on the same trace."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashmoe.engine.experts.cache_sim import align_guesses, replay, routing_stats


@st.composite
def traces(draw, max_layers=3, max_experts=6, max_steps=40):
    layers = draw(st.integers(1, max_layers))
    experts = draw(st.integers(2, max_experts))
    k = draw(st.integers(1, experts))
    steps = draw(st.integers(1, max_steps))
    trace = []
    for _ in range(steps):
        for layer in range(layers):
            chosen = draw(st.sets(st.integers(0, experts - 1), min_size=k, max_size=k))
            trace.append((layer, tuple(sorted(chosen))))
    slots = draw(st.integers(k, layers * experts + 1))
    return trace, slots, layers


@settings(max_examples=200, deadline=None)
@given(traces())
def test_belady_is_never_beaten_by_lru_or_lfu(case):
    trace, slots, layers = case
    best, n = replay(trace, slots, "belady", layers)
    for policy in ("lru", "lfu"):
        hits, lookups = replay(trace, slots, policy, layers)
        assert lookups == n and hits <= best, policy


def optimum(trace, slots) -> int:
    """The most hits any eviction schedule gets (exhaustive: every choice of victims, lazily)."""
    from itertools import combinations

    @functools.lru_cache(maxsize=None)
    def best(i: int, cache: frozenset) -> int:
        if i == len(trace):
            return 0
        layer, experts = trace[i]
        want = {(layer, e) for e in experts}
        hits = len(want & cache)
        over = len(cache | want) - slots
        if over <= 0:
            return hits + best(i + 1, cache | want)
        outside = sorted(cache - want)
        return hits + max(best(i + 1, (cache - set(v)) | want) for v in combinations(outside, over))

    return best(0, frozenset())


@settings(max_examples=100, deadline=None)
@given(traces(max_layers=2, max_experts=5, max_steps=7))
def test_belady_equals_the_exhaustive_optimum(case):
    trace, slots, layers = case
    assert replay(trace, slots, "belady", layers)[0] == optimum(trace, slots)


def test_a_known_trace():
    # one layer, 2 slots, requests a b c a b (K=1): LRU misses all 5, Belady hits a or b once
    trace = [(0, (e,)) for e in (0, 1, 2, 0, 1)]
    assert replay(trace, 2, "lru") == (0, 5)
    assert replay(trace, 2, "belady") == (1, 5)
    with pytest.raises(ValueError, match="cannot hold one fetch"):
        replay([(0, (0, 1, 2))], 2, "lru")
    with pytest.raises(ValueError, match="policy must be one of"):
        replay(trace, 2, "fifo")


def test_routing_stats_arithmetic():
    # layer 0: 3 tokens choosing {0,1}, {1,2}, {1,2}: reuse (1/2 + 2/2) / 2; loads 1, 3, 2, 0
    trace = [(0, (0, 1)), (1, (0, 1)), (0, (1, 2)), (1, (2, 3)), (0, (1, 2)), (1, (2, 3))]
    guesses = [(1, 1, (0, 3)), (3, 1, (2, 3)), (5, 1, (0, 1))]  # made before each layer-1 fetch
    stats = routing_stats(trace, 4, align_guesses(trace, guesses))
    assert stats[0]["reuse"] == pytest.approx(0.75)
    assert stats[0]["hot_share"] == pytest.approx(3 / 6) and stats[0]["max_over_mean"] == pytest.approx(2.0)
    assert stats[1]["lookahead"] == pytest.approx((1 / 2 + 1 + 0) / 3)
    assert "lookahead" in stats[0] and stats[0]["lookahead"] != stats[0]["lookahead"]  # nan: none made


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_replay_counts_what_the_expert_store_counts(model_factory, policy):
    """The same trace through the real engine (a tiny cache, so it evicts) and through replay."""
    from flashmoe.engine.experts.trace import record
    from flashmoe.engine.runtime.loader import load
    from tests.helpers.streaming import PROMPT

    packed = model_factory("qwen3_moe", 4, converted=True)
    lm = load(packed, expert_cache=0, cache_policy=policy, prefetch="hint")
    slots = sum(p.slots for p in lm.store.pools)
    ids = (PROMPT * 4)[:40]
    trace, guesses, logprobs, hits = record(lm, ids)
    lm.close()
    assert len(trace) == len(logprobs) * len(lm.layers) and guesses
    assert slots < len(lm.layers) * lm.layers[0].num_experts  # it had to evict
    assert replay(trace, slots, policy, len(lm.layers))[0] == hits


def test_recorded_tokens_see_the_ones_before_them(model_factory):
    """record() feeds one token at a time, as decoding does: each token's log-probability must be
    what one causal forward over the whole text gives it (a bug once fed every token alone, with
    no KV cache: routing without context, and every routing figure of `bench cache` with it)."""
    import mlx.core as mx

    from flashmoe.engine.experts.trace import record
    from flashmoe.engine.runtime.loader import load
    from tests.helpers.streaming import PROMPT

    lm = load(model_factory("qwen3_moe", 4, converted=True), kernels="cpu")
    ids = (PROMPT * 2)[:24]
    _, _, logprobs, _ = record(lm, ids)
    logits = lm.model(mx.array([ids[:-1]]))[0].astype(mx.float32)
    want = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[mx.arange(len(ids) - 1), mx.array(ids[1:])]
    assert max(abs(a - b) for a, b in zip(logprobs, want.tolist())) < 1e-3
    lm.close()


def test_bench_cache_cli(model_factory, tmp_path):
    from tests.helpers.cli import run_cli

    packed = model_factory("qwen3_moe", 4, converted=True)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, and then it runs away. " * 4)
    out = tmp_path / "cache.json"
    r = run_cli(
        "bench", "cache", "-m", packed, "--text", text, "--tokens", "24", "--out", out, "--experts-per-token", "4"
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert "K=4 of 2, 8 experts x 3 MoE layers" in result["conditions"]
    assert "24 tokens" in result["conditions"]
    assert [row["slots_per_layer"] for row in result["cache"]][0] == 4  # from K up
    # every expert fits: only the first use of each of the 8 x 3 is a miss
    assert result["cache"][-1]["belady"] >= 1 - 8 * 3 / (24 * 4 * 3)
    for row in result["cache"]:
        assert row["belady"] >= max(row["lru"], row["lfu"])
    assert "Belady" in r.stdout and "slots per layer" in r.stdout
    # bad input: one line naming the argument, exit 2, no traceback
    r = run_cli("bench", "cache", "-m", packed, "--text", tmp_path / "missing.txt")
    assert r.returncode == 2 and "--text" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("bench", "cache", "-m", packed, "--text", text, "--slots", "1")
    assert r.returncode == 2 and "--slots 1" in r.stderr
