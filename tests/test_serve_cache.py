"""Prompt caches across agent sessions (issue 40, item 5): a new session's request reuses the
system prompt an earlier session left, Claude Code's per-prompt billing block notwithstanding,
and a hit copies only the prefix it shares, never the other conversation's tail."""

from __future__ import annotations

import threading

import pytest

from flashmoe.cli.serve import anthropic_api
from flashmoe.cli.serve.fields import Fields
from flashmoe.cli.serve.generation import build_request

SYSTEM = "You are a careful coding agent. " * 20


@pytest.fixture(scope="module")
def loaded(model_factory):
    from flashmoe.engine.runtime.loader import load

    return load(model_factory("qwen3_moe"))


def claude_request(billing: str, task: str) -> dict:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": task}],
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{billing}; cc_entrypoint=cli;"},
            {"type": "text", "text": SYSTEM},
        ],
    }


def ids_of(loaded, body: dict) -> list[int]:
    from flashmoe.engine.runtime.generate import render_prompt

    request, _, _ = build_request(anthropic_api.parse_messages(body, Fields()), loaded.tokenizer.template_source)
    return render_prompt(loaded, request)


def test_the_billing_block_is_not_in_the_prompt_so_sessions_share_it(loaded):
    a = ids_of(loaded, claude_request("6fc", "List the files."))
    b = ids_of(loaded, claude_request("a13", "Fix the failing test."))
    from flashmoe.engine.runtime.prompt_cache import common_prefix

    system = len(loaded.tokenizer.encode(SYSTEM))
    assert common_prefix(a, b) >= system  # (with the block kept they parted at its hash: ~20 tokens)
    assert "x-anthropic-billing-header" not in loaded.tokenizer.decode(a)


def run(loaded, session, ids) -> list[int]:
    from flashmoe.engine.runtime.decode import prefill

    session.prepare(ids)
    todo = ids[len(session.tokens) :]
    logits = None
    for _, logits in prefill(loaded.model, session, todo, 512, threading.Event()):  # noqa: B007 (the last logits are used below)
        pass
    return logits


def test_a_hit_copies_the_shared_prefix_only_and_computes_what_a_fresh_cache_does(loaded):
    import mlx.core as mx

    from flashmoe.engine.runtime.generate import Session
    from flashmoe.engine.runtime.prompt_cache import PromptCachePool

    pool = PromptCachePool(loaded)
    long_history = ids_of(
        loaded,
        {
            "max_tokens": 8,
            "system": SYSTEM,
            "messages": [
                {"role": "user", "content": "word " * 300},
                {"role": "assistant", "content": "ok " * 200},
                {"role": "user", "content": "and more"},
            ],
        },
    )
    first = pool.pick(long_history)
    run(loaded, first, long_history)
    new_session = ids_of(
        loaded, {"max_tokens": 8, "system": SYSTEM, "messages": [{"role": "user", "content": "A new task."}]}
    )
    from flashmoe.engine.runtime.prompt_cache import common_prefix

    shared = common_prefix(long_history, new_session)
    hit = pool.pick(new_session)
    assert hit is not first and first in pool.entries  # the other conversation keeps its cache
    assert hit.tokens == new_session[:shared] and all(c.offset == shared for c in hit.cache)
    assert all(c.keys.shape[2] < first.cache[0].keys.shape[2] for c in hit.cache)  # not the whole tail
    logits = run(loaded, hit, new_session)
    fresh = run(loaded, Session(loaded), new_session)
    assert mx.allclose(logits, fresh, atol=1e-4).item()
    assert first.tokens == long_history  # untouched
