"""The server's field policy (docs/serve.md): hints accepted and recorded, translations, one 400
naming every problem, --strict-fields, model names, errors in each API's shape, no paths.

In-process (Starlette's TestClient over the ASGI app) on the scripted test engine: these are
about what the server does with a body, not about generation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from flashmoe.cli.serve import anthropic_api, openai_api, responses_api
from flashmoe.cli.serve.app import Server
from flashmoe.cli.serve.fields import Fields
from flashmoe.cli.serve.generation import Prompter, system_anywhere
from flashmoe.engine.testing import FakeEngine
from tests.tiny_tokenizer import CHAT_TEMPLATE

ROOT = Path(__file__).resolve().parents[1]
HELLO = [{"role": "user", "content": "Hello"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {
    "name": "get_weather",
    "description": "Weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# Qwen3.5's rule: one system message, first (the template raises otherwise).
ONE_SYSTEM = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def client(replies=("Hello there friend",), template=CHAT_TEMPLATE, **options) -> TestClient:
    engine = FakeEngine(list(replies), chat_template=template)
    return TestClient(Server(engine, engine.loaded_info, "demo", **options).app())


@pytest.fixture(scope="module")
def c():
    return client()


def ignored(r) -> list[str]:
    return [x for x in r.headers.get("x-flashmoe-ignored", "").split(", ") if x]


# -- what Claude Code and Codex send that was refused before (issue 40) -----------------------


def test_claude_codes_hint_fields_are_accepted_and_recorded(c):
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "messages": HELLO,
        "metadata": {"user_id": "u"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "output_config": {"effort": "high"},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.6fc; cc_entrypoint=cli;"},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        ],
    }
    r = c.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "demo"  # any name: the one model answers, and says so
    assert set(ignored(r)) == {
        "metadata",
        "thinking",
        "context_management",
        "output_config.effort",
        "system.x-anthropic-billing-header",
        "cache_control",
    }
    m = c.get("/metrics").json()["ignored_fields"]
    assert m["context_management"] >= 1 and m["system.x-anthropic-billing-header"] >= 1


def test_codexs_hint_fields_are_accepted_and_non_function_tools_dropped(c):
    body = {
        "model": "gpt-5.3-codex",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "id": "m1",
                "content": [{"type": "input_text", "text": "Be brief."}],
            },
            {"type": "message", "role": "user", "content": "hi"},
        ],
        "tools": [
            {"type": "function", "name": "exec_command", "parameters": {"type": "object"}, "strict": False},
            {"type": "namespace", "name": "multi_agent_v1", "tools": []},
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k",
        "client_metadata": {"a": "b"},
        "stream": True,
    }
    r = c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    got = set(ignored(r))
    assert {
        "client_metadata",
        "prompt_cache_key",
        "include reasoning.encrypted_content",
        "input[].id",
        "tools[] (type 'namespace')",
        "tools[] (type 'web_search')",
    } <= got
    assert r.text.rstrip().splitlines()[-1].startswith("data: ") and '"response.completed"' in r.text


def test_every_problem_is_named_in_one_400(c):
    body = {
        "input": "hi",
        "previous_response_id": "resp_1",
        "store": True,
        "top_logprobs": 3,
        "frobnicate": 1,
        "include": ["message.output_text.logprobs"],
    }
    r = c.post("/v1/responses", json=body)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg.startswith("5 problems")
    for name in ("previous_response_id", "store", "top_logprobs", "frobnicate", "message.output_text.logprobs"):
        assert name in msg
    r = c.post(
        "/v1/chat/completions",
        json={"messages": HELLO, "n": 2, "logprobs": True, "logit_bias": {"1": 2}, "store": True},
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("4 problems")
    image = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}
    r = c.post("/v1/messages", json={"max_tokens": 5, "messages": [image], "container": "x"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "text only" in r.json()["error"]["message"] and "container" in r.json()["error"]["message"]


def test_a_problem_that_stops_one_reading_does_not_hide_the_others(c):
    """A bad max_tokens, tool_choice, response format, stop or message content used to end the
    reading at once: the 400 named it and the problems before it, not the ones after."""
    image = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AA=="}}]}
    body = {
        "messages": [image, {"role": "user", "content": 5}],
        "container": "x",
        "tool_choice": {"type": "bogus"},
        "stop_sequences": 5,
        "output_config": {"format": {"type": "xml"}},
    }  # and no max_tokens
    msg = c.post("/v1/messages", json=body).json()["error"]["message"]
    assert msg.startswith("7 problems"), msg
    for named in (
        "container",
        "max_tokens",
        "tool_choice",
        "output_config.format",
        "text only",
        "messages[1].content",
        "stop_sequences",
    ):
        assert named in msg, (named, msg)
    body = {
        "messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "user", "content": 5}],
        "n": 2,
        "response_format": {"type": "xml"},
        "tool_choice": "sometimes",
        "max_tokens": 0,
        "stop": 5,
    }
    msg = c.post("/v1/chat/completions", json=body).json()["error"]["message"]
    assert msg.startswith("7 problems"), msg
    for named in (
        "n must be 1",
        "'image_url'",
        "messages[1]",
        "response_format",
        "tool_choice",
        "max_tokens",
        "stop must",
    ):
        assert named in msg, (named, msg)
    body = {
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}],
        "store": True,
        "text": {"format": {"type": "xml"}},
        "tool_choice": "sometimes",
        "max_output_tokens": -1,
    }
    msg = c.post("/v1/responses", json=body).json()["error"]["message"]
    assert msg.startswith("5 problems"), msg
    for named in ("store", "'input_image'", "'xml'", "tool_choice", "max_output_tokens"):
        assert named in msg, (named, msg)
    # a problem found building the engine request (a tool_choice naming no offered tool) is named too
    msg = c.post(
        "/v1/chat/completions",
        json={"messages": HELLO, "n": 2, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ).json()["error"]["message"]
    assert msg.startswith("2 problems") and "'nope'" in msg and "n must be 1" in msg, msg


def test_a_deferred_tool_stays_out_of_the_prompt_unless_named():
    """Claude Code 2.1.337 sends `DeferredToolPlaceholder` ("never call this tool") with
    defer_loading: true. Offered to the demo under a forced first call, it was the call made,
    and Claude Code answered "No such tool". A deferred tool is loaded only when a tool search
    finds it, and this server runs none: it is left out, as Anthropic's API and OpenAI's leave it."""
    placeholder = {
        "name": "DeferredToolPlaceholder",
        "description": "never call this tool",
        "input_schema": {"type": "object", "properties": {}},
        "defer_loading": True,
    }
    engine = FakeEngine([CALL], chat_template=CHAT_TEMPLATE)
    c = TestClient(Server(engine, engine.loaded_info, "demo", force_first_call=True).app())

    def offered() -> str:
        r = engine.requests[-1]
        return json.dumps([r.messages, r.tools])

    r = c.post("/v1/messages", json={"max_tokens": 50, "messages": HELLO, "tools": [placeholder, WEATHER]})
    assert r.status_code == 200 and r.json()["content"][0]["name"] == "get_weather"
    assert "DeferredToolPlaceholder" not in offered() and "get_weather" in offered()
    assert "defer_loading" in r.headers["x-flashmoe-translated"]
    fn = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}, "defer_loading": True}
    c.post(
        "/v1/chat/completions",
        json={
            "messages": HELLO,
            "tools": [
                fn,
                {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}},
            ],
        },
    )
    assert "lookup" not in offered()
    c.post(
        "/v1/responses",
        json={
            "input": "hi",
            "tools": [{"type": "function", "name": "lookup", "defer_loading": True, "parameters": {"type": "object"}}],
        },
    )
    assert "lookup" not in offered()
    # named by tool_choice, it is what the client asked for: offered
    r = c.post(
        "/v1/messages",
        json={
            "max_tokens": 50,
            "messages": HELLO,
            "tools": [placeholder],
            "tool_choice": {"type": "tool", "name": "DeferredToolPlaceholder"},
        },
    )
    assert r.status_code == 200 and "DeferredToolPlaceholder" in offered()
    # only deferred tools: the reply is not forced (there is no tool to force)
    r = c.post("/v1/messages", json={"max_tokens": 50, "messages": HELLO, "tools": [placeholder]})
    assert r.status_code == 200 and engine.requests[-1].constraint is None


def test_a_tool_choice_naming_a_dropped_tool_is_refused(c):
    r = c.post(
        "/v1/messages",
        json={
            "max_tokens": 5,
            "messages": HELLO,
            "tool_choice": {"type": "tool", "name": "web"},
            "tools": [{"type": "web_search_20250305", "name": "web"}],
        },
    )
    assert r.status_code == 400 and "web_search_20250305" in r.json()["error"]["message"]
    r = c.post(
        "/v1/responses", json={"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}
    )
    assert r.status_code == 400 and "function tools only" in r.json()["error"]["message"]
    r = c.post(
        "/v1/chat/completions",
        json={
            "messages": HELLO,
            "tools": [{"type": "custom", "custom": {"name": "x"}}],
            "tool_choice": {"type": "custom", "custom": {"name": "x"}},
        },
    )
    assert r.status_code == 400 and "'custom'" in r.json()["error"]["message"]


def test_strict_fields_refuses_what_would_be_ignored_naming_each():
    strict = client(strict_fields=True)
    body = {
        "max_tokens": 5,
        "messages": HELLO,
        "metadata": {},
        "context_management": {},
        "thinking": {"type": "adaptive"},
    }
    r = strict.post("/v1/messages", json=body)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg.startswith("3 problems") and all(n in msg for n in ("metadata", "context_management", "thinking"))
    assert strict.post("/v1/messages", json={"max_tokens": 5, "messages": HELLO}).status_code == 200


# -- translations -----------------------------------------------------------------------------


def test_mid_conversation_system_messages_follow_the_template():
    assert system_anywhere(CHAT_TEMPLATE) and not system_anywhere(ONE_SYSTEM)
    from flashmoe.cli.serve.generation import ChatCall

    history = [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": "B"},
        {"role": "user", "content": "v"},
    ]
    kept = Prompter(CHAT_TEMPLATE).messages(ChatCall(messages=history), [])
    assert [m["role"] for m in kept] == ["system", "user", "system", "user"]
    fields = Fields()
    merged = Prompter(ONE_SYSTEM).messages(ChatCall(messages=history), [], fields)
    assert merged == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "u"},
        {"role": "user", "content": "v"},
    ]
    assert fields.translated == ["system messages: merged into the system prompt"]
    # Claude Code's mid-conversation system message, through the API and the template that refuses it
    c = client(template=ONE_SYSTEM)
    r = c.post(
        "/v1/messages",
        json={
            "max_tokens": 5,
            "system": "A",
            "messages": [
                {"role": "user", "content": "u"},
                {"role": "system", "content": "B"},
                {"role": "user", "content": "v"},
            ],
        },
    )
    assert r.status_code == 200, r.text
    assert "merged" in r.headers["x-flashmoe-translated"]


def test_thinking_goes_onto_the_templates_switch_or_is_recorded():
    switch = "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}" + CHAT_TEMPLATE
    engine = FakeEngine(["ok"], chat_template=switch)
    c = TestClient(Server(engine, engine.loaded_info, "demo").app())
    r = c.post("/v1/messages", json={"max_tokens": 5, "messages": HELLO, "thinking": {"type": "disabled"}})
    assert r.headers["x-flashmoe-translated"] == "thinking -> enable_thinking=false"
    assert engine.requests[-1].template_kwargs == {"enable_thinking": False}
    c.post("/v1/responses", json={"input": "hi", "reasoning": {"effort": "high"}})
    assert engine.requests[-1].template_kwargs == {"enable_thinking": True}
    c.post("/v1/chat/completions", json={"messages": HELLO, "reasoning_effort": "minimal"})
    assert engine.requests[-1].template_kwargs == {"enable_thinking": False}
    # no switch in the template: nothing it could change, recorded as ignored
    r = client().post("/v1/chat/completions", json={"messages": HELLO, "reasoning_effort": "high"})
    assert ignored(r) == ["reasoning_effort"]


def test_a_request_without_a_temperature_gets_the_servers():
    """Claude Code and Codex send no temperature. At the APIs' default (1) the demo ran on to the
    token budget in 2 of 3 replies after a tool result, and both agents end such a turn in an
    error; greedy, it looped inside its first call's strings ("test-test-test..."), which a
    repetition penalty ended. `flashmoe serve --temp T --repetition-penalty R` set them for
    requests that give none; a request's own value wins."""
    engine = FakeEngine(["ok"], chat_template=CHAT_TEMPLATE)
    server = Server(engine, engine.loaded_info, "demo", temperature=0.0, repetition_penalty=1.2)
    c = TestClient(server.app())
    for path, body in (
        ("/v1/messages", {"max_tokens": 5, "messages": HELLO}),
        ("/v1/chat/completions", {"messages": HELLO, "temperature": None}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        assert c.post(path, json=body).status_code == 200, path
        assert engine.requests[-1].sampling.temperature == 0.0, path
        assert engine.requests[-1].sampling.repetition_penalty == 1.2, path
        c.post(path, json={**body, "temperature": 0.7})
        assert engine.requests[-1].sampling.temperature == 0.7, path
    c.post("/v1/chat/completions", json={"messages": HELLO, "repetition_penalty": 1.05})
    assert engine.requests[-1].sampling.repetition_penalty == 1.05
    plain = FakeEngine(["ok"], chat_template=CHAT_TEMPLATE)
    TestClient(Server(plain, plain.loaded_info, "demo").app()).post("/v1/chat/completions", json={"messages": HELLO})
    assert plain.requests[-1].sampling.temperature == 1.0  # the APIs' default without --temp
    assert plain.requests[-1].sampling.repetition_penalty == 1.0  # off without --repetition-penalty


def test_force_first_call_requires_only_the_conversations_first_reply_to_be_a_call():
    engine = FakeEngine([CALL, "The weather is fine."], chat_template=CHAT_TEMPLATE)
    c = TestClient(Server(engine, engine.loaded_info, "demo", force_first_call=True).app())
    first = c.post(
        "/v1/messages", json={"max_tokens": 50, "messages": [{"role": "user", "content": "Oslo?"}], "tools": [WEATHER]}
    )
    assert first.json()["stop_reason"] == "tool_use" and "force-first-call" in first.headers["x-flashmoe-translated"]
    assert engine.requests[-1].constraint.mode == "required" and not engine.requests[-1].constraint.parallel
    use = first.json()["content"][0]
    after = c.post(
        "/v1/messages",
        json={
            "max_tokens": 50,
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": [use]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"},
                        {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                    ],
                },
            ],
        },
    )
    assert engine.requests[-1].constraint.mode == "tools" and "x-flashmoe-translated" not in after.headers
    # a later user message (Claude Code's "continue" after a reply hit max_tokens) is not forced:
    # forcing each would loop call, result, reply, continue for ever on a model that never stops
    c.post(
        "/v1/messages",
        json={
            "max_tokens": 50,
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "Let me see"},
                {"role": "user", "content": "Go on."},
            ],
        },
    )
    assert engine.requests[-1].constraint.mode == "tools"


def test_keepalives_come_at_least_every_10_seconds(monkeypatch):
    """Issue 40: a keepalive at most every 10 s (agents' idle timeouts fired on a silent prefill);
    --keepalive took up to 60."""
    from flashmoe.cli import startup
    from flashmoe.cli.cli import build_parser
    from flashmoe.cli.errors import UsageError
    from flashmoe.cli.serve.main import cmd_serve

    def no_engine(*a, **k):
        raise AssertionError("--keepalive 30 was taken: the server went on to load the model")

    monkeypatch.setattr(startup, "make_engine", no_engine)
    args = build_parser().parse_args(["serve", "--engine", "fake", "--port", "0", "--keepalive", "30"])
    with pytest.raises(UsageError, match=r"--keepalive 30\.0: give seconds between 0 and 10"):
        cmd_serve(args)


# -- names, routes, errors ----------------------------------------------------------------------


def test_served_model_names_restrict_the_names_and_models_routes_show_no_paths():
    named = client(served_names=("flash", "flash-2"))
    r = named.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": HELLO})
    assert r.status_code == 404 and "'flash'" in r.json()["error"]["message"]
    assert named.post("/v1/chat/completions", json={"model": "flash-2", "messages": HELLO}).json()["model"] == "flash-2"
    assert [m["id"] for m in named.get("/v1/models").json()["data"]] == ["flash", "flash-2"]
    assert named.get("/v1/models/nope").status_code == 404
    any_name = client()
    assert any_name.get("/v1/models/claude-opus-4").json()["id"] == "claude-opus-4"
    listing = any_name.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert listing["data"][0]["type"] == "model" and listing["has_more"] is False
    for text in (any_name.get("/v1/models").text, named.get("/v1/models/flash").text):
        assert not re.search(r'"/[^"]*/', text), text


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/v1/nothing", 404),
        ("GET", "/v1/messages", 405),
        ("DELETE", "/v1/chat/completions", 405),
        ("GET", "/nope", 404),
    ],
)
def test_every_error_is_json_in_the_calling_apis_shape(c, method, path, status):
    r = c.request(method, path)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] in ("not_found_error", "invalid_request_error")
    else:
        assert body["error"]["message"] and "type" in body["error"]
    assert c.request(method, path, headers={"anthropic-version": "2023-06-01"}).json()["type"] == "error"


def test_paths_in_error_messages_are_cut_to_their_last_part():
    from flashmoe.cli.serve.errors import APIError

    e = APIError(500, "cannot read /root/.local/share/flashmoe/models/demo/experts/layer3.bin at http://x:1/v1/y")
    assert e.message == "cannot read layer3.bin at http://x:1/v1/y"


# -- the policy tables and the docs agree ------------------------------------------------------


@pytest.mark.parametrize(
    "heading,policies",
    [
        (
            "POST /v1/messages (Anthropic)",
            [
                anthropic_api.MESSAGES,
                anthropic_api.OUTPUT_CONFIG,
                anthropic_api.THINKING,
                anthropic_api.TOOL,
                anthropic_api.TEXT_BLOCK,
            ],
        ),
        ("POST /v1/messages/count_tokens (Anthropic)", [anthropic_api.COUNT_TOKENS]),
        (
            "POST /v1/chat/completions (OpenAI)",
            [openai_api.CHAT, openai_api.MESSAGE, openai_api.FUNCTION, openai_api.TOOL],
        ),
        ("POST /v1/completions (OpenAI)", [openai_api.COMPLETION]),
        (
            "POST /v1/responses (OpenAI Responses)",
            [
                responses_api.RESPONSES,
                responses_api.TEXT,
                responses_api.REASONING,
                responses_api.FUNCTION,
                responses_api.ITEM,
            ],
        ),
    ],
)
def test_docs_name_every_field_of_each_endpoints_policy(heading, policies):
    doc = (ROOT / "docs" / "serve.md").read_text()
    section = doc.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    for policy in policies:
        missing = (policy.honoured | policy.ignored) - named
        assert not missing, (heading, missing)


def test_the_issue_40_first_requests_parse_without_problems():
    """The field sets issue 40 lists, read by the parsers alone (the replays of the recorded
    requests are tests/test_serve_agents.py)."""
    fields = Fields()
    anthropic_api.parse_messages(
        {
            "model": "m",
            "max_tokens": 32000,
            "messages": HELLO,
            "thinking": {"type": "adaptive"},
            "context_management": {},
            "output_config": {"effort": "high"},
            "stream": True,
            "metadata": {},
        },
        fields,
    )
    responses_api.parse_responses(
        {
            "model": "m",
            "input": "hi",
            "client_metadata": {},
            "reasoning": {},
            "include": ["reasoning.encrypted_content"],
            "store": False,
            "tools": [{"type": "namespace", "name": "n", "tools": []}],
        },
        fields,
        64,
    )
    assert fields.problems == []
    json.dumps(fields.header)


def test_a_clients_text_in_the_record_breaks_no_header_and_grows_no_metrics():
    """Attack: what gets recorded can hold a client's text (a tool's type). A line break must not
    split the header (no injected header), text outside Latin-1 must not make a 500, and a flood
    of distinct names must not grow /metrics without bound."""
    c = client()
    evil = [{"type": "网\r\nx-evil: 1", "name": "x"}, {"type": "a" * 5000, "name": "y"}]
    r = c.post("/v1/messages", json={"max_tokens": 5, "messages": HELLO, "tools": evil})
    assert r.status_code == 200 and "x-evil" not in r.headers
    assert "\\u7f51\\r\\n" in r.headers["x-flashmoe-ignored"] and len(r.headers["x-flashmoe-ignored"]) <= 2000
    for i in range(300):
        c.post("/v1/messages", json={"max_tokens": 1, "messages": HELLO, "tools": [{"type": f"t{i}", "name": "z"}]})
    counted = c.get("/metrics").json()["ignored_fields"]
    assert len(counted) <= 257 and counted["(other names)"] >= 40
