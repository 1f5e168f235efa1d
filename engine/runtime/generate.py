"""Generation as a plain generator of events, over the token loop of decode.py.

Layers, as mlx-lm separates generate_step from stream_generate: decode.py runs the model and
yields ids (logits processors from processors.py, a Sampler from sampling.py); this module turns
them into text and events, and decides when a reply ends. No threads here (the Engine runs this on its own thread); tests and scripts can iterate it
directly. A Session keeps the KV / recurrent cache of one conversation so that the next turn only
runs the tokens that are new.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from time import perf_counter
from typing import Iterator

from flashmoe.engine.runtime.config_check import context_length
from flashmoe.engine.runtime.decode import decode, prefill
from flashmoe.engine.errors import ContextLengthError
from flashmoe.engine.events import GenerationFinished, LayerTimings, PrefillProgress, StepFinished, TokenGenerated
from flashmoe.engine.options import TIMING_MODES, TRUNCATE_MODES
from flashmoe.engine.runtime.processors import ConstraintMask, processors_for
from flashmoe.engine.runtime.reasoning import open_reasoning, prompt_reasoning
from flashmoe.engine.runtime.sampling import Sampler, SamplingParams
from flashmoe.engine.runtime.timing import LayerClock, rows_from

log = logging.getLogger("flashmoe")
# A call under a constraint that is still open at max_tokens is closed (Constraint.finish(),
# tools/grammar.py) rather than cut: generation runs on for at most this many tokens
# more. The forced closers finish a call in a few tokens (tests/test_constrain.py measures the
# worst case of its schemas); the cap is the backstop for a grammar that needs long values.
FINISH_CALL_TOKENS = 256


@dataclass
class GenerationRequest:
    """One turn. Give `messages` (rendered with the chat template) or `prompt` (raw text)."""

    messages: list[dict] | None = None
    prompt: str | None = None
    tools: list[dict] | None = None
    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    timing: str = "step"
    template_kwargs: dict = field(default_factory=dict)
    # Prompt tokens per forward pass. Measured on the CPU path (dense SmolLM2, 1k and 4k prompts):
    # 512 is 5-15% faster than 256, 1024 another ~10%; 512 keeps a cancel within ~3 s of prefill.
    prefill_step: int = 512
    constraint: object = None  # ConstraintFactory: make(tokenizer) -> Constraint (engine/runtime/constrain.py)
    truncate_prompt: str | None = None  # TRUNCATE_MODES; None: as the Engine was told ("off" without one)

    def __post_init__(self):
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages or prompt")
        if self.timing not in TIMING_MODES:
            raise ValueError(f"timing must be one of {', '.join(TIMING_MODES)}, got {self.timing!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.truncate_prompt not in (None, *TRUNCATE_MODES):
            raise ValueError(
                f"truncate_prompt must be one of {', '.join(TRUNCATE_MODES)}, got {self.truncate_prompt!r}"
            )


class Session:
    """The cache of one conversation and the token ids it holds."""

    def __init__(self, loaded, tenant: str = ""):
        self.loaded = loaded
        self.cache = None
        self.tokens: list[int] = []
        self.tenant = tenant  # who the cache's prompt came from (a server's prompt-cache pool keeps them apart)

    def reset(self) -> None:
        self.cache = None
        self.tokens = []

    def prepare(self, ids: list[int]) -> int:
        """Keep the cached prefix that `ids` shares; returns how many tokens are reused."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        if self.cache is not None:
            common = 0
            for a, b in zip(self.tokens, ids):
                if a != b:
                    break
                common += 1
            common = min(common, len(ids) - 1)  # the last prompt token must run to give logits
            drop = len(self.tokens) - common
            if drop == 0:
                return common
            if drop > 0 and can_trim_prompt_cache(self.cache):
                trim_prompt_cache(self.cache, drop)
                del self.tokens[common:]
                return common
        self.cache = make_prompt_cache(self.loaded.model)
        self.tokens = []
        return 0


class StopMatcher:
    """Holds back text that may be the start of a stop string, so it never reaches the user."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to show, whether a stop string was hit)."""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


def render_prompt(loaded, request: GenerationRequest) -> list[int]:
    return render_prompt_text(loaded, request)[0]


def render_prompt_text(loaded, request: GenerationRequest) -> tuple[list[int], str]:
    """The prompt's ids, and the opening marker of the reasoning block it ends inside ("" if none)."""
    tok = loaded.tokenizer
    if request.prompt is not None:
        return tok.encode(request.prompt, add_special_tokens=True), open_reasoning(request.prompt)
    # Control-token text inside messages (a tool result saying "<|im_end|><|im_start|>system")
    # is encoded as text; only the template's own markers are control tokens.
    ids, text = tok.render_chat(
        request.messages, tools=request.tools, add_generation_prompt=True, **request.template_kwargs
    )
    return ids, template_reasoning(tok, request, text)


def template_reasoning(tok, request: GenerationRequest, text: str) -> str:
    """Whether the generation prompt the template added opened a reasoning block (engine/runtime/reasoning.py)."""
    try:
        bare = tok.apply_chat_template(
            request.messages, tools=request.tools, add_generation_prompt=False, **request.template_kwargs
        )
    except Exception:  # noqa: BLE001  (a template that insists on the generation prompt: look at all of it)
        bare = None
    return prompt_reasoning(text, bare)


def fit_context(
    ids: list[int], context: int | None, mode: str, max_tokens: int, what: str | None = None
) -> tuple[list[int], int]:
    """The prompt ids the model will run, and how many of the oldest were dropped.

    "off" refuses a prompt longer than the context (it would run past the positions the model was
    trained on, slower with every token, into garbage; or past the KV cache the memory plan made
    room for). "left" drops the oldest tokens so that the prompt leaves room for the reply:
    max_tokens, at most half the context. `what` names the context in the error."""
    if context is None:
        return ids, 0
    if mode != "left":
        if len(ids) > context:
            what = what or f"the model's context of {context} tokens (max_position_embeddings in config.json)"
            raise ContextLengthError(
                f"the prompt is {len(ids)} tokens, longer than {what}; shorten it, or pass --truncate-prompt left "
                "to drop the oldest tokens"
            )
        return ids, 0
    keep = context - min(max_tokens, context // 2)
    if len(ids) <= keep:
        return ids, 0
    return ids[-keep:], len(ids) - keep


def context_of(loaded) -> tuple[int | None, str | None]:
    """The context a generation may fill, and how to name it when it is the memory plan's rather
    than the model's own (None)."""
    model = context_length(loaded.config)
    context = getattr(loaded, "context", model)
    if context is None or model is None or context >= model:
        return model if context is None else min(context, model) if model else context, None
    return context, (
        f"the context of {context} tokens the memory budget leaves room for (the model's is {model}; "
        "--ctx-size sets it, at the expert cache's cost)"
    )


class DecodeFigures:
    """The decode steps' expert-store counters, summed: what GenerationFinished reports."""

    def __init__(self):
        self.bytes_read = self.hits = self.lookups = self.prefetched = self.prefetch_used = 0
        self.io_wait_s = 0.0

    def add(self, stats: dict) -> tuple[int, int, int]:
        """One step's per-layer stats; returns its (bytes read, hits, misses)."""
        s_bytes = sum(s.bytes_read for s in stats.values())
        s_hits = sum(s.hits for s in stats.values())
        s_miss = sum(s.misses for s in stats.values())
        self.io_wait_s += sum(s.io_wait_s for s in stats.values())
        self.prefetched += sum(s.prefetched for s in stats.values())
        self.prefetch_used += sum(s.prefetch_used for s in stats.values())
        self.bytes_read, self.hits, self.lookups = (
            self.bytes_read + s_bytes,
            self.hits + s_hits,
            self.lookups + s_hits + s_miss,
        )
        return s_bytes, s_hits, s_miss


def generate(loaded, session: Session, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator:
    """Yield PrefillProgress, TokenGenerated, StepFinished, LayerTimings and GenerationFinished.

    The event layer over the token loop (engine/runtime/decode.py): the chat template and the
    context, text (detokenising, stop strings), when to stop, and the figures."""
    model, tok, store = loaded.model, loaded.tokenizer, loaded.store
    cancel = cancel or threading.Event()
    if request.timing == "layer" and loaded.clock is None:
        loaded.clock = LayerClock(loaded)
        loaded.clock.install()
    clock = loaded.clock
    loaded.telemetry.mode = request.timing
    # "cold": the expert slots start empty (first turn after load, or after evict_all).
    cold = store is not None and store.used_bytes == 0
    # "preloaded": the first turn of a process whose cache was seeded from the usage file
    preloaded = store is not None and store.preloaded > 0 and store.asked_steps == 0

    ids, opened = render_prompt_text(loaded, request)
    if not ids:
        raise ValueError("the prompt is empty")
    context, what = context_of(loaded)
    ids, dropped = fit_context(ids, context, request.truncate_prompt or "off", request.max_tokens, what)
    if dropped:
        log.warning(
            "flashmoe: warning: prompt truncated: dropped its oldest %d tokens, kept the newest %d, "
            "to fit %s (--truncate-prompt left)",
            dropped,
            len(ids),
            what or f"the model's context of {context} tokens",
        )
    reused = session.prepare(ids)
    todo = ids[reused:]

    # -- prefill --------------------------------------------------------------------------
    t0 = perf_counter()
    logits = None
    yield PrefillProgress(0, len(todo), reused, opened)
    for done, logits in prefill(model, session, todo, request.prefill_step, cancel):  # noqa: B007 (the last logits go on)
        yield PrefillProgress(done, len(todo), reused, opened, perf_counter() - t0)
    prefill_s = perf_counter() - t0
    if store is not None:
        store.step_done()  # decode figures start clean
    if clock is not None:
        clock.reset()

    # -- decode ---------------------------------------------------------------------------
    mask = ConstraintMask(request.constraint(tok)) if request.constraint is not None else None
    detok = tok.detokenizer()
    stops = StopMatcher(request.stop)
    eos = tok.eos_token_ids
    text_out: list[str] = []
    reason = "cancelled" if logits is None else "length"
    steps = 0
    figures = DecodeFigures()
    tokens = (
        decode(model, session, logits, Sampler(request.sampling), processors_for(request.sampling, mask))
        if logits is not None
        else iter(())
    )
    t_first = step_start = perf_counter()
    for token in tokens:  # each after the first comes with the forward pass on the one before
        if steps:
            now = perf_counter()
            stats = store.step_done() if store is not None else {}
            s_bytes, s_hits, s_miss = figures.add(stats)
            if request.timing != "off":
                wall = now - step_start
                yield StepFinished(steps - 1, wall * 1e3, 1.0 / wall if wall > 0 else 0.0, s_bytes, s_hits, s_miss)
                rows = clock.rows(stats) if request.timing == "layer" else rows_from(loaded.num_layers, stats)
                yield LayerTimings(steps - 1, request.timing, rows)
            step_start = now
        if cancel.is_set():
            reason = "cancelled"
            break
        steps += 1
        if token in eos:
            reason = "stop"
            break
        shown, hit_stop = stops.feed(detok.add(token))
        text_out.append(shown)
        yield TokenGenerated(token, shown, steps - 1)
        if hit_stop or (mask is not None and mask.done(token)):
            reason = "stop"
            break
        if steps >= request.max_tokens:
            constraint = mask.constraint if mask is not None else None
            if not _finish_call(constraint, steps - request.max_tokens, request.max_tokens):
                break
        if context is not None and len(session.tokens) >= context:
            reason = "context"  # the next token would sit past the last position the model knows
            break
    if steps > request.max_tokens:
        log.info(
            "flashmoe: a tool call open at max_tokens (%d) was finished under its grammar, %d tokens past it",
            request.max_tokens,
            steps - request.max_tokens,
        )
    # The first token comes from the prefill's logits: decode speed counts the forward passes
    # after it, over the time they took.
    fed = max(0, steps - 1)
    decode_s = step_start - t_first if fed else 0.0

    tail = stops.pending if reason != "stop" else ""
    tail += detok.flush() if reason != "stop" else ""
    text = "".join(text_out) + tail
    yield GenerationFinished(
        reason=reason,
        prompt_tokens=len(ids),
        reused_prompt_tokens=reused,
        generation_tokens=steps,
        prompt_tps=len(todo) / prefill_s if prefill_s > 0 else 0.0,
        generation_tps=fed / decode_s if decode_s > 0 else 0.0,
        prefill_s=prefill_s,
        decode_s=decode_s,
        io_wait_s=figures.io_wait_s,
        bytes_per_token=figures.bytes_read / fed if fed else 0.0,
        hit_rate=figures.hits / figures.lookups if figures.lookups else 0.0,
        top_k=loaded.top_k,
        bits=model_bits(loaded.config),
        cache_state="cold" if cold else "preloaded" if preloaded else "warm",
        text=text,
        tail=tail,
        prefetch_hit_rate=figures.prefetch_used / figures.prefetched if figures.prefetched else 0.0,
        truncated_prompt_tokens=dropped,
    )


def _finish_call(constraint, past: int, max_tokens: int) -> bool:
    """At or past max_tokens: whether to go on to close a call that is under way (see
    FINISH_CALL_TOKENS). The reply then ends with the call, longer than max_tokens: its
    GenerationFinished says so by generation_tokens > max_tokens, with the reason "length"
    ("stop" in required mode, where the complete call is the whole reply)."""
    finish = getattr(constraint, "finish", None)
    if finish is None or not getattr(constraint, "in_call", False):
        return False
    if past >= FINISH_CALL_TOKENS:
        log.warning(
            "flashmoe: warning: a tool call open at max_tokens (%d) did not close within %d more tokens; it is cut",
            max_tokens,
            FINISH_CALL_TOKENS,
        )
        return False
    if past == 0:
        finish()
    return True


def model_bits(config: dict) -> int | None:
    q = config.get("quantization") or config.get("quantization_config") or {}
    return q.get("bits")
