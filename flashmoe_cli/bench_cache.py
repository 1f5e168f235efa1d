"""`flashmoe bench cache`: record which experts a model routes to on real text, then replay the
expert cache's policies (LRU, LFU) over that trace at a range of sizes beside Belady's optimum,
with the routing statistics peers publish (reuse, load skew, read-ahead accuracy)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import UsageError


def read_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from): the file given, or the demo's held-out pydoc text."""
    if path is None:
        from flashmoe.engine.formats import demo_text

        return demo_text.held_out_text(), f"pydoc pages of {', '.join(demo_text.HELD_OUT_MODULES)}"
    try:
        return Path(path).read_text(encoding="utf-8"), path
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--text {path}: cannot read it as UTF-8 text ({e.__class__.__name__})") from None


def default_slots(k: int, experts: int) -> list[int]:
    """Slots per layer to replay: K (the least a token needs) up to every expert, with 2K and 4K."""
    steps = {k, experts, *(v for v in (2 * k, 4 * k) if v <= experts)}
    steps |= {round(k + (experts - k) * f / 6) for f in range(1, 6)}
    return sorted(steps)


def curve(rows: list[dict], width: int = 56, height: int = 12) -> list[str]:
    """Hit rate against slots per layer as text: B Belady, f LFU, r LRU (* where they meet)."""
    xs = [r["slots_per_layer"] for r in rows]
    lo, hi = min(xs), max(xs)
    grid = [[" "] * (width + 1) for _ in range(height + 1)]
    for r in rows:
        col = round((r["slots_per_layer"] - lo) / ((hi - lo) or 1) * width)
        for mark, key in (("r", "lru"), ("f", "lfu"), ("B", "belady")):
            row = height - round(r[key] * height)
            grid[row][col] = mark if grid[row][col] == " " else "*"
    lines = [f"{100 * (height - i) / height:5.0f}% |" + "".join(g) for i, g in enumerate(grid)]
    lines.append("       +" + "-" * (width + 1))
    lines.append(f"        {lo:<{width // 2}}{'slots per layer':^0}{hi:>{width // 2 - 14}}")
    return lines


def cmd_bench_cache(args) -> int:
    from flashmoe.engine.experts.cache_sim import align_guesses, replay, routing_stats
    from flashmoe.engine.experts.trace import record
    from flashmoe.engine.options import resolve_dtype
    from flashmoe.engine.runtime.generate import model_bits
    from flashmoe.engine.runtime.loader import load

    from .models import resolve_model
    from .units import human_bytes

    if args.disk_cache:
        raise UsageError("--disk-cache: bench cache feeds its text token by token and keeps no prompt caches")
    text, source = read_text(args.text)
    model = resolve_model(args.model)
    # read-ahead must run for its guesses to be recorded: "hint" (page cache only) unless asked for slots
    prefetch = "slots" if args.prefetch == "slots" else "hint"
    loaded = load(
        model,
        expert_cache=args.expert_cache,
        ctx_size=getattr(args, "ctx_size", None),
        io_threads=args.io_threads,
        direct_io=args.direct_io,
        dtype=resolve_dtype(args.dtype),
        kernels=args.kernels,
        kv_cache=args.kv_cache,
        prefetch=prefetch,
        cache_policy=args.cache_policy,
        verify_reads=args.verify_reads != "off",
        experts_per_token=args.experts_per_token,
        allow_resident_experts=args.allow_resident_experts,
    )
    if loaded.store is None:
        raise UsageError(f"-m {model}: its experts are not streamed, so it has no expert cache to study")
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)[: args.tokens + 1]
    if len(ids) < 3:
        raise UsageError(f"--text {source}: {len(ids)} tokens; at least 3 are needed")
    layers = len(loaded.layers)
    experts = max(l.num_experts for l in loaded.layers)
    k = loaded.top_k
    expert = sum(l.expert_bytes for l in loaded.layers) / layers
    bits = model_bits(loaded.config)
    slots_engine = sum(p.slots for p in loaded.store.pools)
    trace, guesses, logprobs, hits = record(loaded, ids)
    conditions = (
        f"{model}: {loaded.config['model_type']}, {bits or 'float'}{'-bit' if bits else ''}, "
        f"K={k}{f' of {loaded.trained_top_k}' if loaded.trained_top_k else ''}, {experts} experts "
        f"x {layers} MoE layers, expert {human_bytes(expert)}; {len(logprobs)} tokens of {source}, "
        f"fed one at a time as in decoding"
    )
    loaded.close()

    stats = routing_stats(trace, experts, align_guesses(trace, guesses))
    sizes = sorted(set(args.slots or default_slots(k, experts)))
    if sizes[0] < k:
        raise UsageError(f"--slots {sizes[0]}: a token needs K={k} slots per layer")
    rows = []
    for per_layer in sizes:
        row = {"slots_per_layer": per_layer, "slots": per_layer * layers, "bytes": per_layer * layers * expert}
        for policy in ("lru", "lfu", "belady"):
            h, n = replay(trace, per_layer * layers, policy, layers)
            row[policy] = h / n
        rows.append(row)
    mean = {}
    for key in ("reuse", "hot_share", "max_over_mean", "lookahead"):  # the first layer has no guess
        values = [s[key] for s in stats.values() if not math.isnan(s.get(key, math.nan))]
        mean[key] = sum(values) / len(values) if values else math.nan
    result = {
        "conditions": conditions,
        "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
        "routing": {"mean": mean, "per_layer": stats},
        "cache": rows,
        "engine": {
            "policy": args.cache_policy,
            "slots": slots_engine,
            "hit_rate": hits / (len(trace) * k) if trace else 0.0,
        },
    }
    print(conditions)
    hot = next(iter(stats.values()))["hot_experts"]
    print(
        f"\nrouting, mean over layers (per layer: --json): reuse of the previous token's experts "
        f"{mean['reuse']:.0%} (random: {k / experts:.0%}); hottest {hot} of {experts} experts serve "
        f"{mean['hot_share']:.0%} of lookups (even: {hot / experts:.0%}); busiest expert {mean['max_over_mean']:.2f}x "
        f"the mean load; read-ahead (next layer's router on this layer's input) guesses "
        f"{mean['lookahead']:.0%} of the next layer's experts (random: {k / experts:.0%})"
    )
    print("\nhit rate over the trace, from an empty cache, one pool shared by all layers (as the engine's):")
    print(f"{'slots/layer':>11} {'slots':>6} {'memory':>9} {'LRU':>6} {'LFU':>6} {'Belady':>7}  LFU/Belady")
    for r in rows:
        print(
            f"{r['slots_per_layer']:>11} {r['slots']:>6} {human_bytes(r['bytes']):>9} {r['lru']:>6.1%} "
            f"{r['lfu']:>6.1%} {r['belady']:>7.1%}  {r['lfu'] / r['belady'] if r['belady'] else 1:.2f}"
        )
    print(
        f"the engine's own run ({args.cache_policy}, {slots_engine} slots, --prefetch {prefetch}): "
        f"{result['engine']['hit_rate']:.1%}"
    )
    print()
    print("\n".join(curve(rows)))
    print("        B Belady (the best possible), f LFU, r LRU, * where marks meet")
    if args.out:  # a temporary name, then renamed: never a half-written file
        out = Path(args.out)
        tmp = out.with_name(f".{out.name}.partial")
        tmp.write_text(json.dumps(result, indent=2, default=float))
        tmp.replace(out)
    return 0
