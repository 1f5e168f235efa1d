#!/usr/bin/env python3
"""Cold start with and without the expert usage file (engine/experts/usage.py), same sitting.

First a usage file is learned by running the model on --learn prompts (chat questions, each
answered with --tokens tokens) into a temporary file. Then, per expert cache size and round, two
fresh processes answer a different question, one with the usage file (preloading from it) and one
without, in alternating order; before each, the model's expert files are dropped from the page
cache (posix_fadvise DONTNEED), so every expert either process reads comes from the disk. Each
prints: load time, time to first token (from the request, after load), decode tok/s, experts read
on demand, and bytes the process read from the disk (/proc/self/io).

    python benchmarks/preload.py                          # the demo, whole cache and a quarter
    python benchmarks/preload.py -m MODEL --cache 1,0.25 --rounds 3 --out /tmp/preload.json

A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_common import cpu_model, source_revision  # noqa: E402

LEARN = [
    "Explain how a hash table works.",
    "Write a short poem about the sea.",
    "What are the planets of the solar system?",
    "How do I read a file line by line in Python?",
    "Give me three tips for a job interview.",
    "Why is the sky blue?",
]
ASK = "Tell me about the history of Paris in a few sentences."


def child(model: str, cache: int | None, usage_file: str | None, prompt: str, tokens: int) -> dict:
    """One fresh process's numbers (this runs in the child)."""
    from flashmoe.engine import GenerationFinished, TokenGenerated
    from flashmoe.engine.benchmark import disk_read_bytes, expert_files
    from flashmoe.engine.runtime.engine import Engine
    from flashmoe.engine.runtime.generate import GenerationRequest

    t0 = time.perf_counter()
    eng = Engine(model, expert_cache=cache, kernels="cpu", expert_usage=usage_file is not None, usage_file=usage_file)
    info = eng.wait_loaded()
    load_s = time.perf_counter() - t0
    read0 = disk_read_bytes()
    t = time.perf_counter()
    first = None
    for ev in eng.submit(GenerationRequest(messages=[{"role": "user", "content": prompt}], max_tokens=tokens)):
        if isinstance(ev, TokenGenerated) and first is None:
            first = time.perf_counter() - t
        if isinstance(ev, GenerationFinished):
            done = ev
    store = eng.loaded.store
    out = dict(
        load_s=load_s,
        ttft_s=first,
        decode_tps=done.generation_tps,
        prompt_tokens=done.prompt_tokens,
        misses=store.misses_total,
        preloaded=info.preloading,
        preloaded_bytes=info.preloading_bytes,
        disk_bytes=(disk_read_bytes() - read0) if read0 is not None else None,
        cache_bytes=info.cache_bytes,
        cache_state=done.cache_state,
        hit_rate=done.hit_rate,
    )
    files = expert_files(eng.loaded)
    eng.close()
    out["files"] = [str(f) for f in files]
    return out


def run_child(*args) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True, cwd=ROOT, timeout=1800
    )
    if r.returncode != 0:
        raise SystemExit(f"child failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="model folder (default: the demo)")
    p.add_argument("--cache", default="1,0.25", help="expert cache sizes as fractions of all experts (default 1,0.25)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--learn", type=int, default=4, help="prompts the usage file is learned from (default 4)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(*json.loads(a.child))))
        return 0
    from flashmoe.engine.benchmark import evict
    from flashmoe.engine.formats.demo import ensure_demo

    model = a.model or str(ensure_demo(lambda *_: None))
    with tempfile.TemporaryDirectory(prefix="flashmoe-preload-") as tmp:
        usage_file = str(Path(tmp) / "expert-usage.json")
        learned = [run_child(model, None, usage_file, LEARN[i % len(LEARN)], a.tokens) for i in range(a.learn)]
        files = [Path(f) for f in learned[0]["files"]]
        total = learned[0]["cache_bytes"]
        data = json.loads(Path(usage_file).read_text())
        print(
            f"model {model}; usage learned from {a.learn} prompts x {a.tokens} tokens ({data['tokens']} tokens "
            f"of fetches); measured on a different prompt; {cpu_model()}; {source_revision()}"
        )
        rows = []
        for frac in [float(x) for x in a.cache.split(",")]:
            cache = None if frac >= 1 else int(total * frac)
            runs: dict[str, list] = {"off": [], "on": []}
            for r in range(a.rounds):
                for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    evict(files)
                    runs[mode].append(run_child(model, cache, usage_file if mode == "on" else None, ASK, a.tokens))
                    if mode == "on":  # measuring must not teach the file the measured prompt
                        Path(usage_file).write_text(json.dumps(data))
            med = {
                m: {
                    k: statistics.median(x[k] for x in v)
                    for k in ("load_s", "ttft_s", "decode_tps", "misses", "disk_bytes", "preloaded")
                }
                for m, v in runs.items()
            }
            rows.append(
                {"cache_fraction": frac, "cache_bytes": runs["on"][0]["cache_bytes"], "median": med, "runs": runs}
            )
            off, on = med["off"], med["on"]
            print(
                f"cache {frac:.0%} of experts ({runs['on'][0]['cache_bytes'] / 2**20:.1f} MiB), page cache dropped "
                f"before each process, {a.rounds} rounds, medians:"
            )
            for m in ("off", "on"):
                x = med[m]
                print(
                    f"  usage {m:>3}: load {x['load_s']:.2f} s, first token {x['ttft_s']:.3f} s "
                    f"({runs[m][0]['prompt_tokens']} prompt tok), decode {x['decode_tps']:.1f} tok/s, "
                    f"{x['misses']:.0f} experts read on demand, {x['preloaded']:.0f} preloaded, "
                    f"disk {x['disk_bytes'] / 2**20:.1f} MiB"
                )
            print(
                f"  ratio on/off: first token {on['ttft_s'] / off['ttft_s']:.2f}x, decode "
                f"{on['decode_tps'] / off['decode_tps']:.2f}x, on-demand reads {on['misses'] / max(off['misses'], 1):.2f}x"
            )
        if a.out:
            Path(a.out).write_text(
                json.dumps({"model": model, "learned_tokens": data["tokens"], "rows": rows}, indent=1)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
