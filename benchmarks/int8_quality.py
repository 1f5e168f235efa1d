#!/usr/bin/env python3
"""What `--kernels cpu-int8` costs in quality, and what it buys in decode speed, same sitting.

For each model: held-out text (the demo's, pydoc pages) is fed one token at a time, as decoding
does (the int8 kernels serve one-row steps; prefill chunks keep the float path), through the
same weights loaded with kernels=cpu and with kernels=cpu-int8. Printed per model: perplexity of
each, the mean KL(cpu || cpu-int8) per token, how often their top tokens agree, how many of 64
greedy tokens of a chat reply are the same before the first difference, and decode ms per step.

    python benchmarks/int8_quality.py -m DENSE_FOLDER -m DEMO_FOLDER [--tokens 256]

A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_common import cpu_model, source_revision  # noqa: E402


def step_logits(lm, ids):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm.model)
    out, times = [], []
    for i in ids:
        t = time.perf_counter()
        y = lm.model(mx.array([[int(i)]]), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(y)
        times.append(time.perf_counter() - t)
        out.append(np.array(y))
    return np.stack(out), sorted(times)[len(times) // 2]


def greedy(lm, ids, n):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm.model)
    y = lm.model(mx.array([ids]), cache=cache)
    toks = []
    for _ in range(n):
        t = int(mx.argmax(y[0, -1]).item())
        toks.append(t)
        y = lm.model(mx.array([[t]]), cache=cache)
    return toks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", action="append", required=True)
    p.add_argument("--tokens", type=int, default=256)
    a = p.parse_args()
    import numpy as np

    from flashmoe.engine.formats import demo_text
    from flashmoe.engine.runtime.loader import load

    print(f"{cpu_model()}; {source_revision()}; {a.tokens} held-out tokens fed one at a time")
    for path in a.model:
        lms = {k: load(path, kernels=k) for k in ("cpu", "cpu-int8")}
        tok = lms["cpu"].tokenizer
        ids = tok.encode(demo_text.held_out_text(), add_special_tokens=False)[: a.tokens + 1]
        chat = tok.encode(
            tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
            add_special_tokens=False,
        )
        res = {}
        for k, lm in lms.items():
            logits, ms = step_logits(lm, ids[:-1])
            lp = logits - logits.max(-1, keepdims=True)
            lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
            res[k] = dict(
                lp=lp,
                ms=ms * 1e3,
                ppl=float(np.exp(-lp[np.arange(len(ids) - 1), ids[1:]].mean())),
                greedy=greedy(lm, chat, 64),
            )
        f, q = res["cpu"], res["cpu-int8"]
        kl = float((np.exp(f["lp"]) * (f["lp"] - q["lp"])).sum(-1).mean())
        agree = float((f["lp"].argmax(-1) == q["lp"].argmax(-1)).mean())
        same = next((i for i, (x, y) in enumerate(zip(f["greedy"], q["greedy"])) if x != y), 64)
        print(f"{path}: int8 matrices {lms['cpu-int8'].int8_matrices}")
        print(
            f"  perplexity cpu {f['ppl']:.3f}, cpu-int8 {q['ppl']:.3f} ({q['ppl'] / f['ppl']:.4f}x); "
            f"KL(cpu || cpu-int8) {kl:.5f} nats/token; top token agrees {agree:.1%}; "
            f"greedy chat reply: first {same} of 64 tokens the same"
        )
        print(
            f"  decode step (median, one token at a time) cpu {f['ms']:.2f} ms, cpu-int8 {q['ms']:.2f} ms "
            f"({f['ms'] / q['ms']:.2f}x)"
        )
        print(f"  cpu     : {tok.decode(f['greedy'][:24])!r}")
        print(f"  cpu-int8: {tok.decode(q['greedy'][:24])!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
