"""A whole decode step on numpy: the embedding lookup, every decoder layer and the final norm, with
the hidden state crossing into MLX once per token instead of twice per layer.

Where every decoder layer is fused (fused.CpuDecoderLayer), the model's inner module (mlx-lm's
`LlamaModel`, `Qwen2MoeModel`, ...: embed_tokens, layers, norm) is wrapped by CpuModelStep. A
one-token step on plain KV caches then runs embed -> layers -> norm as numpy; anything else (a
prompt chunk, another cache type, layer timing, extra arguments) calls the original. The wrapper
is kept only where a probe at load time gives what the original gives, so a model whose inner
module does more (scaled embeddings, extra inputs) keeps its own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from flashmoe.engine.cpu.fused import CpuAttention, CpuDecoderLayer, _close, _mx, _np, _StubFFN, _Wraps
from flashmoe.engine.cpu.install import CpuQuantizedEmbedding
from flashmoe.engine.hidden import Hidden


def _embedding(embed):
    """ids [n] -> rows [n, D] float32 on numpy, for the embeddings this knows."""
    if isinstance(embed, CpuQuantizedEmbedding) and embed.tiled is not None:
        return embed.tiled.rows
    if type(embed) is nn.Embedding and embed.weight.dtype == mx.float32:
        w = _np(embed.weight)
        return lambda ids: w[ids]
    raise ValueError("embedding of an unknown kind")


class CpuModelStep(_Wraps):
    """The inner model with a one-token decode step on numpy (see the module's docstring)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        if not isinstance(inner.get("layers"), list) or type(inner.get("norm")) is not nn.RMSNorm:
            raise ValueError("not embed_tokens / layers / norm")
        self._embed = _embedding(inner.get("embed_tokens"))
        self._norm = (np.ascontiguousarray(_np(inner["norm"].weight), dtype=np.float32), np.float32(inner["norm"].eps))
        self._orig = Hidden(inner)
        self["layers"] = inner["layers"]  # the same list: what finds and times the layers sees them here

    def fast(self, inputs, cache, args, kwargs) -> bool:
        layers = self._orig.module["layers"]
        return (
            all(v is None for v in (*args, *kwargs.values()))
            and inputs.shape == (1, 1)
            and isinstance(cache, list)
            and len(cache) == len(layers)
            and all(type(l) is CpuDecoderLayer for l in layers)
            and all(CpuAttention.fast(inputs, None, c, {}) for c in cache)
        )

    def __call__(self, inputs, cache=None, *args, **kwargs):
        if not self.fast(inputs, cache, args, kwargs):
            return self._orig.module(inputs, cache, *args, **kwargs)
        from flashmoe.engine.cpu.attn import rms_norm_rows

        h = np.ascontiguousarray(self._embed(np.array(inputs).reshape(-1)), dtype=np.float32)
        for layer, c in zip(self._orig.module["layers"], cache):
            h = layer.step_np(h, c)
        h = np.ascontiguousarray(h)
        rms_norm_rows(h, *self._norm)
        return _mx(h.reshape(1, 1, -1))


def _probe(new: CpuModelStep, inner: nn.Module, vocab: int) -> bool:
    """Three tokens through the original, then one decode step each way on copies of the caches,
    with every feed-forward block stubbed (a probe reads no experts)."""
    from mlx_lm.models.cache import KVCache

    layers = inner["layers"]
    stubs = []
    for layer in layers:
        stub = _StubFFN()
        stubs.append((layer, layer._ffn, layer[layer._ffn]))
        layer[layer._ffn] = layer._orig.module[layer._ffn] = stub
    try:
        ids = np.random.default_rng(0).integers(0, vocab, 4)
        a = [KVCache() for _ in layers]
        mx.eval(inner(mx.array(ids[None, :3]), a))
        b = []
        for c in a:
            d = KVCache()
            d.keys, d.values, d.offset = mx.array(np.array(c.keys)), mx.array(np.array(c.values)), c.offset
            b.append(d)
        step = mx.array(ids[None, 3:])
        if not new.fast(step, b, (), {}):
            return False
        return _close(new(step, b), inner(step, a))
    except (ValueError, TypeError, AttributeError, IndexError):
        return False
    finally:
        for layer, name, ffn in stubs:
            layer[name] = layer._orig.module[name] = ffn


def install(model: nn.Module) -> bool:
    """Wrap the inner model where the probe passes; returns whether it did."""
    from flashmoe.engine.cpu.install import set_module
    from flashmoe.engine.runtime.timing import decoder_layers

    try:
        layers = decoder_layers(model)
    except ValueError:
        return False
    if not layers or not all(type(l) is CpuDecoderLayer for l in layers):
        return False
    name, inner = next(((n, m) for n, m in model.named_modules() if m.get("layers") is layers), (None, None))
    if inner is None or not name:
        return False
    try:
        new = CpuModelStep(inner)
    except (ValueError, TypeError, AttributeError):
        return False
    embed = inner["embed_tokens"]
    vocab = embed.tiled.n if isinstance(embed, CpuQuantizedEmbedding) else embed.weight.shape[0]
    if not _probe(new, inner, vocab):
        return False
    set_module(model, name, new)
    return True
