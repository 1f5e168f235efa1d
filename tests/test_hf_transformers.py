"""Hugging Face checkpoints against transformers itself.

Each case builds a tiny random MoE model with transformers, saves it the way the Hub publishes
models (`save_pretrained(..., safe_serialization=True)`: float32, one tensor per expert), and
checks that flashmoe gives transformers' own logits on the same token ids:

- direct mode: `load(hf_folder)` streams the per-expert tensors out of the HF safetensors file;
- packed: `convert(hf_folder)` then `load`;
- 8-bit: `convert(hf_folder, bits=8)` then `load`, under a looser, measured bound (see below).

Folders are loaded exactly as transformers 5 wrote them: it names a few config keys
differently from what mlx-lm 0.32 reads (`rope_parameters` without `rope_scaling`, `layer_types`
and its new layer names, `num_local_experts`, `mlp_layer_types`, Gemma 4's `per_layer_config`,
non-finite floats as {"__float__": "Infinity"}), and flashmoe's config reading adds the classic
names (without that, some models fail to load and others silently run with mlx-lm's default
rope_theta).

CASES holds every MoE family that both transformers 5.24 (a *ForCausalLM, or a text-only use of
a *ForConditionalGeneration, built tiny) and mlx-lm 0.32 (a model type whose experts are a
SwitchGLU / SwitchMLP) implement, each with what flashmoe must do with the folder transformers
writes (test_family_*): `convert` then `load` gives transformers' logits and streams every MoE
layer; direct mode either does the same reading the original files in place (STREAMS), or, where
the original layout cannot be streamed in place (gate and up interleaved, or stored transposed:
gpt_oss, llama4), refuses with one line that names the original tensor and says to run
`flashmoe convert`. Where transformers and mlx-lm themselves disagree (mlx-lm's sanitize or model
does not take what transformers writes), or transformers 5.24 writes a config without keys the
published checkpoints have and mlx-lm requires (glm_moe_dsa, solar_open, mimo_v2_flash,
minimax_m2, longcat_flash), the test is an xfail(strict=True) that says why, naming the keys or
tensors.
"""

from __future__ import annotations

import re
import shutil
from typing import NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mlx.core as mx  # noqa: E402

from flashmoe.engine.formats.convert import convert  # noqa: E402
from flashmoe.engine.errors import ModelLoadError  # noqa: E402
from flashmoe.engine.runtime.loader import load  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB = 320
SEQ = 16
ATOL = 1e-4  # float32 on both sides: measured max |diff| is 0.8e-6 .. 2.3e-6

# rope_theta is not any mlx-lm default (1e4, 1e6), so a dropped rope_theta cannot pass unnoticed.
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

STREAMS = "streams"  # direct mode reads the experts out of transformers' own files, in place


class Case(NamedTuple):
    config_cls: object  # transformers config class name, or a function building the config
    model_cls: str
    config: dict
    moe_layers: int  # MoE layers: every one must stream
    direct: str = STREAMS  # STREAMS, or a regex of the original tensor direct mode's refusal names
    xfail: dict = {}  # "converted" / "direct" -> why that test fails: transformers and mlx-lm disagree
    zero: tuple = ()  # parameters / buffers (name endings) left at zero after the random init
    lm: str | None = None  # submodule whose logits are compared (None: the model itself)


def _llama4(**text):
    """Llama 4 as published (Llama4ForConditionalGeneration) with a one-layer vision tower."""
    return transformers.Llama4Config(
        text_config=text,
        boi_token_index=300,
        eoi_token_index=301,
        image_token_index=302,
        tie_word_embeddings=False,
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            vision_output_dim=32,
            image_size=28,
            patch_size=14,
            projector_input_dim=32,
            projector_output_dim=64,
        ),
    )


# DeepSeek-style multi-head latent attention, tiny.
_MLA = dict(
    num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16
)
_SWA = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"])

# Hidden 64, 2-4 layers, 8 experts, top-2 (llama4: top-1, as published).
CASES = {
    "qwen3_moe": Case(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=128,
            moe_intermediate_size=64,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        moe_layers=2,
    ),
    "mixtral": Case(
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_COMMON, num_hidden_layers=2, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2),
        moe_layers=2,
    ),
    "olmoe": Case(
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
        moe_layers=2,
    ),
    # Hybrid: layers 1 and 3 full attention, 0 and 2 gated delta net; a shared expert; RMSNorms
    # stored zero-centred (HF applies 1 + w; mlx-lm's sanitize adds the 1 for HF originals).
    "qwen3_next": Case(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=4,
            intermediate_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            partial_rotary_factor=0.25,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=2,
        ),
        moe_layers=4,
    ),
    # MLA attention, one dense first layer, a shared expert, sigmoid scores with a correction
    # bias and grouped top-k routing.
    "deepseek_v3": Case(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=128,
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            routed_scaling_factor=2.5,
            kv_lora_rank=32,
            q_lora_rank=32,
            qk_rope_head_dim=16,
            v_head_dim=16,
            qk_nope_head_dim=16,
            n_group=2,
            topk_group=1,
            norm_topk_prob=True,
            first_k_dense_replace=1,
        ),
        moe_layers=2,
    ),
    # ---- every other family both libraries implement, per-expert originals first ----
    "qwen2_moe": Case(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        moe_layers=2,
    ),
    # mlx-lm's deepseek_v2 reads rope_scaling["factor"] unconditionally: YaRN, as every DeepSeek-V2.
    "deepseek_v2": Case(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            _COMMON,
            **_MLA,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            head_dim=16,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=50000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                beta_fast=32,
                beta_slow=1,
                mscale=0.707,
                mscale_all_dim=0.707,
            ),
        ),
        moe_layers=2,
    ),
    # DeepSeek sparse attention (lightning indexer): index_topk above the sequence length.
    "deepseek_v32": Case(
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(
            _COMMON,
            **_MLA,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            mlp_layer_types=["dense", "sparse", "sparse"],
            index_topk=2048,
            index_head_dim=32,
            index_n_heads=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
        ),
        moe_layers=2,
    ),
    "dots1": Case(
        "Dots1Config",
        "Dots1ForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
            n_group=1,
            topk_group=1,
        ),
        moe_layers=2,
    ),
    "glm4_moe": Case(
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.0,
            n_group=1,
            topk_group=1,
            head_dim=16,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
        ),
        moe_layers=2,
    ),
    "glm4_moe_lite": Case(
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(
            _COMMON,
            **_MLA,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            mlp_layer_types=["dense", "sparse", "sparse"],
            routed_scaling_factor=1.8,
        ),
        moe_layers=2,
    ),
    "glm_moe_dsa": Case(
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(
            _COMMON,
            **_MLA,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            mlp_layer_types=["dense", "sparse", "sparse"],
            index_topk=2048,
            index_head_dim=32,
            index_n_heads=2,
            routed_scaling_factor=2.5,
            head_dim=16,
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "transformers 5.24 writes glm_moe_dsa configs without topk_method, scoring_func and moe_layer_freq "
                "(it writes mlp_layer_types), which GLM-5's config.json has and mlx-lm's ModelArgs requires"
            ),
        ),
    ),
    "solar_open": Case(
        "SolarOpenConfig",
        "SolarOpenForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            moe_intermediate_size=64,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            routed_scaling_factor=2.0,
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "transformers 5.24 writes solar_open configs without intermediate_size, first_k_dense_replace and "
                "partial_rotary_factor, which Solar Open's config.json has and mlx-lm's ModelArgs requires"
            ),
        ),
    ),
    "exaone_moe": Case(
        "ExaoneMoeConfig",
        "ExaoneMoeForCausalLM",
        dict(
            _COMMON,
            **_SWA,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            head_dim=16,
            mlp_layer_types=["dense", "sparse", "sparse"],
            first_k_dense_replace=1,
        ),
        moe_layers=2,
    ),
    "afmoe": Case(
        "AfmoeConfig",
        "AfmoeForCausalLM",
        dict(
            _COMMON,
            **_SWA,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            num_dense_layers=1,
            head_dim=16,
            global_attn_every_n_layers=3,
            route_scale=2.0,
            mup_enabled=True,
        ),
        moe_layers=2,
    ),
    "mellum": Case(
        "MellumConfig",
        "MellumForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            mlp_layer_types=["sparse", "sparse"],
        ),
        moe_layers=2,
    ),
    "laguna": Case(
        "LagunaConfig",
        "LagunaForCausalLM",
        dict(
            _COMMON,
            **_SWA,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            mlp_layer_types=["dense", "sparse", "sparse"],
            num_attention_heads_per_layer=[4, 4, 4],
        ),
        moe_layers=2,
    ),
    # head_dim 24: its rotary part (x 0.334) must be even.
    "mimo_v2_flash": Case(
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            head_dim=24,
            v_head_dim=16,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "transformers 5.24 writes mimo_v2_flash configs in its own names (layer_types, mlp_layer_types, "
                "sliding_window, ...), without the 15 keys of MiMo-V2-Flash's config.json that mlx-lm's ModelArgs "
                "requires (hybrid_layer_pattern, moe_layer_freq, sliding_window_size, swa_head_dim, swa_rope_theta, "
                "add_swa_attention_sink_bias, topk_method, scoring_func, ...)"
            ),
        ),
    ),
    # Phi-3.5-MoE has attention and lm_head biases, which mlx-lm's phimoe always builds.
    "phimoe": Case(
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_jitter_noise=0.0,
            input_jitter_noise=0.0,
            attention_bias=True,
            lm_head_bias=True,
        ),
        moe_layers=2,
    ),
    "minimax_m2": Case(
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(
            _COMMON, num_hidden_layers=2, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, head_dim=16
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "transformers 5.24 writes minimax_m2 configs without rotary_dim and shared_intermediate_size, which "
                "MiniMax-M2's config.json has (64 and 0) and mlx-lm's ModelArgs requires"
            ),
        ),
    ),
    # LFM2 ties its embeddings (mlx-lm's lfm2_moe has no lm_head).
    "lfm2_moe": Case(
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            num_dense_layers=1,
            layer_types=["conv", "full_attention", "conv"],
            norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        moe_layers=2,
    ),
    # Mamba-2 / attention / MoE blocks.
    "nemotron_h": Case(
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            _COMMON,
            layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
            intermediate_size=128,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=64,
            moe_shared_expert_intermediate_size=64,
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=1,
            chunk_size=8,
            routed_scaling_factor=2.0,
            n_group=1,
            topk_group=1,
        ),
        moe_layers=2,
    ),
    # Qwen3.5 text: the Hub's checkpoints fuse gate_up_proj; transformers 5.24 writes one tensor per expert.
    "qwen3_5_moe_text": Case(
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=4,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            partial_rotary_factor=0.25,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        ),
        moe_layers=4,
        xfail={
            "converted": "mlx-lm's qwen3_5_moe sanitize stacks only the fused experts.gate_up_proj / "
            "experts.down_proj of the Hub's checkpoints, not the per-expert "
            "model.layers.N.mlp.experts.E.gate_proj.weight transformers 5.24 writes (and mlx-lm has no "
            "model type qwen3_5_moe_text)",
            "direct": "Qwen3_5MoeForCausalLM writes model_type qwen3_5_moe_text, which mlx-lm 0.32.2 does not "
            "have (the Hub's Qwen3.5 MoE checkpoints are qwen3_5_moe, the language model under text_config)",
        },
    ),
    # ERNIE 4.5 picks experts by softmax + moe_statics.e_score_correction_bias; mlx-lm's sanitize drops
    # that bias and picks by the softmax alone. With the bias at zero the two agree.
    "ernie4_5_moe": Case(
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            moe_k=2,
            moe_num_experts=8,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=2,
            moe_layer_interval=1,
        ),
        moe_layers=2,
        zero=("moe_statics.e_score_correction_bias",),
    ),
    "ernie4_5_moe_routing_bias": Case(
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            moe_k=2,
            moe_num_experts=8,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=2,
            moe_layer_interval=1,
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "mlx-lm's ernie4_5_moe sanitize drops model.layers.N.mlp.moe_statics.e_score_correction_bias, "
                "which transformers adds to the router's softmax to pick the experts"
            ),
        ),
    ),
    # ---- fused originals ----
    # gate and up fused as input_linear [E, 2I, H], gate rows first (mlx-lm splits axis 1 in halves),
    # down as output_linear [E, H, I]: each expert's halves are contiguous, so they can stream in place.
    "granitemoe": Case(
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            embedding_multiplier=2.0,
            logits_scaling=1.5,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
        ),
        moe_layers=2,
    ),
    "granitemoehybrid": Case(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            shared_intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            embedding_multiplier=2.0,
            logits_scaling=1.5,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            layer_types=["linear_attention", "full_attention"],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_chunk_size=8,
            position_embedding_type="rope",
        ),
        moe_layers=2,
    ),
    # experts.gate_up_proj [E, 2I, H], gate rows first: streams in place (FUSED_IN_PLACE).
    "gemma4_text": Case(
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=128,
            head_dim=16,
            global_head_dim=32,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=64,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=0,
            tie_word_embeddings=True,
        ),
        moe_layers=2,
    ),
    # gate_up_proj [E, H, 2I]: transposed, gate and up interleaved column by column.
    "gpt_oss": Case(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        moe_layers=2,
        direct=r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)\b",
        xfail={
            "converted": "mlx-lm's gpt_oss sanitize reads only the Hub's MXFP4 gate_up_proj_blocks / _scales "
            "([E, 2I, ...], rows interleaved): the float gate_up_proj [E, H, 2I] transformers writes "
            "becomes experts.gate_proj (no .weight), split along the wrong axis"
        },
    ),
    # As published: the language model under language_model.model, experts.gate_up_proj [E, H, 2I]
    # (transposed, gate columns first); MoE every second layer; 4 layers since mlx-lm's llama4 reads
    # the cache of layer 3. transformers' forward fails on text-only input, so the language model's.
    "llama4": Case(
        _llama4,
        "Llama4ForConditionalGeneration",
        dict(
            _COMMON,
            num_hidden_layers=4,
            intermediate_size=64,
            intermediate_size_mlp=128,
            num_local_experts=8,
            num_experts_per_tok=1,
            head_dim=16,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
        ),
        moe_layers=2,
        direct=r"language_model\.model\.layers\.\d+\.feed_forward\.experts\.(gate_up_proj|down_proj)\b",
        lm="language_model",
    ),
    # ---- the same model type, a different model ----
    "llama4_text": Case(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=4,
            intermediate_size=64,
            intermediate_size_mlp=128,
            num_local_experts=8,
            num_experts_per_tok=1,
            head_dim=16,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "Llama4ForCausalLM writes model_type llama4_text, which mlx-lm builds as its dense llama4_text model "
                "(no experts); mlx-lm's MoE Llama 4 is model_type llama4 with a text_config"
            ),
        ),
    ),
    "minimax": Case(
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"],
            block_size=8,
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "transformers' minimax is MiniMax-Text-01 (lightning attention); mlx-lm's minimax is MiniMax-M2 "
                "(full attention, sigmoid routing, qk norm) and needs rotary_dim and shared_intermediate_size"
            ),
        ),
    ),
    "bailing_hybrid": Case(
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        dict(
            _COMMON,
            **_MLA,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_token=2,
            num_shared_experts=1,
            head_dim=16,
            num_expert_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            layer_types=["linear_attention", "linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            linear_head_dim=16,
            linear_num_heads=4,
            layer_group_size=3,
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "transformers' bailing_hybrid linear layers are gated delta attention (attention.A_log, dt_bias, "
                "b_proj, f_proj, q/k/v_conv1d), mlx-lm's are lightning-style linear attention with a group norm"
            ),
        ),
    ),
    # ---- transformers writes tensors the original checkpoints do not have ----
    "jamba": Case(
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            _COMMON,
            num_hidden_layers=4,
            intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=2,
            attn_layer_offset=0,
            mamba_d_state=8,
            mamba_dt_rank=8,
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "mlx-lm's jamba weighs the top-k experts by a softmax over their logits (renormalized); "
                "transformers (and AI21's original) by the softmax over all experts, unnormalized"
            ),
        ),
    ),
    "longcat_flash": Case(
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        dict(
            _COMMON,
            **_MLA,
            num_layers=2,
            ffn_hidden_size=128,
            expert_ffn_hidden_size=64,
            moe_topk=2,
            n_routed_experts=8,
            zero_expert_num=2,
            head_dim=16,
            routed_scaling_factor=2.0,
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "transformers 5.24 writes longcat_flash configs without attention_method, zero_expert_type, "
                "mla_scale_q_lora and mla_scale_kv_lora (which LongCat-Flash's config.json has and mlx-lm's ModelArgs "
                "requires), and gate_proj / up_proj tensors for the zero (identity) experts too "
                "(model.layers.N.mlp.experts.8.gate_proj.weight, ...), which mlx-lm's sanitize leaves in place: "
                "'Received 8 parameters not in model'"
            ),
        ),
    ),
    "kimi_linear": Case(
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            _COMMON,
            num_key_value_heads=4,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_token=2,
            num_shared_experts=1,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=16,
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_head_dim=16,
            linear_num_heads=4,
        ),
        moe_layers=2,
        xfail=dict.fromkeys(
            ("converted", "direct"),
            (
                "transformers writes the dense first layer as model.layers.0.block_sparse_moe.{gate,up,down}_proj; "
                "the original (and mlx-lm) has it at model.layers.0.mlp"
            ),
        ),
    ),
}
# The five whose per-expert layout, 8-bit bound and configs as written are tested below; every
# case is tested against its expectation in test_family_*.
ARCHS = ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "deepseek_v3"]


def _build(arch: str, seed: int = 0):
    """A random float32 transformers model of `arch`, weights spread enough to matter."""
    case = CASES[arch]
    torch.manual_seed(seed)
    make_config = getattr(transformers, case.config_cls) if isinstance(case.config_cls, str) else case.config_cls
    config = make_config(**case.config)
    model = getattr(transformers, case.model_cls)._from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        # The default init (std 0.02) gives logits of about 1e-3, where a 1e-4 tolerance would
        # prove little. With std 0.1 (embeddings 1.0) the logits have std ~0.8 and max ~3, and
        # router scores differ enough between tokens that routing varies.
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else 0.1)
            else:  # norms (ones or zero-centred zeros), biases, A_log, dt_bias: perturb them all
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # deepseek routing bias
                b.normal_(0.0, 0.1)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(case.zero):
                t.zero_()
    model.eval()
    return model


def _token_ids(seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.RandomState(seed).randint(0, VOCAB, SEQ)]


class HFCase:
    def __init__(self, arch, folder, raw_folder, ids, logits):
        self.arch, self.folder, self.raw_folder, self.ids, self.logits = arch, folder, raw_folder, ids, logits


def _save(arch: str, root) -> HFCase:
    model = _build(arch)
    ids = _token_ids()
    lm = CASES[arch].lm
    with torch.no_grad():
        logits = (getattr(model, lm) if lm else model)(torch.tensor([ids])).logits.float().numpy()
    assert logits.shape == (1, SEQ, VOCAB)
    assert logits.std() > 0.3, "weights too small for the comparison to mean anything"
    raw = root / "raw"
    model.save_pretrained(raw, safe_serialization=True)
    folder = root / "hf"
    shutil.copytree(raw, folder)
    return HFCase(arch, folder, raw, ids, logits)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> its HFCase, each built and saved once for the module (hf and test_family_* share them)."""
    cache = {}

    def get(arch: str) -> HFCase:
        if arch not in cache:
            cache[arch] = _save(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


@pytest.fixture(scope="module", params=ARCHS)
def hf(request, saved) -> HFCase:
    return saved(request.param)


def _flashmoe_logits(folder, ids):
    loaded = load(folder, load_tokenizer=False)
    try:
        out = loaded.model(mx.array([ids]))
        mx.eval(out)
        return loaded, np.array(out.astype(mx.float32))
    finally:
        loaded.close()


def test_hf_folder_is_per_expert(hf):
    """The premise of direct mode: what transformers writes is one tensor per expert."""
    from safetensors import safe_open

    files = sorted(hf.folder.glob("*.safetensors"))
    keys = set()
    for f in files:
        with safe_open(str(f), "np") as st:
            keys.update(st.keys())
    expert_keys = [k for k in keys if ".experts." in k]
    assert expert_keys
    assert not any(".switch_mlp." in k for k in keys)
    if hf.arch == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.7.w1.weight" in keys
    else:
        assert any(k.endswith(".mlp.experts.7.gate_proj.weight") for k in keys)


def test_direct_load_matches_transformers(hf):
    loaded, logits = _flashmoe_logits(hf.folder, hf.ids)
    assert loaded.mode == "direct"
    # the experts are read in place from the HF file, one (path, offset) per expert and part
    for layer in loaded.layers:
        for part in layer.sources:
            assert len(part) == layer.num_experts
            assert {p for p, _ in part} == {str(hf.folder / "model.safetensors")}
            assert len({off for _, off in part}) == layer.num_experts
    assert logits.shape == hf.logits.shape
    diff = np.abs(logits - hf.logits).max()
    assert diff < ATOL, f"{hf.arch}: max |flashmoe - transformers| = {diff:.3g}"


def test_converted_matches_transformers(hf, tmp_path):
    out = convert(hf.folder, tmp_path / "packed")
    loaded, logits = _flashmoe_logits(out, hf.ids)
    assert loaded.mode == "packed"
    diff = np.abs(logits - hf.logits).max()
    assert diff < ATOL, f"{hf.arch}: max |flashmoe - transformers| = {diff:.3g}"


# 8-bit (affine, group 64) bound. Rounding each weight to 1/255 of its group's range adds about
# 0.5% relative error per matmul; over these models' ~10-20 quantized matmuls (embeddings,
# attention, experts, routers and lm_head included) that gives ~1-1.5% relative error per
# position, and that is what we measure (medians 0.85%-2.0% over 10 seeds x 5 archs x 16
# tokens). The router is quantized too, so a token whose two best experts score nearly the
# same can switch to another expert; that position then differs by O(10%-50%) (seen on up to
# 3 of 16 positions; worst whole-tensor error 12%, worst argmax agreement 14/16). Hence:
Q8_MEDIAN_POSITION_REL = 0.03  # median over positions of |dlogits| / |logits|: quantization noise
Q8_TOTAL_REL = 0.20  # whole tensor, routing switches included
Q8_ARGMAX_AGREE = 0.75  # fraction of positions with the same top token


def test_converted_8bit_close_to_transformers(hf, tmp_path):
    out = convert(hf.folder, tmp_path / "q8", bits=8)
    loaded, logits = _flashmoe_logits(out, hf.ids)
    assert loaded.config["quantization"]["bits"] == 8
    ref, got = hf.logits[0], logits[0]
    per_position = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    total = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert per_position.max() > 1e-3, "8-bit logits equal the float ones: nothing was quantized"
    assert np.median(per_position) < Q8_MEDIAN_POSITION_REL, per_position
    assert total < Q8_TOTAL_REL, per_position
    assert agree >= Q8_ARGMAX_AGREE, (got.argmax(-1), ref.argmax(-1))


def test_sharded_hf_checkpoint_direct(tmp_path):
    """Experts spread over several shards (model.safetensors.index.json) are found in each."""
    model = _build("qwen3_moe", seed=1)
    ids = _token_ids(1)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.float().numpy()
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded, logits = _flashmoe_logits(tmp_path, ids)
    assert loaded.mode == "direct"
    assert len({p for l in loaded.layers for part in l.sources for p, _ in part}) > 1
    assert np.abs(logits - ref).max() < ATOL


@pytest.mark.parametrize("arch", ARCHS)
def test_config_as_written_by_transformers(arch, tmp_path):
    """transformers 5 names (rope_parameters, num_local_experts, layer_types) load correctly."""
    model = _build(arch)
    ids = _token_ids()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.float().numpy()
    model.save_pretrained(tmp_path, safe_serialization=True)
    try:
        _, logits = _flashmoe_logits(tmp_path, ids)
    except ModelLoadError as e:
        pytest.fail(f"does not load: {e}")
    diff = np.abs(logits - ref).max()
    assert diff < ATOL, f"{arch}: max |flashmoe - transformers| = {diff:.3g}"


def _family_params(test: str):
    return [
        pytest.param(a, marks=pytest.mark.xfail(strict=True, reason=c.xfail[test])) if test in c.xfail else a
        for a, c in CASES.items()
    ]


@pytest.mark.parametrize("arch", _family_params("converted"))
def test_family_converted(arch, saved, tmp_path):
    """convert + load: transformers' logits, with every MoE layer streamed."""
    hf = saved(arch)
    out = convert(hf.folder, tmp_path / "packed")
    loaded, logits = _flashmoe_logits(out, hf.ids)
    assert loaded.mode == "packed"
    assert len(loaded.layers) == CASES[arch].moe_layers, [l.module for l in loaded.layers]
    diff = np.abs(logits - hf.logits).max()
    assert diff < ATOL, f"{arch}: max |flashmoe - transformers| = {diff:.3g}"


@pytest.mark.parametrize("arch", _family_params("direct"))
def test_family_direct(arch, saved):
    """Direct mode streams every MoE layer out of transformers' own files and gives its logits, or,
    for a layout that cannot stream in place, refuses in one line naming the tensor."""
    hf, case = saved(arch), CASES[arch]
    if case.direct != STREAMS:
        with pytest.raises(ModelLoadError) as e:
            load(hf.folder, load_tokenizer=False)
        message = str(e.value)
        assert "\n" not in message, message
        assert re.search(case.direct, message), message
        assert "flashmoe convert" in message, message
        return
    loaded, logits = _flashmoe_logits(hf.folder, hf.ids)
    assert loaded.mode == "direct"
    assert len(loaded.layers) == case.moe_layers, [l.module for l in loaded.layers]
    originals = {str(f) for f in hf.folder.glob("*.safetensors")}
    for layer in loaded.layers:
        for part in layer.sources:
            assert len(part) == layer.num_experts
            assert {p for p, _ in part} <= originals
    diff = np.abs(logits - hf.logits).max()
    assert diff < ATOL, f"{arch}: max |flashmoe - transformers| = {diff:.3g}"
