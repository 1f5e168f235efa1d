"""`flashmoe serve` against `flashmoe run` on the same model and prompt, and the prefix cache on a
10-turn conversation, in one sitting.

    python benchmarks/serve_bench.py [-m MODEL] [--tokens 32] [--turns 10]

Prints time to first token and decode tok/s through the server (the openai SDK, streaming, as a
client sees them) beside `flashmoe run --json` (its own events, after the model is loaded), and the
prefill of each turn of a resent conversation with the prompt cache and without it (a second
server with --prompt-cache 0 --disk-cache 0). Greedy; every figure with its conditions.
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
    cmd = [sys.executable, "-m", "flashmoe.cli", "serve", "--port", str(port), *extra] + (["-m", model] if model else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, FLASHMOE_HOME=home))
    for line in proc.stderr:
        if "serving" in line:
            return proc, f"http://127.0.0.1:{port}/v1"
    raise SystemExit(f"the server did not start: {proc.wait()}")


def stream_once(client, model: str, messages, tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    usage = None
    for c in client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0,
                                            stream=True):
        if c.choices and c.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            n += 1
        if not c.choices:
            usage = c
    d = usage.model_extra["flashmoe"]
    return {"ttft_s": (first or time.perf_counter()) - t0, "decode_tps": (n - 1) / (last - first) if n > 1 else 0.0,
            "prompt_tokens": usage.usage.prompt_tokens, "cached": usage.usage.prompt_tokens_details.cached_tokens,
            "prefill_s": d["prefill_s"], "conditions": d, "engine_tps": d["decode_tok_per_s"], "text": "", "tokens": usage.usage.completion_tokens}


def run_cli(model: str | None, tokens: int, home: str) -> dict:
    cmd = [sys.executable, "-m", "flashmoe.cli", "run", "--json", "--temp", "0", "--max-tokens", str(tokens), "-n",
           *(["-m", model] if model else []), PROMPT]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=None, help="model folder (default: the demo)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=10)
    args = ap.parse_args()
    import openai

    home = os.environ.get("FLASHMOE_HOME") or tempfile.mkdtemp()
    kv_home = tempfile.mkdtemp()  # the server's disk caches start empty
    for sub in ("models", "downloads"):
        src = os.path.join(home, sub)
        if os.path.isdir(src):
            os.symlink(src, os.path.join(kv_home, sub))
    name = "demo" if not args.model else os.path.basename(args.model.rstrip("/"))
    ref = run_cli(args.model, args.tokens, home)
    proc, url = start(args.model, home=kv_home)
    try:
        c = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
        first = stream_once(c, name, [{"role": "user", "content": PROMPT}], args.tokens)
        served = stream_once(c, name, [{"role": "user", "content": PROMPT}], args.tokens)
        cond = served["conditions"]
        print(f"model {name}, {cond['bits']}-bit, K={cond['experts_per_token']} of {cond['experts']}, "
              f"{cond['cache_state']} expert cache, hit rate {cond['hit_rate']:.2f}, "
              f"{cond['bytes_read_per_token']} B read per token, greedy, {args.tokens} tokens")
        print(f"{'':28}{'ttft s':>9}{'decode tok/s':>14}{'prompt tok':>12}")
        print(f"{'flashmoe run --json (fresh)':28}{ref['ttft_s']:9.3f}{ref['decode_tps']:14.2f}{ref['prompt_tokens']:12d}")
        print(f"{'serve, first request':28}{first['ttft_s']:9.3f}{first['decode_tps']:14.2f}{first['prompt_tokens']:12d}"
              f"   (engine: {first['engine_tps']:.2f} tok/s)")
        print(f"{'serve, same prompt again':28}{served['ttft_s']:9.3f}{served['decode_tps']:14.2f}"
              f"{served['prompt_tokens']:12d}")
        print(f"{'':28}(engine: {served['engine_tps']:.2f} tok/s, as the server's usage reports it)")
        print(f"ratio serve (first request) / run: ttft {first['ttft_s'] / ref['ttft_s']:.2f}x, "
              f"decode {first['decode_tps'] / ref['decode_tps']:.2f}x (both a fresh process's first request)")
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
        print(f"{i:4d}{a['prompt_tokens']:12d}{a['cached']:8d}{a['prefill_s']:11.3f}{b['prefill_s']:21.3f}"
              f"{b['prefill_s'] / a['prefill_s'] if a['prefill_s'] else 0:8.1f}x")


def conversation(client, name: str, turns: int, tokens: int) -> list[dict]:
    history = [{"role": "system", "content": "You are a helpful assistant who answers briefly."}]
    rows = []
    for i in range(turns):
        history.append({"role": "user", "content": f"Question {i + 1}: name a colour and a fruit, please."})
        r = client.chat.completions.create(model=name, messages=history, max_tokens=tokens, temperature=0)
        rows.append({"prompt_tokens": r.usage.prompt_tokens, "cached": r.usage.prompt_tokens_details.cached_tokens,
                     "prefill_s": r.model_extra["flashmoe"]["prefill_s"]})
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    return rows


if __name__ == "__main__":
    main()
