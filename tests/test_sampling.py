from __future__ import annotations

import dataclasses
import math
from collections import Counter

import mlx.core as mx
import pytest

from flashmoe.engine.runtime.processors import apply, processors_for
from flashmoe.engine.runtime.sampling import Sampler, SamplingParams


def logits_from_probs(probs: list[float]) -> mx.array:
    return mx.array([math.log(p) if p > 0 else -1e9 for p in probs])


def draw(params: SamplingParams, logits: mx.array, n: int, history: list[int] | None = None) -> list[int]:
    sampler, processors = Sampler(params), processors_for(params)
    return [sampler(apply(processors, history or [], logits)) for _ in range(n)]


def pick(params: SamplingParams, logits: mx.array, history: list[int]) -> int:
    """One choice as the token loop makes it: the request's logits processors, then the sampler."""
    return Sampler(params)(apply(processors_for(params), history, logits))


# A known distribution over 6 ids, most likely first is id 2.
PROBS = [0.05, 0.10, 0.40, 0.25, 0.15, 0.05]


def test_greedy_is_argmax():
    logits = mx.random.normal((1000,), key=mx.random.key(0))
    expected = int(mx.argmax(logits).item())
    sampler = Sampler(SamplingParams())
    assert sampler(logits) == expected
    assert pick(SamplingParams(temperature=-1), logits, [1, 2, 3]) == expected
    # any float dtype, and a leading batch axis of 1
    assert sampler(logits.astype(mx.bfloat16)) == int(mx.argmax(logits.astype(mx.bfloat16)).item())
    assert sampler(logits[None]) == expected


def test_rejects_bad_logit_shapes():
    with pytest.raises(ValueError, match="shape"):
        Sampler(SamplingParams())(mx.zeros((2, 5)))


def test_same_seed_same_sequence():
    logits = logits_from_probs(PROBS)
    params = SamplingParams(temperature=1.0, seed=42)
    first = draw(params, logits, 50)
    assert first == draw(params, logits, 50)
    assert len(set(first)) > 1  # really sampling, not stuck on one id
    # unaffected by other users of MLX's global random state
    sampler = Sampler(params)
    seq = []
    for _ in range(50):
        mx.random.normal((3,))
        seq.append(sampler(logits))
    assert seq == first


def test_different_seeds_differ():
    logits = logits_from_probs(PROBS)
    assert draw(SamplingParams(temperature=1.0, seed=1), logits, 50) != draw(
        SamplingParams(temperature=1.0, seed=2), logits, 50
    )


def test_sampling_follows_the_distribution():
    counts = Counter(draw(SamplingParams(temperature=1.0, seed=0), logits_from_probs(PROBS), 2000))
    for i, p in enumerate(PROBS):
        assert abs(counts[i] / 2000 - p) < 0.04


def test_top_k_1_equals_greedy():
    logits = mx.random.normal((500,), key=mx.random.key(3))
    expected = int(mx.argmax(logits).item())
    assert set(draw(SamplingParams(temperature=1.5, top_k=1, seed=0), logits, 50)) == {expected}


def test_top_k_restricts_support():
    seen = set(draw(SamplingParams(temperature=1.0, top_k=2, seed=0), logits_from_probs(PROBS), 500))
    assert seen == {2, 3}


def test_top_p_restricts_support():
    # 0.40 + 0.25 = 0.65 >= 0.6: exactly ids 2 and 3 are kept
    seen = set(draw(SamplingParams(temperature=1.0, top_p=0.6, seed=0), logits_from_probs(PROBS), 500))
    assert seen == {2, 3}
    # 0.40 alone reaches 0.3: only the top token
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.3, seed=0), logits_from_probs(PROBS), 100)) == {2}
    # 0.75 needs 2, 3 and 4 (0.40 + 0.25 + 0.15)
    seen = set(draw(SamplingParams(temperature=1.0, top_p=0.75, seed=0), logits_from_probs(PROBS), 1000))
    assert seen == {2, 3, 4}


def test_top_p_always_keeps_one_token():
    logits = mx.array([0.0, 0.0, 50.0, 0.0])
    assert set(draw(SamplingParams(temperature=1.0, top_p=1e-6, seed=0), logits, 20)) == {2}


def test_min_p_restricts_support():
    # threshold 0.5 * 0.40 = 0.20: ids 2 (0.40) and 3 (0.25) survive
    seen = set(draw(SamplingParams(temperature=1.0, min_p=0.5, seed=0), logits_from_probs(PROBS), 500))
    assert seen == {2, 3}
    # threshold 0.3 * 0.40 = 0.12: ids 2, 3 and 4 survive
    seen = set(draw(SamplingParams(temperature=1.0, min_p=0.3, seed=0), logits_from_probs(PROBS), 1000))
    assert seen == {2, 3, 4}


def test_filters_combine():
    # top_k=3 keeps {2, 3, 4}; renormalised, min_p=0.5 drops 4 (0.15 < 0.5 * 0.40)
    params = SamplingParams(temperature=1.0, top_k=3, min_p=0.5, seed=0)
    assert set(draw(params, logits_from_probs(PROBS), 500)) == {2, 3}


def test_high_temperature_does_not_widen_filtered_support():
    params = SamplingParams(temperature=5.0, top_p=0.6, seed=0)
    assert set(draw(params, logits_from_probs(PROBS), 500)) == {2, 3}


def test_repetition_penalty_changes_argmax():
    logits = mx.array([1.0, 3.0, 2.5, -1.0])
    assert pick(SamplingParams(), logits, [1]) == 1
    # 3.0 / 1.5 = 2.0 < 2.5: the repeated token loses
    assert pick(SamplingParams(repetition_penalty=1.5), logits, [1]) == 2
    # not enough to overturn it
    assert pick(SamplingParams(repetition_penalty=1.1), logits, [1]) == 1


def test_repetition_penalty_on_negative_logits_pushes_down():
    logits = mx.array([-2.0, -1.0, -1.5])
    # -1.0 * 2 = -2.0 < -1.5: id 2 wins
    assert pick(SamplingParams(repetition_penalty=2.0), logits, [1]) == 2


def test_repetition_penalty_only_looks_at_recent_context():
    logits = mx.array([1.0, 3.0, 2.5])
    params = SamplingParams(repetition_penalty=2.0, repetition_context=2)
    assert pick(params, logits, [1, 0, 0]) == 1  # id 1 is outside the last 2 ids
    assert pick(params, logits, [0, 1, 0]) == 2
    assert pick(SamplingParams(repetition_penalty=2.0, repetition_context=0), logits, [1]) == 1


def test_repetition_penalty_applies_once_per_id_and_ignores_out_of_range():
    logits = mx.array([1.0, 3.0, 2.2])
    # once: 3 / 1.2 = 2.5 > 2.2 keeps id 1; twice (3 / 1.44 = 2.08) would hand it to id 2
    assert pick(SamplingParams(repetition_penalty=1.2), logits, [1, 1, 1, 99, -5]) == 1


def test_sampler_does_not_modify_callers_logits():
    logits = mx.array([1.0, 3.0, 2.5, 0.5])
    pick(SamplingParams(temperature=1.0, top_k=2, repetition_penalty=2.0, seed=0), logits, [1])
    assert logits.tolist() == [1.0, 3.0, 2.5, 0.5]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be"),
        ({"top_k": 2.5}, "top_k must be"),
        ({"min_p": 1.2}, "min_p must be in [0, 1]"),
        ({"min_p": -0.1}, "min_p must be"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_context": -3}, "repetition_context must be"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"temperature": float("inf")}, "temperature must be"),
        ({"seed": -1}, "seed must be"),
        ({"seed": "7"}, "seed must be"),
    ],
)
def test_invalid_params_rejected(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_params_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 1.0  # type: ignore[misc]
