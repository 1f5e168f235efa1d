"""`flashmoe serve` against `flashmoe run` on the same model and prompt, and the prefix cache on a
10-turn conversation, in one sitting.

    python benchmarks/serve_bench.py [-m MODEL] [--tokens 32] [--turns 10]
    python benchmarks/serve_bench.py --agent-sessions [-m MODEL]

Prints time to first token and decode tok/s through the server (the openai SDK, streaming, as a
client sees them) beside `flashmoe run --json` (its own events, after the model is loaded), and the
prefill of each turn of a resent conversation with the prompt cache and without it (a second
server with --prompt-cache 0 --disk-cache 0). Greedy; every figure with its conditions.

--agent-sessions: what a prompt-cache hit costs across coding-agent sessions. Sessions that
share a long system prompt and tools (Claude Code's recorded first request, tests/fixtures/agents/
claude.json, its per-prompt billing block differing in each) each send a new task; each session's
time to first token, streamed as a client sees it, against the prefill of its new tokens alone
(the engine's prefill_s) and against a short prompt of as many new tokens: the difference is what
the hit itself costs (finding and copying the cached prefix, rendering the longer prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

PROMPT = "Explain in a few sentences why the sky is blue."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str | None, *extra: str, home: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "flashmoe.cli", "serve", "--port", str(port), *extra] + (
        ["-m", model] if model else []
    )
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=dict(os.environ, FLASHMOE_HOME=home)
    )
    for line in proc.stderr:
        if "serving" in line:
            return proc, f"http://127.0.0.1:{port}/v1"
    raise SystemExit(f"the server did not start: {proc.wait()}")


def stream_once(client, model: str, messages, tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    usage = None
    for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=tokens, temperature=0, stream=True
    ):
        if c.choices and c.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            n += 1
        if not c.choices:
            usage = c
    d = usage.model_extra["flashmoe"]
    return {
        "ttft_s": (first or time.perf_counter()) - t0,
        "decode_tps": (n - 1) / (last - first) if n > 1 else 0.0,
        "prompt_tokens": usage.usage.prompt_tokens,
        "cached": usage.usage.prompt_tokens_details.cached_tokens,
        "prefill_s": d["prefill_s"],
        "conditions": d,
        "engine_tps": d["decode_tok_per_s"],
        "text": "",
        "tokens": usage.usage.completion_tokens,
    }


def run_cli(model: str | None, tokens: int, home: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "flashmoe.cli",
        "run",
        "--json",
        "--temp",
        "0",
        "--max-tokens",
        str(tokens),
        "-n",
        *(["-m", model] if model else []),
        PROMPT,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, FLASHMOE_HOME=home))
    t_loaded = first = None
    done = None
    for line in proc.stdout:
        ev = json.loads(line)
        now = time.perf_counter()
        if ev["event"] == "loaded":
            t_loaded = now
        elif ev["event"] == "token" and first is None:
            first = now
        elif ev["event"] == "done":
            done = ev
    proc.wait()
    return {"ttft_s": first - t_loaded, "decode_tps": done["generation_tps"], "prompt_tokens": done["prompt_tokens"]}


def agent_sessions(model: str | None, home: str, sessions: int = 4) -> None:
    """See the module docstring (--agent-sessions)."""
    import httpx

    fixture = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "agents", "claude.json")
    with open(fixture, encoding="utf-8") as f:
        first = next(e for e in json.load(f)["exchanges"] if e["method"] == "POST")["body"]
    proc, url = start(model, home=home)
    base = url[:-3]
    rows = []
    try:
        for i in range(sessions + 1):
            body = json.loads(json.dumps(first))
            body.update(max_tokens=1, stream=True, temperature=0, model="demo")
            body.pop("thinking", None)
            body["system"][0]["text"] = (
                f"x-anthropic-billing-header: cc_version=2.1.197.{i:03x}; cc_entrypoint=sdk-cli;"
            )
            task = (
                f"Session {i}: list the files and say which of them is the largest." if i < sessions else "Say hello."
            )
            if i == sessions:  # the short prompt: about as many new tokens, nothing cached to share
                body = {
                    "model": "demo",
                    "max_tokens": 1,
                    "stream": True,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": f"A prompt of its own {i}: " + task * 2}],
                }
            else:
                body["messages"] = [{"role": "user", "content": task}]
            time.sleep(2.0)  # as an agent runs its tools between requests: the last reply's cache is saved by now
            t0 = time.perf_counter()
            first_byte = first_text = None
            done = None
            with httpx.stream(
                "POST", f"{base}/v1/messages", json=body, timeout=600, headers={"anthropic-version": "2023-06-01"}
            ) as r:
                for line in r.iter_lines():
                    now = time.perf_counter()
                    first_byte = first_byte or now
                    if line.startswith("data: ") and '"content_block_delta"' in line:
                        first_text = first_text or now
                    if line.startswith("data: ") and '"message_delta"' in line:
                        done = json.loads(line[6:])
            use = done["usage"]
            rows.append(
                {
                    "session": i,
                    "ttft_s": (first_text or time.perf_counter()) - t0,
                    "prefill_s": done["flashmoe"]["prefill_s"],
                    "new": use["input_tokens"],
                    "cached": use["cache_read_input_tokens"],
                }
            )
    finally:
        proc.terminate()
        proc.wait()
    print(f"{'session':>8}{'cached':>8}{'new tok':>9}{'ttft s':>9}{'prefill s':>11}{'ttft - prefill':>16}")
    for r in rows:
        label = "short" if r["session"] == sessions else str(r["session"])
        print(
            f"{label:>8}{r['cached']:8d}{r['new']:9d}{r['ttft_s']:9.3f}{r['prefill_s']:11.3f}"
            f"{r['ttft_s'] - r['prefill_s']:16.3f}"
        )
    short = rows[-1]["ttft_s"] - rows[-1]["prefill_s"]
    hits = [r["ttft_s"] - r["prefill_s"] for r in rows[1:-1]]
    print(
        f"a hit's cost beyond its new tokens' prefill: {min(hits) * 1e3:.0f}-{max(hits) * 1e3:.0f} ms "
        f"(a short uncached prompt's: {short * 1e3:.0f} ms); the hit itself: "
        f"{(sum(hits) / len(hits) - short) * 1e3:.0f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None, help="model folder (default: the demo)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--agent-sessions", action="store_true", help="what a prompt-cache hit costs across sessions")
    args = ap.parse_args()
    import openai

    home = os.environ.get("FLASHMOE_HOME") or tempfile.mkdtemp()
    kv_home = tempfile.mkdtemp()  # the server's disk caches start empty
    for sub in ("models", "downloads"):
        src = os.path.join(home, sub)
        if os.path.isdir(src):
            os.symlink(src, os.path.join(kv_home, sub))
    if args.agent_sessions:
        agent_sessions(args.model, kv_home)
        return
    name = "demo" if not args.model else os.path.basename(args.model.rstrip("/"))
    ref = run_cli(args.model, args.tokens, home)
    proc, url = start(args.model, home=kv_home)
    try:
        c = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
        first = stream_once(c, name, [{"role": "user", "content": PROMPT}], args.tokens)
        served = stream_once(c, name, [{"role": "user", "content": PROMPT}], args.tokens)
        cond = served["conditions"]
        print(
            f"model {name}, {cond['bits']}-bit, K={cond['experts_per_token']} of {cond['experts']}, "
            f"{cond['cache_state']} expert cache, hit rate {cond['hit_rate']:.2f}, "
            f"{cond['bytes_read_per_token']} B read per token, greedy, {args.tokens} tokens"
        )
        print(f"{'':28}{'ttft s':>9}{'decode tok/s':>14}{'prompt tok':>12}")
        print(
            f"{'flashmoe run --json (fresh)':28}{ref['ttft_s']:9.3f}{ref['decode_tps']:14.2f}{ref['prompt_tokens']:12d}"
        )
        print(
            f"{'serve, first request':28}{first['ttft_s']:9.3f}{first['decode_tps']:14.2f}{first['prompt_tokens']:12d}"
            f"   (engine: {first['engine_tps']:.2f} tok/s)"
        )
        print(
            f"{'serve, same prompt again':28}{served['ttft_s']:9.3f}{served['decode_tps']:14.2f}"
            f"{served['prompt_tokens']:12d}"
        )
        print(f"{'':28}(engine: {served['engine_tps']:.2f} tok/s, as the server's usage reports it)")
        print(
            f"ratio serve (first request) / run: ttft {first['ttft_s'] / ref['ttft_s']:.2f}x, "
            f"decode {first['decode_tps'] / ref['decode_tps']:.2f}x (both a fresh process's first request)"
        )
        rows = conversation(c, name, args.turns, args.tokens)
    finally:
        proc.terminate()
        proc.wait()
    proc, url = start(args.model, "--prompt-cache", "0", "--disk-cache", "0", home=kv_home)
    try:
        bare = conversation(openai.OpenAI(base_url=url, api_key="-", max_retries=0), name, args.turns, args.tokens)
    finally:
        proc.terminate()
        proc.wait()
    print(f"\n{args.turns}-turn conversation, resent whole each turn ({args.tokens} tokens a reply):")
    print(f"{'turn':>4}{'prompt tok':>12}{'cached':>8}{'prefill s':>11}{'no cache: prefill s':>21}{'ratio':>8}")
    for i, (a, b) in enumerate(zip(rows, bare), 1):
        print(
            f"{i:4d}{a['prompt_tokens']:12d}{a['cached']:8d}{a['prefill_s']:11.3f}{b['prefill_s']:21.3f}"
            f"{b['prefill_s'] / a['prefill_s'] if a['prefill_s'] else 0:8.1f}x"
        )


def conversation(client, name: str, turns: int, tokens: int) -> list[dict]:
    history = [{"role": "system", "content": "You are a helpful assistant who answers briefly."}]
    rows = []
    for i in range(turns):
        history.append({"role": "user", "content": f"Question {i + 1}: name a colour and a fruit, please."})
        r = client.chat.completions.create(model=name, messages=history, max_tokens=tokens, temperature=0)
        rows.append(
            {
                "prompt_tokens": r.usage.prompt_tokens,
                "cached": r.usage.prompt_tokens_details.cached_tokens,
                "prefill_s": r.model_extra["flashmoe"]["prefill_s"],
            }
        )
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    return rows


if __name__ == "__main__":
    main()
