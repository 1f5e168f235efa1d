"""What a reply may carry (issue 40): never more tokens than max_tokens, forced and parallel calls
included; no partial call markup and no blanks between calls as content; calls streamed as they
are written; the stop sequence matched; message_start's real input count (= count_tokens); a
prompt that cannot run refused before the first byte; keepalives on a quiet stream.

A real server process on a tiny random model (its byte-level tokenizer makes a call ~60 tokens,
so budgets bite), plus the scripted engine in-process where a reply must be exactly one text."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from flashmoe.cli.serve.app import Server
from flashmoe.engine.testing import FakeEngine
from tests.helpers.server import HELLO, WEATHER, ServerProcess
from tests.tiny_tokenizer import CHAT_TEMPLATE

MODEL = "tiny"
TOOL_A = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}
MARKUP = ("<tool_call>", "</tool_call>", "<tool", "tool_call", "</tool")


@pytest.fixture(scope="module")
def server(model_factory):
    s = ServerProcess("-m", str(model_factory("qwen3_moe")), "--served-model-name", MODEL)
    yield s
    assert s.stop() == 0


@pytest.fixture()
def oa(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)


@pytest.fixture()
def an(server):
    return anthropic.Anthropic(base_url=server.url, api_key="-", max_retries=0)


def no_markup(text: str | None) -> None:
    assert not any(m in (text or "") for m in MARKUP), text


@pytest.mark.parametrize("max_tokens", [1, 8, 40, 70, 130])
def test_max_tokens_is_a_hard_limit_under_forced_parallel_calls(oa, an, max_tokens):
    """Issue 40 saw max_tokens=8 with tool_choice required give 264 tokens and 9 calls, the cut
    call's markup in the text. Every API, streamed and not: at most max_tokens, calls that
    validate, no markup in the content."""
    schema = WEATHER["function"]["parameters"]
    ask = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
    r = oa.chat.completions.create(
        model=MODEL,
        messages=ask,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=max_tokens,
        temperature=1.0,
        seed=max_tokens,
    )
    assert r.usage.completion_tokens <= max_tokens
    no_markup(r.choices[0].message.content)
    for call in r.choices[0].message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert r.choices[0].finish_reason == ("tool_calls" if r.choices[0].message.tool_calls else "length")
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=ask,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=max_tokens,
            temperature=1.0,
            seed=max_tokens + 1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens <= max_tokens
    no_markup("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    m = an.messages.create(
        model=MODEL,
        max_tokens=max_tokens,
        messages=ask,
        tools=[TOOL_A],
        tool_choice={"type": "any"},
        extra_body={"temperature": 1.0},
    )
    assert m.usage.output_tokens <= max_tokens
    assert m.stop_reason in ("tool_use", "max_tokens")
    for b in m.content:
        no_markup(getattr(b, "text", ""))
        if b.type == "tool_use":
            jsonschema.validate(b.input, schema)
    with an.messages.stream(
        model=MODEL,
        max_tokens=max_tokens,
        messages=ask,
        tools=[TOOL_A],
        tool_choice={"type": "any"},
        extra_body={"temperature": 1.0},
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens <= max_tokens
    for b in final.content:
        if b.type == "tool_use":
            jsonschema.validate(b.input, schema)
    r = oa.responses.create(
        model=MODEL,
        input="Weather in Lima?",
        tool_choice="required",
        max_output_tokens=max_tokens,
        tools=[{"type": "function", "name": "get_weather", "parameters": schema}],
        temperature=1.0,
    )
    assert r.usage.output_tokens <= max_tokens
    assert r.status == ("completed" if any(o.type == "function_call" for o in r.output) else "incomplete")


def test_a_call_that_fits_closes_inside_the_budget(oa):
    """The shortest call here is 58 tokens; at 64 the grammar closes it in time, every seed."""
    for seed in range(4):
        r = oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Oslo?"}],
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=64,
            temperature=1.0,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens <= 64


def test_streamed_call_arguments_arrive_in_pieces_and_add_up(oa, an):
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Oslo?"}],
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 3 and deltas[0].id and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    events = []
    with an.messages.stream(
        model=MODEL,
        max_tokens=200,
        messages=[{"role": "user", "content": "Oslo?"}],
        tools=[TOOL_A],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    ) as stream:
        for ev in stream:
            events.append(ev)
        final = stream.get_final_message()
    pieces = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(pieces) > 3 and json.loads("".join(pieces)) == final.content[0].input


def test_stop_sequence_is_reported_as_matched(an):
    text = an.messages.create(model=MODEL, max_tokens=24, messages=HELLO, extra_body={"temperature": 0}).content[0].text
    stop = text[6:9]
    assert len(stop) == 3 and stop not in text[:6]
    m = an.messages.create(
        model=MODEL, max_tokens=24, messages=HELLO, stop_sequences=["\x00never", stop], extra_body={"temperature": 0}
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:6]
    plain = an.messages.create(
        model=MODEL, max_tokens=24, messages=HELLO, stop_sequences=["\x00never"], extra_body={"temperature": 0}
    )
    assert plain.stop_sequence is None


def test_message_start_carries_the_real_input_count_as_count_tokens_does(server, an):
    body = {"model": MODEL, "max_tokens": 4, "messages": HELLO, "tools": [TOOL_A], "system": "Be brief."}
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]
    with an.messages.stream(**body) as stream:
        start = next(e for e in stream if e.type == "message_start")
        final = stream.get_final_message()
    assert start.message.usage.input_tokens == counted > 100
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted
    assert an.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens < counted  # no tools, no system


def test_a_prompt_that_cannot_run_is_an_http_error_before_the_first_byte(server):
    long = [{"role": "user", "content": "word " * 5000}]  # ~25,000 tokens of the byte-level vocabulary
    for path, body in (
        ("/v1/messages", {"max_tokens": 5, "messages": long, "stream": True}),
        ("/v1/chat/completions", {"messages": long, "stream": True}),
        ("/v1/responses", {"input": "word " * 5000, "stream": True}),
    ):
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
            assert r.status_code == 400, path
            assert "longer than" in json.loads(r.read())["error"]["message"]
    # a tool schema the grammar cannot take, on the same real server
    bad = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}
    for path, body in (
        (
            "/v1/messages",
            {"max_tokens": 5, "messages": HELLO, "stream": True, "tools": [{"name": "t", "input_schema": bad}]},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": HELLO,
                "stream": True,
                "tools": [{"type": "function", "function": {"name": "t", "parameters": bad}}],
            },
        ),
        (
            "/v1/responses",
            {"input": "hi", "stream": True, "tools": [{"type": "function", "name": "t", "parameters": bad}]},
        ),
    ):
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", path
            assert "cannot build a grammar" in r.read().decode(), path


# -- exact replies, in-process on the scripted engine --------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'


def scripted(reply: str, **options) -> TestClient:
    engine = FakeEngine([reply], chat_template=CHAT_TEMPLATE, **options.pop("engine", {}))
    return TestClient(Server(engine, engine.loaded_info, "demo", **options).app())


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_blanks_between_parallel_calls_are_not_content():
    c = scripted(f"{CALL}\n\n{CALL}\n")
    body = {"messages": HELLO, "tools": [WEATHER], "stream": True, "max_tokens": 500}
    chunks = sse(c.post("/v1/chat/completions", json=body).text)
    assert [ch for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content")] == []
    whole = c.post("/v1/chat/completions", json={**body, "stream": False}).json()["choices"][0]
    assert whole["message"]["content"] is None and len(whole["message"]["tool_calls"]) == 2


def test_a_call_cut_by_max_tokens_is_neither_call_nor_content():
    c = scripted(f"Checking. {CALL}")  # cut inside the call at 6 whitespace-separated pieces
    r = c.post("/v1/chat/completions", json={"messages": HELLO, "tools": [WEATHER], "max_tokens": 6}).json()
    assert r["choices"][0]["finish_reason"] == "length" and "tool_calls" not in r["choices"][0]["message"]
    assert r["choices"][0]["message"]["content"] == "Checking."
    assert "max_tokens" in r["flashmoe"]["invalid_tool_calls"][0]["error"]
    m = c.post("/v1/messages", json={"messages": HELLO, "tools": [TOOL_A], "max_tokens": 6}).json()
    assert m["stop_reason"] == "max_tokens" and [b["type"] for b in m["content"]] == ["text"]


def test_keepalives_fill_a_quiet_stream():
    c = scripted(CALL, engine={"token_delay": 0.15}, keepalive_s=0.05)
    text = c.post("/v1/messages", json={"messages": HELLO, "tools": [TOOL_A], "max_tokens": 50, "stream": True}).text
    assert "event: ping" in text and text.rstrip().endswith('data: {"type": "message_stop"}')
    text = c.post("/v1/chat/completions", json={"messages": HELLO, "tools": [WEATHER], "stream": True}).text
    assert ": keepalive" in text and text.rstrip().endswith("data: [DONE]")


# -- the grammar's budget, driven by a 'model' that picks any allowed token -----------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from flashmoe.engine.runtime.tokenizer import Tokenizer
    from tests.tiny_tokenizer import write_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    return Tokenizer.from_folder(folder)


def drive(constraint, tok, seed: int, budget: int, prefix: str = "") -> tuple[list[int], bool]:
    """Tokens as the generation loop takes them, stopping where it stops: the end of sequence,
    the constraint done, or the budget (with in_call False there, nothing runs past it)."""
    import random

    import numpy as np

    rng, out = random.Random(seed), []
    for t in tok.encode(prefix):
        constraint.allowed()
        constraint.accept(t)
        out.append(t)
    while len(out) < budget:
        mask = constraint.allowed()
        ids = np.flatnonzero(mask) if mask is not None else np.arange(tok.vocab_size)
        t = int(ids[rng.randrange(len(ids))])
        if t in tok.eos_token_ids:
            return out, True
        constraint.accept(t)
        out.append(t)
        if constraint.done():
            return out, True
    assert not constraint.in_call  # the loop's _finish_call would stop here: no run-on
    return out, False


@pytest.mark.parametrize("mode,parallel", [("required", True), ("required", False), ("tools", False)])
def test_the_grammar_closes_calls_inside_the_budget(tok, mode, parallel):
    """The shortest call is 58 tokens of this vocabulary. From 64 tokens up every call that
    starts closes inside the budget, whatever the 'model' picks; parallel calls end the reply
    when another would not fit; nothing runs past the budget."""
    from flashmoe.tools.grammar import tool_call_constraint

    from flashmoe.tools.parsers import json_tools

    for budget in (64, 80, 150):
        factory = tool_call_constraint([WEATHER], mode, parallel=parallel, budget=budget)
        for seed in range(6):
            out, ended = drive(factory(tok), tok, seed, budget, prefix="Sure. <tool_call>" if mode == "tools" else "")
            text = tok.decode(out)
            assert len(out) <= budget
            blocks = re.findall(r"<tool_call>.*?</tool_call>", text, re.DOTALL)
            assert blocks and len(blocks) == text.count("<tool_call>"), (budget, seed, text)  # each closed
            for block in blocks:
                (call,) = json_tools.parse_tool_call(block)
                jsonschema.validate(call.arguments, WEATHER["function"]["parameters"])
            if mode == "required":
                assert ended, (budget, seed, text)  # the end of sequence, not the cut


def test_a_call_read_out_of_the_text_is_not_content_too():
    """A model that writes its call without <tool_call> (llama.cpp's lenient Hermes forms): the
    call comes back as a call, and its markup is not also the answer's text."""
    wrapped = '<tools>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tools>'
    c = scripted(wrapped)
    r = c.post("/v1/chat/completions", json={"messages": HELLO, "tools": [WEATHER], "max_tokens": 50}).json()
    message = r["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
    m = c.post("/v1/messages", json={"messages": HELLO, "tools": [TOOL_A], "max_tokens": 50}).json()
    assert [b["type"] for b in m["content"]] == ["tool_use"] and m["stop_reason"] == "tool_use"
