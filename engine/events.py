"""What the engine tells its callers, as frozen dataclasses of plain values.

No MLX arrays, nothing mutable: an event can be queued across threads and written as one JSON
line as it is (`to_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Event:
    def to_dict(self) -> dict:
        return {"event": EVENT_NAMES[type(self)], **asdict(self)}


@dataclass(frozen=True, slots=True)
class ModelLoaded(Event):
    model: str
    model_type: str
    mode: str  # "packed" | "direct"
    layers: int
    moe_layers: int
    experts: int
    top_k: int
    bits: int | None
    cache_bytes: int
    load_s: float
    chat_template: str = ""  # its text: front ends pick the tool-call format from it
    kernels: str = "mlx"  # quantized matmul kernels in use: "mlx" or "cpu"
    kv_cache: str = "float32"  # the CPU kernels' KV cache (options.KV_CACHES)
    cache_policy: str = ""  # which cached expert a miss evicts: "lfu" or "lru" ("" without experts)
    context: int | None = None  # the model's context in tokens (config_check.context_length), None: unknown
    resident_experts: str | None = None  # why every expert is in memory (--allow-resident-experts), or None
    trained_top_k: int | None = None  # the config's experts per token, when --experts-per-token changed it
    preloading: int = 0  # experts being read into the cache from the usage file (experts/usage.py)
    preloading_bytes: int = 0
    usage_file: str = ""  # where this run's expert usage is kept ("" with --expert-usage off)


@dataclass(frozen=True, slots=True)
class PrefillProgress(Event):
    done: int
    total: int
    reused: int  # prompt tokens whose cache was kept from the previous turn
    # The opening marker of the reasoning block the rendered prompt ends inside ("<think>" when the
    # template opened it for the model), "" when none: the reply starts as reasoning.
    reasoning: str = ""
    elapsed_s: float = 0.0  # since the prefill started: with done / total, its speed and what is left


@dataclass(frozen=True, slots=True)
class TokenGenerated(Event):
    id: int
    text: str  # "" while a multi-byte character is still incomplete
    step: int


@dataclass(frozen=True, slots=True)
class LayerRow:
    layer: int
    attn_ms: float  # attention or linear-attention mixer (layer timing only)
    route_ms: float  # router + the sync that tells us the expert ids
    expert_io_ms: float  # waiting for expert reads
    expert_compute_ms: float  # layer timing only
    other_ms: float  # norms, shared expert, combine (layer timing only)
    hits: int
    misses: int
    bytes_read: int


@dataclass(frozen=True, slots=True)
class LayerTimings(Event):
    step: int
    mode: str  # "step" | "layer"
    rows: tuple[LayerRow, ...]


@dataclass(frozen=True, slots=True)
class StepFinished(Event):
    step: int
    wall_ms: float
    tok_per_s: float
    expert_bytes_read: int
    hits: int
    misses: int


@dataclass(frozen=True, slots=True)
class GenerationFinished(Event):
    reason: str  # "stop" | "length" (max_tokens) | "context" (the model's context is full) | "cancelled"
    prompt_tokens: int
    reused_prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    prefill_s: float
    decode_s: float  # the forward passes after the first token
    io_wait_s: float  # of decode_s, time spent waiting for expert reads
    bytes_per_token: float  # expert bytes read per decoded token
    hit_rate: float  # expert cache hits / lookups during decode
    top_k: int
    bits: int | None
    cache_state: (
        str  # "cold": the expert slots were empty when it started; "preloaded": seeded from the usage file; else "warm"
    )
    prefetch_hit_rate: float = 0.0  # --prefetch: read-ahead experts that were then used
    text: str = ""  # the whole reply
    tail: str = ""  # reply text not yet sent in TokenGenerated events (held back, then released)
    truncated_prompt_tokens: int = 0  # oldest prompt tokens dropped to fit the context (truncate_prompt="left")


@dataclass(frozen=True, slots=True)
class EngineFailed(Event):
    message: str
    exc_type: str
    exit_code: int = 1


EVENT_NAMES = {
    ModelLoaded: "loaded",
    PrefillProgress: "prefill",
    TokenGenerated: "token",
    LayerTimings: "layers",
    StepFinished: "step",
    GenerationFinished: "done",
    EngineFailed: "error",
}
