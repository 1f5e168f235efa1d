"""The exactness suites' shared pieces: a fixed prompt, the (architecture, bits) cases, greedy
decoding through a KV cache, and an expert budget under one layer's experts."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from tests.tiny_models import ARCHS

PROMPT = [3, 17, 250, 42, 9, 101, 77, 5, 64, 200, 13, 8]
CASES = [(a, b) for a in ARCHS for b in (None, 4, 8)] + [
    (a, b) for a in ("qwen3_moe", "mixtral", "deepseek_v3") for b in (2, 3)
]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return out


def small_budget(loaded) -> int:
    """Room for K+1 experts: fewer than one layer holds, more than one token needs."""
    l = loaded.layers[0]
    assert loaded.top_k + 1 < l.num_experts
    return (loaded.top_k + 1) * l.expert_bytes
