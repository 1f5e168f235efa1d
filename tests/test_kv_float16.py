"""--kv-cache float16: the CPU kernels keep the KV cache as float16 (as llama.cpp does), rows
rounded as numpy and MLX round them, attention over them as float32 attention over their values;
the option is refused where it would not hold, and saved prompt caches are kept apart."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from flashmoe.engine.cpu import attn as cpu_attn
from flashmoe.engine.errors import OptionError
from flashmoe.engine.runtime.loader import load

RNG = np.random.default_rng(11)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def attention64(qs, K, V, T) -> np.ndarray:
    """Softmax attention in float64 (qs [Hk, g, D] already scaled, K, V [Hk, >= T, D])."""
    s = np.einsum("hjd,htd->hjt", qs.astype(np.float64), K[:, :T].astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hjt,htd->hjd", p, V[:, :T].astype(np.float64)).reshape(-1, K.shape[2])


@pytest.mark.parametrize("D", [64, 24, 128])
@pytest.mark.parametrize("T", [1, 17, 300, 600, 1100])
def test_attention_over_a_float16_cache_is_attention_over_its_values(T, D):
    """The float16 cache (its bits, uint16) gives float32 attention over the float16 values: 16 rows
    a kernel call where D allows, the rest one at a time, short caches and blocks on every core;
    and the float32 cache, through the same kernels, gives float32 attention."""
    Hk, g = 3, 3
    qs = rand(Hk, g, D) * np.float32(D**-0.5)
    K, V = rand(Hk, T + 9, D).astype(np.float16), rand(Hk, T + 9, D).astype(np.float16)
    K[1, T // 2] *= 8  # a peaked score
    want = attention64(qs, K, V, T)
    half = cpu_attn.attend_qs(qs, K.view(np.uint16), V.view(np.uint16), T)
    full = cpu_attn.attend_qs(qs, K.astype(np.float32), V.astype(np.float32), T)
    scale = np.abs(want).max()
    assert np.abs(half - want).max() <= 2e-6 * max(1, scale)
    assert np.abs(full - want).max() <= 2e-6 * max(1, scale)


def test_decode_qs_writes_the_rows_rounded_as_numpy_rounds_them():
    """A float16 cache gets float16(row) of exactly the rows a float32 cache gets (round to nearest
    even), and the queries are the same."""
    H, Hk, hd, pos = 4, 2, 32, 5
    rng = np.random.default_rng(5)
    row = rng.standard_normal(H * hd + 2 * Hk * hd).astype(np.float32) * 300  # past float16's precision
    row[H * hd + Hk * hd + 3] = 70000.0  # a value (no rope) past float16's range
    a, b = (rng.standard_normal(hd).astype(np.float32) for _ in range(2))
    partner = np.roll(np.arange(hd), hd // 2).astype(np.int64)
    none = (np.zeros(0, np.float32), np.float32(0), False)
    args = (row, 0, H * hd, H * hd + Hk * hd, H, Hk, hd, *none, *none, a, b, partner)
    K, V = np.zeros((Hk, 8, hd), np.float32), np.zeros((Hk, 8, hd), np.float32)
    K16, V16 = np.zeros((Hk, 8, hd), np.uint16), np.zeros((Hk, 8, hd), np.uint16)
    qs = cpu_attn.decode_qs(*args, K, V, pos, np.float32(0.25))
    qs16 = cpu_attn.decode_qs(*args, K16, V16, pos, np.float32(0.25))
    assert np.array_equal(qs, qs16)
    with np.errstate(over="ignore"):
        assert np.array_equal(K16, K.astype(np.float16).view(np.uint16))
        assert np.array_equal(V16, V.astype(np.float16).view(np.uint16))
    assert np.isinf(V16.view(np.float16)).sum() == 1  # 70000 is past float16: inf, as numpy casts it


class RoundingCache(KVCache):
    """MLX's reference for a float16 KV cache under a float32 model: rows stored as float16, read
    back as float32."""

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))
        return k.astype(mx.float32), v.astype(mx.float32)


def test_a_model_with_a_float16_cache_computes_as_mlx_over_float16_rows(model_factory):
    """A 252-token prompt in two chunks, decode steps past 256 positions (the cache grows in a
    decode step), another chunk (a next turn's, into the same cache) and more steps: the cache
    stays float16, and every step's logits are MLX's with its rows rounded to float16."""
    path = model_factory("qwen3_moe", 4, converted=True)
    ref = load(path, kernels="mlx", load_tokenizer=False)
    lm = load(path, kernels="cpu", kv_cache="float16", load_tokenizer=False)
    assert lm.kv_cache == "float16"
    prompt = RNG.integers(0, ref.config["vocab_size"], 259).tolist()
    caches = {"ref": [RoundingCache() for _ in ref.model.layers], "cpu": [KVCache() for _ in lm.model.layers]}
    steps = {}
    for name, model in (("ref", ref.model), ("cpu", lm.model)):
        out = []
        for chunk in (prompt[:200], prompt[200:252], 6, prompt[252:], 6):
            if isinstance(chunk, list):
                out.append(model(mx.array([chunk]), cache=caches[name])[0, -1])
                continue
            for _ in range(chunk):
                out.append(model(mx.array([[int(mx.argmax(out[-1]))]]), cache=caches[name])[0, -1])
        steps[name] = [np.array(o) for o in out]
    for got, want in zip(steps["cpu"], steps["ref"]):
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    c = caches["cpu"][0]
    assert c.keys.dtype == c.values.dtype == mx.float16 and c.offset == 271 and c.keys.shape[2] == 512


def test_the_option_is_refused_where_it_would_not_hold(model_factory):
    path = model_factory("qwen3_moe", 4, converted=True)
    with pytest.raises(OptionError, match="--kv-cache float16: the CPU kernels keep it"):
        load(path, kernels="mlx", kv_cache="float16", load_tokenizer=False)
    with pytest.raises(ValueError, match="kv_cache must be one of float32, float16"):
        load(path, kernels="cpu", kv_cache="bfloat16", load_tokenizer=False)


def test_run_says_the_cache_it_keeps_and_refuses_it_on_mlx(model_factory, tmp_path):
    from tests.helpers.cli import run_cli

    packed = model_factory("qwen3_moe", 4, converted=True)
    out = run_cli("run", "-m", packed, "--kernels", "cpu", "--kv-cache", "float16", "--max-tokens", "3", "-n", "hi")
    assert out.returncode == 0, out.stderr
    assert "cpu kernels, float16 KV cache)" in out.stderr
    out = run_cli("run", "-m", packed, "--kernels", "mlx", "--kv-cache", "float16", "-n", "hi")
    assert out.returncode == 2 and "--kv-cache float16: the CPU kernels keep it" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = run_cli("run", "-m", packed, "--kv-cache", "bfloat16", "-n", "hi")
    assert out.returncode == 2 and "--kv-cache" in out.stderr


def test_saved_prompt_caches_of_each_kind_are_kept_apart(model_factory, tmp_path):
    """A float16 run neither reads nor replaces a float32 run's saved prompt cache of the same
    tokens, and the other way round."""
    from flashmoe.engine.runtime.generate import Session
    from flashmoe.engine.runtime.prompt_cache import DiskPromptCache

    path = model_factory("qwen3_moe", 4, converted=True)
    ids = list(range(3, 40))
    files = {}
    for kv in ("float32", "float16"):
        lm = load(path, kernels="cpu", kv_cache=kv, load_tokenizer=False)
        disk = DiskPromptCache(tmp_path, path, kv_cache=kv)
        assert disk.best(ids) == (None, 0)  # the other kind's file is not offered
        session = Session(lm)
        session.cache = [KVCache() for _ in lm.model.layers]
        mx.eval(lm.model(mx.array([ids]), cache=session.cache))
        session.tokens = ids
        disk.save(session)
        files[kv] = next(iter(disk.index))
        assert session.cache[0].keys.dtype == getattr(mx, kv)
        back = disk.load(files[kv], lm)
        assert back is not None and back.cache[0].keys.dtype == getattr(mx, kv)
    assert files["float32"] != files["float16"] and all(f.exists() for f in files.values())
    disk = DiskPromptCache(tmp_path, path, kv_cache="float32")
    assert (
        disk.load(files["float16"], lm) is None
        and "its KV cache is float16, this run keeps float32" in disk.refused[-1]
    )
