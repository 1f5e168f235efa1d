"""`flashmoe bench quality`: what a low bit width or a low K costs, beside what it saves.

For each model and each --experts-per-token: perplexity on a text, the mean KL divergence from a
reference model's next-token distribution on the same text (llama.cpp's perplexity --kl-divergence
mode; the reference is the first model at its own K unless --reference names one), the bytes read
per token and the speed, every figure with its conditions. The valid-call rate of `bench tools`
joins the table from its --out file (--tools)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .bench_cache import read_text
from .errors import UsageError


def tool_rates(path: str | None) -> dict:
    """{(model folder, K): [(constrain mode, valid-call rate)]} from a `bench tools --out` file."""
    if path is None:
        return {}
    try:
        out: dict = {}
        for r in json.loads(Path(path).read_text(encoding="utf-8"))["results"]:
            out.setdefault((os.path.realpath(r["model"]), r["top_k"]), []).append(
                (r["constrain"], float(r["valid_call_rate"]))
            )
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--tools {path}: not a `flashmoe bench tools --out` file ({e.__class__.__name__})") from None


def cmd_bench_quality(args) -> int:
    from flashmoe.engine.options import resolve_dtype
    from flashmoe.engine.quality import DECODE_TOKENS, WINDOW, decode_cost, score
    from flashmoe.engine.runtime.generate import model_bits
    from flashmoe.engine.runtime.loader import load

    from .models import resolve_model
    from .units import human_bytes

    if args.disk_cache:
        raise UsageError("--disk-cache: bench quality scores every window from an empty cache")
    if args.prefetch not in (None, "off"):
        raise UsageError(
            f"--prefetch {args.prefetch}: bench quality scores whole windows (prefill), where read-ahead does not run"
        )
    text, source = read_text(args.text)
    tools = tool_rates(args.tools)
    models = [resolve_model(m) for m in (args.models or [None])]
    ks = args.experts_per_token_list or [None]

    def open_model(model, k):
        return load(
            model,
            expert_cache=args.expert_cache,
            ctx_size=getattr(args, "ctx_size", None),
            io_threads=args.io_threads,
            direct_io=args.direct_io,
            dtype=resolve_dtype(args.dtype),
            kernels=args.kernels,
            kv_cache=args.kv_cache,
            cache_policy=args.cache_policy,
            verify_reads=args.verify_reads != "off",
            experts_per_token=k,
            allow_resident_experts=args.allow_resident_experts,
        )

    reference_model = resolve_model(args.reference) if args.reference else models[0]
    ref = open_model(reference_model, None if args.reference else ks[0])
    ids = ref.tokenizer.encode(text, add_special_tokens=False)[: args.tokens + 1]
    if len(ids) < 2:
        raise UsageError(f"--text {source}: {len(ids)} token(s); at least 2 are needed")
    ref_scores = score(ref, ids, None)
    ref_name = f"{reference_model} at K={ref.top_k}"
    ref.close()
    print(
        f"text: {len(ids) - 1} tokens of {source}, scored in {WINDOW}-token windows (prefill, each from "
        f"an empty KV cache); KL: mean KL(reference || model) per token, reference {ref_name}"
    )
    head = (
        f"{'model':<28} {'type':<10} {'bits':>5} {'K':>8} {'ppl':>8} {'KL':>7} {'logp':>7} "
        f"{'read/token':>11} {'hit':>5} {'decode':>7} {'prefill':>8}  valid calls"
    )
    print(head)
    rows = []
    for model in models:
        for k in ks:
            lm = open_model(model, k)
            bits = model_bits(lm.config)
            r = score(lm, ids, ref_scores["logprobs"])
            r.pop("logprobs")
            r.update(decode_cost(lm, ids[:DECODE_TOKENS]))
            kk = f"{lm.top_k}" + (f" of {lm.trained_top_k}" if lm.trained_top_k else "")
            calls = tools.get((os.path.realpath(model), lm.top_k), [])
            r.update(
                model=str(model),
                model_type=lm.config["model_type"],
                bits=bits,
                k=lm.top_k,
                trained_k=lm.trained_top_k,
                cache=human_bytes(lm.store.capacity_bytes) if lm.store else None,
                valid_calls=dict(calls),
            )
            lm.close()
            rows.append(r)
            name = Path(model).name if len(str(model)) > 28 else str(model)
            valid = ", ".join(f"{v:.0%} ({m})" for m, v in r["valid_calls"].items()) or "-"
            print(
                f"{name[-28:]:<28} {r['model_type'][:10]:<10} {bits or 'float':>5} {kk:>8} "
                f"{r['perplexity']:>8.2f} {r['kl']:>7.4f} {r['mean_logprob']:>7.3f} "
                f"{human_bytes(r['bytes_per_token']):>11} {r['hit_rate']:>5.0%} {r['decode_tps']:>7.1f} "
                f"{r['prefill_tps']:>8.1f}  {valid}"
            )
    print(
        f"read/token, hit, decode: {DECODE_TOKENS} tokens of the text fed one at a time after scoring "
        f"(expert cache {rows[-1]['cache']}, {args.cache_policy}, warm from the scoring); decode and "
        f"prefill in tok/s; valid calls: `bench tools` (--tools)"
    )
    if args.out:  # a temporary name, then renamed: never a half-written file
        out = Path(args.out)
        tmp = out.with_name(f".{out.name}.partial")
        ref_scores.pop("logprobs")
        tmp.write_text(
            json.dumps(
                {
                    "text": source,
                    "tokens": len(ids) - 1,
                    "reference": ref_name,
                    "reference_scores": ref_scores,
                    "rows": rows,
                },
                indent=2,
            )
        )
        tmp.replace(out)
    return 0
