"""A stand-in Engine that replays scripted replies: for front-end tests, snapshots and demos.

Same interface as Engine (wait_loaded, submit -> Handle, reset_session, close) and the same
events, with deterministic per-layer timings, so a UI can be built and tested without a model.
"""

from __future__ import annotations

import itertools
import re
import threading
import time

from flashmoe.engine.runtime.engine import Handle
from flashmoe.engine.events import (
    EngineFailed,
    GenerationFinished,
    LayerRow,
    LayerTimings,
    ModelLoaded,
    PrefillProgress,
    StepFinished,
    TokenGenerated,
)


class FakeEngine:
    def __init__(
        self,
        replies: list[str] | None = None,
        *,
        layers: int = 8,
        token_delay: float = 0.0,
        prompt_tokens: int = 12,
        fail: str | None = None,
        chat_template: str = "",
        context: int | None = 32768,
    ):
        """chat_template: a Jinja chat template that requests are rendered with (as the real engine
        does), so that PrefillProgress says when the prompt ends inside reasoning."""
        self._replies = itertools.cycle(replies or ["Hello! I am a **fake** engine.\n\n- one\n- two"])
        self.layers = layers
        self.token_delay = token_delay
        self.prompt_tokens = prompt_tokens
        self.fail = fail
        self.requests: list = []  # what was submitted, for tests
        self.loaded_info = ModelLoaded(
            model="fake",
            model_type="fake_moe",
            mode="packed",
            layers=layers,
            moe_layers=layers,
            experts=64,
            top_k=4,
            bits=4,
            cache_bytes=64 << 20,
            load_s=0.0,
            cache_policy="lfu",
            chat_template=chat_template,
            context=context,
        )
        self._template = None
        if chat_template:
            from flashmoe.engine.runtime.tokenizer import _make_environment

            self._template = _make_environment().from_string(chat_template)

    def wait_loaded(self, timeout: float | None = None) -> ModelLoaded:
        return self.loaded_info

    def submit(self, request, session: str = "default", tenant: str = "") -> Handle:
        handle = Handle(request, session, tenant)
        self.requests.append(request)
        reply = next(self._replies)
        threading.Thread(target=self._play, args=(handle, reply), daemon=True).start()
        return handle

    def _reasoning(self, request) -> str:
        """As engine.generate.render_prompt_text: the reasoning block the rendered prompt leaves open."""
        from flashmoe.engine.runtime.reasoning import open_reasoning, prompt_reasoning

        if getattr(request, "prompt", None) is not None:
            return open_reasoning(request.prompt)
        if self._template is None or getattr(request, "messages", None) is None:
            return ""

        def render(gen: bool) -> str:
            return self._template.render(
                messages=request.messages,
                tools=request.tools,
                add_generation_prompt=gen,
                bos_token="",
                eos_token="",
                **request.template_kwargs,
            )

        return prompt_reasoning(render(True), render(False))

    def reset_session(self, session: str = "default") -> None:
        pass

    def close(self) -> None:
        pass

    def _play(self, handle: Handle, reply: str) -> None:
        put = handle.events.put
        try:
            opened = self._reasoning(handle.request)
        except Exception as e:  # as the real engine: a template that fails is the request's failure
            put(EngineFailed(str(e), type(e).__name__, getattr(e, "exit_code", 1)))
            return
        put(PrefillProgress(0, self.prompt_tokens, 0, opened))
        put(PrefillProgress(self.prompt_tokens, self.prompt_tokens, 0, opened))
        if self.fail:
            put(EngineFailed(self.fail, "RuntimeError", 1))
            return
        pieces = re.findall(r"\s*\S+|\s+", reply) or [""]
        limit = getattr(handle.request, "max_tokens", len(pieces))
        text, reason = [], "length" if len(pieces) > limit else "stop"
        start = time.perf_counter()
        for step, piece in enumerate(pieces[:limit]):
            if handle.cancelled:
                reason = "cancelled"
                break
            if self.token_delay:
                time.sleep(self.token_delay)
            text.append(piece)
            put(TokenGenerated(1000 + step, piece, step))
            put(StepFinished(step, 50.0, 20.0, 4 << 20, 24, 8))
            put(
                LayerTimings(
                    step,
                    "layer",
                    tuple(
                        LayerRow(i, 1.0 + (i % 3) * 0.5, 0.3, 2.0 + (i * 7 % 5), 3.0, 0.4, 3, 1, 524288)
                        for i in range(self.layers)
                    ),
                )
            )
        wall = max(time.perf_counter() - start, 1e-6)
        put(
            GenerationFinished(
                reason=reason,
                prompt_tokens=self.prompt_tokens,
                reused_prompt_tokens=0,
                generation_tokens=len(text),
                prompt_tps=240.0,
                generation_tps=len(text) / wall,
                prefill_s=0.05,
                decode_s=wall,
                io_wait_s=wall * 0.3,
                bytes_per_token=4 << 20,
                hit_rate=0.75,
                top_k=4,
                bits=4,
                cache_state="warm",
                text="".join(text),
                tail="",
            )
        )
