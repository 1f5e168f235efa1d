"""Issue 41's attacks on `flashmoe serve` (items 1, 3 and 11, and the five 500s), each against a
real server process: one request must never freeze every client, one client must never read
another's prompts through the prompt cache, and a connection, a web page or a key on the command
line must not get what it should not.

"Freeze": /health is asked every 5 ms (from a process of its own) while an attack runs, and each
answer must come within 100 ms. The attacks' bodies are built before the clock starts.

Two servers per module: the tiny random model (keys from FLASHMOE_API_KEY and --api-key-file, a
tenant header, --max-tokens 64, --read-timeout 2, a FLASHMOE_HOME whose kv/ holds a local
conversation's cache), and the scripted engine replying a bare JSON call (the Hermes near-miss a
low-bit model writes) for the attacks that need the model's output to be exactly so.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers.cli import run_cli
from tests.helpers.server import ServerProcess
from tests.tiny_tokenizer import CHAT_TEMPLATE

KA, KB = "sk-alice-key-0123456789", "sk-bob-key-9876543210"
FREEZE_S = 0.1
HELLO = [{"role": "user", "content": "Say hello."}]
LOCAL = [
    {"role": "system", "content": "You keep the notes of a private conversation. " * 4},
    {"role": "user", "content": "What did I say about the budget?"},
]
SECRET = [
    {"role": "system", "content": "The door code is 4831. Never tell it. You guard the building. " * 3},
    {"role": "user", "content": "Who are you?"},
]
# The scripted model's one reply: a bare call (no <tool_call> wrapper) whose "s" backtracks in
# Python's re against the patterns below, and whose "r" is no regular expression re can compile.
BARE_CALL = json.dumps({"name": "check", "arguments": {"s": "a" * 27 + "!", "r": "a{99999999999999999999}"}})


def auth(key: str = KA, tenant: str = "alice") -> dict:
    return {"Authorization": f"Bearer {key}", "X-Tenant": tenant, "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def tiny(model_factory):
    return model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny):
    """A FLASHMOE_HOME whose kv/ holds the cache a local conversation (chat, agent) left for LOCAL."""
    from flashmoe.engine.runtime.engine import Engine
    from flashmoe.engine.runtime.generate import GenerationRequest

    home = tmp_path_factory.mktemp("home")
    engine = Engine(tiny, prompt_cache_dir=str(home / "kv"))
    try:
        engine.wait_loaded()
        for _ in engine.submit(GenerationRequest(messages=LOCAL, max_tokens=2), session="local"):
            pass
    finally:
        engine.close()
    assert len(list((home / "kv").glob("*.safetensors"))) == 1
    return home


@pytest.fixture(scope="module")
def server(home, tiny, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# the second tenant\n{KB}\n")
    keys.chmod(0o600)
    s = ServerProcess(
        "-m",
        str(tiny),
        "--api-key-file",
        str(keys),
        "--tenant-header",
        "X-Tenant",
        "--max-tokens",
        "64",
        "--read-timeout",
        "2",
        env={"FLASHMOE_HOME": str(home), "FLASHMOE_API_KEY": KA},
    )
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    s = ServerProcess(
        "--engine",
        "fake",
        "--allow-host",
        "box.lan",
        env={"FLASHMOE_FAKE_REPLIES": json.dumps([BARE_CALL]), "FLASHMOE_FAKE_TEMPLATE": str(template)},
    )
    yield s
    assert s.stop() == 0


# /health asked in a process of its own (the test's own threads would share its GIL with the
# attack's client): every 5 ms until its stdin closes, then it prints the slowest answer.
POLLER = """
import http.client, select, sys, time
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=120)
slowest, polls = 0.0, 0
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.perf_counter()
    c.request("GET", "/health")
    r = c.getresponse()
    r.read()
    assert r.status == 200, r.status
    slowest, polls = max(slowest, time.perf_counter() - t0), polls + 1
    time.sleep(0.005)
print(slowest, polls, flush=True)
"""


def while_health(url: str, attack, tries: int = 3):
    """(what `attack()` returned, the slowest /health answer while it ran). A freeze comes back
    every time the attack runs; a loaded machine's scheduling hiccup (two test workers on two
    cores) does not: the attack is run again, up to `tries` times, while an answer took longer
    than FREEZE_S."""
    port = url.rsplit(":", 1)[1]
    for _ in range(tries):
        poller = subprocess.Popen(
            [sys.executable, "-c", POLLER, port], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert poller.stdout.readline().strip() == "ready"
        time.sleep(0.03)
        try:
            result = attack()
            time.sleep(0.02)
        finally:
            out, _ = poller.communicate(timeout=600)
        slowest, polls = out.split()
        assert int(polls) >= 2, out
        if float(slowest) < FREEZE_S:
            break
    return result, float(slowest)


def post(url: str, body, path: str = "/v1/chat/completions", headers=None, timeout: float = 120):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return lambda: httpx.post(f"{url}{path}", content=raw, headers=headers or auth(), timeout=timeout)


def tool(parameters: dict, name: str = "t") -> dict:
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": parameters}}


def anthropic_error(r) -> str:
    body = r.json()
    assert body["type"] == "error" and body["error"]["message"], body
    return body["error"]["message"]


def openai_error(r) -> str:
    body = r.json()
    assert body["error"]["message"], body
    return body["error"]["message"]


# -- item 1: no request freezes every client ------------------------------------------------------


def big_schema(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


FREEZES = {
    "10,000 properties": {"messages": HELLO, "max_tokens": 2, "tools": [tool(big_schema(10_000))]},
    "200,000-value enum": {
        "messages": HELLO,
        "max_tokens": 2,
        "tools": [tool({"type": "object", "properties": {"x": {"enum": list(range(200_000))}}})],
    },
    "a self-referencing $ref": {
        "messages": HELLO,
        "max_tokens": 2,
        "tools": [tool({"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}})],
    },
    "a $ref loop through allOf": {
        "messages": HELLO,
        "max_tokens": 2,
        "tools": [
            tool(
                {
                    "type": "object",
                    "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}},
                    "properties": {"x": {"$ref": "#/$defs/a"}},
                }
            )
        ],
    },
    "the root referring to itself": {
        "messages": HELLO,
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}},
    },
    "a schema nested 40 deep": {
        "messages": HELLO,
        "max_tokens": 2,
        "tools": [tool(json.loads('{"type": "object", "properties": {"a": ' * 20 + '{"type": "string"}' + "}}" * 20))],
    },
    "a 3 MB message": {"messages": [{"role": "user", "content": "ab " * 1_000_000}], "max_tokens": 2},
}


@pytest.mark.parametrize("name", FREEZES)
def test_a_request_that_cannot_run_is_refused_without_freezing_the_server(server, name):
    """Today's main: 10,000 properties stalled /health for ~1 s of its 21 s, the enum 1.4 s of 7 s,
    the 3 MB message (tokenized before the context was checked) for seconds; a $ref loop was a
    200 or a 500. Now each is a 400 in a moment, and /health never waits (the enum: decoding its
    body alone held the GIL for 40-80 ms in one call, 100-500 ms beside another test worker; a
    body that may hold more than 50,000 values is now decoded in a process of its own)."""
    r, slowest = while_health(server.url, post(server.url, json.dumps(FREEZES[name]).encode()))
    assert r.status_code == 400, r.text[:300]
    assert openai_error(r)
    assert slowest < FREEZE_S, f"/health took {slowest * 1000:.0f} ms"


def test_a_body_of_many_values_is_refused_naming_the_limit(server):
    """Values anywhere in the body count (messages' parts, not only schemas): 60,000 empty text
    parts are refused before anything is built from them."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 30_000}], "max_tokens": 2}
    r, slowest = while_health(server.url, post(server.url, body))
    assert r.status_code == 400 and "50,000 JSON values" in openai_error(r), r.text[:300]
    assert slowest < FREEZE_S, f"/health took {slowest * 1000:.0f} ms"


def test_a_text_full_of_commas_is_not_taken_for_many_values(server):
    """A pasted CSV: 300,000 commas inside one string are one value. The bound read off the raw
    bytes sends it to the checking process, which passes it; what refuses it then is the
    context (600,000 characters cannot fit the tiny model's), not the count of values."""
    body = {"messages": [{"role": "user", "content": "1,2," * 150_000 + " sum these"}], "max_tokens": 2}
    r, slowest = while_health(server.url, post(server.url, body))
    assert r.status_code == 400, r.text[:300]
    message = openai_error(r)
    assert "JSON values" not in message and "context" in message, message
    assert slowest < FREEZE_S, f"/health took {slowest * 1000:.0f} ms"


def test_a_body_past_the_limit_is_refused_as_it_arrives(server):
    """A 20 MB message (its Content-Length, or chunked with none) is refused at the 4 MB limit,
    before it is decoded; today it was tokenized: a 33 s stall, RSS 0.4 -> 1.9 GB."""
    body = json.dumps({"messages": [{"role": "user", "content": "ab " * 7_000_000}], "max_tokens": 2}).encode()
    r, slowest = while_health(server.url, post(server.url, body))
    assert r.status_code == 413 and "--max-body" in openai_error(r) and slowest < FREEZE_S

    def chunked():
        return httpx.post(
            f"{server.url}/v1/messages",
            headers=auth(),
            timeout=120,
            content=(body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)),
        )

    r, slowest = while_health(server.url, chunked)
    assert r.status_code == 413 and "--max-body" in anthropic_error(r) and slowest < FREEZE_S


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """The same call inside <tool_call> (parsed, then checked by the agent loop's validation)."""
    template = tmp_path_factory.mktemp("template") / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    s = ServerProcess(
        "--engine",
        "fake",
        env={
            "FLASHMOE_FAKE_REPLIES": json.dumps([f"<tool_call>\n{BARE_CALL}\n</tool_call>"]),
            "FLASHMOE_FAKE_TEMPLATE": str(template),
        },
    )
    yield s
    assert s.stop() == 0


def check_tool(**s_schema) -> dict:
    return tool(
        {
            "type": "object",
            "properties": {"s": {"type": "string", **s_schema}, "r": {"type": "string"}},
            "required": ["s"],
        },
        "check",
    )


@pytest.mark.parametrize("pattern", ["^(a+)+$", "^(a|a)*$"])
def test_a_call_checked_against_a_backtracking_pattern_freezes_nothing(scripted, wrapped, pattern):
    """Today's main checked the reply on the event loop with Python's re: 27 characters of 'a'
    against ^(a+)+$ froze every client for 11 s, doubling with each one more; the bare call (the
    near-miss check) and the wrapped one (the call's validation) alike. Now the reply is read off
    the event loop and its patterns matched with a time limit (the regex engine, the GIL let go):
    the call does not match, so the bare one stays text and the wrapped one is refused, and
    /health never waits."""
    body = {"messages": HELLO, "max_tokens": 200, "tools": [check_tool(pattern=pattern)]}
    r, slowest = while_health(scripted.url, post(scripted.url, body))
    assert r.status_code == 200, r.text[:300]
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"] == BARE_CALL
    assert slowest < FREEZE_S, f"/health took {slowest * 1000:.0f} ms"
    r, slowest = while_health(wrapped.url, post(wrapped.url, body))
    assert r.status_code == 200, r.text[:300]
    assert "tool_calls" not in r.json()["choices"][0]["message"]
    assert "$.s" in r.json()["flashmoe"]["invalid_tool_calls"][0]["error"]
    assert slowest < FREEZE_S, f"/health took {slowest * 1000:.0f} ms"


def test_a_call_under_format_regex_that_re_cannot_compile_is_refused_not_a_500(scripted, wrapped):
    """`r` is `a{99999999999999999999}`: Python's re raised OverflowError past jsonschema's format
    check, a 500. Now that value fails its schema: the bare reply stays text, the wrapped call is
    refused."""
    body = {
        "messages": HELLO,
        "max_tokens": 200,
        "tools": [
            tool(
                {"type": "object", "properties": {"s": {"type": "string"}, "r": {"type": "string", "format": "regex"}}},
                "check",
            )
        ],
    }
    r = post(scripted.url, body)()
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == BARE_CALL, r.text[:300]
    r = post(wrapped.url, body)()
    assert r.status_code == 200, r.text[:300]
    assert "'regex'" in r.json()["flashmoe"]["invalid_tool_calls"][0]["error"]


def test_the_grammar_holds_a_backtracking_pattern_without_freezing(server):
    """The call is written under the grammar (llguidance's own linear-time matcher) and checked
    after (the regex engine, with a time limit): a valid call, and /health never waits."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(a+)+$", "maxLength": 12}},
        "required": ["s"],
    }
    body = {
        "messages": HELLO,
        "max_tokens": 60,
        "tools": [tool(schema, "check")],
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": 3,
    }
    r, slowest = while_health(server.url, post(server.url, body))
    assert r.status_code == 200, r.text[:300]
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert set(json.loads(call["arguments"])["s"]) == {"a"} and slowest < FREEZE_S


# -- the five 500s: each a 400 in the calling API's error JSON ------------------------------------


def test_five_former_500s_are_400s_in_the_apis_shape(server):
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path, read in (("/v1/chat/completions", openai_error), ("/v1/messages", anthropic_error)):
        r = post(server.url, deep, path)()
        assert r.status_code == 400 and "deep" in read(r), r.text[:200]
    surrogate = b'{"max_tokens": 4, "messages": [{"role": "user", "content": "a \\ud800 b"}]}'
    for path, read in (("/v1/chat/completions", openai_error), ("/v1/messages", anthropic_error)):
        r = post(server.url, surrogate, path)()
        assert r.status_code == 400 and "surrogate" in read(r), r.text[:200]
    r = post(server.url, b'{"messages": [{"role": "user", "content": "x"}], "seed": "\\udfff"}')()
    assert r.status_code == 400 and "surrogate" in openai_error(r)
    loop = {
        "max_tokens": 4,
        "messages": HELLO,
        "tools": [
            {
                "name": "t",
                "input_schema": {
                    "type": "object",
                    "$defs": {"a": {"$ref": "#/$defs/a"}},
                    "properties": {"x": {"$ref": "#/$defs/a"}},
                },
            }
        ],
    }
    r = post(server.url, loop, "/v1/messages")()
    assert r.status_code == 400 and "loop" in anthropic_error(r)
    for pattern in ("a{99999999999999999999}", "(" * 3000 + ")" * 3000):
        bad = {
            "messages": HELLO,
            "tools": [tool({"type": "object", "properties": {"x": {"type": "string", "pattern": pattern}}})],
        }
        r = post(server.url, bad)()
        assert r.status_code == 400 and "regex" in openai_error(r), r.text[:200]


# -- item 3: the prompt cache keeps tenants apart --------------------------------------------------


def cached(url: str, messages, headers) -> int:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers=headers,
        timeout=120,
        json={"messages": messages, "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200, r.text[:300]
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_never_reuses_another_tenants_prompt_cache(server, home):
    """The issue read a 4-digit secret in another conversation's system prompt back through
    cached_tokens in 40 requests. Now a tenant (a key; within it, the --tenant-header value) is
    given only its own caches, in memory and on disk, and the server's disk tier is apart from
    the local conversations' (kv/serve/): no one else's prefix shows in cached_tokens."""
    # (tenants no other test uses: every prompt of this template shares its first 8 tokens)
    assert cached(server.url, SECRET, auth(KA, "guard")) == 0
    assert cached(server.url, SECRET, auth(KA, "guard")) > 50  # a tenant still reuses its own
    assert cached(server.url, SECRET, auth(KB, "guard")) == 0  # another key
    assert cached(server.url, SECRET, auth(KA, "mallory")) == 0  # the same key, another tenant header
    assert cached(server.url, LOCAL, auth(KA, "notes")) == 0  # a local conversation's cache in kv/
    serve_files = list((home / "kv" / "serve").glob("*.safetensors"))
    assert serve_files and len(list((home / "kv").glob("*.safetensors"))) == 1  # the local one only
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": HELLO, "max_tokens": 2},
        headers={"Authorization": f"Bearer {KA}"},
        timeout=60,
    )
    assert r.status_code == 400 and "X-Tenant" in openai_error(r)


# -- item 11: connections, web pages, max_tokens, keys ----------------------------------------------


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except ConnectionResetError:  # (closed with the client's bytes unread)
        pass
    return out


def test_half_open_connections_are_closed_at_the_read_timeout(server):
    """Slowloris: a connection that sends nothing, one that trickles its headers, one that stops
    inside its body. Today each stayed open for ever (at the descriptor limit nobody was served);
    with --read-timeout 2 each is closed (the body one with a 408) within a few seconds."""
    results: dict[str, bytes] = {}

    def silent():
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.settimeout(8)
            results["silent"] = read_until_closed(s)

    def trickle():
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.settimeout(8)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            try:
                for i in range(12):
                    time.sleep(0.5)
                    s.sendall(b"X-Slow-%d: 1\r\n" % i)
            except OSError:
                pass
            results["trickle"] = read_until_closed(s)

    def stalled_body():
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.settimeout(8)
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                + KA.encode()
                + b'\r\nX-Tenant: a\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"m'
            )
            results["body"] = read_until_closed(s)

    t0 = time.monotonic()
    threads = [threading.Thread(target=f) for f in (silent, trickle, stalled_body)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["silent"] == b"" and results["trickle"] == b""
    assert results["body"].startswith(b"HTTP/1.1 408") and b"--read-timeout" in results["body"]
    assert time.monotonic() - t0 < 6


def test_max_tokens_is_capped_at_the_servers_max_tokens(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=auth(),
        timeout=120,
        json={"messages": HELLO, "max_tokens": 10**9, "temperature": 1.0, "seed": 1},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 64
    assert "max_tokens: 1000000000 -> 64 (--max-tokens)" in r.headers["x-flashmoe-translated"]
    m = httpx.post(
        f"{server.url}/v1/messages",
        headers=auth(),
        timeout=120,
        json={"messages": HELLO, "max_tokens": 10**9, "temperature": 1.0},
    )
    assert m.status_code == 200 and m.json()["usage"]["output_tokens"] <= 64


def test_a_web_page_cannot_post_text_or_forms(server):
    """A page on any origin may POST text/plain, a form or a typeless Blob without asking the
    server first (no CORS preflight): only application/json is read."""
    body = json.dumps({"messages": HELLO, "max_tokens": 2})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {k: v for k, v in auth().items() if k != "Content-Type"}
        if content_type:
            headers["Content-Type"] = content_type
        r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers=headers, timeout=60)
        assert r.status_code == 415 and "application/json" in openai_error(r), content_type
        r = httpx.post(f"{server.url}/v1/messages", content=body, headers=headers, timeout=60)
        assert r.status_code == 415 and anthropic_error(r), content_type
    ok = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=body,
        timeout=60,
        headers={**auth(), "Content-Type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200


def test_the_host_must_be_the_servers_unless_allowed(scripted):
    """DNS rebinding: a page whose name resolves to 127.0.0.1 reaches the server with its own
    name as Host."""
    for host in ("evil.example", "evil.example:%d" % scripted.port, "127.0.0.1.evil.example"):
        r = httpx.get(f"{scripted.url}/health", headers={"Host": host}, timeout=30)
        assert r.status_code == 421 and "--allow-host" in openai_error(r), host
    r = httpx.post(
        f"{scripted.url}/v1/messages",
        json={"max_tokens": 2, "messages": HELLO},
        headers={"Host": "evil.example"},
        timeout=30,
    )
    assert r.status_code == 421 and anthropic_error(r)
    for host in (f"127.0.0.1:{scripted.port}", "localhost", f"localhost:{scripted.port}", "box.lan:80", "BOX.LAN"):
        assert httpx.get(f"{scripted.url}/health", headers={"Host": host}, timeout=30).status_code == 200, host


def test_keys_come_from_the_environment_and_a_file_and_stay_off_the_command_line(server):
    for key in (KA, KB):
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sk-nobody"}).status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert b"serve" in cmdline and KA.encode() not in cmdline and KB.encode() not in cmdline


def test_an_empty_key_is_refused_not_served_openly(tmp_path):
    """`--api-key ""` (an unset variable in a script) served everyone while looking protected."""
    empty = tmp_path / "keys"
    empty.write_text("# none yet\n\n")
    for args, env, said in (
        (["--api-key", ""], {}, "--api-key '': an empty key"),
        (["--api-key-file", str(empty)], {}, "holds no key"),
        ([], {"FLASHMOE_API_KEY": " "}, "FLASHMOE_API_KEY is set but empty"),
    ):
        out = run_cli("serve", "--engine", "fake", "--port", "0", *args, env=env, timeout=60)
        assert out.returncode == 2 and said in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr and "serving" not in out.stderr


def test_the_limits_leave_the_agents_requests_alone():
    """Every request the coding agents were recorded sending (tests/fixtures/agents) passes each
    limit with room to spare: 4 MB, 64 deep, 10,000 schema values, 32 deep."""
    from pathlib import Path

    from flashmoe.cli.serve.limits import Limits, _size, parse_json

    limits = Limits()
    for f in sorted((Path(__file__).parent / "fixtures" / "agents").glob("*.json")):
        for x in json.loads(f.read_text())["exchanges"]:
            if not isinstance(x.get("body"), dict):
                continue
            raw = json.dumps(x["body"]).encode()
            assert len(raw) * 8 < limits.max_body and parse_json(raw, limits.max_depth // 3) == x["body"]
            schemas = [
                t.get("input_schema") or t.get("parameters") or t.get("function", {}).get("parameters")
                for t in x["body"].get("tools") or []
            ]
            sizes = [_size(s) for s in schemas if s]
            assert sum(n for n, _ in sizes) * 4 < limits.schema_nodes, f.name
            assert all(d * 2 < limits.schema_depth for _, d in sizes), f.name
