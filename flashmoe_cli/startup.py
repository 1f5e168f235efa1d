"""What every face does before its first turn: build the engine, open the conversation."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from flashmoe.engine.options import IO_THREADS, resolve_dtype

from .errors import UsageError
from .models import resolve_model
from .store import StoreError


@dataclass(frozen=True)
class EngineOptions:
    """What the engine is built with, read once from the parsed flags and settings."""

    model: str | None = None  # None: the demo
    engine: str = "real"  # "fake": the scripted test double (the hidden --engine flag)
    expert_cache: int | None = None
    io_threads: int = IO_THREADS
    direct_io: bool | None = None  # None: O_DIRECT where the file system takes it
    dtype: str = "auto"  # options.DTYPES
    kernels: str = "auto"
    kv_cache: str = "float32"  # options.KV_CACHES
    prefetch: str = "off"
    cache_policy: str = "lfu"
    verify_reads: bool = True
    expert_usage: bool = True  # the usage file kept across runs, and preloading from it (experts/usage.py)
    allow_resident_experts: bool = False
    truncate_prompt: str = "off"
    experts_per_token: int | None = None  # None: as the model was trained
    ctx_size: int | None = None  # None: what the memory plan leaves room for (engine/runtime/memory.py)
    prompt_cache_bytes: int = 0  # prompt caches kept in memory for requests without a conversation (serve)
    prompt_cache_dir: str | None = None  # where they are also saved (serve: FLASHMOE_HOME/kv); None: not
    prompt_cache_disk_bytes: int = 8 << 30

    @classmethod
    def from_args(cls, args) -> "EngineOptions":
        return cls(
            model=args.model,
            engine=args.engine,
            expert_cache=args.expert_cache,
            io_threads=args.io_threads,
            direct_io=args.direct_io,
            dtype=args.dtype,
            kernels=args.kernels,
            kv_cache=args.kv_cache,
            prefetch=args.prefetch,
            cache_policy=args.cache_policy,
            verify_reads=getattr(args, "verify_reads", "on") != "off",
            allow_resident_experts=getattr(args, "allow_resident_experts", False),
            truncate_prompt=getattr(args, "truncate_prompt", "off"),
            experts_per_token=getattr(args, "experts_per_token", None),
            expert_usage=getattr(args, "expert_usage", "on") != "off",
            ctx_size=getattr(args, "ctx_size", None),
            prompt_cache_bytes=getattr(args, "prompt_cache", 0),
            **disk_cache(args),
        )


DISK_CACHE_BYTES = 8 << 30
# Conversations that come back; and tools turns (`agent`, `run --tools`), whose ~1,000 tokens of
# tool instructions are the same every time: a second tools turn on the demo waits 0.4-0.5 s for
# its first token instead of 3.3-4 s (benchmarks/log/2026-12-04-saved-prefix-by-default.md).
# A plain `run`: --disk-cache.
DISK_CACHE_BY_DEFAULT = ("chat", "serve")


def disk_cache(args) -> dict:
    """Where prompt caches are saved (FLASHMOE_HOME/kv) and how much room they get: --disk-cache,
    else on for chat, serve and tools turns, off for a plain `run`. A server's go in kv/serve/:
    its network clients are never given a cache a local conversation (run, chat, agent) left,
    nor the other way round (issue 41)."""
    from flashmoe.engine.formats.demo import flashmoe_home

    size = getattr(args, "disk_cache", None)
    if size is None:
        command = getattr(args, "command", None)
        tools = command == "agent" or (command == "run" and bool(getattr(args, "tools", None)))
        size = DISK_CACHE_BYTES if command in DISK_CACHE_BY_DEFAULT or tools else 0
    folder = flashmoe_home() / "kv" / ("serve" if getattr(args, "command", None) == "serve" else "")
    return {"prompt_cache_disk_bytes": size, "prompt_cache_dir": str(folder) if size else None}


def make_engine(opts: EngineOptions):
    """The engine for run/chat/agent/bench: the real one, or (tests, hidden flag) a scripted fake."""
    if opts.engine == "fake":
        from flashmoe.engine.testing import FakeEngine

        replies = json.loads(os.environ.get("FLASHMOE_FAKE_REPLIES", "null"))
        delay = float(os.environ.get("FLASHMOE_FAKE_DELAY", "0"))
        template = os.environ.get("FLASHMOE_FAKE_TEMPLATE")  # a chat template file the fake renders with
        return FakeEngine(
            replies,
            token_delay=delay,
            fail=os.environ.get("FLASHMOE_FAKE_FAIL") or None,
            chat_template=open(template, encoding="utf-8").read() if template else "",
        )
    from flashmoe.engine.runtime.engine import Engine

    return Engine(
        resolve_model(opts.model),
        expert_cache=opts.expert_cache,
        io_threads=opts.io_threads,
        direct_io=opts.direct_io,
        dtype=resolve_dtype(opts.dtype),
        kernels=opts.kernels,
        kv_cache=opts.kv_cache,
        prefetch=opts.prefetch,
        cache_policy=opts.cache_policy,
        verify_reads=opts.verify_reads,
        allow_resident_experts=opts.allow_resident_experts,
        truncate_prompt=opts.truncate_prompt,
        prompt_cache_bytes=opts.prompt_cache_bytes,
        prompt_cache_dir=opts.prompt_cache_dir,
        prompt_cache_disk_bytes=opts.prompt_cache_disk_bytes,
        experts_per_token=opts.experts_per_token,
        ctx_size=opts.ctx_size,
        expert_usage=opts.expert_usage,
    )


@dataclass(frozen=True)
class ConversationOptions:
    """How a conversation is opened and sampled, read once from the parsed flags."""

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    timing: str = "off"
    system: str | None = None
    stop: tuple[str, ...] = ()
    thinking: str | None = None
    continue_: bool = False  # -c: resume the latest conversation
    cid: str | None = None  # --cid: resume this one
    no_log: bool = False  # -n: this turn is not saved

    @classmethod
    def from_args(cls, args) -> "ConversationOptions":
        return cls(
            max_tokens=args.max_tokens,
            temp=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            timing=args.timing,
            system=args.system,
            stop=tuple(args.stop),
            thinking=getattr(args, "thinking", None),
            continue_=args.continue_,
            cid=args.cid,
            no_log=args.no_log,
        )


def open_conversation(opts: ConversationOptions, engine, model_name: str):
    """A ChatSession, resumed (-c / --cid) or new; saved unless -n."""
    from flashmoe.engine.runtime.sampling import SamplingParams

    from .chat import ChatOptions, ChatSession
    from .store import logging_disabled, open_store

    try:
        sampling = SamplingParams(
            temperature=opts.temp,
            top_p=opts.top_p,
            top_k=opts.top_k,
            min_p=opts.min_p,
            repetition_penalty=opts.repetition_penalty,
            seed=opts.seed,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if opts.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {opts.max_tokens}")
    options = ChatOptions(
        max_tokens=opts.max_tokens,
        sampling=sampling,
        timing=opts.timing,
        system=opts.system,
        stop=opts.stop,
        thinking=opts.thinking,
    )
    resume = opts.continue_ or opts.cid
    try:
        store = None if (opts.no_log or logging_disabled()) and not resume else open_store()
    except StoreError as e:  # resuming needs it (exit 3); a new conversation goes on unsaved
        if resume:
            raise
        print(f"flashmoe: warning: the conversation is not saved ({e})", file=sys.stderr)
        store = None
    cid = opts.cid
    if opts.continue_ and cid is None:
        cid = store.latest()
        if cid is None:
            raise UsageError("--continue: there is no saved conversation yet")
    try:
        session = ChatSession(engine, store, options, cid=cid, model_name=model_name)
    except KeyError:
        raise UsageError(f"--cid {cid}: no such conversation (see `flashmoe logs`)") from None
    if opts.no_log:
        session.store = None  # resumed, but this turn is not saved
    return session
