"""Reasoning ("thinking") blocks: the marker pairs models write them in, and whether a rendered
prompt leaves one open (templates that open `<think>` themselves when thinking is on).

Plain Python, no MLX. The marker pairs are template vocabulary the text state machine
(tools/textstate.py) needs too, and tools must not import the engine: they live in
prompts/reasoning.py.
"""

from __future__ import annotations

import re

from flashmoe.prompts.reasoning import REASONING_MARKERS

from flashmoe.engine.options import THINKING_CHOICES


def close_marker(open_marker: str) -> str:
    """The marker that closes a reasoning block opened by `open_marker` ("" when unknown)."""
    return dict(REASONING_MARKERS).get(open_marker, "")


def open_reasoning(prompt: str) -> str:
    """The opening marker of the reasoning block `prompt` ends inside, or "" when it ends outside
    any: for each marker pair, after the last opening marker there is no closing one. When several
    pairs are open, the one opened last wins."""
    best, best_at = "", -1
    for start, end in REASONING_MARKERS:
        at = prompt.rfind(start)
        if at > best_at and prompt.find(end, at + len(start)) < 0:
            best, best_at = start, at
    return best


def prompt_reasoning(prompt: str, without_generation_prompt: str | None = None) -> str:
    """open_reasoning, looking only at what the generation prompt added when the same messages
    rendered without it (`without_generation_prompt`) are a prefix of `prompt`: a system prompt
    that merely mentions `<think>` then opens nothing."""
    if without_generation_prompt and prompt.startswith(without_generation_prompt):
        tail = prompt[len(without_generation_prompt) :]
        return open_reasoning(tail)
    return open_reasoning(prompt)


_THINKING_KWARG = re.compile(r"\benable_thinking\b")
_BARE_THINKING = re.compile(
    r"\b(?:if|not|and|or)\s+thinking\b|\bthinking\s+is\s+(?:defined|undefined|true|false|sameas)\b"
)


def thinking_switch(template: str) -> str | None:
    """The template variable that turns thinking on and off: "enable_thinking" (Qwen3, Qwen3.5,
    Qwen3-Next, GLM), "thinking" (DeepSeek V3.1), or None when the template has no switch."""
    if _THINKING_KWARG.search(template or ""):
        return "enable_thinking"
    if _BARE_THINKING.search(template or ""):
        return "thinking"
    return None


def thinking_kwargs(thinking: str | None, template: str) -> dict:
    """The template kwargs for --thinking on|off (None: the template's own default)."""
    if thinking is None:
        return {}
    if thinking not in THINKING_CHOICES:
        raise ValueError(f"thinking must be on or off, got {thinking!r}")
    return {thinking_switch(template) or "enable_thinking": thinking == "on"}
