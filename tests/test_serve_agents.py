"""The requests coding agents really send, replayed as they were sent (tests/fixtures/agents/, one
file per client and version, recorded by benchmarks/agents_e2e.py through its logging proxy; the
workspace, home folder, ids and keys replaced).

Every recorded request, headers and body as the client sent them, against a real server process
(the scripted engine: this is about what the server accepts and how it answers, not the words)
must get a 2xx and stream to its end. In-process, each client's tool-calling request gets a call
to one of its own tools back in its API's shape, and under --strict-fields Claude Code's and
Codex's first requests are refused naming every field (the behaviour issue 40 reported)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from flashmoe.cli.serve.app import Server
from flashmoe.engine.testing import FakeEngine
from tests.helpers.server import ServerProcess
from tests.tiny_tokenizer import CHAT_TEMPLATE

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
RECORDINGS = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(FIXTURES.glob("*.json"))}
REQUESTS = [
    (name, i, e) for name, rec in RECORDINGS.items() for i, e in enumerate(rec["exchanges"]) if e["method"] == "POST"
]
REPLY = "I looked at the folder: it holds README.md."


def sse(text: str) -> list[tuple[str, object]]:
    out = []
    for block in text.split("\n\n"):
        name, data = "message", None
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                raw = line[5:].strip()
                data = raw if raw == "[DONE]" else json.loads(raw)
        if data is not None:
            out.append((name, data))
    return out


def streamed_to_the_end(text: str) -> bool:
    events = sse(text)
    errors = [d for n, d in events if n == "error" or (isinstance(d, dict) and "error" in d and "choices" not in d)]
    last = events[-1] if events else ("", None)
    return not errors and (
        last[0] == "message_stop"
        or last[1] == "[DONE]"
        or (isinstance(last[1], dict) and last[1].get("type") in ("response.completed", "response.incomplete"))
    )


def test_the_recordings_are_real_and_cover_the_agents():
    assert {"claude", "claude-default", "codex", "aider", "llm", "opencode", "openai-agents"} <= set(RECORDINGS)
    for name, rec in RECORDINGS.items():
        assert rec["version"][0].isdigit() and rec["command"] and rec["exchanges"], name
        text = json.dumps(rec)
        assert "/tmp/" not in text.replace("/tmp/opencode", "") and "/root/" not in text, name  # paths replaced
    # a tool round trip was recorded for each agent that calls tools (aider edits in text)
    for name in ("claude", "codex", "llm", "opencode", "openai-agents"):
        bodies = json.dumps([e["body"] for e in RECORDINGS[name]["exchanges"]])
        assert any(k in bodies for k in ('"tool_result"', '"function_call_output"', '"role": "tool"')), name


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    s = ServerProcess(
        "--engine",
        "fake",
        "--api-key",
        "sk-test",
        "--temp",
        "0",
        env={"FLASHMOE_FAKE_REPLIES": json.dumps([REPLY]), "FLASHMOE_FAKE_TEMPLATE": str(template)},
    )
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("name,i,exchange", REQUESTS, ids=[f"{n}-{i}" for n, i, _ in REQUESTS])
def test_a_recorded_request_as_sent_succeeds_and_streams_to_its_end(server, name, i, exchange):
    headers = {**exchange["headers"], "x-api-key": "sk-test", "authorization": "Bearer sk-test"}
    r = httpx.post(f"{server.url}{exchange['path']}", headers=headers, json=exchange["body"], timeout=120)
    assert 200 <= r.status_code < 300, (name, i, r.text[:500])
    if exchange["body"].get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream")
        assert streamed_to_the_end(r.text), (name, i, r.text[-800:])
        if "/v1/messages" in exchange["path"]:
            start = sse(r.text)[0][1]
            assert start["type"] == "message_start"
    else:
        assert r.json()


# -- in-process: a call to the client's own tool, in its API's shape --------------------------


def first_with_tools(name: str) -> dict:
    return next(e for e in RECORDINGS[name]["exchanges"] if e["method"] == "POST" and e["body"].get("tools"))


def tool_names(body: dict) -> list[str]:
    out = []
    for t in body["tools"]:
        if t.get("type") in (None, "custom") or (t.get("type") == "function" and "name" in t):
            out.append(t["name"])
        elif t.get("type") == "function":
            out.append(t["function"]["name"])
    return out


def calls_in(path: str, text: str) -> list[tuple[str, dict]]:
    """(name, arguments) of the calls a streamed reply carried, read the way each SDK reads them."""
    out: dict[str, list] = {}
    for _, d in sse(text):
        if not isinstance(d, dict):
            continue
        if d.get("type") == "content_block_start" and d["content_block"]["type"] == "tool_use":
            out[d["index"]] = [d["content_block"]["name"], ""]
        elif d.get("type") == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
            out[d["index"]][1] += d["delta"]["partial_json"]
        elif d.get("type") == "response.output_item.done" and d["item"]["type"] == "function_call":
            out[d["item"]["call_id"]] = [d["item"]["name"], d["item"]["arguments"]]
        for ch in d.get("choices") or []:
            for tc in ch["delta"].get("tool_calls") or []:
                slot = out.setdefault(tc["index"], ["", ""])
                slot[0] += tc["function"].get("name") or ""
                slot[1] += tc["function"].get("arguments") or ""
    return [(n, json.loads(a or "{}")) for n, a in out.values()]


def minimal_args(schema: dict) -> dict:
    """Arguments that satisfy a tool's required properties (the scripted engine has no grammar)."""
    simple = {"string": "x", "integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}
    props = schema.get("properties") or {}
    out = {}
    for key in schema.get("required") or []:
        prop = props.get(key) or {}
        out[key] = prop["enum"][0] if prop.get("enum") else simple.get(prop.get("type"), "x")
    return out


@pytest.mark.parametrize(
    "name", ["claude", "claude-default", "claude-2.1.337", "codex", "llm", "opencode", "openai-agents"]
)
def test_each_agents_tool_request_gets_a_call_to_its_own_tool_back(name):
    exchange = first_with_tools(name)
    tool = tool_names(exchange["body"])[0]
    schema = next(
        t.get("input_schema") or t.get("parameters") or t.get("function", {}).get("parameters")
        for t in exchange["body"]["tools"]
        if (t.get("name") or t.get("function", {}).get("name")) == tool
    )
    args = minimal_args(schema or {})
    call = f"<tool_call>\n{json.dumps({'name': tool, 'arguments': args})}\n</tool_call>"
    engine = FakeEngine([call], chat_template=CHAT_TEMPLATE)
    c = TestClient(Server(engine, engine.loaded_info, "demo").app())
    r = c.post(exchange["path"], json={**exchange["body"], "stream": True}, headers=exchange["headers"])
    assert r.status_code == 200, r.text[:500]
    assert streamed_to_the_end(r.text), r.text[-800:]
    assert calls_in(exchange["path"], r.text) == [(tool, args)]


@pytest.mark.parametrize("name", ["claude-default", "codex"])
def test_strict_fields_refuses_the_first_request_naming_every_field(name):
    exchange = first_with_tools(name)
    engine = FakeEngine([REPLY], chat_template=CHAT_TEMPLATE)
    c = TestClient(Server(engine, engine.loaded_info, "demo", strict_fields=True).app())
    r = c.post(exchange["path"], json=exchange["body"], headers=exchange["headers"])
    assert r.status_code == 400
    message = json.dumps(r.json())
    expected = {
        "claude-default": ("thinking", "context_management", "output_config.effort", "metadata"),
        "codex": ("client_metadata", "prompt_cache_key", "reasoning.encrypted_content", "namespace"),
    }[name]
    assert all(field in message for field in expected), message
