"""Fused CPU modules for the decode step: whole attention, MLP, MoE blocks and decoder layers on
the numba kernels.

With the matmuls on numba (engine/cpu/install.py) a token still paid for MLX's small ops and syncs:
each of q/k/v/o and gate/up/down evaluated its input (a sync), and the rope, norms, cache update
and attention between them cost 5-15 us of dispatch apiece, ~0.5 ms per layer in all, more than
the matmuls of a small model. Here:

- CpuAttention: one sync on its input, then q/k/v in one kernel call on their concatenated
  weights, q/k norms, rotary embedding from a table, the cache write and attention over it, and
  o_proj, all on numpy views (the cache's own MLX buffers, written in place). Only one-token
  decode steps on a plain KVCache take this path; prefill and anything else run the original
  mlx-lm module (whose matmuls are already on the kernels).
- CpuMLP: silu(gate(x)) * up(x) -> down in one sync and two kernel calls.
- CpuMoE: a plain top-k MoE block (router, routing, streamed experts, weighted sum) in one sync.
- SharedAhead: a MoE block's shared expert runs while the routed experts are being read.
- CpuDecoderLayer: a pre-norm decoder layer whose attention and feed-forward block are both
  fused runs as numpy from input to output: no MLX op in the layer at all.

Nothing here knows a model file. A module is replaced only when it has the expected parts AND
the replacement reproduces the original on a probe input at load time (the original is kept for
everything else); otherwise it is left alone. The rotary table is read off the model's own rope
module (it is applied to the identity), so any rope variant that rotates pairs of dimensions works.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from flashmoe.engine.cpu.install import CpuQuantizedLinear, set_module
from flashmoe.engine.cpu.routing import MODES, combine, gate_rows, route
from flashmoe.engine.hidden import Hidden
from flashmoe.engine.options import KV_CACHES

PROBE_TOL = 1e-4  # relative to the output's largest magnitude


class Fused:
    """Several CpuQuantizedLinear sharing an input, as one matrix: each keeps a view of its rows
    (so the originals' arrays are freed, not kept twice)."""

    def __init__(self, linears: list[CpuQuantizedLinear]):
        self.bits, self.gs = linears[0]._bits, linears[0]._gs
        self.sizes = [l.out_features for l in linears]
        self.bias = None
        if any(l._bias is not None for l in linears):
            self.bias = np.concatenate(
                [l._bias if l._bias is not None else np.zeros(n, np.float32) for l, n in zip(linears, self.sizes)]
            )
        if all(l.tiled is not None for l in linears):
            from flashmoe.engine.cpu.tiled import Tiled

            self.tiled, views, self.starts = Tiled.stack([l.tiled for l in linears])
            for l, v in zip(linears, views):
                l.rebind_tiled(v)
            if self.bias is not None:  # laid out as the stacked output is: parts start on a tile
                bias = np.zeros(self.tiled.n, np.float32)
                for start, n, part in zip(self.starts, self.sizes, np.split(self.bias, np.cumsum(self.sizes)[:-1])):
                    bias[start : start + n] = part
                self.bias = bias
            return
        self.tiled = None
        self.w = np.concatenate([l._w for l in linears])
        self.s = np.concatenate([l._s for l in linears])
        self.b = np.concatenate([l._b for l in linears])
        self.starts = [int(v) for v in np.cumsum([0] + self.sizes[:-1])]
        for l, start, n in zip(linears, self.starts, self.sizes):
            l.rebind(self.w[start : start + n], self.s[start : start + n], self.b[start : start + n])

    @staticmethod
    def compatible(linears) -> bool:
        return (
            all(isinstance(l, CpuQuantizedLinear) for l in linears)
            and len({(l._bits, l._gs, l.in_features) for l in linears}) == 1
        )

    def stacked(self, x2: np.ndarray) -> np.ndarray:
        """x2 [R, in] -> [R, width]: every part's output, part i from column starts[i]."""
        from flashmoe.engine.cpu.qmm import qmm

        if self.tiled is not None:
            out = self.tiled.matmul(x2)
        else:
            out = qmm(x2, self.w, self.s, self.b, self.bits, self.gs)
        return out + self.bias if self.bias is not None else out

    def __call__(self, x2: np.ndarray) -> list[np.ndarray]:
        out = self.stacked(x2)
        return [out[:, start : start + n] for start, n in zip(self.starts, self.sizes)]


def _linear_np(lin: CpuQuantizedLinear, x2: np.ndarray) -> np.ndarray:
    return lin.matmul(x2)


def _mx(a: np.ndarray) -> mx.array:
    """numpy -> MLX, already in its final shape: an mx reshape would be a lazy op, and the next
    eval of it a sync with MLX's stream (~45 us here) instead of ~1 us."""
    return mx.array(a)


def _np(a: mx.array) -> np.ndarray:
    from flashmoe.engine.cpu.qmm import to_numpy

    mx.eval(a)
    return to_numpy(a)


class RopeTable:
    """Rotary embedding at each position as x[d] <- a[d] * x[d] + b[d] * x[partner[d]], read off
    the model's rope module by applying it to the identity, shared by every layer whose rope
    agrees. Rows come AHEAD positions per MLX call (one call a position cost a decode step 0.44 ms
    of 15 on the upcycled demo): a batch of one-token sequences, each at its own offset (an array
    of offsets, as batched generation passes them), so that each row is the one-position call's.
    Each batch is checked against one-position calls at its first, middle and last row, bit for
    bit; a rope that takes no array of offsets (dynamic NTK) or whose rows differ is computed one
    position at a time from then on, as decoding calls the original module."""

    AHEAD = 64
    batches = True  # False once a batch failed its check

    def __init__(self, rope, dim: int):
        self.rope, self.dim = rope, dim
        self.a = np.zeros((0, dim), np.float32)
        self.b = np.zeros((0, dim), np.float32)
        self.known = np.zeros(0, bool)
        self.partner = None
        self.row(1)  # fixes the pairing (position 0 rotates nothing) or raises ValueError

    def row(self, pos: int):
        if pos >= self.known.shape[0]:
            n = max(64, 2 * pos + 1, pos + self.AHEAD)
            self.a = np.resize(self.a, (n, self.dim))
            self.b = np.resize(self.b, (n, self.dim))
            self.known = np.concatenate([self.known, np.zeros(n - self.known.shape[0], bool)])
        if not self.known[pos]:
            self._compute(pos)
        return self.a[pos], self.b[pos]

    def _compute(self, pos: int) -> None:
        n = min(self.AHEAD, self.known.shape[0] - pos)
        if self.batches and self.partner is not None and n > 1:
            try:
                a, b = self._rows(pos, n)
                self.batches = all(
                    np.array_equal(r, one[0])
                    for i in (0, n // 2, n - 1)
                    for r, one in zip((a[i], b[i]), self._rows(pos + i, 1))
                )
            except (ValueError, TypeError):  # no array of offsets
                self.batches = False
            if self.batches:
                self.a[pos : pos + n], self.b[pos : pos + n], self.known[pos : pos + n] = a, b, True
                return
        (a,), (b,) = self._rows(pos, 1)
        self.a[pos], self.b[pos], self.known[pos] = a, b, True

    def _rows(self, pos: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(a, b) [n, dim] of positions pos .. pos + n - 1 from one call of the rope module: n
        one-token sequences of D "heads", head i the basis vector i."""
        D = self.dim
        eye = mx.broadcast_to(mx.eye(D, dtype=mx.float32).reshape(1, D, 1, D), (n, D, 1, D))
        out = np.array(self.rope(eye, offset=mx.arange(pos, pos + n) if n > 1 else pos), dtype=np.float32)
        idx = np.arange(D)
        a, b = np.empty((n, D), np.float32), np.empty((n, D), np.float32)
        for t in range(n):
            R = out[t, :, 0, :].T  # R[j, i]: output j of basis vector i
            off = R.copy()
            off[idx, idx] = 0.0
            if self.partner is None:
                self.partner = np.where(np.abs(off).max(axis=1) > 0, np.abs(off).argmax(axis=1), idx).astype(np.int64)
            a[t], b[t] = np.diagonal(R), off[idx, self.partner]
            if not np.array_equal(np.abs(off).sum(axis=1), np.abs(b[t])):
                raise ValueError("the rope module does not rotate pairs of dimensions")
        return a, b


def _rope_key(rope, dim: int):
    """Rope modules that agree on a probe share one table (usually every layer's)."""
    x = mx.array(np.random.default_rng(7).standard_normal((1, 1, 2, dim)).astype(np.float32))
    return dim, np.array(rope(x, offset=4099)).tobytes()


def _rms_parts(norm, H: int, hd: int):
    """(weight, eps, per_head) of an nn.RMSNorm applied per head [hd] or on all heads [H*hd]."""
    if norm is None:
        return None
    if type(norm) is not nn.RMSNorm:
        raise ValueError("not an RMSNorm")
    w = np.ascontiguousarray(_np(norm.weight), dtype=np.float32)
    if w.shape[0] not in (hd, H * hd):
        raise ValueError("norm size fits neither a head nor all heads")
    return w, np.float32(norm.eps), w.shape[0] == hd


KV_DTYPES = tuple(getattr(mx, name) for name in KV_CACHES)  # the KV caches the CPU kernels' attention keeps


def _kv_view(a: mx.array) -> np.ndarray:
    """A cache's keys or values [1, Hk, capacity, hd] as a numpy view of their memory [Hk,
    capacity, hd]: float32, or a float16 cache's bits as uint16 (numba has no float16). Made
    again at every step: a slice assignment (update_and_fetch) may move an array's data."""
    v = np.asarray(memoryview(a))[0]
    return v.view(np.uint16) if v.dtype == np.float16 else v


HEADS = ("n_heads", "num_heads", "num_attention_heads")
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")


def _heads(attn, names) -> int:
    for n in names:
        if isinstance(getattr(attn, n, None), int):
            return getattr(attn, n)
    raise ValueError(f"no {names[0]}")


class _Wraps(nn.Module):
    """Reads attributes it does not have from the module it replaces (its q_proj, n_heads, ...).
    Its own private state (names from "_": numpy arrays, tuples, kernels) are plain attributes,
    not a Module's children: read on every decode step, where a child's lookup (Module.__getattr__,
    then this one) cost about a microsecond each, 270 of them a step on the demo."""

    def __setattr__(self, name, value):
        if name.startswith("_") and not isinstance(value, (nn.Module, mx.array)):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_orig" not in self.__dict__:
                raise
            return getattr(self.__dict__["_orig"].module, name)


class CpuAttention(_Wraps):
    """One-token decode of a standard multi-head / grouped-query attention on the CPU kernels,
    and causal prefill chunks on numpy's BLAS where its probe says they agree too."""

    prefill_ok = True  # set by _probe_attention
    kv_dtype = mx.float32  # a new cache's element type: float16 with --kv-cache float16 (the loader sets it)

    def __init__(self, attn: nn.Module, tables: dict):
        super().__init__()
        projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if not all(isinstance(p, CpuQuantizedLinear) for p in projs) or not Fused.compatible(projs[:3]):
            raise ValueError("projections are not all on the CPU kernels")
        self.H, self.Hk = _heads(attn, HEADS), _heads(attn, KV_HEADS)
        self.hd = projs[0].out_features // self.H
        if self.H % self.Hk or projs[1].out_features != self.Hk * self.hd or projs[2].out_features != self.Hk * self.hd:
            raise ValueError("head counts do not fit the projections")
        self.scale = np.float32(attn.scale)
        self.q_norm = _rms_parts(getattr(attn, "q_norm", None), self.H, self.hd)
        self.k_norm = _rms_parts(getattr(attn, "k_norm", None), self.Hk, self.hd)
        key = _rope_key(attn.rope, self.hd)
        if key not in tables:
            tables[key] = RopeTable(attn.rope, self.hd)
        self._rope = tables[key]
        self._orig = Hidden(attn)
        self._qkv = Fused(projs[:3])
        self._o = projs[3]
        none = (np.zeros(0, np.float32), np.float32(0), False)  # no norm, as decode_qs takes it
        self._norm_args = (*(self.q_norm or none), *(self.k_norm or none))
        self._block = None  # block_np's kernel and arguments, made on its first call

    @staticmethod
    def fast(x, mask, cache, kwargs) -> bool:
        """Whether this call is a one-token decode step on a plain KVCache, empty or of KV_DTYPES
        (block_np and decode_np make it or grow it, _position). (The CPU kernels compute in float32.)"""
        from mlx_lm.models.cache import KVCache

        return not (
            kwargs
            or type(cache) is not KVCache
            or x.shape[0] != 1
            or x.shape[1] != 1
            or (cache.keys is not None and cache.keys.dtype not in KV_DTYPES)
            or not (mask is None or isinstance(mask, str))
        )

    @staticmethod
    def prefill_fits(x, mask, cache, kwargs) -> bool:
        """Whether this call is a causal prefill chunk (several tokens) on a plain KVCache of KV_DTYPES."""
        from mlx_lm.models.cache import KVCache

        return not (
            kwargs
            or type(cache) is not KVCache
            or x.shape[0] != 1
            or x.shape[1] < 2
            or x.dtype != mx.float32
            or (cache.keys is not None and cache.keys.dtype not in KV_DTYPES)
            or not (isinstance(mask, str) and mask == "causal")
        )

    def __call__(self, x, mask=None, cache=None, **kwargs):
        if self.fast(x, mask, cache, kwargs):
            return _mx(self.decode_np(_np(x).reshape(1, -1), cache).reshape(1, 1, -1))
        if self.prefill_ok and self.prefill_fits(x, mask, cache, kwargs):
            return self.prefill(x, cache)
        if getattr(cache, "keys", None) is not None and cache.keys.dtype == mx.float16 and x.dtype == mx.float32:
            # MLX's attention would write float32 rows into it and grow it as float32
            raise ValueError(
                "a float16 KV cache (--kv-cache float16) is kept by the CPU kernels' attention only, "
                "and this call is not one of theirs"
            )
        return self._orig.module(x, mask, cache, **kwargs)

    def _room(self, cache, n: int) -> None:
        """Room for n more positions in the cache, made as KVCache.update_and_fetch makes it (in
        steps of cache.step positions), in the cache's element type (a new one: kv_dtype)."""
        if cache.keys is not None and cache.offset + n <= cache.keys.shape[2]:
            return
        dtype = self.kv_dtype if cache.keys is None else cache.keys.dtype
        shape = (1, self.Hk, (n + cache.step - 1) // cache.step * cache.step, self.hd)
        if cache.keys is None:
            cache.keys, cache.values = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        else:
            cache.keys, cache.values = (
                mx.concatenate([c[..., : cache.offset, :], mx.zeros(shape, dtype)], axis=2)
                for c in (cache.keys, cache.values)
            )
        mx.eval(cache.keys, cache.values)

    def prefill(self, x, cache) -> mx.array:
        """A prompt chunk [1, T, D]: projections and norms as in decoding, the rope by the
        model's own module (some ropes depend on the call's length), the cache by its own
        update_and_fetch, then causal attention on numpy's BLAS (attn.attend_causal) instead
        of MLX's CPU attention (15 of 20 s of a 1k-token prefill on the dense SmolLM2)."""
        from flashmoe.engine.cpu.attn import attend_causal, rms_norm_rows

        T = x.shape[1]
        H, Hk, hd = self.H, self.Hk, self.hd
        self._room(cache, T)
        q, k, v = (np.ascontiguousarray(t) for t in self._qkv(_np(x).reshape(T, -1)))
        for t, norm, n in ((q, self.q_norm, H), (k, self.k_norm, Hk)):
            if norm is not None:
                w, eps, per_head = norm
                rms_norm_rows(t.reshape(T * n, hd) if per_head else t, w, eps)
        rope = self._orig.module.rope
        queries = rope(mx.array(q).reshape(1, T, H, hd).transpose(0, 2, 1, 3), offset=cache.offset)
        keys = rope(mx.array(k).reshape(1, T, Hk, hd).transpose(0, 2, 1, 3), offset=cache.offset)
        dtype = cache.keys.dtype  # (a float16 cache: its rounded rows are what later steps read)
        keys, values = cache.update_and_fetch(
            keys.astype(dtype), mx.array(v).reshape(1, T, Hk, hd).transpose(0, 2, 1, 3).astype(dtype)
        )
        mx.eval(queries, keys, values)
        o = attend_causal(
            np.array(queries[0]), np.array(keys[0], np.float32), np.array(values[0], np.float32), self.scale
        )
        return _mx(_linear_np(self._o, o.reshape(T, H * hd)).reshape(1, T, -1))

    def block_np(self, x2: np.ndarray, cache, norms) -> tuple[np.ndarray, np.ndarray] | None:
        """A pre-norm layer's attention block for one decoding token in one kernel call
        (tiled.py's `_attn_half`): x2 [1, D] -> (h = x2 + attention(norm1(x2)), norm2(h)),
        norms = ((weight, eps) of norm1, of norm2). The arithmetic of decode_np between the
        norms, op for op, in one call where it took ten and the Python between them (the
        upcycled demo's step: 15.3 -> 13.7 ms, 55 us a layer). None where the projections are
        not tiled in one format (and kind, float or int8): the caller takes decode_np."""
        _, fn, qkv_args, o_args, parallel = self.block_parts()
        if fn is None:
            return None
        (w1, eps1), (w2, eps2) = norms
        h, n2 = fn(x2, w1, eps1, *qkv_args, *self._position(cache), *o_args, w2, eps2, *parallel)
        cache.offset += 1
        return h, n2

    def block_parts(self) -> tuple:
        """(the kernels' kind, _attn_half or None, its arguments before the step's own, after them,
        its parallel flags), for the kind the projections are switched to now."""
        kind = getattr(self._o.tiled, "int8", None)  # (float or int8 kernels: int8.use_int8 switches them)
        if self._block is None or self._block[0] != kind:
            self._block = (kind, *self._block_kernel())
        return self._block

    def _block_kernel(self) -> tuple:
        """(_attn_half or None, its arguments before the step's own, after them, its parallel
        flags): made once per kind of kernels."""
        qkv, o = self._qkv.tiled, self._o.tiled
        if qkv is None or o is None or (qkv.bits, qkv.gs, qkv.int8) != (o.bits, o.gs, o.int8) or o.n != qkv.k:
            return None, (), (), ()
        none = np.zeros(0, np.float32)
        bias_o = none if self._o._bias is None else np.ascontiguousarray(self._o._bias, dtype=np.float32)
        return (
            qkv.entry("attn_half"),
            (
                qkv.wt,
                qkv.st,
                qkv.bt,
                none if self._qkv.bias is None else self._qkv.bias,
                *self._qkv.starts,
                self.H,
                self.Hk,
                self.hd,
                *self._norm_args,
            ),
            (self.scale, o.wt, o.st, o.bt, bias_o),
            (qkv.one_row_parallel, o.one_row_parallel),
        )

    def _position(self, cache) -> tuple:
        """This step's rope row (a, b, partner), the cache's keys and values as numpy [Hk,
        capacity, hd] (written in place; float16 as its bits, uint16; room made for this
        position) and the position."""
        self._room(cache, 1)
        return (
            *self._rope.row(cache.offset),
            self._rope.partner,
            _kv_view(cache.keys),
            _kv_view(cache.values),
            cache.offset,
        )

    def decode_np(self, x2: np.ndarray, cache) -> np.ndarray:
        """x2 [1, D] -> [1, D_out]; writes this position's keys and values into the cache."""
        from flashmoe.engine.cpu.attn import attend_qs, decode_qs

        a, b, partner, K, V, pos = self._position(cache)
        qs = decode_qs(
            self._qkv.stacked(x2)[0],
            *self._qkv.starts,
            self.H,
            self.Hk,
            self.hd,
            *self._norm_args,
            a,
            b,
            partner,
            K,
            V,
            pos,
            self.scale,
        )
        cache.offset = pos + 1
        return _linear_np(self._o, attend_qs(qs, K, V, pos + 1).reshape(1, -1))


class CpuMLP(_Wraps):
    """down(silu(gate(x)) * up(x)) with gate and up as one kernel call."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, CpuQuantizedLinear) for p in projs) or not Fused.compatible(projs[:2]):
            raise ValueError("projections are not all on the CPU kernels")
        if any(p._bias is not None for p in projs):
            raise ValueError("projections with a bias")
        self._orig = Hidden(mlp)
        self._gate_up = Fused(projs[:2])
        self._down = projs[2]

    def __call__(self, x):
        return _mx(self.np(_np(x).reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1))

    def np(self, x2: np.ndarray) -> np.ndarray:
        from flashmoe.engine.cpu.attn import silu_mul

        g, u = self._gate_up(x2)
        return _linear_np(self._down, silu_mul(g, u))

    def tiled_parts(self) -> tuple:
        """(gate and up's tiled matrix, down's), either None where not tiled."""
        return self._gate_up.tiled, self._down.tiled


FFN_NAMES = ("mlp", "block_sparse_moe", "feed_forward")


class CpuDecoderLayer(_Wraps):
    """A pre-norm decoder layer, h = x + attn(norm1(x)); out = h + ffn(norm2(h)), decoded one
    token at a time on numpy: with its attention and feed-forward block fused, the layer needs no
    MLX op at all, and the hidden state crosses into MLX once per layer instead of twice. The
    parts stay children of this module (so --timing layer can wrap the attention; a wrapped
    attention is then called through MLX)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        ffn = next((n for n in FFN_NAMES if isinstance(layer.get(n), (CpuMLP, CpuMoE))), None)
        if not isinstance(layer.get("self_attn"), CpuAttention) or ffn is None:
            raise ValueError("attention or feed-forward not fused")
        norms = [layer.get(n) for n in ("input_layernorm", "post_attention_layernorm")]
        if not all(type(n) is nn.RMSNorm for n in norms):
            raise ValueError("not RMSNorm pre-norms")
        self._orig = Hidden(layer)
        self._ffn = ffn
        for n in ("input_layernorm", "self_attn", "post_attention_layernorm", ffn):
            self[n] = layer[n]
        self._norms = [(np.ascontiguousarray(_np(n.weight), dtype=np.float32), np.float32(n.eps)) for n in norms]
        self._call = None  # what _one_call calls: _call_parts

    def __call__(self, x, mask=None, cache=None, **kwargs):
        if not CpuAttention.fast(x, mask, cache, kwargs):
            return self._orig.module(x, mask, cache, **kwargs)
        return _mx(self.step_np(_np(x).reshape(1, -1), cache).reshape(1, 1, -1))

    def step_np(self, x2: np.ndarray, cache) -> np.ndarray:
        """One decode step: x2 [1, D] -> [1, D] (the cache must pass CpuAttention.fast)."""
        from flashmoe.engine.cpu.attn import rms_norm_rows

        (w1, eps1), (w2, eps2) = self._norms
        attn = self["self_attn"]
        if isinstance(attn, CpuAttention):
            out = self._one_call(attn, x2, cache)
            if out is not None:
                return out
        block = attn.block_np(x2, cache, self._norms) if isinstance(attn, CpuAttention) else None
        if block is not None:
            h, n2 = block
            return h + self[self._ffn].np(n2)
        n1 = x2.copy()
        rms_norm_rows(n1, w1, eps1)
        if isinstance(attn, CpuAttention):
            h = x2 + attn.decode_np(n1, cache)
        else:  # wrapped (layer timing): through MLX
            h = x2 + _np(attn(_mx(n1.reshape(1, 1, -1)), None, cache)).reshape(1, -1)
        n2 = h.copy()
        rms_norm_rows(n2, w2, eps2)
        return h + self[self._ffn].np(n2)

    def _one_call(self, attn: CpuAttention, x2: np.ndarray, cache) -> np.ndarray | None:
        """The whole layer in one kernel call (engine/cpu/layer_step.py): the attention block,
        then a dense MLP, or a MoE block's router, routing and cached experts. A MoE layer whose
        experts are read ahead (--prefetch) is not (the reads start before its compute). Where
        an expert chosen is not in the slot it was last found in, the call stops after the
        routing and the block goes on from there (CpuMoE.routed). None where the layer cannot
        (_call_parts): the caller takes the separate calls."""
        _, kind, fn, args = self._call_parts(attn)
        ffn = self[self._ffn]
        if fn is None or (kind == "moe" and not ffn._switch.fusable()):
            return None
        _, _, qkv_args, o_args, parallel = attn.block_parts()
        (w1, eps1), (w2, eps2) = self._norms
        head = (x2, w1, eps1, *qkv_args, *attn._position(cache), *o_args, w2, eps2, *parallel)
        if kind == "mlp":
            out = fn(*head, *args)
            cache.offset += 1
            return out
        k = ffn.k
        ids, scores, slots, times = (
            np.empty((1, k), np.int64),
            np.empty((1, k), np.float32),
            np.empty(k, np.int64),
            np.zeros(3),
        )
        out, n2, hit = fn(*head, *args, ids, scores, slots, times)
        cache.offset += 1
        ffn._switch.fused_done(ids, slots if hit else None, times, n2=n2)
        return out if hit else out + ffn.routed(n2, ids, scores)

    def one_call(self) -> str | None:
        """What a decode step can take in one kernel call with this layer's attention block (a
        dense "mlp", or a "moe" block while its experts are cached), or None."""
        attn = self["self_attn"]
        return self._call_parts(attn)[1] if isinstance(attn, CpuAttention) else None

    def _call_parts(self, attn: CpuAttention) -> tuple:
        """((kind of kernels, feed-forward block), "moe" / "mlp" / None, the kernel, its arguments
        after the attention block's), for the kernels' kind now (float or int8, as switched) and
        the block now (a probe stubs it for a while): made once for each."""
        key = (getattr(attn._o.tiled, "int8", None), self[self._ffn])
        if self._call is None or self._call[0][0] != key[0] or self._call[0][1] is not key[1]:
            self._call = (key, *self._call_kernel(attn))
        return self._call

    def _call_kernel(self, attn: CpuAttention) -> tuple:
        from flashmoe.engine.cpu import layer_step

        ffn, attn_half = self[self._ffn], attn.block_parts()[1]
        if attn_half is None:
            return None, None, ()
        if isinstance(ffn, CpuMLP):
            mlp = _mlp_args(ffn)
            if mlp is None:
                return None, None, ()
            runs, args = mlp
            return "mlp", layer_step.mlp_kernel(attn_half, *runs), args
        if not isinstance(ffn, CpuMoE) or ffn._gate is None:
            return None, None, ()
        router, bank = ffn._gate.tiled, ffn._switch.tiled_bank
        if router is None or bank is None or not bank.one_call:
            return None, None, ()
        swiglu_sum, tiles, parallel = bank.sum_args(ffn.k, attn._qkv.tiled.k)
        bias = ffn._gate._bias
        bias = np.zeros(0, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        args = (
            router.wt,
            router.st,
            router.bt,
            bias,
            router.n,
            ffn.k,
            MODES[ffn.routing],
            *ffn._switch.slot_args(),
            *tiles,
            parallel,
        )
        if not ffn._shared:
            return "moe", layer_step.moe_kernel(attn_half, swiglu_sum, router.run_kernel()), args
        shared = ffn.shared_mlp()
        gate = ffn._orig.module.get("shared_expert_gate")
        mlp = _mlp_args(shared) if isinstance(shared, CpuMLP) else None
        if mlp is None or (
            gate is not None
            and not (isinstance(gate, CpuQuantizedLinear) and gate.tiled is not None and gate._bias is None)
        ):
            return None, None, ()
        (gate_up_run, down_run), shared_args = mlp
        g = gate.tiled if gate is not None else shared.tiled_parts()[0]  # (ungated: a stand-in, never read)
        return (
            "moe",
            layer_step.shared_moe_kernel(
                attn_half, swiglu_sum, router.run_kernel(), gate_up_run, down_run, g.run_kernel()
            ),
            (*args, *shared_args, g.wt, g.st, g.bt, gate is not None),
        )


def _mlp_args(mlp: "CpuMLP") -> tuple | None:
    """((gate/up's kernel, down's kernel), the arguments layer_step takes for them) of a fused
    MLP whose gate and up are one tiled matrix (gate first, one width) and down is tiled."""
    gate_up, down = mlp.tiled_parts()
    fused = mlp._gate_up
    if gate_up is None or down is None or fused.starts[0] != 0 or len(set(fused.sizes)) != 1:
        return None
    return (gate_up.run_kernel(), down.run_kernel()), (
        gate_up.wt,
        gate_up.st,
        gate_up.bt,
        fused.starts[1],
        fused.sizes[0],
        gate_up.one_row_parallel,
        down.wt,
        down.st,
        down.bt,
        down.one_row_parallel,
    )


class _StubFFN(nn.Module):
    """Stands in for a feed-forward block while a decoder layer is probed (no expert reads)."""

    def __call__(self, x):
        return x * 2.0 - 1.0

    def np(self, x2):
        return x2 * np.float32(2.0) - np.float32(1.0)


def _probe_layer(new: CpuDecoderLayer, layer: nn.Module, dim: int) -> bool:
    ffn = layer[new._ffn]
    stub = _StubFFN()
    layer[new._ffn] = new[new._ffn] = stub
    try:
        return _probe_attention(new, layer, dim)
    finally:
        layer[new._ffn] = new[new._ffn] = ffn


SHARED_NAMES = ("shared_expert", "shared_experts")


class SharedAhead(_Wraps):
    """A MoE block's shared expert, computed while the routed experts are being read: the
    streamed experts call run_ahead(x, x2) once their reads are in flight, and the block's own
    call with that same x then returns the result. Any other call computes as usual."""

    def __init__(self, mlp: CpuMLP):
        super().__init__()
        self._orig = Hidden(mlp)
        self._ahead = None  # (the x it was computed for, result)
        self.used = 0  # results handed over (tests)

    def run_ahead(self, x: mx.array, x2: np.ndarray) -> None:
        self._ahead = (x, self._orig.module.np(x2))

    def __call__(self, x):
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] is x:
            self.used += 1
            return _mx(ahead[1].reshape(*x.shape[:-1], -1))
        return self._orig.module(x)


def _install_shared(block: nn.Module) -> bool:
    from flashmoe.engine.experts.switch import StreamingSwitchGLU

    switch = block.get("switch_mlp")
    name = next((n for n in SHARED_NAMES if isinstance(block.get(n), CpuMLP)), None)
    if not isinstance(switch, StreamingSwitchGLU) or not switch.on_cpu_kernels or name is None:
        return False
    block[name] = SharedAhead(block[name])
    switch.compute_beside(block[name])
    return True


ROUTINGS = tuple(MODES)  # how mlx-lm's MoE blocks route (routing.route)


def _linear_fn(lin):
    """A router-like linear layer (CpuQuantizedLinear, or a float32 nn.Linear) as x2 -> x2 @ W.T."""
    if isinstance(lin, CpuQuantizedLinear):
        return lin.matmul
    if type(lin) is nn.Linear and lin.weight.dtype == mx.float32:
        w = _np(lin.weight)
        bias = _np(lin.bias) if "bias" in lin else None
        return lambda x2: x2 @ w.T + bias if bias is not None else x2 @ w.T
    raise ValueError("unsupported linear layer")


class CpuMoE(_Wraps):
    """A sparse MoE block (router, top-k, streamed experts, weighted sum, and a shared expert if
    it has one) in one sync: the router runs on the kernel or numpy's BLAS instead of MLX's small
    ops, and the shared expert while the routed experts are read. A shared expert is added as is
    (`shared_experts`, DeepSeek's name) or through a sigmoid gate (`shared_expert` with
    `shared_expert_gate`: Qwen2-MoE, Qwen3-Next); the probe at load checks which the block does.
    Other routings and blocks keep the original (whose experts already stream on the kernels)."""

    def __init__(self, block: nn.Module, routing: str):
        super().__init__()
        from flashmoe.engine.experts.switch import StreamingSwitchGLU

        switch = getattr(block, "switch_mlp", None)
        if not isinstance(switch, StreamingSwitchGLU) or not switch.on_cpu_kernels:
            raise ValueError("experts are not streamed on the CPU kernels")
        if "shared_mlp" in block or ("shared_expert" in block and "shared_experts" in block):
            raise ValueError("shared experts of an unknown kind")
        self.k = next(
            (getattr(block, n) for n in ("top_k", "num_experts_per_tok") if isinstance(getattr(block, n, None), int)),
            None,
        )
        if self.k is None:
            raise ValueError("no top_k")
        self._router = _linear_fn(getattr(block, "gate", None))
        self._gate = block.gate if isinstance(block.gate, CpuQuantizedLinear) else None  # (fused layer: its tiles)
        self._shared = next((n for n in SHARED_NAMES if n in block), None)
        gate = block.get("shared_expert_gate") if self._shared else None
        self._shared_gate = _linear_fn(gate) if gate is not None else None
        self.routing = routing
        self._orig = Hidden(block)
        self._switch = switch

    def __call__(self, x):
        return _mx(self.np(_np(x).reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1))

    def shared_mlp(self):
        """The shared expert's module (the fused MLP behind a SharedAhead)."""
        m = self._orig.module[self._shared]
        return m._orig.module if isinstance(m, SharedAhead) else m

    def shared_np(self, x2: np.ndarray) -> np.ndarray:
        """The shared expert's output, through its gate."""
        m = self.shared_mlp()
        out = m.np(x2) if isinstance(m, (CpuMLP, _StubFFN)) else _np(m(_mx(x2)))  # (not yet fused: MLX)
        if self._shared_gate is not None:
            out = np.array(out, dtype=np.float32)  # (a copy: m's output may be a view of its own)
            gate_rows(out, np.ascontiguousarray(self._shared_gate(x2), dtype=np.float32))
        return out

    def np(self, x2: np.ndarray, experts=None) -> np.ndarray:
        """x2 [R, D] -> [R, D]; `experts` stands in for the streamed experts (the probe)."""
        from time import perf_counter

        switch = self._switch
        t0 = perf_counter()
        logits = self._router(x2)
        if experts is None and x2.shape[0] == 1:  # decoding: every expert cached takes one call
            ids, scores, slots = switch.route_cached(logits, self.k, MODES[self.routing])
            switch.add_route_time(perf_counter() - t0)
            if slots is not None:  # each where it was last time: no lookups
                shared = (lambda: self.shared_np(x2)) if self._shared else None
                return switch.decode_slots(x2, ids, slots, scores, shared)
            return self.routed(x2, ids, scores)
        ids, scores = route(logits, self.k, self.routing)
        switch.add_route_time(perf_counter() - t0)
        return self.routed(x2, ids, scores, experts)

    def routed(self, x2: np.ndarray, ids: np.ndarray, scores: np.ndarray, experts=None) -> np.ndarray:
        """The block's output for x2 [R, D] routed to ids with scores [R, k]."""
        switch = self._switch
        if experts is None and x2.shape[0] == 1:
            out = switch.decode_cached(x2, ids, scores, (lambda: self.shared_np(x2)) if self._shared else None)
            if out is not None:
                return out
        shared = []
        if experts is not None:
            y = experts(x2, ids)
        else:
            during = (lambda: shared.append(self.shared_np(x2))) if self._shared else None
            y = switch.experts_np(x2, ids, during=during)  # [R, k, D]
        if self._shared:  # computed during the reads, or now (the probe, or no reads)
            return combine(y, scores, shared[0] if shared else self.shared_np(x2))
        return combine(y, scores)


class _FakeExperts(nn.Module):
    """Stands in for the streamed experts while a MoE block is probed: a fixed output per (row,
    expert), no reads."""

    def __init__(self, table: np.ndarray):
        super().__init__()
        self._table = table  # [R, E, D]
        self.seen = None

    def np_call(self, x2, ids):
        return np.take_along_axis(self._table, ids.reshape(ids.shape[0], -1)[..., None], axis=1)

    def __call__(self, x, indices):
        self.seen = np.array(indices).reshape(self._table.shape[0], -1)
        return mx.array(self.np_call(None, self.seen))


def _probe_moe(block: nn.Module) -> str | None:
    """The routing (of ROUTINGS) that reproduces the block's experts and output on a probe, with
    the experts replaced by fixed outputs (a probe must not read experts from disk)."""
    switch = block["switch_mlp"]
    try:
        new = CpuMoE(block, ROUTINGS[0])
    except ValueError:
        return None
    dim = switch.expert_input_dim()
    num_experts = switch.num_experts
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 3, dim)).astype(np.float32))
    x2 = np.array(x).reshape(3, dim)
    # The shared expert is stubbed too: its real output can be orders of magnitude larger than the
    # fake experts' (the demo's is), and the tolerance, relative to the largest output, then let
    # a routing that weighs the experts twice over pass.
    shared = block[new._shared] if new._shared else None
    for routing in ROUTINGS:
        new.routing = routing
        fake = _FakeExperts(rng.standard_normal((3, num_experts, dim)).astype(np.float32))
        block["switch_mlp"] = fake
        if shared is not None:
            block[new._shared] = _StubFFN()
        try:
            want = block(x)
            seen = fake.seen
            got = mx.array(new.np(x2, fake.np_call)).reshape(x.shape)
        except (ValueError, TypeError, AttributeError, IndexError):  # not a block this fits
            return None
        finally:
            block["switch_mlp"] = switch
            if shared is not None:
                block[new._shared] = shared
        ids, _ = route(new._router(x2), new.k, routing)
        if seen is not None and _close(got, want) and np.array_equal(np.sort(ids, axis=-1), np.sort(seen, axis=-1)):
            return routing
    return None


def _close(got: mx.array, want: mx.array) -> bool:
    got, want = np.array(got), np.array(want)
    return got.shape == want.shape and bool(np.abs(got - want).max() <= PROBE_TOL * max(1.0, float(np.abs(want).max())))


def _probe_attention(new: CpuAttention, attn: nn.Module, dim: int) -> bool:
    """A 3-token prefill through the original, then one decode step each way on copies of the
    cache: same output and same cache row."""
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 4, dim)).astype(np.float32))
    a = KVCache()
    mx.eval(attn(x[:, :3], None, a))
    b = KVCache()
    b.keys, b.values, b.offset = mx.array(np.array(a.keys)), mx.array(np.array(a.values)), a.offset
    want = attn(x[:, 3:], None, a)
    got = new(x[:, 3:], None, b)
    decode_ok = (
        b.offset == a.offset
        and _close(got, want)
        and _close(b.keys[..., : b.offset, :], a.keys[..., : a.offset, :])
        and _close(b.values[..., : b.offset, :], a.values[..., : a.offset, :])
    )
    # a causal chunk of 5 after one of 3, each way
    x = mx.array(rng.standard_normal((1, 8, dim)).astype(np.float32))
    a, b = KVCache(), KVCache()
    want = [attn(x[:, :3], "causal", a), attn(x[:, 3:], "causal", a)]
    try:
        got = [new(x[:, :3], "causal", b), new(x[:, 3:], "causal", b)]
        new.prefill_ok = (
            b.offset == a.offset
            and all(_close(g, w) for g, w in zip(got, want))
            and _close(b.keys[..., : b.offset, :], a.keys[..., : a.offset, :])
        )
    except (ValueError, TypeError, AttributeError):
        new.prefill_ok = False
    return decode_ok


def _probe_mlp(new: CpuMLP, mlp: nn.Module, dim: int) -> bool:
    x = mx.array(np.random.default_rng(0).standard_normal((1, 3, dim)).astype(np.float32))
    return _close(new(x), mlp(x))


def _input_dim(module: nn.Module, first: str) -> int:
    return getattr(module, first).in_features


def use_kv_cache(model: nn.Module, dtype) -> None:
    """Keep every layer's KV cache in `dtype` (float16: --kv-cache). Every layer's attention must
    be a CpuAttention that prefills too, on a plain KVCache: MLX's attention would write float32
    rows into the cache and grow it as float32, so there the option would not hold (OptionError)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from flashmoe.engine.errors import OptionError
    from flashmoe.engine.runtime.timing import decoder_layers

    name = f"--kv-cache {str(dtype).split('.')[-1]}"
    try:
        layers = decoder_layers(model)
    except ValueError as e:
        raise OptionError(f"{name}: {e}") from None
    not_plain = [type(c).__name__ for c in make_prompt_cache(model) if type(c) is not KVCache]
    if not_plain:
        raise OptionError(f"{name}: this model keeps a {not_plain[0]} (the CPU kernels keep plain KV caches only)")
    for i, layer in enumerate(layers):
        attn = layer.get("self_attn") if isinstance(layer, nn.Module) else None
        if not isinstance(attn, CpuAttention) or not attn.prefill_ok:
            raise OptionError(
                f"{name}: layer {i}'s attention does not run on the CPU kernels "
                f"({'its prefill did not pass their probe' if isinstance(attn, CpuAttention) else 'not fused'})"
            )
    for layer in layers:
        layer["self_attn"].kv_dtype = dtype


def install(model: nn.Module) -> dict:
    """Replace the attention, MLP and MoE blocks that pass their probe, put shared experts ahead
    of the routed experts' reads, then fuse the decoder layers whose blocks were all replaced.
    Returns counts by kind (tried and replaced). Run after cpu.install.install (the projections must
    already be CpuQuantizedLinear)."""
    from flashmoe.engine.cpu.attn import warmup

    warmup()
    tables: dict = {}
    counts = {"attention": 0, "mlp": 0, "moe": 0, "attention_tried": 0, "mlp_tried": 0, "moe_tried": 0}
    replacements = []
    for name, m in model.named_modules():
        if isinstance(m, (CpuAttention, CpuMLP, CpuMoE)):
            continue
        if "switch_mlp" in m and "gate" in m:
            counts["moe_tried"] += 1
            routing = _probe_moe(m)
            if routing is not None:
                replacements.append((name, CpuMoE(m, routing)))
                counts["moe"] += 1
            continue
        kind = (
            "attention"
            if all(
                isinstance(getattr(m, n, None), CpuQuantizedLinear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
            )
            and hasattr(m, "rope")
            and hasattr(m, "scale")
            else "mlp"
            if all(isinstance(getattr(m, n, None), CpuQuantizedLinear) for n in ("gate_proj", "up_proj", "down_proj"))
            else None
        )
        if kind is None:
            continue
        counts[f"{kind}_tried"] += 1
        try:
            if kind == "attention":
                new = CpuAttention(m, tables)
                ok = _probe_attention(new, m, _input_dim(m, "q_proj"))
            else:
                new = CpuMLP(m)
                ok = _probe_mlp(new, m, _input_dim(m, "gate_proj"))
        except (ValueError, TypeError, AttributeError):
            ok = False
        if ok:
            replacements.append((name, new))
            counts[kind] += 1
    # deepest first: a block's parts (a MoE block's shared expert) are replaced inside the block
    # before the block itself is wrapped, so the wrapper computes with the replaced parts
    for name, new in sorted(replacements, key=lambda r: -r[0].count(".")):
        set_module(model, name, new)
    counts["shared_ahead"] = sum(_install_shared(m) for _, m in model.named_modules() if "switch_mlp" in m)
    _install_layers(model, counts)
    from flashmoe.engine.cpu import decode_step

    counts["model_step"] = int(decode_step.install(model))
    _release_freed_memory()
    return counts


def _release_freed_memory() -> None:
    """The fused q/k/v and gate/up copies replaced the original arrays: hand their memory back
    to the system (MLX keeps freed buffers in its cache, glibc keeps freed heap), or the process
    would hold the replaced weights twice in its RSS (~150 MB on the 24-layer synthetic model)."""
    import ctypes
    import gc

    gc.collect()
    mx.clear_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _install_layers(model: nn.Module, counts: dict) -> None:
    from flashmoe.engine.runtime.timing import decoder_layers

    try:
        layers = decoder_layers(model)
    except ValueError:
        return
    counts["layer"] = counts["layer_tried"] = 0
    for i, layer in enumerate(layers):
        if not isinstance(layer.get("self_attn"), CpuAttention):
            continue
        counts["layer_tried"] += 1
        try:
            new = CpuDecoderLayer(layer)
            ok = _probe_layer(new, layer, new._norms[0][0].shape[0])
        except (ValueError, TypeError, AttributeError):
            ok = False
        if ok:
            layers[i] = new
            counts["layer"] += 1
