"""A float32 numpy forward of the two folders the demo is made of (SmolLM2 as llama, and its
carve as qwen2_moe), for perplexity over thousands of tokens: MLX's CPU backend takes over a
minute per 512-token window of this model, numpy's BLAS a second or two. tests/test_demo.py
checks it against mlx-lm on the same folders first, so its perplexity is mlx-lm's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np


class NumpyLM:
    def __init__(self, folder: Path, experts_per_token: int | None = None):
        self.config = c = json.loads((Path(folder) / "config.json").read_text())
        self.w = {
            k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(Path(folder) / "model.safetensors")).items()
        }
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c["hidden_size"] // self.heads
        self.eps, self.top_k = c["rms_norm_eps"], experts_per_token or c.get("num_experts_per_tok")
        inv = c["rope_theta"] ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        self.inv_freq = inv

    def norm(self, x, name):
        return (x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name]).astype(np.float32)

    def rope(self, x):  # [H, T, d], rotate-half (mlx-lm's traditional=False)
        angles = np.arange(x.shape[1])[:, None] * self.inv_freq[None]
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        a, b = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    def linear(self, x, name):
        y = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def attention(self, x, p):
        t = x.shape[0]
        q = self.linear(x, f"{p}.q_proj").reshape(t, self.heads, self.head_dim).transpose(1, 0, 2)
        k = self.linear(x, f"{p}.k_proj").reshape(t, self.kv_heads, self.head_dim).transpose(1, 0, 2)
        v = self.linear(x, f"{p}.v_proj").reshape(t, self.kv_heads, self.head_dim).transpose(1, 0, 2)
        q, k = self.rope(q), self.rope(k)
        rep = self.heads // self.kv_heads
        k, v = np.repeat(k, rep, 0), np.repeat(v, rep, 0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(self.head_dim)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        return self.linear(o.transpose(1, 0, 2).reshape(t, -1), f"{p}.o_proj")

    def swiglu(self, x, p):
        g = self.linear(x, f"{p}.gate_proj")
        return self.linear(g / (1 + np.exp(-g)) * self.linear(x, f"{p}.up_proj"), f"{p}.down_proj")

    def mlp(self, x, p):
        if f"{p}.gate.weight" not in self.w:
            return self.swiglu(x, p)
        logits = x @ self.w[f"{p}.gate.weight"].T
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        chosen = np.argpartition(-logits, self.top_k - 1, axis=-1)[:, : self.top_k]
        weight = np.zeros_like(scores)
        np.put_along_axis(weight, chosen, np.take_along_axis(scores, chosen, -1), -1)
        y = sum(self.swiglu(x, f"{p}.experts.{e}") * weight[:, e : e + 1] for e in range(scores.shape[1]))
        gate = 1 / (1 + np.exp(-(x @ self.w[f"{p}.shared_expert_gate.weight"].T)))
        return y + self.swiglu(x, f"{p}.shared_expert") * gate

    def logits(self, ids: list[int]) -> np.ndarray:
        x = self.w["model.embed_tokens.weight"][np.array(ids)]
        for i in range(self.config["num_hidden_layers"]):
            p = f"model.layers.{i}"
            x = x + self.attention(self.norm(x, f"{p}.input_layernorm.weight"), f"{p}.self_attn")
            x = x + self.mlp(self.norm(x, f"{p}.post_attention_layernorm.weight"), f"{p}.mlp")
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return self.norm(x, "model.norm.weight") @ head.T

    def perplexity(self, ids: list[int], window: int = 512) -> float:
        """Each window scored on its own (as benchmarks/fit_demo_routing.py does)."""
        nll, count = 0.0, 0
        for s in range(0, len(ids) - 1, window):
            piece = ids[s : s + window + 1]
            z = self.logits(piece[:-1]).astype(np.float64)
            z -= z.max(-1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
            nll -= logp[np.arange(len(piece) - 1), piece[1:]].sum()
            count += len(piece) - 1
        return math.exp(nll / count)
