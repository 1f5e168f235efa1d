"""The coding agents people use, unmodified, against `flashmoe serve`: one turn each, with a tool
call that the agent runs and answers, through a logging proxy that sees every request.

    python benchmarks/agents_e2e.py [--install] [-m MODEL] [--clients claude,codex] [--record DIR]

--install first installs the current `claude` and `codex` CLIs from npm (`npm install -g
@anthropic-ai/claude-code@latest @openai/codex@latest`), so the next release can be checked in
one command. Each client runs in a fresh temporary workspace (and, for Codex, a fresh CODEX_HOME)
pointed at the proxy; the server runs the model (default: the demo) with `--force-first-call`,
because the 135M demo never starts a call by itself, and `--temp 0 --repetition-penalty 1.2`,
because the agents send neither and the demo runs on to the token budget at the APIs' default
temperature (1) and loops when greedy without a penalty (both agents end such a turn in an
error): the bar on the demo is that the turn completes with a tool call executed, not a good
answer. A client passes when its run exits 0,
every request it sent got a 2xx and streamed to its end, one reply carried a tool call, and a
later request carried that call's result (the agent ran it); aider edits from the reply's text
and calls no tools, so for it the first three suffice.

Other clients (aider, llm, opencode, openai-agents: --clients all) are run the same way when they
are on PATH (or, for the Python ones, in --venv); --record DIR writes each client's requests
and replies as a fixture (tests/fixtures/agents/), with the client's version, and the workspace,
home folder, ids and keys replaced.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CLIENTS = ("claude", "codex", "aider", "llm", "opencode", "openai-agents")
EDITS_IN_TEXT = ("aider",)  # edits files from the reply's text: no tool call to expect
KEY = "sk-flashmoe-e2e"
TASK = "List the files in this folder with a tool, then say what you found."
# Claude Code's reply budget: it asks for 32,000 tokens, four times the demo's context; a reply that
# runs on (a model that loops) ends at 1,024 instead, which Claude Code reports as an error.
REPLY_TOKENS = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the logging proxy -------------------------------------------------------------------------


class Recorder:
    """A proxy in front of the server that passes every request and reply through as it comes
    (SSE chunk by chunk) and keeps a copy of each exchange."""

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.exchanges: list[dict] = []
        self.lock = threading.Lock()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self):
                recorder.forward(self)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = _any

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that drops a
                    super().handle_error(request, client_address)  # kept-alive one is no news

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def forward(self, h) -> None:
        length = int(h.headers.get("content-length") or 0)
        body = h.rfile.read(length) if length else b""
        up = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=1800)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "accept-encoding")}
        up.request(h.command, h.path, body=body, headers=headers)
        r = up.getresponse()
        h.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                h.send_header(k, v)
        h.send_header("transfer-encoding", "chunked")
        h.end_headers()
        data = b""
        try:
            while True:
                chunk = r.read1(65536)
                if not chunk:
                    break
                data += chunk
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                h.wfile.flush()
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        with self.lock:
            self.exchanges.append(
                {
                    "method": h.command,
                    "path": h.path,
                    "headers": dict(h.headers.items()),
                    "body": parsed,
                    "status": r.status,
                    "response_headers": dict(r.getheaders()),
                    "response": data.decode("utf-8", "replace"),
                }
            )

    def close(self) -> None:
        self.httpd.shutdown()


# -- what a run shows --------------------------------------------------------------------------


def sse_events(text: str) -> list[tuple[str, dict | str]]:
    """(event name, data) of an SSE body ("message" when unnamed); comments dropped."""
    out = []
    for block in text.split("\n\n"):
        name, data = "message", []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            raw = "\n".join(data)
            try:
                out.append((name, json.loads(raw)))
            except ValueError:
                out.append((name, raw))
    return out


def ended(exchange: dict) -> bool:
    """A generating reply that streamed to its end (or a whole JSON reply), with no error event."""
    text = exchange["response"]
    if "text/event-stream" not in exchange["response_headers"].get("content-type", ""):
        return True
    events = sse_events(text)
    if any(
        name == "error"
        or (isinstance(d, dict) and d.get("type") in ("error", "response.failed"))
        or (isinstance(d, dict) and "error" in d and "choices" not in d)
        for name, d in events
    ):
        return False
    last = events[-1] if events else ("", "")
    return (
        last[0] == "message_stop"
        or last[1] == "[DONE]"
        or (isinstance(last[1], dict) and last[1].get("type") in ("response.completed", "response.incomplete"))
    )


def calls_made(exchange: dict) -> list[str]:
    """The ids of the tool calls a reply carried (any of the three APIs, streamed or not)."""
    ids: list[str] = []
    text = exchange["response"]
    payloads = (
        [d for _, d in sse_events(text)]
        if "event-stream" in exchange["response_headers"].get("content-type", "")
        else [json.loads(text)]
        if text.startswith("{")
        else []
    )
    for d in payloads:
        if not isinstance(d, dict):
            continue
        block = d.get("content_block") or {}
        if block.get("type") == "tool_use":
            ids.append(block["id"])
        item = d.get("item") or {}
        if item.get("type") == "function_call" and d.get("type") == "response.output_item.done":
            ids.append(item["call_id"])
        for choice in d.get("choices") or []:
            for c in (choice.get("delta") or choice.get("message") or {}).get("tool_calls") or []:
                if c.get("id"):
                    ids.append(c["id"])
        for b in d.get("content") or []:
            if isinstance(b, dict) and b.get("type") == "tool_use":
                ids.append(b["id"])
        for o in d.get("output") or []:
            if isinstance(o, dict) and o.get("type") == "function_call":
                ids.append(o["call_id"])
    return ids


def results_sent(exchange: dict) -> set[str]:
    """The call ids whose results a request carries."""
    body = exchange["body"] if isinstance(exchange["body"], dict) else {}
    out = set()
    for m in body.get("messages") or []:
        if m.get("role") == "tool" and m.get("tool_call_id"):
            out.add(m["tool_call_id"])
        for b in m.get("content") if isinstance(m.get("content"), list) else []:
            if isinstance(b, dict) and b.get("type") == "tool_result":
                out.add(b.get("tool_use_id"))
    for item in body.get("input") if isinstance(body.get("input"), list) else []:
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            out.add(item.get("call_id"))
    return out


def verdict(exchanges: list[dict]) -> dict:
    generating = [e for e in exchanges if e["method"] == "POST"]
    made = [i for e in generating for i in calls_made(e)]
    answered = set().union(*(results_sent(e) for e in generating)) if generating else set()
    return {
        "requests": len(generating),
        "all_2xx": all(200 <= e["status"] < 300 for e in generating),
        "streamed_to_end": all(ended(e) for e in generating if 200 <= e["status"] < 300),
        "calls": len(made),
        "calls_answered": len(set(made) & answered),
        "first_status": generating[0]["status"] if generating else None,
    }


# -- fixtures ----------------------------------------------------------------------------------

_UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
_HEX = re.compile(r"\b[0-9a-f]{32,}\b")
_DROP_HEADERS = ("authorization", "x-api-key", "host", "content-length", "connection", "accept-encoding")


def scrub(value, replace: dict[str, str]):
    """The recording with paths, ids and keys replaced (the same id by the same stand-in)."""
    text = json.dumps(value, ensure_ascii=False)
    for old, new in sorted(replace.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(old, new)
    seen: dict[str, str] = {}

    def stand_in(m, kind):
        key = m.group(0)
        if key not in seen:
            n = len(seen) + 1
            seen[key] = f"00000000-0000-4000-8000-{n:012d}" if kind == "uuid" else f"{n:0{len(key)}x}"
        return seen[key]

    text = _UUID.sub(lambda m: stand_in(m, "uuid"), text)
    text = _HEX.sub(lambda m: stand_in(m, "hex"), text)
    return json.loads(text)


def fixture(client: str, version: str, command: list[str], exchanges: list[dict], replace: dict[str, str]) -> dict:
    kept = []
    for e in exchanges:
        headers = {k: v for k, v in e["headers"].items() if k.lower() not in _DROP_HEADERS}
        kept.append(
            {
                "method": e["method"],
                "path": e["path"],
                "headers": headers,
                "body": e["body"],
                "status": e["status"],
                "response": e["response"][:4000],
            }
        )
    return scrub(
        {
            "client": client,
            "version": version,
            "recorded": time.strftime("%Y-%m-%d"),
            "command": " ".join([Path(command[0]).name, *command[1:]]),
            "exchanges": kept,
        },
        replace,
    )


# -- the clients -------------------------------------------------------------------------------


def version_of(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    m = re.search(r"\d+\.\d+(\.\d+)?", out.stdout + out.stderr)
    return m.group(0) if m else "?"


def run_claude(base: str, work: Path, home: Path, timeout: float) -> tuple[list[str], dict, str]:
    """`claude -p` with a short system prompt and the Read tool only, so that the prompt fits
    the demo's 8,192-token context (its default tools alone are ~18,000 tokens)."""
    cmd = [
        "claude",
        "-p",
        "--tools",
        "Read,Glob",
        "--allowedTools",
        "Read,Glob",
        "--system-prompt",
        "You are a coding agent. Use the tools to look at files.",
        TASK,
    ]
    env = {
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_MODEL": "demo",
        "ANTHROPIC_SMALL_FAST_MODEL": "demo",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(REPLY_TOKENS),
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "HOME": str(home),
    }
    return cmd, env, version_of(["claude", "--version"])


def run_codex(base: str, work: Path, home: Path, timeout: float) -> tuple[list[str], dict, str]:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        'model = "demo"\nmodel_provider = "flashmoe"\nmodel_max_output_tokens = 256\n\n'
        '[model_providers.flashmoe]\nname = "flashmoe"\n'
        f'base_url = "{base}/v1"\nwire_api = "responses"\nenv_key = "FLASHMOE_API_KEY"\n'
    )
    cmd = ["codex", "exec", "--skip-git-repo-check", "-s", "read-only", "--ephemeral", TASK]
    env = {"CODEX_HOME": str(codex_home), "FLASHMOE_API_KEY": KEY, "HOME": str(home)}
    return cmd, env, version_of(["codex", "--version"])


def run_aider(base: str, work: Path, home: Path, timeout: float, venv: Path | None = None):
    exe = str(venv / "bin" / "aider") if venv else "aider"
    (work / "notes.txt").write_text("hello\n")
    cmd = [
        exe,
        "--model",
        "openai/demo",
        "--no-git",
        "--yes-always",
        "--no-show-model-warnings",
        "--message",
        "Add a line to notes.txt",
        "notes.txt",
    ]
    env = {"OPENAI_API_BASE": f"{base}/v1", "OPENAI_API_KEY": KEY, "HOME": str(home)}
    return cmd, env, version_of([exe, "--version"])


def run_llm(base: str, work: Path, home: Path, timeout: float, venv: Path | None = None):
    exe = str(venv / "bin" / "llm") if venv else "llm"
    cfg = home / "llm"
    cfg.mkdir(parents=True, exist_ok=True)
    (cfg / "extra-openai-models.yaml").write_text(
        f'- model_id: demo\n  model_name: demo\n  api_base: "{base}/v1"\n  api_key_name: flashmoe\n'
        "  supports_tools: true\n"
    )
    env = {"LLM_USER_PATH": str(cfg), "HOME": str(home)}
    subprocess.run([exe, "keys", "set", "flashmoe", "--value", KEY], env=dict(os.environ, **env), check=True)
    cmd = [exe, "-m", "demo", "-T", "llm_version", "What version of llm is this? Use the tool."]
    return cmd, env, version_of([exe, "--version"])


def run_opencode(base: str, work: Path, home: Path, timeout: float):
    cfg = {
        "$schema": "https://opencode.ai/config.json",
        "model": "flashmoe/demo",
        "provider": {
            "flashmoe": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "flashmoe",
                "options": {"baseURL": f"{base}/v1", "apiKey": KEY},
                "models": {"demo": {"name": "demo"}},
            }
        },
    }
    folder = home / ".config" / "opencode"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "opencode.json").write_text(json.dumps(cfg))
    cmd = ["opencode", "run", "-m", "flashmoe/demo", TASK]
    return cmd, {"HOME": str(home)}, version_of(["opencode", "--version"])


AGENTS_SCRIPT = """
import asyncio, os, sys
from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI

@function_tool
def list_files() -> str:
    \"\"\"The names of the files in the current folder.\"\"\"
    return ", ".join(sorted(os.listdir(".")))

set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=sys.argv[1] + "/v1", api_key=sys.argv[2]), use_for_tracing=False)
agent = Agent(name="demo", model="demo", instructions="Use the tool to answer.", tools=[list_files])
print(Runner.run_sync(agent, sys.argv[3], max_turns=3).final_output)
"""


def run_openai_agents(base: str, work: Path, home: Path, timeout: float, venv: Path | None = None):
    script = work / "agent_run.py"
    script.write_text(AGENTS_SCRIPT)
    py = str(venv / "bin" / "python") if venv else sys.executable
    cmd = [py, str(script), base, KEY, TASK]
    version = (
        subprocess.run(
            [py, "-c", "import importlib.metadata as m; print(m.version('openai-agents'))"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        or "?"
    )
    return cmd, {"HOME": str(home)}, version


RUNNERS = {
    "claude": run_claude,
    "codex": run_codex,
    "aider": run_aider,
    "llm": run_llm,
    "opencode": run_opencode,
    "openai-agents": run_openai_agents,
}


# -- main --------------------------------------------------------------------------------------


def start_server(model: str | None, home: str, extra: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "flashmoe.cli",
        "serve",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--force-first-call",
        "--temp",
        "0",
        "--repetition-penalty",
        "1.2",
        *extra,
    ]
    cmd += ["-m", model] if model else []
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=dict(os.environ, FLASHMOE_HOME=home)
    )
    for line in proc.stderr:
        print(f"  server: {line.rstrip()}", file=sys.stderr)
        if "serving" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, port
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--install", action="store_true", help="npm install -g the current claude and codex first")
    ap.add_argument("-m", "--model", default=None, help="model folder (default: the demo)")
    ap.add_argument("--clients", default="claude,codex", help=f"comma-separated, or all ({', '.join(CLIENTS)})")
    ap.add_argument("--venv", type=Path, default=None, help="a virtual environment holding aider, llm, openai-agents")
    ap.add_argument("--record", type=Path, default=None, help="write each client's exchanges here as a fixture")
    ap.add_argument("--timeout", type=float, default=900, help="seconds each client may take (default 900)")
    ap.add_argument("--server-arg", action="append", default=[], help="an extra `flashmoe serve` argument")
    args = ap.parse_args()
    clients = CLIENTS if args.clients == "all" else tuple(c.strip() for c in args.clients.split(","))
    unknown = [c for c in clients if c not in RUNNERS]
    if unknown:
        ap.error(f"--clients: unknown {', '.join(unknown)}")
    if args.install:
        cmd = ["npm", "install", "-g", "@anthropic-ai/claude-code@latest", "@openai/codex@latest"]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    home = os.environ.get("FLASHMOE_HOME") or str(Path.home() / ".local" / "share" / "flashmoe")
    proc, port = start_server(args.model, home, args.server_arg)
    rows, failed = [], 0
    try:
        for client in clients:
            recorder = Recorder(port)
            work = Path(tempfile.mkdtemp(prefix=f"flashmoe-e2e-{client}-"))
            user_home = Path(tempfile.mkdtemp(prefix="flashmoe-e2e-home-"))
            (work / "README.md").write_text("A folder for a coding agent to look at.\n")
            base = f"http://127.0.0.1:{recorder.port}"
            runner = RUNNERS[client]
            kw = {"venv": args.venv} if client in ("aider", "llm", "openai-agents") else {}
            cmd, env, version = runner(base, work, user_home, args.timeout, **kw)
            if shutil.which(cmd[0]) is None and not Path(cmd[0]).exists():
                rows.append({"client": client, "version": "-", "result": f"skipped: {cmd[0]} not found"})
                continue
            print(f"\n$ {' '.join(cmd)}   ({client} {version}, in {work})", flush=True)
            t0 = time.monotonic()
            try:
                out = subprocess.run(
                    cmd,
                    cwd=work,
                    env=dict(os.environ, **env),
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                    stdin=subprocess.DEVNULL,
                )
                code, stdout, stderr = out.returncode, out.stdout, out.stderr
            except subprocess.TimeoutExpired as e:
                code, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
            took = time.monotonic() - t0
            recorder.close()
            v = verdict(recorder.exchanges)
            ok = (
                code == 0
                and v["requests"] > 0
                and v["all_2xx"]
                and v["streamed_to_end"]
                and (v["calls_answered"] > 0 or client in EDITS_IN_TEXT)
            )
            failed += not ok and client in ("claude", "codex")
            tail = (stdout if isinstance(stdout, str) else stdout.decode("utf-8", "replace")).strip()[-300:]
            print(f"  exit {code} in {took:.0f} s; {json.dumps(v)}\n  stdout: {tail!r}", flush=True)
            if not ok:
                err = stderr if isinstance(stderr, str) else stderr.decode("utf-8", "replace")
                print(f"  stderr: {err.strip()[-1500:]}", flush=True)
                for i, e in enumerate(recorder.exchanges):  # what each request got, where it went wrong
                    if e["method"] == "POST" and not (200 <= e["status"] < 300 and ended(e)):
                        print(f"  request {i} ({e['path']}, HTTP {e['status']}) ended: {e['response'][-600:]!r}")
            rows.append(
                {
                    "client": client,
                    "version": version,
                    "exit": code,
                    "seconds": round(took),
                    **v,
                    "result": "PASS" if ok else "FAIL",
                }
            )
            if args.record:
                args.record.mkdir(parents=True, exist_ok=True)
                replace = {
                    str(work): "/workspace",
                    str(user_home): "/home/user",
                    KEY: "sk-test",
                    f"127.0.0.1:{recorder.port}": "127.0.0.1:8080",
                    f"127.0.0.1:{port}": "127.0.0.1:8080",
                }
                data = fixture(client, version, cmd, recorder.exchanges, replace)
                target = args.record / f"{client}.json"
                target.with_suffix(".partial").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
                target.with_suffix(".partial").replace(target)
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(user_home, ignore_errors=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"\n{'client':15}{'version':12}{'requests':>9}{'calls':>7}{'answered':>10}  result")
    for r in rows:
        print(
            f"{r['client']:15}{r['version']:12}{r.get('requests', 0):9}{r.get('calls', 0):7}"
            f"{r.get('calls_answered', 0):10}  {r['result']}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
