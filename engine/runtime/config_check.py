"""Refuse absurd configs before mlx-lm builds a model from them.

mlx-lm trusts config.json: num_hidden_layers = 10**12 makes it build layer objects until memory
runs out, a zero head count divides by zero, a top-k above the expert count fails in the middle
of the first token. We check the sizes' types and ranges first (check_values), then the config
against the tensors the files actually hold (check_against_weights), so such a folder fails in
milliseconds with one line naming the key.
"""

from __future__ import annotations

import re
from pathlib import Path

from flashmoe.engine.errors import ModelLoadError

# Keys that are sizes or counts wherever they appear (top level or text_config): an integer,
# at least 1 (or 0 where it counts optional things), or null where the model allows "unset".
POSITIVE = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_top_k",
    "max_position_embeddings",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "linear_num_value_heads",
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "n_group",
    "topk_group",
    "full_attention_interval",
    "decoder_sparse_step",
    "moe_layer_freq",
)
NON_NEGATIVE = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")
MAX_DIM = 2**31 - 1  # MLX shapes are 32-bit
# Keys a config names its routed-expert count under (ernie4_5_moe: moe_num_experts).
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
# Keys that may also be a per-layer list of whole numbers (mimo_v2_flash: moe_layer_freq [0, 1, ...]).
PER_LAYER_LISTS = ("moe_layer_freq",)
TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def merged(config: dict) -> dict:
    """The language model's settings: multimodal configs keep them under text_config."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_values(config: dict, cfg: Path) -> None:
    """Every known size is an integer in range, and top-k fits the expert count."""
    for where in (config, config.get("text_config")):
        if not isinstance(where, dict):
            continue
        prefix = "text_config." if where is not config else ""
        for key, low in [(k, 1) for k in POSITIVE] + [(k, 0) for k in NON_NEGATIVE]:
            v = where.get(key)
            if v is None:
                continue
            if key in PER_LAYER_LISTS and isinstance(v, list):
                if not all(_is_int(x) and 0 <= x <= MAX_DIM for x in v):
                    raise ModelLoadError(cfg, f"{prefix}{key} = {v!r} is not a list of whole numbers")
                continue
            if not _is_int(v):
                raise ModelLoadError(cfg, f"{prefix}{key} = {v!r} is not a whole number")
            if not low <= v <= MAX_DIM:
                raise ModelLoadError(cfg, f"{prefix}{key} = {v} is out of range ({low} to {MAX_DIM})")
    c = merged(config)
    k_key = next((k for k in TOP_K_KEYS if k in c and c[k] is not None), None)
    e_key = next((k for k in EXPERT_COUNT_KEYS if _is_int(c.get(k))), None)
    if k_key is not None and not _is_int(c[k_key]):
        raise ModelLoadError(cfg, f"{k_key} = {c[k_key]!r} is not a whole number")
    if k_key is not None and c[k_key] < 1:
        raise ModelLoadError(cfg, f"{k_key} = {c[k_key]}: each token needs at least one expert")
    if k_key is not None and e_key is not None and c[k_key] > c[e_key]:
        raise ModelLoadError(cfg, f"{k_key} = {c[k_key]} is more than the {c[e_key]} experts ({e_key})")


def layers_in(names) -> set[int]:
    return {int(m.group(1)) for n in names if (m := _LAYER.search(n))}


def check_against_weights(config: dict, cfg: Path, shapes: dict[str, tuple], expert_counts: dict[str, int]) -> None:
    """The config against the tensors the files hold, before anything is built from it.

    shapes: every tensor's name -> shape (headers only, nothing loaded); expert_counts: each
    routed-expert module -> how many experts the files hold for it."""
    c = merged(config)
    layers = layers_in(list(shapes) + list(expert_counts))
    n = c.get("num_hidden_layers")
    if _is_int(n) and layers and n > len(layers):
        raise ModelLoadError(cfg, f"num_hidden_layers = {n} but the weights hold {len(layers)} layers")
    norm = next((s for k, s in shapes.items() if re.search(r"(?:^|\.)model\.norm\.weight$", k)), None)
    hidden = c.get("hidden_size")
    if norm is not None and len(norm) == 1 and _is_int(hidden) and hidden != norm[0]:
        raise ModelLoadError(cfg, f"hidden_size = {hidden} but the weights are {norm[0]} wide (model.norm.weight)")
    embed = next((s for k, s in shapes.items() if k.endswith("embed_tokens.weight")), None)
    vocab = c.get("vocab_size")
    if embed is not None and _is_int(vocab) and vocab != embed[0]:
        raise ModelLoadError(cfg, f"vocab_size = {vocab} but the embedding has {embed[0]} rows")
    counts = set(expert_counts.values())
    e_key = next((k for k in EXPERT_COUNT_KEYS if _is_int(c.get(k))), None)
    if e_key is not None and counts and counts != {c[e_key]}:
        raise ModelLoadError(
            cfg, f"{e_key} = {c[e_key]} but the expert files hold {_listing(counts)} experts per layer"
        )
    k_key = next((k for k in TOP_K_KEYS if _is_int(c.get(k))), None)
    if k_key is not None and counts and c[k_key] > min(counts):
        raise ModelLoadError(cfg, f"{k_key} = {c[k_key]} is more than the {min(counts)} experts the files hold")


def _listing(xs) -> str:
    return " or ".join(str(x) for x in sorted(xs))


def context_length(config: dict) -> int | None:
    """Tokens the model can attend to: max_position_embeddings, or what rope scaling stretches
    it to when the config gives the factor and the original length (YaRN as Qwen documents it)."""
    c = merged(config)
    n = c.get("max_position_embeddings")
    if not _is_int(n):
        return None
    rope = c.get("rope_scaling")
    if isinstance(rope, dict):
        factor, orig = rope.get("factor"), rope.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and _is_int(orig) and factor > 1:
            n = max(n, int(orig * factor))
    return n
