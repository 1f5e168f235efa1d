"""The engine thread, events, sessions, timing and the cache budget."""

from __future__ import annotations

import pytest

from flashmoe.engine import EngineFailed, GenerationFinished, LayerTimings, PrefillProgress, TokenGenerated
from flashmoe.engine.runtime.engine import Engine
from flashmoe.engine.runtime.generate import GenerationRequest, Session, StopMatcher, generate
from flashmoe.engine.runtime.loader import load
from tests.helpers.streaming import greedy
from tests.tiny_models import reference_model

CHAT = [{"role": "user", "content": "Tell me about café culture in Paris."}]


def collect(events):
    evs = list(events)
    return evs, [e for e in evs if isinstance(e, TokenGenerated)], evs[-1]


def test_engine_thread_tokens_match_reference(model_factory):
    src = model_factory("qwen3_moe", 4)
    packed = model_factory("qwen3_moe", 4, converted=True)
    eng = Engine(packed, expert_cache=0)
    info = eng.wait_loaded()
    assert (info.model_type, info.mode, info.top_k, info.bits) == ("qwen3_moe", "packed", 2, 4)
    evs, toks, done = collect(eng.submit(GenerationRequest(messages=CHAT, max_tokens=24)))
    assert isinstance(done, GenerationFinished) and done.reason == "length"
    assert isinstance(evs[0], PrefillProgress)

    # Same prompt ids through resident mlx-lm, greedily.
    lm = load(packed, load_tokenizer=True)
    ids = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    assert [t.id for t in toks] == greedy(reference_model(src), ids, 24)
    assert done.text == "".join(t.text for t in toks) + done.tail
    assert done.generation_tokens == 24 and done.prompt_tokens == len(ids)
    # cache 0: every decode step reads K experts per MoE layer (no slot survives 3 layers).
    per_token = lm.top_k * sum(l.expert_bytes for l in lm.layers)
    assert done.bytes_per_token == pytest.approx(per_token * (1 - done.hit_rate), rel=1e-6)
    eng.close()


def test_layer_timing_rows_and_cancel(model_factory):
    packed = model_factory("qwen3_next", 4, converted=True)
    eng = Engine(packed)
    eng.wait_loaded()
    handle = eng.submit(GenerationRequest(messages=CHAT, max_tokens=10_000, timing="layer"))
    n_layers = eng.loaded.num_layers
    seen = 0
    for ev in handle:
        if isinstance(ev, LayerTimings):
            assert ev.mode == "layer" and len(ev.rows) == n_layers
            assert all(r.attn_ms > 0 and r.other_ms >= 0 for r in ev.rows)
            assert all(r.route_ms > 0 and r.hits + r.misses == 2 for r in ev.rows)  # every layer is MoE here
            seen += 1
            if seen == 5:
                handle.cancel()
        last = ev
    assert isinstance(last, GenerationFinished) and last.reason == "cancelled"
    assert 5 <= last.generation_tokens < 10_000
    eng.close()


def test_second_turn_reuses_the_cache_and_gives_the_same_tokens(model_factory):
    lm = load(model_factory("mixtral", 8, converted=True))
    session = Session(lm)
    _, toks1, done1 = collect(generate(lm, session, GenerationRequest(messages=CHAT, max_tokens=8)))
    turn2 = CHAT + [{"role": "assistant", "content": done1.text}, {"role": "user", "content": "And in Rome?"}]
    _, toks2, done2 = collect(generate(lm, session, GenerationRequest(messages=turn2, max_tokens=8)))
    assert done2.reused_prompt_tokens >= done1.prompt_tokens - 1
    _, fresh, _ = collect(generate(lm, Session(lm), GenerationRequest(messages=turn2, max_tokens=8)))
    assert [t.id for t in toks2] == [t.id for t in fresh]


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_cache_never_exceeds_budget_over_a_long_generation(model_factory, policy):
    packed = model_factory("olmoe", 4, converted=True)
    probe = load(packed, load_tokenizer=False)
    budget = 5 * probe.layers[0].expert_bytes
    lm = load(packed, expert_cache=budget, cache_policy=policy)
    session = Session(lm)
    req = GenerationRequest(
        messages=CHAT, max_tokens=200, sampling=__import__("engine").SamplingParams(temperature=1.0, seed=1)
    )
    used = []
    for ev in generate(lm, session, req):  # noqa: B007 (the last event is read below)
        used.append(lm.store.used_bytes)
        assert lm.store.used_bytes <= budget
    assert lm.store.peak_used_bytes <= budget and lm.store.capacity_bytes <= budget
    assert max(used) == budget  # the budget is used, not left idle
    assert isinstance(ev, GenerationFinished) and 0 < ev.hit_rate < 1


def test_stop_strings_are_held_back_and_cut():
    m = StopMatcher(("STOP",))
    assert m.feed("hello S") == ("hello ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("ill") == ("STill", False)
    assert m.feed(" ST") == (" ", False)
    assert m.feed("OP and more") == ("", True)


def test_stop_string_ends_generation(model_factory):
    lm = load(model_factory("mixtral", 8, converted=True))
    _, toks, done = collect(generate(lm, Session(lm), GenerationRequest(messages=CHAT, max_tokens=20)))
    text = done.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    _, _, done2 = collect(generate(lm, Session(lm), GenerationRequest(messages=CHAT, max_tokens=20, stop=(stop,))))
    assert done2.reason == "stop" and done2.text == text[: text.index(stop)]


def test_engine_reports_load_errors(tmp_path):
    eng = Engine(tmp_path / "nope")
    with pytest.raises(Exception) as e:
        eng.wait_loaded()
    assert "nope" in str(e.value)
    failed = list(eng.submit(GenerationRequest(prompt="x")))
    assert isinstance(failed[-1], EngineFailed) and failed[-1].exit_code == 3


def test_bad_requests_are_rejected():
    with pytest.raises(ValueError, match="timing"):
        GenerationRequest(prompt="x", timing="often")
    with pytest.raises(ValueError, match="exactly one"):
        GenerationRequest()


def hits_with_one_hot_expert_per_layer(packed, policy: str, tokens: int = 40) -> tuple[int, int, int]:
    """Each token asks every layer for its own hot expert and one of the others in turn. The
    cache holds one slot more than there are layers: LRU evicts each hot expert before it comes
    back (every other layer's two experts come in between), LFU keeps the often-asked ones."""
    probe = load(packed, load_tokenizer=False)
    layers = [l.layer for l in probe.layers]
    n = probe.layers[0].num_experts
    lm = load(
        packed, expert_cache=(len(layers) + 1) * probe.layers[0].expert_bytes, load_tokenizer=False, cache_policy=policy
    )
    assert lm.store.pools[0].slots == len(layers) + 1
    for t in range(tokens):
        for layer in layers:
            lut = lm.store.fetch(layer, [0, 1 + t % (n - 1)])
            assert lut[0] != lut[1 + t % (n - 1)]  # two slots, both holding what was asked for
        assert lm.store.used_bytes <= lm.store.budget_bytes
    stats = lm.store.take_stats().values()
    lm.close()
    return sum(s.hits for s in stats), sum(s.misses for s in stats), len(layers)


def test_lfu_keeps_the_experts_asked_for_most_where_lru_keeps_none(model_factory):
    packed = model_factory("qwen3_moe", 4, converted=True)
    hits, misses, layers = hits_with_one_hot_expert_per_layer(packed, "lru")
    assert layers >= 2 and hits == 0 and misses == 2 * 40 * layers
    hits, misses, _ = hits_with_one_hot_expert_per_layer(packed, "lfu")
    assert hits >= layers * 38  # every hot expert hits once the counts tell them apart
    assert hits + misses == 2 * 40 * layers
