"""`flashmoe`: argument parsing, dispatch to the command's module, and the mapping from
failures to one-line errors and exit codes. Nothing else lives here: no front-end module
imports this one back.

Heavy imports (MLX, the engine) happen inside the commands, so `--help` and usage errors are fast.
"""

from __future__ import annotations

import argparse
import os
import sys

from flashmoe.engine.options import IO_THREADS

from . import __version__, argtypes
from .agent_cli import add_tool_options
from .argtypes import at_least, output_file, parse_size
from .config import (
    CACHE_POLICY_CHOICES,
    DTYPE_CHOICES,
    KERNEL_CHOICES,
    KV_CACHE_CHOICES,
    PREFETCH_CHOICES,
    THINKING_CHOICES,
    TIMING_CHOICES,
    TRUNCATE_CHOICES,
    ConfigError,
)
from .errors import UsageError, error, quiet_broken_pipe
from .exit_codes import ExitCode
from .store import StoreError

EPILOG = """exit codes: 0 ok, 1 generation failure, 2 usage, 3 model load or I/O, 4 timeout,
5 a tool call needed approval and did not get it, 130 interrupted, 143 / 129 stopped by SIGTERM / SIGHUP"""


S = argparse.SUPPRESS  # settings flags default to "not given", so config and env can fill them


def _add_engine_options(p: argparse.ArgumentParser, k_list: bool = False, usage: bool = True) -> None:
    """How the engine loads and streams: shared by run, chat, agent and the benchmarks
    (k_list: --experts-per-token takes a list, N,N,..., for benchmarks that compare K; usage:
    --expert-usage, for the commands that keep a usage file, not the speed and cache benchmarks,
    which measure cold and warm caches themselves)."""
    p.add_argument(
        "--expert-cache",
        type=parse_size,
        default=S,
        metavar="SIZE",
        help="byte budget of the expert cache, e.g. 2GB, 512MB; 0 keeps only what the "
        "current token needs (default: what the memory this process may use leaves after the "
        "resident weights, the KV cache, the kernels and a margin: cgroup limit, MemAvailable, "
        "rlimits; `flashmoe info` prints it)",
    )
    p.add_argument(
        "--ctx-size",
        type=at_least(256),
        default=S,
        metavar="N",
        help="the longest prompt and reply, in tokens, the KV cache gets room for (default: the "
        "model's context where the memory budget has room, else what a quarter of it holds)",
    )
    p.add_argument(
        "--cache-policy",
        choices=CACHE_POLICY_CHOICES,
        default=S,
        help="which cached expert a miss evicts: lfu (default), the least often used, or lru, the least recently used",
    )
    p.add_argument(
        "--direct-io",
        action="store_const",
        const=True,
        default=None,
        help="read experts with O_DIRECT, and fail where the file system cannot (default: O_DIRECT "
        "wherever it can, else through the page cache)",
    )
    p.add_argument(
        "--buffered-io", dest="direct_io", action="store_const", const=False, help="read experts through the page cache"
    )
    p.add_argument(
        "--io-threads", type=at_least(1), default=S, metavar="N", help=f"parallel expert reads (default {IO_THREADS})"
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=S,
        help="float32 widens 16-bit weights and scales (much faster on MLX's CPU backend); "
        "auto (default): float32 on CPU, keep elsewhere",
    )
    p.add_argument(
        "--kernels",
        choices=KERNEL_CHOICES,
        default=S,
        help="quantized matmul kernels: cpu (numba, many times faster than MLX's CPU path), "
        "mlx, or auto (default: cpu when MLX runs on the CPU)",
    )
    p.add_argument(
        "--kv-cache",
        choices=KV_CACHE_CHOICES,
        default=S,
        help="the CPU kernels' KV cache: float32 (default: exact, the same tokens as mlx-lm) or "
        "float16 (as llama.cpp keeps it: half the bytes a decode step reads from it, not exact)",
    )
    p.add_argument(
        "--prefetch",
        choices=PREFETCH_CHOICES,
        default=S,
        help="while a layer computes, guess the next layer's experts from its router: slots "
        "reads them into the expert cache, hint asks the kernel to bring them into the page "
        "cache, off (default: both measured slower, docs/speed.md)",
    )
    p.add_argument(
        "--no-verify-reads",
        dest="verify_reads",
        action="store_const",
        const="off",
        default=S,
        help="do not check each expert against the manifest's CRC-32 the first time it is read "
        "(setting verify_reads = on|off; default on; cost: `flashmoe bench speed`)",
    )
    if usage:
        p.add_argument(
            "--expert-usage",
            choices=("on", "off"),
            default=S,
            help="on (default): count which experts this model's runs ask for, in expert-usage.json "
            "beside the model (else under FLASHMOE_HOME/usage), and read the most used into the "
            "expert cache at start; off: neither (setting expert_usage)",
        )
    if k_list:
        p.add_argument(
            "--experts-per-token",
            dest="experts_per_token_list",
            type=argtypes.lengths,
            default=None,
            metavar="N,N,...",
            help="measure each model routed to each of these numbers of experts per token "
            "(default: the number it was trained with)",
        )
    else:
        p.add_argument(
            "--experts-per-token",
            type=at_least(1),
            default=None,
            metavar="N",
            help="route each token to N experts instead of the number the model was trained with "
            "(fewer: less to read per token, at a cost in quality; the summary says K=N of TRAINED)",
        )
    p.add_argument(
        "--disk-cache",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="room for prompt caches saved under FLASHMOE_HOME/kv, so a resumed conversation or a "
        "restarted server does not run its prompt again (default 8GB for chat, serve, agent "
        "and run --tools, whose tool instructions repeat; 0 (none) for a plain run and the benchmarks)",
    )
    p.add_argument(
        "--allow-resident-experts",
        action="store_true",
        help="load a model whose experts cannot stream (its expert blocks are not mlx-lm switch "
        "layers) with every expert in memory; without it such a model fails to load",
    )


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """Options shared by run, chat and agent; their defaults come from config.py."""
    p.add_argument(
        "-m",
        "--model",
        metavar="MODEL",
        default=S,
        help="model folder (flashmoe or mlx-lm), or org/name[@revision] from the Hugging Face cache "
        "(see `flashmoe pull`); default: the built-in demo model, built on first use",
    )
    p.add_argument("-s", "--system", default=S, help="system prompt")
    p.add_argument("--max-tokens", type=at_least(1), default=S, metavar="N", help="default 512")
    p.add_argument(
        "--temp",
        type=argtypes.temperature,
        default=S,
        metavar="T",
        help="temperature, at least 0; 0 is greedy (default 0)",
    )
    p.add_argument("--top-p", type=argtypes.top_p, default=S, metavar="P", help="in (0, 1]; default 1.0")
    p.add_argument("--top-k", type=at_least(0), default=S, metavar="K", help="default 0 (off)")
    p.add_argument("--min-p", type=argtypes.min_p, default=S, metavar="P", help="in [0, 1]; default 0 (off)")
    p.add_argument(
        "--repetition-penalty",
        type=argtypes.repetition_penalty,
        default=S,
        metavar="R",
        help="greater than 0; default 1.0 (off)",
    )
    p.add_argument("--seed", type=int, default=S, help="sampling seed (default: a fresh one each run)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument(
        "--timing",
        choices=TIMING_CHOICES,
        default=S,
        help="step (default): host-side figures only; layer: per-layer breakdown (adds syncs)",
    )
    _add_engine_options(p)
    p.add_argument(
        "--thinking",
        choices=THINKING_CHOICES,
        default=S,
        help="reasoning on or off, through the chat template's own switch (enable_thinking); "
        "default: the template's default. Said when the template has no such switch",
    )
    p.add_argument(
        "--truncate-prompt",
        choices=TRUNCATE_CHOICES,
        default=S,
        help="a prompt longer than the model's context: off (default) refuses it (exit 2), left "
        "drops its oldest tokens to leave room for the reply, and says so on stderr",
    )
    p.add_argument(
        "-c", "--continue", dest="continue_", action="store_true", help="continue the most recent conversation"
    )
    p.add_argument("--cid", metavar="ID", help="continue the conversation with this id (see `flashmoe logs`)")
    p.add_argument("-n", "--no-log", action="store_true", help="do not save this conversation")
    p.add_argument("--engine", choices=("real", "fake"), default="real", help=argparse.SUPPRESS)


TEXT_FLAGS = {"system": "--system", "stop": "--stop", "cid": "--cid"}  # the prompt: headless.read_prompt
TUI_FPS = 20  # the TUI's frames a second (cmd_chat says why)


def decode_text_flags(args) -> None:
    """argv holds bytes that are not UTF-8 as lone surrogates, which no save or tokenizer takes:
    text flags get U+FFFD (said once per flag). Paths (--model, --workspace...) keep their bytes."""
    from .utf8 import scrub, warn

    for name, flag in TEXT_FLAGS.items():
        value = getattr(args, name, None)
        values = value if isinstance(value, list) else [value] if isinstance(value, str) else []
        clean = [scrub(v) for v in values]
        if clean != values:
            warn(flag)
            setattr(args, name, clean if isinstance(value, list) else clean[0])


def apply_settings(args) -> None:
    """defaults < config file < FLASHMOE_* < flags: fill args with the merged settings."""
    from .config import SETTINGS, load_settings

    explicit = {k: getattr(args, k) for k in SETTINGS if hasattr(args, k)}
    for k, v in load_settings(explicit).items():
        setattr(args, k, v)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashmoe",
        description="Run Mixture-of-Experts models bigger than memory, streaming experts from disk.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flashmoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="generate one reply (stdin and/or PROMPT in, answer on stdout)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("prompt", nargs="?", help="the prompt; piped stdin comes first, then a blank line, then this")
    run.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    run.add_argument(
        "--json",
        action="store_true",
        help="one JSON event per line on stdout (reasoning text as its own 'reasoning' events)",
    )
    run.add_argument(
        "--show-reasoning",
        action="store_true",
        help="also print the model's reasoning on stdout, before the answer, between lines "
        "'<think>' and '</think>' (default: the answer only)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop the reply after this long (model loading included) and exit 4",
    )
    _add_model_options(run)
    add_tool_options(run)

    chat = sub.add_parser(
        "chat",
        help="chat in the terminal (TUI; a line REPL with --no-tui or TERM=dumb)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument("--no-tui", action="store_true", help="plain line REPL instead of the full-screen app")
    _add_model_options(chat)
    add_tool_options(chat)

    agent = sub.add_parser(
        "agent",
        help="run a scripted tool-using session unattended",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    agent.add_argument(
        "--script",
        required=True,
        metavar="FILE",
        help='session.jsonl: {"role": "user", "content": "..."} per line ("-": stdin)',
    )
    agent.add_argument("--transcript", type=output_file, metavar="FILE", help="every event as JSON lines")
    agent.add_argument(
        "--approve",
        choices=("ask", "auto", "never"),
        default="ask",
        help="ask (on the terminal; fails closed without one), auto (reads and writes; "
        "never commands), never (declined, the model is told)",
    )
    _add_model_options(agent)
    add_tool_options(agent)

    bench = sub.add_parser("bench", help="benchmarks that print every figure with its conditions")
    bench_sub = bench.add_subparsers(dest="bench", metavar="WHAT", required=True)
    bt = bench_sub.add_parser("tools", help="tool-call reliability per model and constrained-decoding mode")
    bt.add_argument(
        "-m",
        "--model",
        dest="models",
        action="append",
        metavar="MODEL",
        help="model folder or org/name[@revision] in the Hugging Face cache (repeat for several "
        "bit widths; default: the demo model)",
    )
    bt.add_argument(
        "--constrain-modes",
        default="tools",
        metavar="MODES",
        help="comma-separated: off, tools, required (default tools, as --constrain)",
    )
    bt.add_argument("--out", type=output_file, metavar="FILE", help="write the results as JSON")
    bt.add_argument("--max-tokens", type=at_least(1), default=96, metavar="N", help="per reply (default 96)")
    bt.add_argument(
        "--max-repairs", type=at_least(0), default=2, metavar="N", help="repair rounds for bad calls (default 2)"
    )
    bt.add_argument(
        "--temp",
        type=argtypes.temperature,
        default=S,
        metavar="T",
        help="temperature, at least 0; 0 is greedy (default 0)",
    )
    bt.add_argument("--seed", type=int, default=S, help="sampling seed")
    _add_engine_options(bt)
    bt.add_argument("--engine", choices=("real", "fake"), default="real", help=argparse.SUPPRESS)

    bs = bench_sub.add_parser("speed", help="prefill and decode speed, warm and cold, against the disk's limit")
    bs.add_argument(
        "-m",
        "--model",
        metavar="MODEL",
        default=S,
        help="model folder or org/name[@revision] in the Hugging Face cache (default: the demo model)",
    )
    bs.add_argument(
        "--prompt-tokens", type=at_least(1), default=64, metavar="N", help="prompt length in tokens (default 64)"
    )
    bs.add_argument("--tokens", type=at_least(1), default=32, metavar="N", help="generated per run (default 32)")
    bs.add_argument(
        "--rounds",
        type=at_least(1),
        default=1,
        metavar="N",
        help="repeat warm and cold this many times, alternating (default 1)",
    )
    bs.add_argument("--cold-only", action="store_true", help="skip the warm runs")
    bs.add_argument(
        "--prompt-lengths",
        type=argtypes.lengths,
        default=None,
        metavar="N,N,...",
        help="also measure prefill at each of these prompt lengths and decode after it, warm "
        "(e.g. 128,1k,4k), as a table and in --out's JSON under 'scaling'",
    )
    bs.add_argument(
        "--no-page-cache",
        action="store_true",
        help="also run cold with the page cache dropped before every token (a model larger than RAM)",
    )
    bs.add_argument("--skip-disk", action="store_true", help="do not measure the disk")
    bs.add_argument("--out", type=output_file, metavar="FILE", help="write the results as JSON")
    _add_engine_options(bs, usage=False)

    bc = bench_sub.add_parser(
        "cache",
        help="routing on real text, and LRU / LFU against Belady's optimum "
        "over the recorded trace, at a range of cache sizes",
    )
    bc.add_argument(
        "-m",
        "--model",
        metavar="MODEL",
        default=S,
        help="model folder or org/name[@revision] in the Hugging Face cache (default: the demo model)",
    )
    bc.add_argument(
        "--text",
        metavar="FILE",
        default=None,
        help="UTF-8 text to route (default: the demo's held-out text, pydoc pages)",
    )
    bc.add_argument(
        "--tokens",
        type=at_least(2),
        default=256,
        metavar="N",
        help="tokens of it to feed, one at a time as in decoding (default 256)",
    )
    bc.add_argument(
        "--slots",
        type=argtypes.lengths,
        default=None,
        metavar="N,N,...",
        help="cache sizes to replay, in slots per MoE layer (default: K up to every expert)",
    )
    bc.add_argument("--out", type=output_file, metavar="FILE", help="write the results as JSON")
    _add_engine_options(bc, usage=False)

    bq = bench_sub.add_parser(
        "quality", help="perplexity and KL from a reference per model and K, beside bytes read per token and speed"
    )
    bq.add_argument(
        "-m",
        "--model",
        dest="models",
        action="append",
        metavar="MODEL",
        help="model folder or org/name[@revision] (repeat to compare bit widths; default: the demo)",
    )
    bq.add_argument(
        "--reference",
        metavar="MODEL",
        default=None,
        help="the model KL is measured from (default: the first -m, at the first K)",
    )
    bq.add_argument(
        "--text",
        metavar="FILE",
        default=None,
        help="UTF-8 text to score (default: the demo's held-out text, pydoc pages)",
    )
    bq.add_argument(
        "--tokens", type=at_least(1), default=1024, metavar="N", help="tokens of it to score (default 1024)"
    )
    bq.add_argument(
        "--tools",
        metavar="FILE",
        default=None,
        help="a `flashmoe bench tools --out` file: its valid-call rates join the table",
    )
    bq.add_argument("--out", type=output_file, metavar="FILE", help="write the results as JSON")
    _add_engine_options(bq, k_list=True, usage=False)

    serve = sub.add_parser(
        "serve",
        help="serve the model over HTTP: OpenAI- and Anthropic-compatible API",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "-m",
        "--model",
        metavar="MODEL",
        default=S,
        help="model folder, or org/name[@revision] from the Hugging Face cache (default: the demo)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free one)")
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        action="append",
        default=[],
        help="require this key on every request (Authorization: Bearer KEY, or x-api-key); "
        "repeatable, each key its own tenant of the prompt caches. Other local users see it "
        "in /proc/PID/cmdline and ps: prefer FLASHMOE_API_KEY or --api-key-file",
    )
    serve.add_argument(
        "--api-key-file",
        metavar="FILE",
        action="append",
        default=[],
        help="take the keys in FILE, one a line (# starts a comment; repeatable)",
    )
    serve.add_argument(
        "--tenant-header",
        metavar="NAME",
        default=None,
        help="keep the prompt caches of requests apart by this header's value as well as by key "
        "(set it in a proxy that authenticates users: a client can send any value)",
    )
    serve.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="also answer requests whose Host header is NAME (default: only the --host address; "
        "bound to 0.0.0.0, any IP address; '*': any name). Guards against DNS rebinding",
    )
    serve.add_argument(
        "--max-body",
        type=parse_size,
        default=4 << 20,
        metavar="SIZE",
        help="largest request body (default 4MB; a larger one is refused with 413)",
    )
    serve.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a client has to send a request's headers, and again its body, before "
        "the connection is closed (default 30)",
    )
    serve.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="answer browser requests (CORS) from this origin, e.g. http://localhost:3000 (repeatable; default: none)",
    )
    serve.add_argument(
        "--max-queue",
        type=at_least(1),
        default=16,
        metavar="N",
        help="requests in flight or waiting before new ones are refused with 429 (default 16)",
    )
    serve.add_argument(
        "--max-tokens",
        type=at_least(1),
        default=1024,
        metavar="N",
        help="reply length when a chat request does not say, and the most one may ask for "
        "(more is cut to N and said in x-flashmoe-translated) (default 1024)",
    )
    serve.add_argument(
        "--truncate-prompt",
        choices=TRUNCATE_CHOICES,
        default=S,
        help="a prompt longer than the context: off (default) refuses it (HTTP 400), left drops its oldest tokens",
    )
    serve.add_argument(
        "--prompt-cache",
        type=parse_size,
        default=2 << 30,
        metavar="SIZE",
        help="memory for the caches of recent prompts, reused by requests that resend them (0: none) "
        "(default 2GB, at most a quarter of what the memory budget leaves after the weights and "
        "the KV cache)",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="a model name clients may ask for (repeatable; default: any name is this model)",
    )
    serve.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse (HTTP 400) request fields that would be ignored or translated, instead of "
        "accepting and recording them (see docs/serve.md)",
    )
    serve.add_argument(
        "--keepalive",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds a stream may stay silent (a long prefill, a call being written) before a "
        "keepalive is sent (default 5, at most 10)",
    )
    serve.add_argument(
        "--force-first-call",
        action="store_true",
        help="a conversation's first reply must be a tool call when tools are offered under "
        "tool_choice auto (for models too small to start one, like the demo)",
    )
    serve.add_argument(
        "--temp",
        type=argtypes.temperature,
        default=1.0,
        metavar="T",
        help="temperature of a request that gives none (default 1, the APIs' own; 0 is greedy: "
        "Claude Code and Codex send none, and the demo ends its replies only when greedy)",
    )
    serve.add_argument(
        "--repetition-penalty",
        type=argtypes.repetition_penalty,
        default=1.0,
        metavar="R",
        help="repetition penalty of a request that gives none (default 1.0, off; the demo, "
        "greedy, loops without one: 1.2)",
    )
    _add_engine_options(serve)
    serve.add_argument("--engine", choices=("real", "fake"), default="real", help=argparse.SUPPRESS)

    logs = sub.add_parser("logs", help="list saved conversations, or show one")
    logs.add_argument(
        "action",
        nargs="?",
        choices=("list", "show", "path"),
        default="list",
        help="list (default), show one conversation, or print the file they are saved in",
    )
    logs.add_argument("cid", nargs="?", metavar="ID", help="conversation id for `show` (default: the latest)")
    logs.add_argument("-n", "--count", type=at_least(1), default=20, help="how many to list (default 20)")
    logs.add_argument("--json", action="store_true", help="print as JSON")

    conv = sub.add_parser(
        "convert", help="convert a model (mlx-lm or Hugging Face folder, or .gguf) into a flashmoe folder"
    )
    conv.add_argument(
        "src",
        metavar="SRC",
        help="mlx-lm / Hugging Face model folder, org/name[@revision] in the Hugging Face cache, or a .gguf file",
    )
    conv.add_argument(
        "out", metavar="OUT", help="the flashmoe folder to write (a new path; one already converted is left as it is)"
    )
    conv.add_argument(
        "--bits",
        type=int,
        choices=(2, 3, 4, 5, 6, 8),
        default=None,
        help="quantize to this many bits (default: keep the source's precision)",
    )
    conv.add_argument(
        "--group-size",
        type=int,
        choices=(32, 64, 128),
        default=64,
        help="weights sharing one scale and bias (default 64)",
    )
    conv.add_argument(
        "--expert-bits",
        type=int,
        choices=(2, 3, 4, 5, 6, 8),
        default=None,
        help="bits of the routed experts (default: --bits)",
    )
    conv.add_argument(
        "--layer-bits",
        action="append",
        default=[],
        metavar="LAYERS=BITS",
        help="experts' bits for some layers: 7=8, 3-5=8, first:2=4, last:2=4 (repeatable)",
    )
    conv.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="cast float tensors (and quantization scales) to this type; float32 is "
        "fastest on CPU (default: keep the source's)",
    )
    conv.add_argument(
        "--expert-layout",
        choices=("auto", "mlx", "tiles"),
        default="auto",
        help="how the experts' bytes are ordered: auto (default) stores them in the CPU kernels' "
        "tiles wherever those compute them, so a read lands ready (the MLX kernels put them "
        "back in rows as they land); mlx keeps MLX's rows; tiles fails where a layer cannot",
    )

    info = sub.add_parser("info", help="describe a model folder")
    info.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="model folder (flashmoe or mlx-lm) or org/name[@revision] in the Hugging Face cache; "
        "default: the demo model, built on first use",
    )
    info.add_argument("-m", "--model", dest="model_flag", metavar="MODEL", help="the same as MODEL")
    info.add_argument("--json", action="store_true", help="print the description as JSON")
    info.add_argument(
        "--ctx-size",
        type=at_least(256),
        default=None,
        metavar="N",
        help="plan the memory budget for this context, as run and chat would (default: theirs)",
    )
    info.add_argument(
        "--load",
        action="store_true",
        help="also load the model (its resident weights) and say which code computes each block "
        "as loaded: MLX, the CPU kernels, or a fused CPU block",
    )
    info.add_argument(
        "--kernels",
        choices=KERNEL_CHOICES,
        default="auto",
        help="with --load: the kernels to load with, as run/chat take them (default auto)",
    )

    ver = sub.add_parser("verify", help="check every expert block against the manifest's checksums")
    ver.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="model folder (flashmoe or mlx-lm) or org/name[@revision] in the Hugging Face cache; "
        "default: the demo model, built on first use",
    )
    ver.add_argument("-m", "--model", dest="model_flag", metavar="MODEL", help="the same as MODEL")

    pull = sub.add_parser("pull", help="download a model from the Hugging Face Hub into its cache (for -m org/name)")
    pull.add_argument(
        "repo",
        metavar="ORG/NAME[@REVISION]",
        help="the model's Hub id, optionally @branch, tag or commit (default: main)",
    )

    demo = sub.add_parser(
        "demo", help="build the demo model (SmolLM2-135M carved into 16 experts, 8 per token) and print its path"
    )
    demo.add_argument("--rebuild", action="store_true", help="build it again from the GGUF")
    return parser


def entry() -> int:
    """The `flashmoe` command (and `python -m flashmoe.cli`): main() in a process of its own."""
    # flashmoe never runs torch, but mlx-lm imports transformers, which imports torch whole when
    # it is installed (the test extra installs it): 1.5 of the 3 s each start spent importing.
    # A None in sys.modules makes transformers see no torch. Only here, in a process of our own:
    # main() also runs inside other processes (the tests), where torch may be wanted.
    sys.modules.setdefault("torch", None)
    return main()


def main(argv: list[str] | None = None) -> int:
    from . import signals

    try:
        code = _main(argv)
    except OSError:
        if signals.received is None:
            raise
        code = ExitCode.INTERRUPTED  # the terminal closed under a write: the exit code says why
    return signals.exit_code(code)  # 128 + the signal after SIGTERM / SIGHUP


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None):
    """parse_args, but an unknown option names the nearest real one: `--temperature` -> `--temp`
    (Python 3.11's argparse has no suggest_on_error). Usage errors exit 2, as argparse's own do."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = _chosen_parser(parser, args)
        hints = [h for h in (suggest_option(sub, a) for a in extra) if h]
        sub.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))
    return args


def _chosen_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The (sub)parser of the command given (`bench speed` is two levels down)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _chosen_parser(action.choices[name], args)
    return parser


def suggest_option(parser: argparse.ArgumentParser, arg: str) -> str | None:
    """'did you mean --temp?' for an unknown option, from the parser's own option strings."""
    import difflib

    if not arg.startswith("-") or arg == "-":
        return None
    typed = arg.split("=", 1)[0]
    options = [o for a in parser._actions for o in a.option_strings if a.help != argparse.SUPPRESS]
    close = [o for o in options if len(o) > 3 and typed.startswith(o)]  # --temperature: --temp
    close = sorted(close, key=len, reverse=True)[:1] or difflib.get_close_matches(typed, options, n=1, cutoff=0.6)
    return f"{typed}: did you mean {close[0]}?" if close else None


def _main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return ExitCode.USAGE
    try:
        if args.command in ("run", "chat", "agent"):
            from .signals import install

            install()  # SIGTERM / SIGHUP stop a reply as Ctrl-C does, and it is saved
            decode_text_flags(args)
            apply_settings(args)
        if args.command == "agent":
            from .agent_cli import cmd_agent

            return cmd_agent(args)
        if args.command == "bench":
            apply_settings(args)
            if args.bench == "speed":
                from .bench_speed import cmd_bench_speed

                return cmd_bench_speed(args)
            if args.bench == "cache":
                from .bench_cache import cmd_bench_cache

                return cmd_bench_cache(args)
            if args.bench == "quality":
                from .bench_quality import cmd_bench_quality

                return cmd_bench_quality(args)
            from .bench_tools import cmd_bench_tools

            return cmd_bench_tools(args)
        if args.command == "run":
            from .headless import run

            return run(args)
        if args.command == "chat":
            return cmd_chat(args)
        if args.command == "serve":
            from .serve.main import cmd_serve

            apply_settings(args)
            return cmd_serve(args)
        if args.command == "logs":
            from .logs_cli import cmd_logs

            return cmd_logs(args)
        if args.command in ("convert", "info", "verify", "demo"):
            from . import model_commands

            return getattr(model_commands, f"cmd_{args.command}")(args)
        if args.command == "pull":
            from .pull import cmd_pull

            return cmd_pull(args)
    except UsageError as e:
        error(str(e))
        return ExitCode.USAGE
    except ConfigError as e:
        error(str(e))
        return ExitCode.USAGE
    except StoreError as e:
        error(str(e))
        return ExitCode.MODEL
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        quiet_broken_pipe()
        return ExitCode.OK
    except Exception as e:
        from flashmoe.engine.errors import FlashMoEError, ModelLoadError

        if isinstance(e, ModelLoadError):
            error(str(e))
            return ExitCode.MODEL
        if isinstance(e, FlashMoEError):
            error(str(e))
            return e.exit_code  # 1, or 2 for a prompt longer than the context
        raise
    return ExitCode.USAGE


def cmd_chat(args) -> int:
    """Pick the face: TUI on a terminal, line REPL on a dumb one or with --no-tui, else headless."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        from .headless import run

        args.prompt, args.raw, args.json = None, False, False
        return run(args)
    if args.no_tui or os.environ.get("TERM", "") in ("dumb", ""):
        from .repl import run_repl

        return run_repl(args)
    # Textual composes the screen up to 60 times a second; while a reply streams that took most
    # of a core from the engine's kernels (2 cores: the demo decoded at 26-30 tok/s in the TUI,
    # 66 headless). 20 frames a second gave 35-44 (benchmarks/log/2026-12-04-chat-app-frames.md).
    # Read when textual is imported; a TEXTUAL_FPS the user set wins.
    os.environ.setdefault("TEXTUAL_FPS", str(TUI_FPS))
    from .tui.app import run_tui

    return run_tui(args)
