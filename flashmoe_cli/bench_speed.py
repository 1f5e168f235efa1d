"""`flashmoe bench speed`: decode and prefill speed, warm and cold, with every condition printed,
and the disk measured in the same run so cold figures read as a fraction of its limit."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from .errors import UsageError
from .exit_codes import ExitCode


def cmd_bench_speed(args) -> int:
    from flashmoe.engine.benchmark import cpu_model, expert_files, measure_disk, prompt_of, run_generation
    from flashmoe.engine.runtime.generate import model_bits
    from flashmoe.engine.runtime.loader import load

    from flashmoe.engine.options import resolve_dtype

    from .models import resolve_model

    from .summaries import kv_label
    from .units import human_bytes

    if args.disk_cache:  # every run here must prefill its whole prompt
        raise UsageError("--disk-cache: bench speed measures prefill, so it keeps no saved prompt caches")
    model = resolve_model(args.model)
    loaded = load(
        model,
        expert_cache=args.expert_cache,
        ctx_size=getattr(args, "ctx_size", None),
        io_threads=args.io_threads,
        direct_io=args.direct_io,
        dtype=resolve_dtype(args.dtype),
        kernels=args.kernels,
        kv_cache=args.kv_cache,
        prefetch=args.prefetch,
        cache_policy=args.cache_policy,
        verify_reads=args.verify_reads != "off",
        allow_resident_experts=args.allow_resident_experts,
        experts_per_token=args.experts_per_token,
    )
    bits = model_bits(loaded.config)
    expert = (sum(l.expert_bytes for l in loaded.layers) / len(loaded.layers)) if loaded.layers else 0
    machine = f"{os.cpu_count()}x {cpu_model()}, {platform.system()} {platform.release()}"
    model_line = (
        f"{loaded.config['model_type']} ({loaded.mode}, "
        f"{'cpu-int8' if loaded.int8_matrices else loaded.kernels} kernels{kv_label(loaded)}"
        f", prefetch {args.prefetch}), "
        f"{bits or 'float'}{'-bit' if bits else ''}, "
        f"K={loaded.top_k}{f' of {loaded.trained_top_k}' if loaded.trained_top_k else ''}, "
        f"{len(loaded.layers)} MoE layers of {loaded.num_layers}, "
        f"expert {human_bytes(expert)}, expert cache {human_bytes(loaded.store.capacity_bytes if loaded.store else 0)}"
        + (f" ({loaded.store.policy})" if loaded.store else "")
        + (f", EXPERTS RESIDENT, NOT STREAMED ({loaded.resident_experts})" if loaded.resident_experts else "")
    )
    print(f"model   : {model}\n          {model_line}\nmachine : {machine}", flush=True)
    result = {
        "model": str(model),
        "model_line": model_line,
        "machine": machine,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": [],
    }

    disk = None
    if loaded.layers and not args.skip_disk:
        disk = measure_disk(expert_files(loaded), int(expert), threads=args.io_threads)
        result["disk"] = disk.__dict__
        print(
            f"disk    : expert files, cold: sequential {disk.sequential_gbps:.2f} GB/s; random "
            f"{human_bytes(disk.block_bytes)} reads x{disk.threads} threads {disk.random_gbps:.2f} GB/s",
            flush=True,
        )

    prompt = prompt_of(loaded.tokenizer, args.prompt_tokens)
    run_generation(loaded, prompt, 2, cold=False)  # compile and touch everything once
    order = ([] if args.cold_only else [("warm", False, False)]) + [("cold", True, False)]
    if args.no_page_cache:
        order.append(("uncached", True, True))
        print(
            "uncached: cold, and the expert files dropped from the page cache before every token too: every "
            "expert read comes from the device, as for a model larger than RAM (drop time left out)",
            flush=True,
        )
    cold_runs = []
    for _ in range(args.rounds):
        for name, cold, drop in order:
            r = run_generation(loaded, prompt, args.tokens, cold, drop_every_token=drop)
            if cold:
                cold_runs.append(r)
            if not cold:  # measure warm on a second, identical run: everything cached
                r = run_generation(loaded, prompt, args.tokens, cold=False)
            limit, r_dict = "", r.as_dict()
            if r.device_bytes_per_token is not None and r.bytes_per_token:
                limit = f" | from the device {human_bytes(r.device_bytes_per_token)}/token"
            if cold and disk and r.bytes_per_token:
                # Two ceilings: had every expert read gone to the device, and for the device
                # bytes measured (re-reads of evicted experts can come from the page cache).
                ceiling = disk.random_gbps * 1e9 / r.bytes_per_token
                limit += f" | disk limit {ceiling:.2f} tok/s, {r.decode_tps / ceiling:.0%} of it"
                r_dict["disk_limit_tps"] = ceiling
                if r.device_bytes_per_token:
                    measured = disk.random_gbps * 1e9 / r.device_bytes_per_token
                    limit += f" (on the device bytes: {measured:.2f} tok/s, {r.decode_tps / measured:.0%})"
                    r_dict["device_limit_tps"] = measured
            result["runs"].append(r_dict)
            roof = r.roof_fraction(disk.random_gbps) if disk else None
            r_dict["roof_fraction"] = roof
            streamed = (
                f"{human_bytes(r.bytes_per_token)}/token read (theory {human_bytes(r.theory_bytes_per_token)})"
                f" | hit rate {r.hit_rate:.0%} | io wait {r.io_wait_share:.0%}{limit}"
                f" | roof fraction {'-' if roof is None else f'{roof:.0%}'}"
                f" (device bytes x tok/s / the disk's random GB/s) | overlap {r.overlap:.0%} "
                f"(decode with a read at the device)"
                if loaded.layers
                else "no routed experts: nothing streamed"
            )
            print(
                f"{name:<8}: prefill {r.prompt_tokens} tok {r.prefill_tps:.1f} tok/s | decode {r.generated_tokens} tok "
                f"{r.decode_tps:.2f} tok/s | {streamed}"
                + (f" | prefetch hits {r.prefetch_hit_rate:.0%}" if args.prefetch != "off" else ""),
                flush=True,
            )
    if args.prompt_lengths:
        result["scaling"] = scaling(loaded, args.prompt_lengths, args.tokens)
    verify = verify_line(loaded, cold_runs)
    result["verify"] = verify
    print(f"verify  : {verify}", flush=True)
    loaded.close()
    if args.out:
        out = Path(args.out)
        tmp = out.with_name(out.name + ".partial")
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, out)
    return ExitCode.OK


def scaling(loaded, lengths: list[int], tokens: int) -> list[dict]:
    """Prefill speed at each prompt length and decode speed right after it, warm (the experts a
    first run of that length read are cached), as a table; the rows for --out's JSON."""
    from flashmoe.engine.benchmark import prompt_of, run_generation

    print(f"scaling : warm, {tokens} tokens decoded after each prompt", flush=True)
    print(f"          {'prompt':>8} | {'prefill tok/s':>13} | {'decode tok/s':>12} | {'hit rate':>8}", flush=True)
    rows = []
    for n in lengths:
        prompt = prompt_of(loaded.tokenizer, n)
        run_generation(loaded, prompt, 2, cold=False)  # the experts this length routes to, cached
        r = run_generation(loaded, prompt, tokens, cold=False)
        rows.append(r.as_dict())
        print(
            f"          {r.prompt_tokens:>8} | {r.prefill_tps:>13.1f} | {r.decode_tps:>12.2f} | {r.hit_rate:>8.0%}",
            flush=True,
        )
    return rows


def verify_line(loaded, cold_runs) -> str:
    """What checking each expert's CRC-32 on its first read cost the cold runs (reader-thread time,
    which overlaps the other reads and the compute, so it is an upper bound on the slowdown)."""
    store = loaded.store
    if store is None or not store.has_checksums:
        return "no checksums to check (" + ("no routed experts" if store is None else "direct mode") + ")"
    if not store.verify_reads:
        return "off (--no-verify-reads): expert reads are not checked against the manifest's CRC-32"
    decoded = sum(max(0, r.generated_tokens - 1) for r in cold_runs)
    decode_s = sum(
        (r.generated_tokens - 1) / r.decode_tps for r in cold_runs if r.decode_tps and r.generated_tokens > 1
    )
    spent = sum(r.verify_decode_s for r in cold_runs)
    prefill = sum(r.verify_prefill_s for r in cold_runs)
    per_token = spent / decoded * 1e3 if decoded else 0.0
    share = spent / decode_s if decode_s else 0.0
    return (
        f"CRC-32 of each expert's first read: {per_token:.3f} ms/token on the reader threads, "
        f"{share:.1%} of cold decode time ({prefill * 1e3:.1f} ms in cold prefill); "
        "--no-verify-reads turns it off"
    )
