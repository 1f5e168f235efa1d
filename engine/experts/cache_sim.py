"""Expert-cache policies replayed over a recorded routing trace, against Belady's optimum.

A trace is the sequence of fetches the engine makes while decoding: (layer, experts), one per
MoE layer per token, every expert of a fetch needed at once. The cache is the engine's: one pool
of slots shared by all layers (ExpertStore), holding (layer, expert) keys; a fetch's own experts
are never evicted to make room for each other. `lru` and `lfu` replay ExpertStore's rules (LFU
with its half-life decay and LRU among equals); `belady` evicts the cached expert asked for
again farthest in the future, which no policy can beat: the exchange argument for Belady's rule
holds unchanged when each request is a set that must be resident at once, because both the
optimal and the farthest-first schedule evict only from outside the current set.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from flashmoe.engine.experts.store import LFU_HALF_LIFE

POLICIES = ("lru", "lfu", "belady")
Trace = list[tuple[int, tuple[int, ...]]]


def replay(trace: Trace, slots: int, policy: str, layers: int | None = None) -> tuple[int, int]:
    """(hits, lookups) of `policy` with `slots` cache slots over `trace`, from an empty cache."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    widest = max((len(e) for _, e in trace), default=0)
    if slots < widest:
        raise ValueError(f"{slots} slots cannot hold one fetch of {widest} experts")
    layers = layers or len({layer for layer, _ in trace}) or 1
    return {"lru": _lru, "lfu": _lfu, "belady": _belady}[policy](trace, slots, layers)


def _missing(want: list, cache) -> list:
    """The keys of a fetch that are not cached (the rest are its hits)."""
    return [key for key in want if key not in cache]


def _lru(trace, slots, layers):
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    hits = lookups = 0
    for layer, experts in trace:
        want = [(layer, e) for e in experts]
        missing = _missing(want, cache)
        hits, lookups = hits + len(want) - len(missing), lookups + len(want)
        for key in want:
            if key in cache:
                cache.move_to_end(key)
        wanted = set(want)
        while len(cache) + len(missing) > slots:
            victim = next(k for k in cache if k not in wanted)
            del cache[victim]
        for key in missing:
            cache[key] = None
    return hits, lookups


def _lfu(trace, slots, layers):
    freq: defaultdict[tuple[int, int], float] = defaultdict(float)
    used_at: dict[tuple[int, int], int] = {}  # the cache: key -> tick of its last use
    hits = lookups = fetches = 0
    for tick, (layer, experts) in enumerate(trace, 1):
        fetches += 1
        if fetches >= LFU_HALF_LIFE * layers:  # as ExpertStore._count: counts halve
            for key in freq:
                freq[key] *= 0.5
            fetches = 0
        want = [(layer, e) for e in experts]
        missing = _missing(want, used_at)
        hits, lookups = hits + len(want) - len(missing), lookups + len(want)
        for key in want:
            freq[key] += 1
            used_at[key] = tick
        over = len(used_at) - slots
        if over > 0:
            wanted = set(want)
            order = sorted((k for k in used_at if k not in wanted), key=lambda k: (freq[k], used_at[k]))
            for key in order[:over]:
                del used_at[key]
    return hits, lookups


def _belady(trace, slots, layers):
    # next_use[i][key]: the index of the next fetch after i that asks for key (inf if none)
    far = len(trace)
    upcoming: dict[tuple[int, int], int] = {}
    next_use: list[dict[tuple[int, int], int]] = [None] * len(trace)  # type: ignore[list-item]
    for i in range(len(trace) - 1, -1, -1):
        layer, experts = trace[i]
        next_use[i] = {}
        for e in experts:
            key = (layer, e)
            next_use[i][key] = upcoming.get(key, far)
            upcoming[key] = i
    cache: dict[tuple[int, int], int] = {}  # key -> index of its next use
    hits = lookups = 0
    for i, (layer, experts) in enumerate(trace):
        want = [(layer, e) for e in experts]
        missing = _missing(want, cache)
        hits, lookups = hits + len(want) - len(missing), lookups + len(want)
        wanted = set(want)
        over = len(cache) + len(missing) - slots
        if over > 0:
            order = sorted((k for k in cache if k not in wanted), key=lambda k: -cache[k])
            for key in order[:over]:
                del cache[key]
        for key in want:
            cache[key] = next_use[i][key]
    return hits, lookups


def align_guesses(trace: Trace, guesses: list[tuple[int, int, tuple[int, ...]]]) -> dict[int, tuple[int, ...]]:
    """{trace index: guessed experts}: each read-ahead guess (made when the trace was `pos` long,
    for `layer`) belongs to the first fetch of that layer from `pos` on."""
    out = {}
    for pos, layer, experts in guesses:
        j = next((j for j in range(pos, min(pos + 4, len(trace))) if trace[j][0] == layer), None)
        if j is not None:
            out[j] = experts
    return out


def routing_stats(trace: Trace, experts: int, guessed: dict[int, tuple[int, ...]] | None = None):
    """Per layer: reuse (share of a token's experts the previous token also chose), load skew
    (the hottest tenth of experts' share of lookups, and the busiest expert's load over the
    mean), and, given the read-ahead guesses {trace index: experts} (align_guesses), the share
    of a layer's experts that the previous layer's guess got right. Returns {layer: dict}."""
    by_layer: defaultdict[int, list[int]] = defaultdict(list)  # layer -> its trace indices
    for i, (layer, _) in enumerate(trace):
        by_layer[layer].append(i)
    hot = max(1, round(experts / 10))
    out = {}
    for layer, idx in sorted(by_layer.items()):
        steps = [trace[i][1] for i in idx]
        k = len(steps[0])
        reuse = [len(set(a) & set(b)) / k for a, b in zip(steps, steps[1:])]
        load = [0] * experts
        for chosen in steps:
            for e in chosen:
                load[e] += 1
        total = sum(load)
        row = {
            "tokens": len(steps),
            "k": k,
            "reuse": sum(reuse) / len(reuse) if reuse else float("nan"),
            "hot_share": sum(sorted(load, reverse=True)[:hot]) / total,
            "hot_experts": hot,
            "max_over_mean": max(load) / (total / experts),
        }
        if guessed is not None:
            right = [len(set(guessed[i]) & set(trace[i][1])) / k for i in idx if i in guessed]
            row["lookahead"] = sum(right) / len(right) if right else float("nan")
        out[layer] = row
    return out
