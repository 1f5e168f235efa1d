#!/usr/bin/env python3
"""Time to first token: load a model in the Engine (as `flashmoe chat` does), then send the same
short chat prompt a few times and print how long each first token took.

The first request pays for what loading leaves lazy (numba kernels read from their disk cache,
first MLX graphs); the later ones show the steady state. Every request runs in a new session, so
each prefills the whole prompt (a conversation's next turn would reuse its prefix and be faster).

    python benchmarks/ttft.py                 # the demo model (built on first use)
    python benchmarks/ttft.py -m MODEL --requests 5 --kernels mlx
    python benchmarks/ttft.py --tools         # a tools turn: the agent's system prompt and built-in tools
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_common import cpu_model, source_revision  # noqa: E402


def plain_turn(eng, prompt: str, i: int) -> tuple[float, int]:
    from flashmoe.engine import TokenGenerated
    from flashmoe.engine.runtime.generate import GenerationRequest

    t = time.perf_counter()
    first = prompt_tokens = None
    request = GenerationRequest(messages=[{"role": "user", "content": prompt}], max_tokens=1, timing="off")
    for ev in eng.submit(request, session=f"ttft-{i}"):
        if isinstance(ev, TokenGenerated) and first is None:
            first = time.perf_counter() - t
        prompt_tokens = getattr(ev, "prompt_tokens", prompt_tokens)
    return first, prompt_tokens


def tools_turn(eng, prompt: str, i: int) -> tuple[float, int]:
    """The first token of a tools turn as `flashmoe run --tools builtin PROMPT` asks for it (the
    flags as the CLI parses them, a fresh conversation each time)."""
    from flashmoe.cli.agent_cli import ToolOptions, make_loop
    from flashmoe.cli.chat import ChatSession
    from flashmoe.cli.cli import build_parser
    from flashmoe.engine import GenerationFinished, TokenGenerated
    from flashmoe.tools.policy import NonInteractiveApprover

    args = build_parser().parse_args(["run", "--tools", "builtin", "--max-tokens", "1", prompt])
    seen: dict = {}
    t = time.perf_counter()

    def on_event(ev):
        if isinstance(ev, TokenGenerated) and "first" not in seen:
            seen["first"] = time.perf_counter() - t
            loop.cancel()  # the first token is all this measures
        if isinstance(ev, GenerationFinished):
            seen.setdefault("prompt_tokens", ev.prompt_tokens)

    loop = make_loop(
        ToolOptions.from_args(args),
        ChatSession(eng, cid=f"ttft-tools-{i}"),
        eng.loaded_info.chat_template,
        NonInteractiveApprover(),
        on_event,
    )
    loop.run_turn(prompt)
    return seen["first"], seen.get("prompt_tokens")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", help="model folder (default: the demo model)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--kernels", default="auto", choices=("auto", "mlx", "cpu", "cpu-int8"))
    p.add_argument(
        "--tools",
        action="store_true",
        help="send each prompt as `flashmoe run --tools builtin` does: through the AgentLoop, with "
        "the built-in tools' instructions in the prompt",
    )
    p.add_argument(
        "--saved-prefixes",
        action="store_true",
        help="with prompt caches saved to a fresh folder (as chat and serve keep them in "
        "FLASHMOE_HOME/kv): each new conversation starts from the prefix the last one saved",
    )
    args = p.parse_args()

    from flashmoe.engine import ModelLoaded
    from flashmoe.engine.formats.demo import ensure_demo
    from flashmoe.engine.runtime.engine import Engine

    model = Path(args.model) if args.model else ensure_demo()
    t0 = time.perf_counter()
    import tempfile

    kv = tempfile.mkdtemp(prefix="fm-ttft-kv-") if args.saved_prefixes else None
    eng = Engine(model, kernels=args.kernels, prompt_cache_dir=kv)
    info = eng.wait_loaded()
    load_s = time.perf_counter() - t0
    assert isinstance(info, ModelLoaded)
    print(f"model   : {model} ({info.model_type}, {info.bits}-bit, K={info.top_k}, kernels {info.kernels})")
    print(f"machine : {cpu_model()}; flashmoe {source_revision()}")
    print(f"load    : {load_s:.2f} s")
    for i in range(args.requests):
        prompt = args.prompt if i == 0 else f"{args.prompt} (question {i + 1})"  # a new question each time
        first, prompt_tokens = (tools_turn if args.tools else plain_turn)(eng, prompt, i)
        print(
            f"request {i + 1}: first token after {first:.3f} s ({prompt_tokens} prompt tokens"
            f"{', built-in tools' if args.tools else ''}, "
            f"{'first request after load' if i == 0 else 'prefix from the saved cache' if kv else 'full prefill again'})"
        )
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
