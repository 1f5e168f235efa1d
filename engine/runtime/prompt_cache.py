"""Prompt caches shared by requests that carry no conversation of their own (the server's).

An API client resends the whole history every turn. The pool keeps the KV / recurrent caches
of several recent prompts (LRU, under a byte budget) and gives each new request the one that
shares the longest token prefix with it, so turn N runs only its new tokens.

A cache that is reused is never trimmed in place when it holds more than the new request
shares: the CPU fast path writes keys and values into the cache's buffers in place, so two
requests must not share buffers. The shared part is copied instead, and the longer cache stays
for the conversation it came from.
"""
from __future__ import annotations

from flashmoe.engine.runtime.generate import Session


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cache_bytes(session: Session) -> int:
    if session.cache is None:
        return 0
    return sum(int(getattr(c, "nbytes", 0) or 0) for c in session.cache)


def _copy_cache(cache: list):
    """An independent copy of a prompt cache (mlx-lm's cache objects), buffers included."""
    import copy

    import mlx.core as mx
    from mlx.utils import tree_map

    out = []
    for c in cache:
        new = copy.copy(c)
        if c.state is not None:
            new.state = tree_map(lambda x: x + 0 if isinstance(x, mx.array) else x, c.state)
        out.append(new)
    mx.eval([c.state for c in out if c.state is not None])
    return out


class PromptCachePool:
    """Sessions for prompts, picked by longest shared prefix; least recently used go first."""

    def __init__(self, loaded, budget_bytes: int = 2 << 30, max_entries: int = 16):
        self.loaded = loaded
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.entries: list[Session] = []  # least recently used first

    def pick(self, ids: list[int]) -> Session:
        """The session for a prompt of these ids: a cached one that `ids` continues, a copy of the
        one that shares most with them, or a new one."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        best, shared = None, 0
        for s in self.entries:
            n = common_prefix(s.tokens, ids)
            usable = n == len(s.tokens) or (s.cache is not None and can_trim_prompt_cache(s.cache))
            if usable and n > shared:
                best, shared = s, n
        if best is None:
            session = Session(self.loaded)
        elif shared == len(best.tokens) and shared < len(ids):
            self.entries.remove(best)  # this prompt continues it: it moves on with it
            session = best
        else:
            session = Session(self.loaded)
            session.cache, session.tokens = _copy_cache(best.cache), list(best.tokens)
        self.entries.append(session)
        self._evict(keep=session)
        return session

    def _evict(self, keep: Session) -> None:
        while len(self.entries) > self.max_entries or (
                len(self.entries) > 1 and sum(cache_bytes(s) for s in self.entries) > self.budget_bytes):
            victim = next(s for s in self.entries if s is not keep)
            self.entries.remove(victim)

    def settle(self) -> None:
        """After a generation: the budget holds with the new cache's size."""
        if self.entries:
            self._evict(keep=self.entries[-1])

    def drop(self, session: Session) -> None:
        if session in self.entries:
            self.entries.remove(session)

    def clear(self) -> None:
        self.entries = []
