"""Carve a dense SmolLM2 into the real-routing demo MoE, as mlx-lm's qwen2_moe expresses it.

The carve itself (which neuron goes to which expert, each layer's router, a low-rank change of
down_proj) was fitted once on real text by benchmarks/fit_demo_routing.py and ships as
demo_routing.npz; here it is only applied to the dense weights, so building takes seconds.

How qwen2_moe's combine rule reproduces "shared slice + sum of the chosen experts":
- the router's logits are scaled small (their spread is about 0.1), so the softmax over all E
  experts is near-uniform and the chosen experts' scores are close to 1/E; every expert's
  down_proj is multiplied by E, and the fit accounted for the exact scores;
- the shared slice sits behind `sigmoid(shared_expert_gate(x))`: a zero gate gives 0.5, and its
  down_proj is doubled;
- SmolLM2's attention has no biases; qwen2_moe's q/k/v biases are written as zeros, and the tied
  embedding is written out as lm_head (qwen2_moe does not tie).
With the correction left out and a tiny router scale (`correction=False, spread=...`), choosing all
E experts gives the dense model back up to the softmax's spread: the golden test of the carve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from flashmoe.engine.formats.safetensors_io import write_streaming

ROUTING = Path(__file__).with_name("demo_routing.npz")


def load_routing(path: Path = ROUTING) -> dict:
    with np.load(path) as z:
        routing = {k: z[k] for k in z.files}
    routing["meta"] = {k[5:]: routing.pop(k).item() for k in list(routing) if k.startswith("meta_")}
    return routing


def carve_dense(
    dense: Path,
    out: Path,
    *,
    routing: dict | None = None,
    experts_per_token: int | None = None,
    correction: bool = True,
    spread: float | None = None,
) -> Path:
    """Write the qwen2_moe folder `out` (float32 safetensors) from the dense SmolLM2 folder."""
    routing = routing or load_routing()
    meta = routing["meta"]
    config = json.loads((dense / "config.json").read_text())
    layers, hidden, ffn = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    expert_of = routing["expert_of"].astype(np.int64)
    experts = int(expert_of.max()) + 1
    if expert_of.shape != (layers, ffn):
        raise ValueError(f"{ROUTING.name} was fitted for {expert_of.shape} neurons; {dense} has {(layers, ffn)}")
    shared = int((expert_of[0] < 0).sum())
    per_expert = (ffn - shared) // experts
    gates = routing["gate"].astype(np.float32)
    if spread is not None:  # rescale each layer's router so its logits spread by `spread`
        gates = gates * (spread / meta["spread"])
    weights = mx.load(str(dense / "model.safetensors"))
    items: list[tuple[str, mx.array]] = []
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        items.append((name, weights[name].astype(mx.float32)))
    items.append(
        ("lm_head.weight", weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).astype(mx.float32))
    )
    for i in range(layers):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            items.append((f"{p}.{norm}.weight", weights[f"{p}.{norm}.weight"].astype(mx.float32)))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = weights[f"{p}.self_attn.{proj}.weight"].astype(mx.float32)
            items.append((f"{p}.self_attn.{proj}.weight", w))
            if proj != "o_proj":
                items.append((f"{p}.self_attn.{proj}.bias", mx.zeros((w.shape[0],), mx.float32)))
        gate_proj = weights[f"{p}.mlp.gate_proj.weight"].astype(mx.float32)
        up_proj = weights[f"{p}.mlp.up_proj.weight"].astype(mx.float32)
        down = weights[f"{p}.mlp.down_proj.weight"].astype(mx.float32)
        if correction:
            u = mx.array(routing["u"][i].astype(np.float32))
            v = mx.array(routing["v"][i].astype(np.float32))
            down = down + (u @ v).T
        groups = [("shared_expert", np.nonzero(expert_of[i] < 0)[0], 2.0)]
        groups += [(f"experts.{e}", np.nonzero(expert_of[i] == e)[0], float(experts)) for e in range(experts)]
        for prefix, ids, scale in groups:
            idx = mx.array(ids.astype(np.int32))
            items.append((f"{p}.mlp.{prefix}.gate_proj.weight", gate_proj[idx]))
            items.append((f"{p}.mlp.{prefix}.up_proj.weight", up_proj[idx]))
            items.append((f"{p}.mlp.{prefix}.down_proj.weight", down[:, idx] * scale))
        items.append((f"{p}.mlp.gate.weight", mx.array(gates[i])))
        items.append((f"{p}.mlp.shared_expert_gate.weight", mx.zeros((1, hidden), mx.float32)))

    out.mkdir(parents=True, exist_ok=True)
    write_streaming(out / "model.safetensors", items)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (dense / name).exists():
            shutil.copyfile(dense / name, out / name)
    moe_config = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "moe_intermediate_size": per_expert,
        "shared_expert_intermediate_size": shared,
        "num_experts": experts,
        "num_experts_per_tok": experts_per_token or int(meta["top_k"]),
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": config["rope_theta"],
        "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id"),
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(moe_config, indent=2) + "\n")
    return out
