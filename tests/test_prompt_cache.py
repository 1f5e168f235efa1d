"""The prompt-cache pool (engine/runtime/prompt_cache.py): the longest shared prefix is reused,
a cache another conversation holds is copied rather than cut, the byte budget holds, and saved
caches let a new engine (a resumed `flashmoe chat -c`) skip the prompt it already ran, with the
same tokens as computing it all."""

from __future__ import annotations

import threading

import pytest

from flashmoe.engine.events import GenerationFinished, TokenGenerated
from flashmoe.engine.runtime.decode import prefill
from flashmoe.engine.runtime.generate import GenerationRequest, Session, render_prompt
from flashmoe.engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SYSTEM = {"role": "system", "content": "You answer in one short sentence. " * 8}


@pytest.fixture(scope="module")
def loaded(model_factory):
    from flashmoe.engine.runtime.loader import load

    return load(model_factory("qwen3_moe"))


def run(loaded, session, ids):
    session.prepare(ids)
    for _ in prefill(loaded.model, session, ids[len(session.tokens) :], 512, threading.Event()):
        pass


def ids_of(loaded, *users: str):
    msgs = [SYSTEM] + [{"role": "user", "content": u} for u in users]
    return render_prompt(loaded, GenerationRequest(messages=msgs))


def test_the_longest_prefix_is_picked_and_a_continued_one_moves_on(loaded):
    from flashmoe.engine.runtime.prompt_cache import PromptCachePool, common_prefix

    pool = PromptCachePool(loaded)
    a = ids_of(loaded, "What is the capital of France?")
    s = pool.pick(a)
    run(loaded, s, a)
    longer = a + ids_of(loaded, "And of Spain?")[len(SYSTEM) :]  # continues a
    assert pool.pick(longer) is s  # the same cache goes on with its conversation
    other = ids_of(loaded, "Name a river.")
    copy = pool.pick(other)
    assert copy is not s and copy.prepare(other) == common_prefix(a, other) > 20
    assert s.tokens == a  # the original was not cut
    assert len(pool.entries) == 2


def test_a_copied_cache_gives_the_same_logits_as_a_fresh_one(loaded):
    import mlx.core as mx

    from flashmoe.engine.runtime.prompt_cache import PromptCachePool

    pool = PromptCachePool(loaded)
    a, b = ids_of(loaded, "Tell me a joke."), ids_of(loaded, "Tell me a story.")
    s = pool.pick(a)
    run(loaded, s, a)
    t = pool.pick(b)
    reused = t.prepare(b)  # the shared system turn; the copy is cut back to it
    assert reused > 20
    logits = list(prefill(loaded.model, t, b[reused:], 512, threading.Event()))[-1][1]
    fresh = Session(loaded)
    fresh.prepare(b)
    want = list(prefill(loaded.model, fresh, b, 512, threading.Event()))[-1][1]
    assert mx.allclose(logits, want, atol=1e-4).item()
    # and the first conversation's cache, which the copy's writes must not have touched, still
    # answers for it: one more token on it gives what a fresh run of the whole gives
    more = list(prefill(loaded.model, s, [a[-1]], 512, threading.Event()))[-1][1]
    whole = Session(loaded)
    whole.prepare(a + [a[-1]])
    want = list(prefill(loaded.model, whole, a + [a[-1]], 512, threading.Event()))[-1][1]
    assert s.tokens == a + [a[-1]] and mx.allclose(more, want, atol=1e-4).item()


def test_the_byte_budget_evicts_the_least_recently_used(loaded):
    from flashmoe.engine.runtime.prompt_cache import PromptCachePool, cache_bytes

    pool = PromptCachePool(loaded, budget_bytes=1)  # room for the one in use only
    first = pool.pick([5, 6, 7, 8])
    run(loaded, first, [5, 6, 7, 8])
    pool.settle()
    second = pool.pick([9, 10, 11, 12])
    run(loaded, second, [9, 10, 11, 12])
    pool.settle()
    assert pool.entries == [second] and cache_bytes(second) > 1
    assert PromptCachePool(loaded, budget_bytes=0).pick([5, 6]).tokens == []  # 0: no pool


def generate_all(engine, messages, session):
    handle = engine.submit(GenerationRequest(messages=messages, max_tokens=12, sampling=GREEDY), session=session)
    events = list(handle)
    done = events[-1]
    assert isinstance(done, GenerationFinished), done
    return "".join(e.text for e in events if isinstance(e, TokenGenerated)) + done.tail, done


def test_a_new_engine_resumes_a_conversation_from_its_saved_cache(model_factory, tmp_path):
    from flashmoe.engine.runtime.engine import Engine

    folder = model_factory("qwen3_moe")
    first = [SYSTEM, {"role": "user", "content": "Tell me about the sea."}]
    e1 = Engine(folder, prompt_cache_dir=tmp_path)
    try:
        reply, done1 = generate_all(e1, first, "conversation-1")
    finally:
        e1.close()
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    resumed = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the sky?"}]
    e2 = Engine(folder, prompt_cache_dir=tmp_path)  # the process after a restart: `flashmoe chat -c`
    try:
        text2, done2 = generate_all(e2, resumed, "conversation-1")
    finally:
        e2.close()
    assert done2.reused_prompt_tokens >= done1.prompt_tokens
    e3 = Engine(folder)  # no saved caches: everything computed
    try:
        text3, done3 = generate_all(e3, resumed, "conversation-1")
    finally:
        e3.close()
    assert done3.reused_prompt_tokens == 0 and text2 == text3


def test_the_expert_usage_file_written_between_runs_does_not_orphan_saved_caches(model_factory, tmp_path):
    """Every run rewrites expert-usage.json beside the model (experts/usage.py); a saved cache is
    keyed by the model's files, and must still be found by the next run."""
    import shutil

    from flashmoe.engine.experts.usage import FILE
    from flashmoe.engine.runtime.engine import Engine

    folder = shutil.copytree(model_factory("qwen3_moe"), tmp_path / "model")
    kv = tmp_path / "kv"
    first = [SYSTEM, {"role": "user", "content": "Tell me about the sea."}]
    e1 = Engine(folder, prompt_cache_dir=kv, expert_usage=True)
    try:
        reply, done1 = generate_all(e1, first, "conversation-1")
    finally:
        e1.close()
    assert (folder / FILE).is_file()
    resumed = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the sky?"}]
    e2 = Engine(folder, prompt_cache_dir=kv, expert_usage=True)
    try:
        _, done2 = generate_all(e2, resumed, "conversation-1")
    finally:
        e2.close()
    assert done2.reused_prompt_tokens >= done1.prompt_tokens


def test_disk_cache_is_on_by_default_where_prompts_repeat():
    from types import SimpleNamespace

    from flashmoe.cli.startup import DISK_CACHE_BYTES, disk_cache

    def size(**kw):
        return disk_cache(SimpleNamespace(disk_cache=None, **kw))["prompt_cache_disk_bytes"]

    assert size(command="chat") == size(command="serve") == size(command="agent") == DISK_CACHE_BYTES
    assert size(command="run", tools=["builtin"]) == DISK_CACHE_BYTES  # tool instructions repeat
    assert size(command="run", tools=None) == 0  # a one-shot prompt: nothing to come back to
    assert disk_cache(SimpleNamespace(disk_cache=0, command="agent"))["prompt_cache_dir"] is None


@pytest.mark.slow
def test_a_second_tools_run_starts_from_the_first_ones_saved_prefix():
    """`flashmoe run --tools builtin` twice on the demo, different questions: the second runs only
    what follows the shared system prompt and tool instructions."""
    import json

    from tests.helpers.cli import run_cli

    def done(question):
        r = run_cli("run", "--tools", "builtin", "--max-tokens", "2", "--json", question, timeout=300)
        assert r.returncode == 0, r.stderr
        return next(e for e in map(json.loads, r.stdout.splitlines()) if e.get("event") == "done")

    first, second = done("List the files here."), done("What is in the README?")
    # (this worker's FLASHMOE_HOME is shared by its tests: the first may find a saved cache too)
    assert first["prompt_tokens"] > 500
    assert second["reused_prompt_tokens"] >= first["prompt_tokens"] - 20
