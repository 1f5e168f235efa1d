"""Choosing the next token from logits: greedy, or temperature sampling with the usual filters.

What reshapes the logits before (the constraint mask, the repetition penalty) are logits
processors (engine/runtime/processors.py); the sampler only picks. Everything stays in MLX ops so the same code runs on CPU and GPU without copying logits out.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

from flashmoe.engine.options import SamplingParams  # noqa: F401  (re-exported: it lives with the other options)


class Sampler:
    """Picks one token id per call. Holds its own PRNG key, so a fixed seed gives the
    same sequence of choices regardless of any other use of MLX's global random state."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> int:
        p = self.params
        if logits.ndim == 2 and logits.shape[0] == 1:
            logits = logits[0]
        if logits.ndim != 1:
            raise ValueError(f"expected logits of shape [vocab], got {tuple(logits.shape)}")
        logits = logits.astype(mx.float32)  # bf16/fp16 cumsums and comparisons are too coarse

        if p.greedy:
            return int(mx.argmax(logits).item())

        # Filters look at the untempered distribution (as mlx-lm and llama.cpp do), so
        # temperature only reshapes the probabilities among the tokens that survive.
        if 0 < p.top_k < logits.shape[0]:
            logits = _top_k(logits, p.top_k)
        if p.top_p < 1.0:
            logits = _top_p(logits, p.top_p)
        if p.min_p > 0.0:
            logits = _min_p(logits, p.min_p)

        self._key, key = mx.random.split(self._key)
        return int(mx.random.categorical(logits / p.temperature, key=key).item())


def _top_k(logits: mx.array, k: int) -> mx.array:
    # argpartition puts the k largest first; mask the rest.
    drop = mx.argpartition(-logits, kth=k - 1)[k:]
    logits[drop] = -mx.inf
    return logits


def _top_p(logits: mx.array, top_p: float) -> mx.array:
    order = mx.argsort(-logits)
    probs = mx.softmax(logits[order])
    # Keep a token while the mass strictly before it is < top_p: the smallest prefix whose
    # total reaches top_p, and always the most likely token.
    before = mx.cumsum(probs) - probs
    keep_sorted = before < top_p
    keep = keep_sorted[mx.argsort(order)]  # back to vocabulary order
    return mx.where(keep, logits, -mx.inf)


def _min_p(logits: mx.array, min_p: float) -> mx.array:
    # prob >= min_p * max_prob  <=>  logit >= max_logit + log(min_p); avoids tiny-prob underflow.
    threshold = mx.max(logits) + math.log(min_p)
    return mx.where(logits >= threshold, logits, -mx.inf)
