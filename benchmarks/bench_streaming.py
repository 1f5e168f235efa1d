#!/usr/bin/env python3
"""Streamed flashmoe engine vs resident mlx-lm on the same weights, measured in one run.

Builds (or reuses, with --keep) a synthetic random MoE model as an mlx-lm folder, converts it to
a flashmoe folder, then measures on the same prompt and decode length:

  1. resident mlx-lm: every weight in RAM, greedy loop over make_prompt_cache (the reference);
  2. streamed, expert cache big enough for every expert, all experts loaded (warm);
  3. streamed, expert cache 0 (the store keeps only top-k slots): expert files warm in the
     page cache; cold at the start of the run (posix_fadvise DONTNEED on experts/layer_*.bin,
     store.evict_all()); and cold before every token (the same eviction between tokens, its
     time taken out of the step it precedes);
  4. one timing="layer" run per streamed state: where the time goes inside a layer.

The configurations run round-robin for --rounds rounds (order rotated each round) with all
three models loaded, so that changes in machine load hit them alike; ratios are paired by
round. Every side keeps its KV cache across runs, as the engine's Session does for a repeated
prompt: only the first run prefills the whole prompt.

Every figure is printed with its conditions; --out writes everything as JSON.
Decode tok/s = forward passes / their wall time, for both sides: the engine's own
generation_tps (tokens / decode time, counting the token sampled from the prefill) is
also shown for reference.

This is a benchmark, not a test: it asserts nothing except that the runs completed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.tiny_tokenizer and engine, when run from anywhere

import mlx.core as mx  # noqa: E402

from bench_common import (  # noqa: E402
    cpu_model,
    disk_read_bytes,
    evict,
    mem_total_gib,
    read_into_page_cache,
    source_revision,
)

MARKER = "bench_model.json"
FILLER = (
    "The quick brown fox jumps over the lazy dog. Mixture-of-experts models route each "
    "token to a few experts, and the experts that are not needed stay on the disk until "
    "a token asks for them. We met at a cafe and talked about the weather in Paris, the "
    "time of day, and what to eat for dinner. Numbers like 12, 345 and 6789 appear too. "
)


# -- machine and conditions ------------------------------------------------------------------


def filesystem_of(path: Path) -> str:
    """'<fstype> on <device>' of the mount that holds path (longest mount-point prefix)."""
    path = path.resolve()
    best, desc = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, desc = mnt, f"{fstype} on {dev}"
    except OSError:
        pass
    return desc


def machine_info(model_dir: Path) -> dict:
    import mlx_lm

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "nproc": affinity,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "mem_total_gib": round(mem_total_gib(), 1),
        "model_fs": filesystem_of(model_dir),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx_device": str(mx.default_device()),
        "revision": source_revision(),
    }


# -- page cache ------------------------------------------------------------------------------

_libc = None


def _load_libc():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _libc = libc
    return _libc


def resident_fraction(files: list[Path]) -> float | None:
    """Fraction of the files' pages that sit in the page cache (mincore), or None if unknown."""
    try:
        libc = _load_libc()
        page = os.sysconf("SC_PAGE_SIZE")
        total = resident = 0
        for f in files:
            size = f.stat().st_size
            if size == 0:
                continue
            fd = os.open(f, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    n = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * n)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    resident += sum(b & 1 for b in vec)
                    total += n
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
        return resident / total if total else None
    except (OSError, AttributeError):
        return None


drop_from_page_cache = evict  # the engine's own: posix_fadvise DONTNEED on each file


# -- the synthetic model ---------------------------------------------------------------------


def model_config(a) -> dict:
    common = dict(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if a.arch == "qwen3_moe":
        return dict(
            common,
            model_type="qwen3_moe",
            head_dim=a.head_dim,
            num_experts=a.experts,
            num_experts_per_tok=a.top_k,
            moe_intermediate_size=a.moe_intermediate,
            intermediate_size=2 * a.moe_intermediate,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    if a.arch == "mixtral":
        return dict(
            common,
            model_type="mixtral",
            num_local_experts=a.experts,
            num_experts_per_tok=a.top_k,
            intermediate_size=a.moe_intermediate,
        )
    raise ValueError(a.arch)


def build_options(a) -> dict:
    return {
        "config": model_config(a),
        "bits": a.bits,
        "group_size": a.group_size,
        "float_dtype": a.float_dtype,
        "router_scale": a.router_scale,
        "seed": a.seed,
    }


def build_source(folder: Path, a) -> None:
    """Random weights with mlx-lm's own classes, quantized by mlx-lm, saved as an mlx-lm folder.

    Weights are N(0, 1/fan_in); routers are multiplied by --router-scale so that the top-k
    choice changes from token to token. Everything stays lazy until one decoder layer at a time
    is evaluated, so the peak is one layer of float weights, not the whole float model.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    from tests.tiny_tokenizer import write_tiny_tokenizer

    config = model_config(a)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    dtype = getattr(mx, a.float_dtype)
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(a.seed), len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if p.ndim >= 2 and mx.issubdtype(p.dtype, mx.floating):
            p = mx.random.normal(p.shape, key=k, dtype=mx.float32) * (p.shape[-1] ** -0.5)
            leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
            if leaf == "gate":  # the router (qwen3_moe mlp.gate, mixtral block_sparse_moe.gate)
                p = p * a.router_scale
            elif "embed" in name:
                p = p * 8.0
        if mx.issubdtype(p.dtype, mx.floating):
            p = p.astype(dtype)
        new.append((name, p))
    model.load_weights(new, strict=True)
    del new, params
    if a.bits:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, a.group_size, a.bits)
    for layer in model.layers:  # one layer's float weights at a time
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    write_tiny_tokenizer(folder, min(a.vocab, 1024))
    del model
    gc.collect()
    mx.clear_cache()


def prepare_model(workdir: Path, a, log) -> tuple[Path, Path, float]:
    """(mlx-lm folder, flashmoe folder, seconds spent building); reuses a matching earlier build."""
    from flashmoe.engine.formats.convert import convert

    src, packed = workdir / "mlx_lm", workdir / "flashmoe"
    marker = workdir / MARKER
    want = build_options(a)
    if marker.exists():
        have = json.loads(marker.read_text())
        if have == want and (packed / "config.json").exists() and (src / "config.json").exists():
            log(f"reusing the model in {workdir}")
            return src, packed, 0.0
        log(f"{workdir} holds a model built with other options: rebuilding it")
        marker.unlink()
        for d in (src, packed, workdir / "flashmoe.partial"):
            shutil.rmtree(d, ignore_errors=True)
    elif workdir.exists() and any(workdir.iterdir()):
        sys.exit(f"error: {workdir} is not empty and was not made by this script (no {MARKER})")
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    log("building the random model (mlx-lm classes) ...")
    build_source(src, a)
    log(f"  built in {time.perf_counter() - t0:.1f} s; converting to the flashmoe format ...")
    t1 = time.perf_counter()
    convert(src, packed)
    log(f"  converted in {time.perf_counter() - t1:.1f} s")
    marker.write_text(json.dumps(want, indent=1))
    return src, packed, time.perf_counter() - t0


# -- prompt ----------------------------------------------------------------------------------


def make_prompt(tokenizer, n: int) -> str:
    """Text that the model's tokenizer encodes to exactly n tokens (or the nearest it can)."""
    words = (FILLER * (1 + 2 * n // max(1, len(FILLER.split())))).split(" ")
    best = ""
    for i in range(1, len(words) + 1):
        text = " ".join(words[:i])
        m = len(tokenizer.encode(text, add_special_tokens=True))
        if m == n:
            return text
        if m > n:
            break
        best = text
    ids = tokenizer.encode(best or FILLER, add_special_tokens=True)
    return best or tokenizer.decode(ids[:n])


# -- the two sides ---------------------------------------------------------------------------
#
# Both sides keep one KV cache across runs, as the engine's Session does for a repeated prompt:
# the first run prefills the whole prompt; later runs trim the cache back to prompt[:-1] and
# feed only the last prompt token. Decode then starts from the same state on both sides, and a
# measured run costs its decode plus one token, not a whole (for cache=0, slow) prefill.


def summarize_steps(steps: list[float], tokens: list[int], prefill_s: float, prefilled: int) -> dict:
    total = sum(steps)
    return {
        "prefilled_tokens": prefilled,
        "generated_tokens": len(tokens),
        "forward_passes": len(steps),
        "prefill_s": prefill_s,
        "prefill_tps": prefilled / prefill_s if prefill_s > 0 else 0.0,
        "decode_s": total,
        "decode_tps": len(steps) / total if total > 0 else 0.0,
        "step_ms": [1e3 * s for s in steps],
        "tokens": tokens,
    }


class ResidentSide:
    """mlx-lm's model with every weight in RAM and a plain greedy loop: the reference."""

    def __init__(self, model, ids: list[int]):
        self.model, self.ids, self.cache = model, ids, None

    def run(self, n: int) -> dict:
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        if self.cache is None:
            self.cache, todo = make_prompt_cache(self.model), self.ids
        else:
            trim_prompt_cache(self.cache, self.cache[0].offset - (len(self.ids) - 1))
            todo = self.ids[-1:]
        t0 = time.perf_counter()
        logits = self.model(mx.array([todo]), cache=self.cache)[0, -1]
        mx.eval(logits)
        prefill_s = time.perf_counter() - t0
        tokens, steps = [], []
        for i in range(n):  # n tokens: the first from the prefill's logits, then n-1 forward passes
            t = time.perf_counter()
            token = int(mx.argmax(logits.astype(mx.float32)).item())
            tokens.append(token)
            if i == n - 1:
                break
            logits = self.model(mx.array([[token]]), cache=self.cache)[0, -1]
            mx.eval(logits)
            steps.append(time.perf_counter() - t)
        return summarize_steps(steps, tokens, prefill_s, len(todo))


class EngineSide:
    """The streamed engine through engine.generate, one Session kept across runs."""

    def __init__(self, loaded, prompt: str, expert_files: list[Path]):
        from flashmoe.engine.runtime.generate import Session

        self.loaded, self.prompt, self.files = loaded, prompt, expert_files
        self.session = Session(loaded)

    def run(self, n: int, timing: str = "step", drop_each_token: bool = False) -> dict:
        from flashmoe.engine.events import GenerationFinished, LayerTimings, StepFinished, TokenGenerated
        from flashmoe.engine.runtime.generate import GenerationRequest, generate

        tokens, steps, layer_rows = [], [], []
        drops: dict[int, float] = {}
        hits = misses = nbytes = 0
        done = None
        disk0 = disk_read_bytes()
        req = GenerationRequest(prompt=self.prompt, max_tokens=n, timing=timing)
        for ev in generate(self.loaded, self.session, req):
            if isinstance(ev, TokenGenerated):
                tokens.append(ev.id)
                if drop_each_token and len(tokens) < n:
                    # The forward pass that follows reads this token's experts: make them cold.
                    # The time spent here lands in the engine's step wall time; subtract it.
                    t = time.perf_counter()
                    drop_from_page_cache(self.files)
                    drops[ev.step] = time.perf_counter() - t
            elif isinstance(ev, StepFinished):
                steps.append(ev.wall_ms / 1e3 - drops.get(ev.step, 0.0))
                hits, misses, nbytes = hits + ev.hits, misses + ev.misses, nbytes + ev.expert_bytes_read
            elif isinstance(ev, LayerTimings):
                layer_rows.append(ev.rows)
            elif isinstance(ev, GenerationFinished):
                done = ev
        disk1 = disk_read_bytes()
        if done is None or done.generation_tokens != n:
            raise RuntimeError(
                f"the engine generated {done and done.generation_tokens} tokens, wanted {n} "
                f"(reason {done and done.reason})"
            )
        out = summarize_steps(steps, tokens, done.prefill_s, done.prompt_tokens - done.reused_prompt_tokens)
        # The store's io wait and router sync reach callers only through the per-layer rows
        # (sent in step mode too). Prefill is not in them: the engine resets the store's
        # counters after prefill. /proc/self/io is per run, so its disk bytes include prefill's.
        io_s = sum(r.expert_io_ms for rows in layer_rows for r in rows) / 1e3
        route_s = sum(r.route_ms for rows in layer_rows for r in rows) / 1e3
        out.update(
            {
                "engine_generation_tps": done.generation_tps,
                "engine_bytes_per_token": done.bytes_per_token,
                "engine_hit_rate": done.hit_rate,
                "engine_cache_state": done.cache_state,
                "bytes_read": nbytes,
                "hits": hits,
                "misses": misses,
                "io_wait_s": io_s,
                "route_s": route_s,
                "disk_bytes_run": (disk1 - disk0) if disk0 is not None and disk1 is not None else None,
                "drop_s": sum(drops.values()),
            }
        )
        if timing == "layer":
            # Engines whose layer clock is not reset after prefill (no LayerClock.reset) put the
            # prefill's attention and layer totals into step 0's rows, where "other" absorbs
            # the whole prefill: leave step 0 out there.
            skip = 0 if clock_resets_after_prefill() else 1
            rows = layer_rows[skip:] if len(layer_rows) > skip else layer_rows
            out["layer_ms"] = mean_layer_rows(rows)
            out["layer_steps_averaged"] = len(rows)
            out["layer_step0_skipped"] = bool(skip)
        return out


def clock_resets_after_prefill() -> bool:
    from flashmoe.engine.runtime.timing import LayerClock

    return hasattr(LayerClock, "reset")


LAYER_FIELDS = ("attn_ms", "route_ms", "expert_io_ms", "expert_compute_ms", "other_ms")


def mean_layer_rows(per_step: list) -> list[dict]:
    """Per layer, the mean per decode step of attn / route / io / compute / other ms."""
    if not per_step:
        return []
    n = len(per_step)
    out = []
    for i in range(len(per_step[0])):
        row = {"layer": per_step[0][i].layer}
        for f in LAYER_FIELDS:
            row[f] = sum(getattr(rows[i], f) for rows in per_step) / n
        out.append(row)
    return out


def prewarm_all_experts(loaded) -> None:
    """Read every expert of every layer into the store's slots (needs a cache that holds them)."""
    store = loaded.store
    for l in loaded.layers:
        if store.pool(l.layer).slots < l.num_experts:
            raise RuntimeError("the expert cache is too small to hold every expert")
        store.fetch(l.layer, list(range(l.num_experts)))
    store.step_done()


def aggregate(runs: list[dict], ref_runs: list[dict] | None, theory_all_miss: float) -> dict:
    """One configuration over its rounds: medians of per-round figures, sums of the counters."""
    tps = [r["decode_tps"] for r in runs]
    steps = [s for r in runs for s in r["step_ms"]]
    fwd = sum(r["forward_passes"] for r in runs)
    out = {
        "rounds": len(runs),
        "decode_tps_median": statistics.median(tps),
        "decode_tps_rounds": tps,
        "decode_tps_pooled": fwd / sum(r["decode_s"] for r in runs),
        "step_ms_median": statistics.median(steps),
        "step_ms_min": min(steps),
        "step_ms_max": max(steps),
        "prefilled_tokens": runs[0]["prefilled_tokens"],
        "generated_tokens": runs[0]["generated_tokens"],
        "forward_passes_per_run": runs[0]["forward_passes"],
    }
    if ref_runs is not None:
        # Paired by round (the two ran back to back), which cancels slow drifts in machine load.
        ratios = [r["decode_tps"] / q["decode_tps"] for r, q in zip(runs, ref_runs)]
        out["ratio_rounds"] = ratios
        out["ratio_median"] = statistics.median(ratios)
    if "hits" in runs[0]:
        hits = sum(r["hits"] for r in runs)
        misses = sum(r["misses"] for r in runs)
        nbytes = sum(r["bytes_read"] for r in runs)
        io_s = sum(r["io_wait_s"] for r in runs)
        decode_s = sum(r["decode_s"] for r in runs)
        disk = [r["disk_bytes_run"] for r in runs]
        miss_rate = misses / (hits + misses) if hits + misses else 0.0
        out.update(
            {
                "hits": hits,
                "misses": misses,
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "miss_rate": miss_rate,
                "bytes_per_token": nbytes / fwd,
                "bytes_per_token_theory": theory_all_miss * miss_rate,
                "engine_bytes_per_token": [r["engine_bytes_per_token"] for r in runs],
                "io_wait_s": io_s,
                "io_gbps": nbytes / io_s / 1e9 if io_s > 0 else None,
                "io_wait_share": io_s / decode_s if decode_s > 0 else 0.0,
                "route_ms_per_token": 1e3 * sum(r["route_s"] for r in runs) / fwd,
                "disk_bytes_per_token": (sum(disk) / fwd) if None not in disk else None,
                "engine_generation_tps": [r["engine_generation_tps"] for r in runs],
                "engine_cache_state": sorted({r["engine_cache_state"] for r in runs}),
                "page_cache_resident_before": [r.get("page_cache_resident_before") for r in runs],
            }
        )
    return out


# -- reporting -------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Benchmark the streamed flashmoe engine against resident mlx-lm on the same "
        "synthetic MoE weights, in one run. Prints every figure with its conditions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("synthetic model")
    g.add_argument("--arch", choices=("qwen3_moe", "mixtral"), default="qwen3_moe")
    g.add_argument("--hidden", type=int, default=1024, help="hidden size")
    g.add_argument("--layers", type=int, default=8, help="decoder layers (all MoE)")
    g.add_argument("--experts", type=int, default=64, help="routed experts per layer")
    g.add_argument("--top-k", type=int, default=8, help="experts per token")
    g.add_argument("--moe-intermediate", type=int, default=768, help="expert intermediate size")
    g.add_argument("--heads", type=int, default=16, help="attention heads")
    g.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    g.add_argument("--head-dim", type=int, default=64, help="head dim (qwen3_moe)")
    g.add_argument("--vocab", type=int, default=2048, help="vocabulary of the model")
    g.add_argument(
        "--bits", type=int, default=4, choices=(0, 2, 3, 4, 5, 6, 8), help="quantization bits (0: keep float weights)"
    )
    g.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    g.add_argument(
        "--float-dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the float weights, hence of the quantization scales and biases",
    )
    g.add_argument(
        "--router-scale",
        type=float,
        default=4.0,
        help="router weights x this, so that routing varies from token to token",
    )
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("run")
    g.add_argument("--prompt-tokens", type=int, default=32)
    g.add_argument(
        "--gen-tokens",
        type=int,
        default=32,
        help="tokens generated per measured run (gen-tokens - 1 timed forward passes)",
    )
    g.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measured runs per configuration, interleaved round-robin so that "
        "changes in machine load hit every configuration alike",
    )
    g.add_argument("--layer-tokens", type=int, default=10, help="tokens per timing='layer' run")
    g.add_argument("--io-threads", type=int, default=8)
    g.add_argument("--direct-io", action="store_true", help="load the streamed models with O_DIRECT")
    g.add_argument(
        "--kernels",
        default="mlx",
        choices=("mlx", "cpu", "auto"),
        help="quantized matmul kernels of the streamed engine (default mlx)",
    )
    g.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="build the model in DIR and keep it; a later run with the same model "
        "options reuses it (default: a temporary folder, removed at the end)",
    )
    g.add_argument("--out", type=Path, metavar="FILE", help="also write every figure as JSON")
    a = p.parse_args(argv)
    if a.gen_tokens < 2 or a.layer_tokens < 3:
        p.error("--gen-tokens must be at least 2 and --layer-tokens at least 3")
    if a.rounds < 1 or a.prompt_tokens < 2:
        p.error("--rounds must be at least 1 and --prompt-tokens at least 2")
    if a.vocab < 320:
        p.error("--vocab must be at least 320 (the tiny tokenizer's byte alphabet needs 261 ids)")
    if a.top_k > a.experts:
        p.error("--top-k cannot exceed --experts")

    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    tmp = None
    if a.keep:
        workdir = a.keep
    else:
        tmp = tempfile.mkdtemp(prefix="flashmoe-bench-")
        workdir = Path(tmp)
    try:
        return bench(a, workdir, log, t_start)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


CONFIGS = (
    # key, label, cache state of the expert files
    ("resident", "resident mlx-lm (all in RAM)", "warm"),
    ("full", "stream, cache=all, prewarmed", "warm"),
    ("zero_warm", "stream, cache=0, page cache warm", "warm"),
    ("zero_cold", "stream, cache=0, COLD at start", "cold"),
    ("zero_cold_each", "stream, cache=0, COLD every token", "cold"),
)


def bench(a, workdir: Path, log, t_start: float) -> int:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from flashmoe.engine.runtime.generate import GenerationRequest, render_prompt
    from flashmoe.engine.runtime.loader import load

    load_start = [round(x, 2) for x in os.getloadavg()]  # before the build: was the machine busy?
    src, packed, build_s = prepare_model(workdir, a, log)
    machine = machine_info(packed)
    machine["loadavg_at_start"] = load_start

    # -- load all three: resident mlx-lm, streamed with every expert cached, streamed cache=0 --
    log("loading resident mlx-lm and two streamed models (cache=all, cache=0) ...")
    model, _ = load_model(src)
    mx.eval(model.parameters())
    resident_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    def open_streamed(cache):
        loaded = load(packed, expert_cache=cache, io_threads=a.io_threads, direct_io=a.direct_io, kernels=a.kernels)
        loaded.tokenizer.eos_token_ids = frozenset()  # random weights: never stop early
        return loaded

    from flashmoe.engine.experts.layout import read_manifest

    every_expert = sum(l.expert_bytes * l.num_experts for l in read_manifest(packed / "experts"))
    full, zero = open_streamed(every_expert), open_streamed(0)
    prompt = make_prompt(full.tokenizer, a.prompt_tokens)
    ids = render_prompt(full, GenerationRequest(prompt=prompt))  # the ids the engine will run
    layers = full.layers
    K = full.top_k
    expert_bytes = layers[0].expert_bytes
    moe_layers = len(layers)
    theory_all_miss = K * expert_bytes * moe_layers
    expert_files = [packed / "experts" / l.file for l in layers]
    all_expert_bytes = sum(l.expert_bytes * l.num_experts for l in layers)
    caps = {"full": full.store.capacity_bytes, "zero": zero.store.capacity_bytes}

    sides = {
        "resident": ResidentSide(model, ids),
        "full": EngineSide(full, prompt, expert_files),
        "zero": EngineSide(zero, prompt, expert_files),
    }

    # -- warm-up: the full prefill of each side (reported), MLX and allocator warm-up ---------
    log(f"warm-up runs (full {len(ids)}-token prefill on each side) ...")
    read_into_page_cache(expert_files)
    warm = {"resident": sides["resident"].run(4), "full": sides["full"].run(4), "zero": sides["zero"].run(4)}
    prewarm_all_experts(full)

    def run_config(key: str, n: int, timing: str = "step") -> dict:
        if key == "resident":
            return sides["resident"].run(n)
        if key == "full":
            return sides["full"].run(n, timing)
        if key == "zero_warm":
            read_into_page_cache(expert_files)
        else:
            drop_from_page_cache(expert_files)
        zero.store.evict_all()
        before = resident_fraction(expert_files)
        r = sides["zero"].run(n, timing, drop_each_token=(key == "zero_cold_each"))
        r["page_cache_resident_before"] = before
        return r

    # -- measured rounds, round-robin, the order rotated each round --------------------------
    keys = [k for k, _, _ in CONFIGS]
    runs: dict[str, list[dict]] = {k: [] for k in keys}
    for rnd in range(a.rounds):
        order = keys[rnd % len(keys) :] + keys[: rnd % len(keys)]
        for key in order:
            runs[key].append(run_config(key, a.gen_tokens))
        log(
            f"round {rnd + 1}/{a.rounds}: " + ", ".join(f"{k} {runs[k][-1]['decode_tps']:.2f}" for k in keys) + " tok/s"
        )
    read_into_page_cache(expert_files)

    # -- where the time goes: one timing="layer" run per streamed state ----------------------
    log("timing='layer' runs ...")
    layer_runs = {
        "full": run_config("full", a.layer_tokens, "layer"),
        "zero_warm": run_config("zero_warm", a.layer_tokens, "layer"),
        "zero_cold": run_config("zero_cold", a.layer_tokens, "layer"),
    }
    read_into_page_cache(expert_files)  # leave the files as we found them (warm)
    full.close()
    zero.close()

    # -- report -------------------------------------------------------------------------------
    agg = {k: aggregate(runs[k], None if k == "resident" else runs["resident"], theory_all_miss) for k in keys}
    cfg = model_config(a)
    shape = (
        f"{a.arch} hidden {a.hidden}, {a.layers} layers ({moe_layers} MoE), {a.experts} experts, "
        f"top-{K}, expert intermediate {a.moe_intermediate}, heads {a.heads}/{a.kv_heads}, "
        f"vocab {a.vocab}"
    )
    quant = f"{a.bits}-bit group {a.group_size}, {a.float_dtype} scales" if a.bits else f"{a.float_dtype}, unquantized"
    load_end = [round(x, 2) for x in os.getloadavg()]
    lines = []
    w = lines.append
    w("=" * 110)
    w("flashmoe streamed engine vs resident mlx-lm: same weights, same prompt, greedy, one process")
    w(
        f"machine : {machine['nproc']} CPUs ({machine['cpu_model']}), {machine['mem_total_gib']} GiB RAM, "
        f"model on {machine['model_fs']}, mlx {machine['mlx']} [{machine['mlx_device']}], "
        f"mlx-lm {machine['mlx_lm']}, Linux {machine['kernel']}"
    )
    w(
        f"          load average (1 min) {load_start[0]:.2f} at start, {load_end[0]:.2f} at end "
        f"(anything above ~0 means other processes shared the {machine['nproc']} CPUs)"
    )
    w(f"source  : flashmoe {machine['revision']}")
    w(f"model   : {shape}")
    w(
        f"weights : {quant}; streamed engine on {a.kernels} kernels; expert {fmt_bytes(expert_bytes)}, all experts {fmt_bytes(all_expert_bytes)}, "
        f"resident mlx-lm model {fmt_bytes(resident_bytes)}"
    )
    w(
        f"run     : prompt {len(ids)} tokens; {a.gen_tokens} generated per run = {a.gen_tokens - 1} timed "
        f"forward passes; {a.rounds} rounds round-robin; io_threads {a.io_threads}, direct_io {a.direct_io}"
    )
    w(
        "          measured runs reuse the prompt's KV cache (prompt[:-1]) and feed its last token, "
        "as the engine's Session does"
    )
    w(
        f"theory  : bytes/token = K x expert_bytes x moe_layers x miss rate = {K} x {fmt_bytes(expert_bytes)} "
        f"x {moe_layers} x miss = {fmt_bytes(theory_all_miss)} x miss"
    )
    w("-" * 110)
    w(f"{'configuration':<36}{'tok/s':>7}{'ratio':>7}{'ms/tok p50':>11}{'min':>7}{'max':>7}   per round tok/s (ratio)")
    for key, label, _ in CONFIGS:
        g = agg[key]
        ratio = g.get("ratio_median", 1.0)
        per = ", ".join(
            f"{t:.2f}" + (f" ({q:.2f})" if "ratio_rounds" in g else "")
            for t, q in zip(g["decode_tps_rounds"], g.get("ratio_rounds", g["decode_tps_rounds"]))
        )
        w(
            f"{label:<36}{g['decode_tps_median']:>7.2f}{ratio:>7.2f}{g['step_ms_median']:>11.1f}"
            f"{g['step_ms_min']:>7.0f}{g['step_ms_max']:>7.0f}   {per}"
        )
    w(
        "  tok/s: median over rounds of (forward passes / their wall time); ratio: median over rounds of "
        "(tok/s / resident tok/s of the same round)"
    )
    w("-" * 110)
    w(
        f"{'configuration':<36}{'hit rate':>9}{'B/tok meas':>12}{'B/tok theory':>13}{'disk B/tok':>12}"
        f"{'io GB/s':>9}{'io share':>9}{'pages cached':>14}"
    )
    for key, label, _ in CONFIGS[1:]:
        g = agg[key]
        pc = [x for x in g["page_cache_resident_before"] if x is not None]
        pcs = f"{100 * statistics.mean(pc):.0f}%" if pc else "-"
        gb = f"{g['io_gbps']:.2f}" if g["io_gbps"] else "-"
        w(
            f"{label:<36}{g['hit_rate']:>9.3f}{fmt_bytes(g['bytes_per_token']):>12}"
            f"{fmt_bytes(g['bytes_per_token_theory']):>13}{fmt_bytes(g['disk_bytes_per_token']):>12}"
            f"{gb:>9}{100 * g['io_wait_share']:>8.0f}%{pcs:>14}"
        )
    w(
        "  B/tok meas: expert bytes the store read per forward pass (StepFinished.expert_bytes_read); theory uses "
        "the measured miss rate"
    )
    w(
        "  disk B/tok: /proc/self/io read_bytes over the run (incl. its 1-token prefill) / forward passes: what "
        "actually came from the device"
    )
    w(
        "  io GB/s: store bytes / store io wait; io share: io wait / decode time; pages cached: expert-file pages "
        "in the page cache just before each run (mincore)"
    )
    w(
        "  step-mode 'route' (the store's router sync, LayerRow.route_ms) per token: "
        + ", ".join(f"{k} {agg[k]['route_ms_per_token']:.1f} ms" for k, _, _ in CONFIGS[1:])
        + " -- in step mode this sync waits for all lazy work queued before the router (attention, the previous "
        "layer's experts), so it is not routing time; see the layer-timing section for the split"
    )
    w("-" * 110)
    w("conditions, one line per figure:")
    for key, label, state in CONFIGS:
        g = agg[key]
        tail = ""
        if key != "resident":
            cap = caps["full" if key == "full" else "zero"]
            tail = (
                f"; expert cache {fmt_bytes(cap)}; {fmt_bytes(g['bytes_per_token'])} read/token, hit rate "
                f"{g['hit_rate']:.3f}; engine generation_tps "
                f"{statistics.median(g['engine_generation_tps']):.2f} (cache_state={','.join(g['engine_cache_state'])})"
            )
        w(
            f"  {label}: {g['decode_tps_median']:.2f} tok/s | {shape}; {quant}; K={K}; expert files {state}; "
            f"prompt {len(ids)} tok (1 fed per run); {g['generated_tokens']} generated{tail}; "
            f"{machine['nproc']}x {machine['cpu_model']}"
        )
    w("-" * 110)
    w(
        f"first run, full prefill of {len(ids)} tokens (one sample each, while warming up): "
        + ", ".join(f"{k} {warm[k]['prefill_tps']:.1f} tok/s" for k in ("resident", "full", "zero"))
    )
    w("-" * 110)
    if clock_resets_after_prefill():
        w(
            f"where the time goes: timing='layer', {a.layer_tokens} tokens, mean ms per token per layer over "
            f"decode steps 0..{a.layer_tokens - 2}; layer timing adds a sync per phase"
        )
    else:
        w(
            f"where the time goes: timing='layer', {a.layer_tokens} tokens, mean ms per token per layer over "
            f"decode steps 1..{a.layer_tokens - 2} (step 0 left out:"
        )
        w("  this engine's layer clock still holds the prefill there); layer timing adds a sync per phase")
    names = {
        "attn_ms": "attention",
        "route_ms": "routing",
        "expert_io_ms": "expert I/O",
        "expert_compute_ms": "expert compute",
        "other_ms": "other",
    }
    for key, label in (
        ("full", "cache=all, prewarmed"),
        ("zero_warm", "cache=0, page cache warm"),
        ("zero_cold", "cache=0, COLD at start"),
    ):
        r = layer_runs[key]
        lm = r["layer_ms"]
        mean = {f: sum(row[f] for row in lm) / len(lm) for f in LAYER_FIELDS}
        per_layer = sum(mean.values())
        top = max(LAYER_FIELDS, key=lambda f: mean[f])
        r["layer_mean_ms"], r["dominant"] = mean, top
        w(
            f"  {label}: {r['decode_tps']:.2f} tok/s in this mode; {fmt_bytes(r['bytes_read'] / r['forward_passes'])}"
            f"/token; sum over layers {per_layer * len(lm):.1f} ms/token"
        )
        w(f"    {'layer':>5}{'attn':>8}{'route':>8}{'io':>8}{'compute':>9}{'other':>8}{'total':>8}")
        for row in lm:
            w(
                f"    {row['layer']:>5}{row['attn_ms']:>8.2f}{row['route_ms']:>8.2f}{row['expert_io_ms']:>8.2f}"
                f"{row['expert_compute_ms']:>9.2f}{row['other_ms']:>8.2f}{sum(row[f] for f in LAYER_FIELDS):>8.2f}"
            )
        w(
            f"    {'mean':>5}{mean['attn_ms']:>8.2f}{mean['route_ms']:>8.2f}{mean['expert_io_ms']:>8.2f}"
            f"{mean['expert_compute_ms']:>9.2f}{mean['other_ms']:>8.2f}{per_layer:>8.2f}"
            f"   -> {names[top]} dominates ({100 * mean[top] / per_layer:.0f}% of a layer)"
        )
    w("-" * 110)
    n_cmp = min(16, a.gen_tokens)
    ref_tokens = runs["resident"][0]["tokens"][:n_cmp]
    w(f"greedy check, first {n_cmp} tokens of resident mlx-lm: {ref_tokens}")
    agree, bad = {}, []
    checks = [(f"{k} round {i + 1}", r["tokens"]) for k in keys for i, r in enumerate(runs[k])]
    checks += [(f"warm-up {k}", warm[k]["tokens"]) for k in warm]
    checks += [(f"layer-timing {k}", r["tokens"]) for k, r in layer_runs.items()]
    for name, t in checks:
        m = min(n_cmp, len(t))
        agree[name] = t[:m] == ref_tokens[:m]
        if not agree[name]:
            bad.append(f"  {name} DIFFERS: {t[:m]}")
    lines.extend(bad)
    w(
        f"  streamed and resident agree: {'yes' if all(agree.values()) else 'NO'} in {sum(agree.values())}/"
        f"{len(agree)} runs (warm-up runs compare 4 tokens, layer-timing runs {min(n_cmp, a.layer_tokens)})"
    )
    total = time.perf_counter() - t_start
    w(f"total wall time {total:.0f} s (model build {build_s:.0f} s)")
    w("=" * 110)
    print("\n".join(lines), flush=True)

    if a.out:
        summary = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:],
            "machine": dict(machine, loadavg_at_end=load_end),
            "model": {
                "config": cfg,
                "bits": a.bits,
                "group_size": a.group_size,
                "float_dtype": a.float_dtype,
                "top_k": K,
                "moe_layers": moe_layers,
                "expert_bytes": expert_bytes,
                "all_expert_bytes": all_expert_bytes,
                "resident_mlx_lm_bytes": resident_bytes,
                "bytes_per_token_all_miss": theory_all_miss,
                "router_scale": a.router_scale,
                "seed": a.seed,
                "build_s": build_s,
            },
            "expert_cache_bytes": caps,
            "prompt_tokens": len(ids),
            "gen_tokens": a.gen_tokens,
            "rounds": a.rounds,
            "io_threads": a.io_threads,
            "direct_io": a.direct_io,
            "summary": agg,
            "runs": runs,
            "warmup": warm,
            "layer_timing": layer_runs,
            "greedy_agree": agree,
            "total_s": total,
        }
        a.out.write_text(json.dumps(summary, indent=1) + "\n")
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
