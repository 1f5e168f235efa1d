"""Tiny random MoE models, built with mlx-lm's own classes and saved as mlx-lm folders.

The configs are the real ones (../shared/reference/configs) scaled down: same model_type and
the same switches (shared experts, dense first layers, grouped routing, hybrid attention), tiny
sizes. Dims are multiples of 64 so every group size up to 64 quantizes every expert tensor.
"""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

VOCAB = 320
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)  # room for tool prompts

CONFIGS = {
    "qwen3_moe": dict(
        _COMMON,
        model_type="qwen3_moe",
        intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        head_dim=16,
        norm_topk_prob=True,
    ),
    "qwen3_next": dict(
        _COMMON,
        model_type="qwen3_next",
        num_hidden_layers=4,
        intermediate_size=128,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        partial_rotary_factor=0.25,
        head_dim=16,
        norm_topk_prob=True,
        full_attention_interval=2,
    ),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe",
        tie_word_embeddings=False,
        text_config=dict(
            _COMMON,
            model_type="qwen3_5_moe_text",
            num_hidden_layers=4,
            intermediate_size=128,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[],
            moe_intermediate_size=64,
            head_dim=16,
            norm_topk_prob=True,
            full_attention_interval=2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        ),
    ),
    "mixtral": dict(_COMMON, model_type="mixtral", intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        _COMMON,
        model_type="qwen2_moe",
        intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    ),
    "olmoe": dict(
        _COMMON,
        model_type="olmoe",
        intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        head_dim=16,
    ),
    "deepseek_v3": dict(
        _COMMON,
        model_type="deepseek_v3",
        intermediate_size=128,
        moe_intermediate_size=64,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        v_head_dim=16,
        qk_nope_head_dim=16,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        moe_layer_freq=1,
        first_k_dense_replace=1,
    ),
    "glm4_moe": dict(
        _COMMON,
        model_type="glm4_moe",
        intermediate_size=128,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        n_group=1,
        head_dim=16,
        topk_group=1,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=1.0,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        rope_scaling=None,
        use_qk_norm=True,
        attention_bias=False,
        partial_rotary_factor=0.5,
    ),
}
ARCHS = sorted(CONFIGS)


def make_model(arch: str, seed: int = 0):
    from mlx_lm.utils import _get_classes

    config = copy.deepcopy(CONFIGS[arch])
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Spread the weights a little more than the default init so that routing differs
    # between tokens and greedy decoding does not settle on one token.
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, p), k in zip(params, keys):
        if p.ndim >= 2 and mx.issubdtype(p.dtype, mx.floating):
            p = mx.random.normal(p.shape, key=k) * (1.0 / p.shape[-1] ** 0.5)
            if "gate" in name and "proj" not in name:
                p = p * 4.0  # routers: sharper, more varied expert choice
            if "embed" in name:
                p = p * 8.0
        new.append((name, p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())
    return model, config


def save_folder(
    folder: Path, arch: str, *, bits: int | None = None, group_size: int = 64, seed: int = 0, tokenizer: bool = True
) -> Path:
    """An mlx-lm folder (config.json + model.safetensors) of a tiny random `arch` model."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    model, config = make_model(arch, seed)
    if bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, bits)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    if tokenizer:
        from tests.tiny_tokenizer import write_tiny_tokenizer

        write_tiny_tokenizer(folder, VOCAB)
    return folder


def reference_model(folder: Path):
    """The resident mlx-lm model on the same weights: the exact reference."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder))
    return model
