#!/usr/bin/env python3
"""Streamed flashmoe engine vs resident mlx-lm on the same weights, measured in one run.

Builds (or reuses, with --keep) a synthetic random MoE model as an mlx-lm folder, converts it to
a flashmoe folder, then measures on the same prompt and decode length:

  1. resident mlx-lm: every weight in RAM, greedy loop over make_prompt_cache (the reference);
  2. streamed, expert cache big enough for every expert, all experts loaded (warm);
  3. streamed, expert cache 0 (the store keeps only top-k slots), expert files warm in the
     page cache, then cold (evicted with posix_fadvise DONTNEED before the run);
  4. one timing="layer" run per streamed state: where the time goes inside a layer.

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
import math
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

MARKER = "bench_model.json"
FILLER = ("The quick brown fox jumps over the lazy dog. Mixture-of-experts models route each "
          "token to a few experts, and the experts that are not needed stay on the disk until "
          "a token asks for them. We met at a cafe and talked about the weather in Paris, the "
          "time of day, and what to eat for dinner. Numbers like 12, 345 and 6789 appear too. ")


# -- machine and conditions ------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


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
    }


# -- page cache ------------------------------------------------------------------------------

_libc = None


def _load_libc():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
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


def drop_from_page_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_into_page_cache(files: list[Path]) -> None:
    buf = bytearray(8 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# -- the synthetic model ---------------------------------------------------------------------

def model_config(a) -> dict:
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                  num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0, max_position_embeddings=4096, tie_word_embeddings=False)
    if a.arch == "qwen3_moe":
        return dict(common, model_type="qwen3_moe", head_dim=a.head_dim, num_experts=a.experts,
                    num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_intermediate,
                    intermediate_size=2 * a.moe_intermediate, decoder_sparse_step=1,
                    mlp_only_layers=[], norm_topk_prob=True)
    if a.arch == "mixtral":
        return dict(common, model_type="mixtral", num_local_experts=a.experts,
                    num_experts_per_tok=a.top_k, intermediate_size=a.moe_intermediate)
    raise ValueError(a.arch)


def build_options(a) -> dict:
    return {"config": model_config(a), "bits": a.bits, "group_size": a.group_size,
            "float_dtype": a.float_dtype, "router_scale": a.router_scale, "seed": a.seed}


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
    from engine.convert import convert

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

def resident_run(model, ids: list[int], n: int) -> dict:
    """Greedy decode on the resident mlx-lm model; times the n-1 forward passes after prefill."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    mx.eval(logits)
    prefill_s = time.perf_counter() - t0
    tokens, steps = [], []
    for i in range(n):
        t = time.perf_counter()
        token = int(mx.argmax(logits.astype(mx.float32)).item())
        tokens.append(token)
        if i == n - 1:
            break
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
        mx.eval(logits)
        steps.append(time.perf_counter() - t)
    return summarize_steps(steps, tokens, prefill_s, len(ids))


def summarize_steps(steps: list[float], tokens: list[int], prefill_s: float, prompt_tokens: int) -> dict:
    total = sum(steps)
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": len(tokens),
        "forward_passes": len(steps),
        "prefill_s": prefill_s,
        "prompt_tps": prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        "decode_s": total,
        "decode_tps": len(steps) / total if total > 0 else 0.0,
        "step_ms_median": 1e3 * statistics.median(steps) if steps else 0.0,
        "step_ms_min": 1e3 * min(steps) if steps else 0.0,
        "step_ms_max": 1e3 * max(steps) if steps else 0.0,
        "tokens": tokens,
    }


def engine_run(loaded, prompt: str, n: int, timing: str = "step") -> dict:
    """One generation through engine.generate on a fresh Session; collects its events."""
    from engine.events import GenerationFinished, LayerTimings, StepFinished, TokenGenerated
    from engine.generate import GenerationRequest, Session, generate

    tokens, steps, layer_rows = [], [], []
    step_bytes = step_hits = step_misses = 0
    done = None
    req = GenerationRequest(prompt=prompt, max_tokens=n, timing=timing)
    for ev in generate(loaded, Session(loaded), req):
        if isinstance(ev, TokenGenerated):
            tokens.append(ev.id)
        elif isinstance(ev, StepFinished):
            steps.append(ev.wall_ms / 1e3)
            step_bytes += ev.expert_bytes_read
            step_hits += ev.hits
            step_misses += ev.misses
        elif isinstance(ev, LayerTimings):
            layer_rows.append(ev.rows)
        elif isinstance(ev, GenerationFinished):
            done = ev
    if done is None or done.generation_tokens != n:
        raise RuntimeError(f"the engine generated {done and done.generation_tokens} tokens, wanted {n} "
                           f"(reason {done and done.reason})")
    out = summarize_steps(steps, tokens, done.prefill_s, done.prompt_tokens)
    lookups = step_hits + step_misses
    # The store's io wait reaches us only through the per-layer rows (sent in step mode too).
    io_s = sum(r.expert_io_ms for rows in layer_rows for r in rows) / 1e3
    out.update({
        "engine_generation_tps": done.generation_tps,
        "engine_prompt_tps": done.prompt_tps,
        "engine_bytes_per_token": done.bytes_per_token,
        "engine_hit_rate": done.hit_rate,
        "engine_cache_state": done.cache_state,
        "bytes_read": step_bytes,
        "bytes_per_token": step_bytes / len(steps) if steps else 0.0,
        "hits": step_hits,
        "misses": step_misses,
        "hit_rate": step_hits / lookups if lookups else 0.0,
        "miss_rate": step_misses / lookups if lookups else 0.0,
        "io_wait_s": io_s,
        "io_gbps": step_bytes / io_s / 1e9 if io_s > 0 else None,
        "io_wait_share": io_s / sum(steps) if steps and sum(steps) > 0 else 0.0,
    })
    if timing == "layer":
        # Step 0's rows also hold the prefill's attention and layer totals: the engine's layer
        # clock is not reset after prefill (the store's counters are), so its "other" column
        # absorbs the whole prefill. Average over the later steps only.
        out["layer_ms"] = mean_layer_rows(layer_rows[1:] if len(layer_rows) > 1 else layer_rows)
        out["layer_steps_averaged"] = max(1, len(layer_rows) - 1)
    return out


def mean_layer_rows(per_step: list) -> list[dict]:
    """Mean per decode step of each layer's attn / route / io / compute / other ms."""
    if not per_step:
        return []
    fields = ("attn_ms", "route_ms", "expert_io_ms", "expert_compute_ms", "other_ms")
    n = len(per_step)
    out = []
    for i in range(len(per_step[0])):
        row = {"layer": per_step[0][i].layer}
        for f in fields:
            row[f] = sum(rows[i].__getattribute__(f) for rows in per_step) / n
        row["hits"] = sum(rows[i].hits for rows in per_step)
        row["misses"] = sum(rows[i].misses for rows in per_step)
        row["bytes_read"] = sum(rows[i].bytes_read for rows in per_step)
        out.append(row)
    return out


def prewarm_all_experts(loaded) -> None:
    """Read every expert of every layer into the store's slots (needs a cache that holds them)."""
    store = loaded.store
    for l in loaded.layers:
        if store.pool(l.layer).slots < l.num_experts:
            raise RuntimeError("the expert cache is too small to hold every expert")
        store.fetch(l.layer, list(range(l.num_experts)))
    store.take_stats()
    store.pending.clear()


# -- reporting -------------------------------------------------------------------------------

def fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Benchmark the streamed flashmoe engine against resident mlx-lm on the same "
                    "synthetic MoE weights, in one run. Prints every figure with its conditions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    g.add_argument("--bits", type=int, default=4, choices=(0, 2, 3, 4, 5, 6, 8),
                   help="quantization bits (0: keep float weights)")
    g.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    g.add_argument("--float-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the float weights, hence of the quantization scales and biases")
    g.add_argument("--router-scale", type=float, default=4.0,
                   help="router weights x this, so that routing varies from token to token")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("run")
    g.add_argument("--prompt-tokens", type=int, default=32)
    g.add_argument("--gen-tokens", type=int, default=32, help="tokens generated per measured run")
    g.add_argument("--layer-tokens", type=int, default=12, help="tokens per timing='layer' run")
    g.add_argument("--io-threads", type=int, default=8)
    g.add_argument("--direct-io", action="store_true", help="load the streamed model with O_DIRECT")
    g.add_argument("--keep", type=Path, metavar="DIR",
                   help="build the model in DIR and keep it; a later run with the same model "
                        "options reuses it (default: a temporary folder, removed at the end)")
    g.add_argument("--out", type=Path, metavar="FILE", help="also write every figure as JSON")
    a = p.parse_args(argv)
    if a.gen_tokens < 2 or a.layer_tokens < 2:
        p.error("--gen-tokens and --layer-tokens must be at least 2 (one forward pass after prefill)")
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


def bench(a, workdir: Path, log, t_start: float) -> int:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from engine.generate import GenerationRequest, render_prompt
    from engine.loader import load
    from engine.tokenizer import Tokenizer

    load_start = [round(x, 2) for x in os.getloadavg()]  # before the build: was the machine busy?
    src, packed, build_s = prepare_model(workdir, a, log)
    machine = machine_info(packed)
    machine["loadavg_at_start"] = load_start
    tok = Tokenizer.from_folder(packed)
    prompt = make_prompt(tok, a.prompt_tokens)

    # -- 1. resident mlx-lm ------------------------------------------------------------------
    log("resident mlx-lm: load, warm-up run, measured run ...")
    model, _ = load_model(src)
    mx.eval(model.parameters())
    resident_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    # The engine's own rendering of the prompt, so both sides see the same ids.
    ids = tok.encode(prompt, add_special_tokens=True)
    resident_run(model, ids, min(4, a.gen_tokens))  # warm-up
    resident = resident_run(model, ids, a.gen_tokens)
    del model
    gc.collect()
    mx.clear_cache()
    log(f"  resident: {resident['decode_tps']:.2f} tok/s")

    results = {"resident": resident}
    expert_files = []

    def open_streamed(cache):
        loaded = load(packed, expert_cache=cache, io_threads=a.io_threads, direct_io=a.direct_io)
        # Random weights: never stop early on the tokenizer's end-of-turn token.
        loaded.tokenizer.eos_token_ids = frozenset()
        return loaded

    # -- 2. streamed, every expert cached --------------------------------------------------
    log("streamed, expert cache = all experts: load, prewarm, warm-up run, measured run ...")
    loaded = open_streamed(None)
    assert render_prompt(loaded, GenerationRequest(prompt=prompt)) == ids
    layers = loaded.layers
    K = loaded.top_k
    expert_bytes = layers[0].expert_bytes
    moe_layers = len(layers)
    expert_files = [packed / "experts" / l.file for l in layers]
    all_expert_bytes = sum(l.expert_bytes * l.num_experts for l in layers)
    full_cap = loaded.store.capacity_bytes
    read_into_page_cache(expert_files)
    engine_run(loaded, prompt, min(4, a.gen_tokens))  # warm-up (MLX, allocator, first reads)
    prewarm_all_experts(loaded)
    results["stream_full_warm"] = engine_run(loaded, prompt, a.gen_tokens)
    results["stream_full_warm"]["capacity_bytes"] = full_cap
    log(f"  full cache: {results['stream_full_warm']['decode_tps']:.2f} tok/s, "
        f"hit rate {results['stream_full_warm']['hit_rate']:.3f}")
    log("  timing='layer' run (full cache) ...")
    results["layers_full_warm"] = engine_run(loaded, prompt, a.layer_tokens, timing="layer")
    loaded.close()
    del loaded
    gc.collect()
    mx.clear_cache()

    # -- 3. streamed, expert cache 0: page cache warm, then cold ---------------------------
    log("streamed, expert cache = 0: load, warm-up run ...")
    loaded = open_streamed(0)
    zero_cap = loaded.store.capacity_bytes
    read_into_page_cache(expert_files)
    engine_run(loaded, prompt, min(4, a.gen_tokens))  # warm-up

    def measured(state: str, timing: str = "step", n: int = a.gen_tokens) -> dict:
        if state == "cold":
            drop_from_page_cache(expert_files)
        else:
            read_into_page_cache(expert_files)
        loaded.store.evict_all()
        before = resident_fraction(expert_files)
        r = engine_run(loaded, prompt, n, timing=timing)
        r["page_cache_resident_before"] = before
        r["capacity_bytes"] = zero_cap
        return r

    log("  page cache warm, measured run ...")
    results["stream_zero_warm"] = measured("warm")
    log(f"  cache 0, page cache warm: {results['stream_zero_warm']['decode_tps']:.2f} tok/s")
    log("  page cache cold (fadvise DONTNEED), measured run ...")
    results["stream_zero_cold"] = measured("cold")
    log(f"  cache 0, page cache cold: {results['stream_zero_cold']['decode_tps']:.2f} tok/s")
    log("  timing='layer' runs (cache 0, warm and cold) ...")
    results["layers_zero_warm"] = measured("warm", "layer", a.layer_tokens)
    results["layers_zero_cold"] = measured("cold", "layer", a.layer_tokens)
    loaded.close()
    del loaded
    read_into_page_cache(expert_files)  # leave the files as we found them (warm)

    # -- report -----------------------------------------------------------------------------
    cfg = model_config(a)
    shape = (f"{a.arch} hidden {a.hidden}, {a.layers} layers ({moe_layers} MoE), {a.experts} experts, "
             f"top-{K}, expert intermediate {a.moe_intermediate}, heads {a.heads}/{a.kv_heads}, "
             f"vocab {a.vocab}")
    quant = (f"{a.bits}-bit group {a.group_size}, {a.float_dtype} scales" if a.bits else f"{a.float_dtype}, unquantized")
    theory_full = K * expert_bytes * moe_layers
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "machine": machine,
        "model": {"config": cfg, "bits": a.bits, "group_size": a.group_size, "float_dtype": a.float_dtype,
                  "top_k": K, "moe_layers": moe_layers, "expert_bytes": expert_bytes,
                  "all_expert_bytes": all_expert_bytes, "resident_mlx_lm_bytes": resident_bytes,
                  "bytes_per_token_if_all_miss": theory_full, "router_scale": a.router_scale,
                  "seed": a.seed, "build_s": build_s},
        "prompt_tokens": len(ids),
        "gen_tokens": a.gen_tokens,
        "io_threads": a.io_threads,
        "direct_io": a.direct_io,
        "results": results,
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }

    ref = resident["decode_tps"]
    lines = []
    w = lines.append
    w("=" * 100)
    w("flashmoe streamed engine vs resident mlx-lm (same weights, same prompt, greedy)")
    w(f"machine : {machine['nproc']} CPUs ({machine['cpu_model']}), {machine['mem_total_gib']} GiB RAM, "
      f"model on {machine['model_fs']}, mlx {machine['mlx']} [{machine['mlx_device']}], "
      f"mlx-lm {machine['mlx_lm']}, Linux {machine['kernel']}; load average at start "
      f"{machine['loadavg_at_start'][0]:.2f}, at end {summary['loadavg_at_end'][0]:.2f}")
    w(f"model   : {shape}")
    w(f"weights : {quant}; expert {fmt_bytes(expert_bytes)}, all experts {fmt_bytes(all_expert_bytes)}, "
      f"resident mlx-lm model {fmt_bytes(resident_bytes)}")
    w(f"run     : prompt {len(ids)} tokens, {a.gen_tokens} generated ({a.gen_tokens - 1} timed forward passes "
      f"after prefill), io_threads {a.io_threads}, direct_io {a.direct_io}")
    w(f"theory  : K x expert_bytes x moe_layers = {K} x {fmt_bytes(expert_bytes)} x {moe_layers} = "
      f"{fmt_bytes(theory_full)} per token at miss rate 1")
    w("-" * 100)
    hdr = (f"{'configuration':<34}{'tok/s':>7}{'ratio':>7}{'ms/tok p50':>11}{'hit rate':>9}"
           f"{'B/tok meas':>12}{'B/tok theory':>13}{'io GB/s':>8}{'io share':>9}")
    w(hdr)
    rows = [
        ("resident mlx-lm (all in RAM)", "resident", "warm"),
        ("stream, cache=all, prewarmed", "stream_full_warm", "warm"),
        ("stream, cache=0, page cache warm", "stream_zero_warm", "warm"),
        ("stream, cache=0, page cache COLD", "stream_zero_cold", "cold"),
    ]
    for label, key, _state in rows:
        r = results[key]
        if key == "resident":
            w(f"{label:<34}{r['decode_tps']:>7.2f}{1.0:>7.2f}{r['step_ms_median']:>11.1f}{'-':>9}"
              f"{'-':>12}{'-':>13}{'-':>8}{'-':>9}")
            continue
        theory = theory_full * r["miss_rate"]
        gbps = f"{r['io_gbps']:.2f}" if r.get("io_gbps") else "-"
        w(f"{label:<34}{r['decode_tps']:>7.2f}{r['decode_tps'] / ref:>7.2f}{r['step_ms_median']:>11.1f}"
          f"{r['hit_rate']:>9.3f}{fmt_bytes(r['bytes_per_token']):>12}{fmt_bytes(theory):>13}{gbps:>8}"
          f"{100 * r['io_wait_share']:>8.0f}%")
        r["bytes_per_token_theory"] = theory
        r["ratio_to_resident"] = r["decode_tps"] / ref
    w("-" * 100)
    w("conditions per figure:")
    for label, key, state in rows:
        r = results[key]
        extra = ""
        if key != "resident":
            pc = r.get("page_cache_resident_before")
            extra = (f", expert cache {fmt_bytes(r['capacity_bytes'])}, bytes read/token "
                     f"{fmt_bytes(r['bytes_per_token'])}, hit rate {r['hit_rate']:.3f}"
                     + (f", expert pages in page cache before run {100 * pc:.0f}%" if pc is not None else "")
                     + f"; engine's own generation_tps {r['engine_generation_tps']:.2f} "
                       f"(cache_state={r['engine_cache_state']!r})")
        w(f"  {label}: {shape}; {quant}; K={K}; {state}; prompt {r['prompt_tokens']} tok; "
          f"generated {r['generated_tokens']} tok; decode {r['decode_tps']:.2f} tok/s{extra}; "
          f"{machine['nproc']}x {machine['cpu_model']}")
    w("-" * 100)
    w("expert I/O (bytes read / store io wait):")
    for key, label in (("stream_zero_warm", "cache=0, page cache warm"),
                       ("stream_zero_cold", "cache=0, page cache COLD")):
        r = results[key]
        gbps = f"{r['io_gbps']:.2f} GB/s" if r.get("io_gbps") else "n/a"
        w(f"  {label}: {fmt_bytes(r['bytes_read'])} in {1e3 * r['io_wait_s']:.0f} ms of io wait = {gbps}; "
          f"{fmt_bytes(r['bytes_per_token'])}/token vs theory {fmt_bytes(theory_full * r['miss_rate'])} "
          f"(miss rate {r['miss_rate']:.3f}); io wait = {100 * r['io_wait_share']:.0f}% of decode time")
    w("-" * 100)
    w(f"where the time goes, timing='layer' ({a.layer_tokens} tokens, mean over decode steps 1.."
      f"{a.layer_tokens - 2}; step 0 is left out because the engine's layer clock still holds the "
      f"prefill there; layer timing adds syncs, so these runs are slower):")
    for key, label in (("layers_full_warm", "cache=all, prewarmed"),
                       ("layers_zero_warm", "cache=0, page cache warm"),
                       ("layers_zero_cold", "cache=0, page cache COLD")):
        r = results[key]
        lm = r["layer_ms"]
        names = ("attn_ms", "route_ms", "expert_io_ms", "expert_compute_ms", "other_ms")
        mean = {f: sum(row[f] for row in lm) / len(lm) for f in names}
        per_layer_total = sum(mean.values())
        top = max(names, key=lambda f: mean[f])
        r["layer_mean_ms"] = mean
        r["dominant"] = top
        w(f"  {label}: {r['decode_tps']:.2f} tok/s, hit rate {r['hit_rate']:.3f}, "
          f"{fmt_bytes(r['bytes_per_token'])}/token")
        w(f"    {'layer':>5}{'attn':>8}{'route':>8}{'io':>8}{'compute':>9}{'other':>8}{'total':>8}   (ms per token)")
        for row in lm:
            tot = sum(row[f] for f in names)
            w(f"    {row['layer']:>5}{row['attn_ms']:>8.2f}{row['route_ms']:>8.2f}{row['expert_io_ms']:>8.2f}"
              f"{row['expert_compute_ms']:>9.2f}{row['other_ms']:>8.2f}{tot:>8.2f}")
        w(f"    {'mean':>5}{mean['attn_ms']:>8.2f}{mean['route_ms']:>8.2f}{mean['expert_io_ms']:>8.2f}"
          f"{mean['expert_compute_ms']:>9.2f}{mean['other_ms']:>8.2f}{per_layer_total:>8.2f}"
          f"   -> {top.replace('_ms', '').replace('expert_', 'expert ')} dominates "
          f"({100 * mean[top] / per_layer_total:.0f}% of the layer)")
    w("-" * 100)
    n_cmp = min(16, a.gen_tokens)
    ref_tokens = resident["tokens"][:n_cmp]
    w(f"greedy check, first {n_cmp} tokens (resident): {ref_tokens}")
    agree = {}
    for key in ("stream_full_warm", "stream_zero_warm", "stream_zero_cold", "layers_full_warm",
                "layers_zero_warm", "layers_zero_cold"):
        t = results[key]["tokens"][:n_cmp]
        m = min(len(t), len(ref_tokens))
        agree[key] = t[:m] == ref_tokens[:m]
        if not agree[key]:
            first = next(i for i in range(m) if t[i] != ref_tokens[i])
            w(f"  {key}: DIFFERS from token {first}: {t}")
    w(f"  streamed and resident agree: {'yes, all runs' if all(agree.values()) else 'NO'} "
      f"({sum(agree.values())}/{len(agree)} runs; layer runs compared on their first "
      f"{min(n_cmp, a.layer_tokens)} tokens)")
    w(f"total wall time {time.perf_counter() - t_start:.0f} s (model build {build_s:.0f} s)")
    w("=" * 100)
    summary["greedy_agree"] = agree
    summary["total_s"] = time.perf_counter() - t_start
    print("\n".join(lines), flush=True)
    if a.out:
        a.out.write_text(json.dumps(summary, indent=1, default=float) + "\n")
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
