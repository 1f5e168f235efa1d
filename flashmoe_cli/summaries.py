"""The statistics lines every face prints after a reply: each speed with its conditions."""

from __future__ import annotations

from .units import human_bytes


def kv_label(loaded) -> str:
    """ ", float16 KV cache" where --kv-cache chose one (a ModelLoaded or a loaded model); else ""."""
    kv = getattr(loaded, "kv_cache", "float32")
    return f", {kv} KV cache" if kv != "float32" else ""


def summary(done, loaded) -> str:
    """The one-line summary on stderr: every speed with its conditions."""
    bits = f"{done.bits}-bit" if done.bits else "float"
    parts = [
        f"prefill {done.prompt_tokens - done.reused_prompt_tokens} tok {done.prompt_tps:.1f} tok/s"
        + (f" ({done.reused_prompt_tokens} tok cached)" if done.reused_prompt_tokens else ""),
        f"decode {done.generation_tokens} tok {done.generation_tps:.2f} tok/s",
        f"{human_bytes(done.bytes_per_token)}/token read",
        f"hit rate {done.hit_rate:.0%}",
        f"io wait {done.io_wait_s / done.decode_s:.0%}" if done.decode_s > 0 else "io wait -",
        f"K={done.top_k}" + (f" of {loaded.trained_top_k}" if getattr(loaded, "trained_top_k", None) else ""),
        bits,
        f"{done.cache_state} expert cache"
        + (f" {human_bytes(loaded.cache_bytes)} {loaded.cache_policy}" if loaded.cache_policy else "")
        + (
            f" ({loaded.preloading} experts, {human_bytes(loaded.preloading_bytes)} from the usage file)"
            if done.cache_state == "preloaded" and getattr(loaded, "preloading", 0)
            else ""
        ),
        f"{loaded.model_type} ({loaded.mode}, {loaded.kernels} kernels{kv_label(loaded)})",
    ]
    if loaded.resident_experts:  # --allow-resident-experts: never a line that looks like streaming
        parts.append("experts resident, not streamed")
    return " | ".join(parts)


def layer_table(rows_sum: dict, steps: int) -> str:
    head = f"{'layer':>5} {'attn':>8} {'route':>8} {'io':>8} {'compute':>8} {'other':>8} {'hits':>6} {'miss':>6} {'read':>10}"
    lines = [f"per layer over {steps} decode steps: mean ms per step; hits, misses and bytes read in total", head]
    for i in sorted(rows_sum):
        r = rows_sum[i]
        lines.append(
            f"{i:>5} {r[0] / steps:8.2f} {r[1] / steps:8.2f} {r[2] / steps:8.2f} {r[3] / steps:8.2f} "
            f"{r[4] / steps:8.2f} {r[5]:>6.0f} {r[6]:>6.0f} {r[7]:>10.0f}"
        )
    return "\n".join(lines)
