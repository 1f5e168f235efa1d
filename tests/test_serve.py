"""`flashmoe serve` driven by the official `openai` and `anthropic` SDKs, against a real server
process on 127.0.0.1 running a tiny random model (built here) or the scripted test engine."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.helpers.cli import run_cli
from tests.helpers.server import HELLO, WEATHER, ServerProcess

KEY = "sk-test-serve"


@pytest.fixture(scope="module")
def tiny(model_factory):
    return model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def server(tiny):
    s = ServerProcess("-m", str(tiny), "--api-key", KEY)
    yield s
    assert s.stop() == 0  # SIGTERM drains and exits 0


@pytest.fixture()
def oa(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture()
def an(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


MODEL = "qwen3_moe-None-64"  # the tiny model's folder name (model_factory), as /v1/models lists it


def test_startup_line_names_the_model_and_url(server):
    line = next(x for x in server.lines if "serving" in x)
    assert MODEL in line and f"http://127.0.0.1:{server.port}/v1" in line and "K=2 of 8" in line


def test_models_lists_the_served_model(oa):
    assert [m.id for m in oa.models.list()] == [MODEL]


def test_chat_plain_and_streamed_give_the_same_greedy_text(oa):
    r = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
    chunks = list(oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert r.model_extra["flashmoe"]["experts_per_token"] == 2  # the run's conditions ride along


def test_greedy_output_equals_flashmoe_run_json(oa, tiny):
    text = "Write one line about the sea."
    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=16, temperature=0
    )
    out = run_cli("run", "-m", tiny, "--json", "--temp", "0", "--max-tokens", "16", "-n", text)
    assert out.returncode == 0, out.stderr
    events = [json.loads(x) for x in out.stdout.splitlines()]
    tokens = [e["text"] for e in events if e["event"] == "token"]
    done = next(e for e in events if e["event"] == "done")
    assert r.usage.completion_tokens == done["generation_tokens"]
    assert r.choices[0].message.content == "".join(tokens) + done["tail"]


def test_a_resent_conversation_reads_only_its_new_tokens(oa):
    history = [{"role": "user", "content": "Count from one to five, please, slowly."}]
    first = oa.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, seed=1)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And now backwards."},
    ]
    second = oa.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, seed=1)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # turn one's prompt (and what of its reply re-tokenises alike)
    assert second.usage.prompt_tokens - cached < second.usage.prompt_tokens - first.usage.prompt_tokens + 8


def test_tool_choice_required_returns_a_valid_call_every_time(oa):
    schema = WEATHER["function"]["parameters"]
    for seed in range(4):
        r = oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=64,
            temperature=1.0,
            seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_round_trip_call_result_answer(oa):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oa.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0,
    )
    call = r.choices[0].message.tool_calls[0]
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21, "sky": "clear"}'},
    ]
    answer = oa.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=12, temperature=0
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    # tool_choice "none" leaves the tools out of the prompt (as vLLM does), not the call and its result
    bare = oa.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens > bare.usage.prompt_tokens + 10


def test_streamed_required_call_arrives_as_tool_call_deltas(oa):
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Oslo?"}],
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_response_format_json_schema_validates(oa):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for seed in range(3):
        r = oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Make up a person."}],
            max_tokens=96,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_wrong_api_key_is_401(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=HELLO
        )


def test_an_unknown_field_is_a_400_that_names_it(oa, an):
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, logit_bias={"1": 5})
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, extra_body={"frobnicate": True})
    with pytest.raises(anthropic.BadRequestError, match="frobnicate"):
        an.messages.create(model=MODEL, max_tokens=4, messages=HELLO, extra_body={"frobnicate": 1})


def test_any_model_name_is_the_served_model_and_the_reply_says_so(oa):
    # (issue 40: with one model served, a client's own model name is no 404; --served-model-name
    # restricts the names, tests/test_serve_fields.py)
    r = oa.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=4)
    assert r.model == MODEL


def test_anthropic_message_and_stream(an, oa):
    m = an.messages.create(model=MODEL, max_tokens=12, messages=HELLO, extra_body={"temperature": 0})
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    with an.messages.stream(model=MODEL, max_tokens=12, messages=HELLO, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == "".join(b.text for b in m.content if b.type == "text")
    assert final.stop_reason == m.stop_reason
    # the same words as the OpenAI face gives on the same messages
    r = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    assert streamed == r.choices[0].message.content


def test_anthropic_tool_use_round_trip(an):
    tool = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    m = an.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=messages,
        tools=[tool],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "tool_use"
    use = next(b for b in m.content if b.type == "tool_use")
    jsonschema.validate(use.input, tool["input_schema"])
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]},
    ]
    answer = an.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=messages,
        tools=[tool],
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    with an.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=messages[:1],
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == use.input


def test_eight_concurrent_streams_match_one_alone(oa):
    alone = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, temperature=0)
    expected = alone.choices[0].message.content
    results: list = [None] * 8

    def client(i):
        stream = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, temperature=0, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [expected] * 8


def test_a_client_that_leaves_mid_stream_frees_the_engine(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3000, "temperature": 0, "stream": True}
    before = httpx.get(f"{server.url}/metrics", headers=headers).json()["generated_tokens"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 10:
                break  # the connection closes here
    t0 = time.monotonic()
    while httpx.get(f"{server.url}/health").json()["queue"] and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/health").json()["queue"] == 0
    quick = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=headers,
        timeout=60,
        json={"model": MODEL, "messages": HELLO, "max_tokens": 2},
    )
    assert quick.status_code == 200
    after = httpx.get(f"{server.url}/metrics", headers=headers).json()
    assert after["generated_tokens"] - before < 1000  # it stopped long before its 3,000 tokens
    assert after["queue_depth"] == 0


def test_metrics_and_health(server):
    m = httpx.get(f"{server.url}/metrics", headers={"x-api-key": KEY}).json()
    for key in (
        "requests",
        "queue_depth",
        "generated_tokens",
        "decode_tok_per_s",
        "expert_hit_rate",
        "bytes_read_per_token",
        "cached_prompt_tokens",
    ):
        assert key in m
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{server.url}/metrics").status_code == 401


def test_completions_endpoint(oa):
    r = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 6


def test_past_the_queue_a_request_is_refused_at_once(tmp_path):
    env = {
        "FLASHMOE_FAKE_REPLIES": json.dumps(["one two three four five six seven eight"]),
        "FLASHMOE_FAKE_DELAY": "0.2",
    }
    s = ServerProcess("--engine", "fake", "--max-queue", "1", env=env)
    try:
        slow = threading.Thread(
            target=lambda: httpx.post(
                f"{s.url}/v1/chat/completions", timeout=60, json={"messages": HELLO, "max_tokens": 50}
            )
        )
        slow.start()
        t0 = time.monotonic()
        while httpx.get(f"{s.url}/health").json()["queue"] == 0 and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        busy = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HELLO}, timeout=10)
        assert busy.status_code == 429 and "--max-queue 1" in busy.json()["error"]["message"]
        over = httpx.post(f"{s.url}/v1/messages", json={"messages": HELLO, "max_tokens": 5}, timeout=10)
        assert over.status_code == 529 and over.json()["error"]["type"] == "overloaded_error"
        slow.join(timeout=60)
    finally:
        assert s.stop() == 0


LONG = [
    {"role": "system", "content": "You are a careful assistant. " * 12},
    {"role": "user", "content": "Tell me about the history of the printing press in Europe."},
]


def test_after_a_restart_the_prompt_cache_comes_from_disk(tiny, tmp_path):
    env = {"FLASHMOE_HOME": str(tmp_path / "home")}
    first = ServerProcess("-m", str(tiny), env=env)
    try:
        c = openai.OpenAI(base_url=f"{first.url}/v1", api_key="-", max_retries=0)
        cold = c.chat.completions.create(model=MODEL, messages=LONG, max_tokens=6, temperature=0)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        assert first.stop() == 0
    saved = list((tmp_path / "home" / "kv" / "serve").glob("*.safetensors"))  # (apart from local conversations')
    assert len(saved) == 1 and ".partial" not in saved[0].name
    again = ServerProcess("-m", str(tiny), env=env)
    try:
        c = openai.OpenAI(base_url=f"{again.url}/v1", api_key="-", max_retries=0)
        history = LONG + [
            {"role": "assistant", "content": cold.choices[0].message.content},
            {"role": "user", "content": "Shorter, please."},
        ]
        warm = c.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
        assert warm.usage.prompt_tokens_details.cached_tokens >= cold.usage.prompt_tokens
        # the same words as a server that computed everything itself
        fresh = ServerProcess("-m", str(tiny), "--disk-cache", "0", env={"FLASHMOE_HOME": str(tmp_path / "other")})
        try:
            f = openai.OpenAI(base_url=f"{fresh.url}/v1", api_key="-", max_retries=0)
            full = f.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
        finally:
            fresh.stop()
        assert full.usage.prompt_tokens_details.cached_tokens == 0
        assert warm.choices[0].message.content == full.choices[0].message.content
    finally:
        assert again.stop() == 0


def test_a_prompt_cache_written_by_another_model_is_refused(model_factory, tiny, tmp_path):
    from flashmoe.engine.runtime.generate import render_prompt
    from flashmoe.engine.runtime.loader import load
    from flashmoe.engine.runtime.prompt_cache import DiskPromptCache, PromptCachePool
    from flashmoe.engine.runtime.generate import GenerationRequest, Session
    from flashmoe.engine.runtime.decode import prefill

    other = model_factory("qwen3_moe", bits=4)  # same architecture and tokenizer, other weights
    a, b = load(tiny), load(other)
    ids = render_prompt(a, GenerationRequest(messages=LONG))
    session = Session(a)
    session.prepare(ids)
    for _ in prefill(a.model, session, ids, 512, threading.Event()):
        pass
    DiskPromptCache(tmp_path, a.path).save(session)
    (saved,) = tmp_path.glob("*.safetensors")
    disk_b = DiskPromptCache(tmp_path, b.path)
    assert disk_b.best(ids) == (None, 0)  # not offered to the other model
    assert disk_b.load(saved, b) is None and "another model" in disk_b.refused[-1]
    pool = PromptCachePool(b, disk=disk_b)
    assert pool.pick(ids).tokens == []  # computed afresh
    disk_a = DiskPromptCache(tmp_path, a.path)
    assert disk_a.best(ids) == (saved, len(ids))
    assert disk_a.load(saved, a).tokens == ids


def test_responses_text_streamed_and_a_function_call_round_trip(oa):
    r = oa.responses.create(model=MODEL, input="Say hello to the world.", max_output_tokens=12, temperature=0)
    chat = oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    events = list(
        oa.responses.create(
            model=MODEL, input="Say hello to the world.", max_output_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    # cut by max_output_tokens: the stream ends as its status says (issue 40: it said "completed")
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.usage.output_tokens == 12
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER["function"]["parameters"],
    }
    call_r = oa.responses.create(
        model=MODEL, input="Weather in Lima?", tools=[tool], tool_choice="required", max_output_tokens=64, temperature=0
    )
    call = next(o for o in call_r.output if o.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    answer = oa.responses.create(
        model=MODEL,
        tools=[tool],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
        input=[
            {"role": "user", "content": "Weather in Lima?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
        ],
    )
    bare = oa.responses.create(model=MODEL, input="Weather in Lima?", max_output_tokens=1, temperature=0)
    assert answer.output_text and answer.usage.input_tokens > bare.usage.input_tokens + 10  # the call, its result
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oa.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")


def test_no_cors_unless_asked(server):
    r = httpx.get(f"{server.url}/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    s = ServerProcess("--engine", "fake", "--allow-origin", "http://localhost:3000")
    try:
        ok = httpx.options(
            f"{s.url}/v1/chat/completions",
            headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
        )
        assert ok.headers.get("access-control-allow-origin") == "http://localhost:3000"
        other = httpx.get(f"{s.url}/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    finally:
        assert s.stop() == 0


def test_a_taken_port_is_a_one_line_usage_error(server):
    out = run_cli("serve", "--engine", "fake", "--port", str(server.port), timeout=60)
    assert out.returncode == 2 and f"--port {server.port}: cannot listen there" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_body_of_the_wrong_shapes_is_a_400_not_a_crash(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    for body in (
        {"messages": HELLO, "response_format": "json"},
        {"messages": "hello"},
        [1, 2],
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": HELLO, "max_tokens": -1},
    ):
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(
        f"{server.url}/v1/messages",
        content=b"{not json",
        timeout=30,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["type"] == "error"
