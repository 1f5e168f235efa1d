"""Recording which experts a model routes to, token by token, for `flashmoe bench cache`."""

from __future__ import annotations


def record(loaded, ids: list[int]) -> tuple[list, list, list[float], int]:
    """Feed `ids` one token at a time (as decoding does) and record every fetch, every read-ahead
    guess, each next token's log-probability, and the engine's own cache hits."""
    import mlx.core as mx

    from mlx_lm.models.cache import make_prompt_cache

    # A KV cache of its own: each token sees the ones before it, as in decoding (a Session's
    # cache is None until prepared, and None means every token alone, without context).
    store, cache = loaded.store, make_prompt_cache(loaded.model)
    store.trace, store.guesses = [], []
    logprobs, hits = [], 0
    store.take_stats()
    try:
        for tok, nxt in zip(ids, ids[1:]):
            logits = loaded.model(mx.array([[tok]]), cache=cache)[0, -1].astype(mx.float32)
            logprobs.append((logits[nxt] - mx.logsumexp(logits)).item())
            hits += sum(s.hits for s in store.step_done().values())
        return store.trace, store.guesses, logprobs, hits
    finally:
        store.trace = store.guesses = None
