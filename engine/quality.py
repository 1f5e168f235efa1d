"""Perplexity, KL from a reference and the decode cost of a loaded model on a text, for
`flashmoe bench quality`."""

from __future__ import annotations

import math
import time

WINDOW = 512  # tokens per forward: each window is scored on its own, from an empty cache
DECODE_TOKENS = 32  # fed one at a time after scoring, for the decode cost: speed, bytes read


def decode_cost(loaded, ids: list[int]) -> dict:
    """Decode speed and expert bytes read per token, feeding `ids` one token at a time (the
    expert cache as the scoring left it: warm)."""
    import mlx.core as mx

    from mlx_lm.models.cache import make_prompt_cache

    warm = make_prompt_cache(loaded.model)  # compile what this K's shapes need first, outside the timing
    for tok in ids[:2]:
        mx.eval(loaded.model(mx.array([[tok]]), cache=warm))
    cache, read, hits, lookups = make_prompt_cache(loaded.model), 0, 0, 0  # each token after the ones before
    if loaded.store is not None:
        loaded.store.take_stats()
    t0 = time.perf_counter()
    for tok in ids:
        mx.eval(loaded.model(mx.array([[tok]]), cache=cache))
        if loaded.store is not None:
            for s in loaded.store.step_done().values():
                read, hits, lookups = read + s.bytes_read, hits + s.hits, lookups + s.hits + s.misses
    return {
        "decode_tps": len(ids) / (time.perf_counter() - t0),
        "bytes_per_token": read / len(ids),
        "hit_rate": hits / lookups if lookups else 1.0,
    }


def score(loaded, ids: list[int], reference: list | None) -> dict:
    """Perplexity (and KL from `reference`'s log-probs, one array per window) over `ids`; without a
    reference, its own log-probs are returned (under "logprobs") to be one."""
    import mlx.core as mx

    nll = kl = 0.0
    count = 0
    windows, seconds = [], 0.0
    for w, start in enumerate(range(0, len(ids) - 1, WINDOW)):
        piece = ids[start : start + WINDOW + 1]
        t0 = time.perf_counter()
        logits = loaded.model(mx.array([piece[:-1]]))[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logprobs)
        seconds += time.perf_counter() - t0
        picked = mx.take_along_axis(logprobs, mx.array(piece[1:])[:, None], axis=-1)
        nll -= picked.sum().item()
        count += len(piece) - 1
        if reference is not None:
            ref = reference[w]
            kl += (mx.exp(ref) * (ref - logprobs)).sum().item()
        if reference is None:  # only the reference's are needed later (for KL): ~200 MB per 1k tokens
            windows.append(logprobs)
    return {
        "tokens": count,
        "perplexity": math.exp(nll / count),
        "mean_logprob": -nll / count,
        "kl": kl / count if reference is not None else None,
        "prefill_tps": count / seconds,
        "logprobs": windows,
    }
