"""`--kernels cpu-int8`: tiled matrices times int8-quantized activations (engine/cpu/int8.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from flashmoe.engine.cpu import int8
from flashmoe.engine.cpu.tiled import Tiled
from flashmoe.engine.runtime.loader import load
from tests.helpers.cli import run_cli

# two int8 terms (VNNI's default) and one int16 (elsewhere) at every size; one int8 term, llama.cpp's
# way, at group 64 (compiling each costs seconds)
CASES = [(bits, gs, xq, 5e-4) for xq in ("int8x2", "int16") for bits in int8.BITS for gs in int8.GROUP_SIZES] + [
    (bits, 64, "int8x1", 0.06) for bits in int8.BITS
]


def _tiled(rng, n, k, bits, gs):
    w, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05), group_size=gs, bits=bits)
    return Tiled.from_mlx(np.array(w), np.array(s), np.array(b), bits, gs), np.array(mx.dequantize(w, s, b, gs, bits))


def _exact(t: Tiled, wf: np.ndarray, x: np.ndarray, xq: str) -> np.ndarray:
    """What the kernel computes, from its own definition: x rounded per group to int8 steps
    (and with two terms what that left, rounded again) or int16 ones, the integer dot products
    of the weights' q values with each, scaled, plus bias times the exact sums."""
    gs = t.gs
    terms, top = {"int8x2": (2, 127), "int8x1": (1, 127), "int16": (1, 32767)}[xq]
    xg = x.reshape(x.shape[0], -1, gs).astype(np.float32)
    sums = xg.astype(np.float64).sum(-1)
    r, parts = xg.copy(), []
    for _ in range(terms):
        dx = np.abs(r).max(-1, keepdims=True) / np.float32(top)
        q = np.rint(r * np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0)).astype(np.int64)
        r = (r - dx * q.astype(np.float32)).astype(np.float32)
        parts.append((dx.astype(np.float64), q))
    n = t.n
    s = t.st.transpose(0, 2, 1).reshape(-1, t.st.shape[1])[:n].astype(np.float64)
    b = t.bt.transpose(0, 2, 1).reshape(-1, t.bt.shape[1])[:n].astype(np.float64)
    q = np.rint((wf.reshape(n, -1, gs) - b[:, :, None]) / np.where(s == 0, 1, s)[:, :, None]).astype(np.int64)
    scaled = sum(np.einsum("ngk,mgk->mng", q, xq) * dx[:, None, :, 0] for dx, xq in parts)
    return (scaled * s[None] + b[None] * sums[:, None, :]).sum(-1)


@pytest.mark.parametrize("bits, gs, xq, bound", CASES)
def test_kernel_is_its_definition_and_close_to_the_float_product(bits, gs, xq, bound):
    rng = np.random.default_rng(bits * 1000 + gs)
    t, wf = _tiled(rng, 100, 2 * 128 * 3, bits, gs)  # 100 rows: a padded last tile
    x = rng.standard_normal((3, 768)).astype(np.float32)
    x[1, :gs] = 0  # an all-zero group: step 0, no division by it
    x[2, 7] = 40.0  # an outlier channel, as real hidden states have
    for parallel in (False, True):
        got = int8.kernel(bits, gs, xq)(t.wt, t.st, t.bt, x, parallel)[:, :100]
        ref = _exact(t, wf, x, xq)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-6  # float32 rounding only
        exact = x.astype(np.float64) @ wf.T.astype(np.float64)
        err = np.abs(got - exact).max() / np.abs(exact).max()
        assert 0 < err <= bound  # activation rounding, not the float path under another name


@pytest.mark.parametrize("bits", int8.BITS)
def test_every_dot_product_instruction_gives_the_same_integers(bits):
    """The VPDPBUSD kernel, the AVX2 one (VPMADDUBSW + VPMADDWD, whose int16 pair sums would
    saturate on 8-bit weights multiplied as they are) and the one built from plain vector IR agree
    bit for bit (integer sums), on the largest products too: every weight at its top value,
    x at +-127 steps with both signs side by side. The plain one always runs, the others where the
    CPU has the instruction."""
    rng = np.random.default_rng(bits)
    t, _ = _tiled(rng, 64, 512, bits, 64)
    top = Tiled.from_mlx(
        np.full((64, 512 * bits // 32), 0xFFFFFFFF, np.uint32),
        np.ones((64, 8), np.float32),
        np.zeros((64, 8), np.float32),
        bits,
        64,
    )
    x = rng.standard_normal((3, 512)).astype(np.float32) * 3
    x[2] = np.where(np.arange(512) % 4 < 2, 5.0, -5.0)  # every q at +-127: the int16 pairs' extremes
    x[2, ::64] = 5.0
    have = {"vnni": ["vnni", "avx2"], "avx2": ["avx2"], "plain": []}[int8.host_dot()]  # (AVX-512 CPUs have AVX2)
    for tiles in (t, top):
        for xq in ("int8x1", "int8x2"):
            plain = int8.kernel(bits, 64, xq, dot="plain")(tiles.wt, tiles.st, tiles.bt, x, False)
            assert np.isfinite(plain).all()
            for dot in have:
                assert np.array_equal(
                    int8.kernel(bits, 64, xq, dot=dot)(tiles.wt, tiles.st, tiles.bt, x, False), plain
                ), dot
    top_row = int8.kernel(bits, 64, "int8x1", dot="plain")(top.wt, top.st, top.bt, x[2:], False)[0, :64]
    assert np.allclose(top_row, (2**bits - 1) * x[2].sum(), rtol=1e-5)  # the extremes summed, not saturated


@pytest.mark.parametrize("bits", int8.BITS)
def test_int16_sums_do_not_overflow(bits):
    """One int16 term: a lane sums a group's products in int32, at most 128 x 255 x 32767 (about
    2^30) at 8 bits and groups of 128. Every weight at its top value, x at its top step with one
    sign (the largest sum) and then alternating: each row the exact sum, x's own rounding aside."""
    gs = 128
    top = Tiled.from_mlx(
        np.full((32, 1024 * bits // 32), 0xFFFFFFFF, np.uint32),
        np.ones((32, 8), np.float32),
        np.zeros((32, 8), np.float32),
        bits,
        gs,
    )
    x = np.stack([np.full(1024, 3.0, np.float32), np.where(np.arange(1024) % 2, 3.0, -3.0).astype(np.float32)])
    got = int8.kernel(bits, gs, "int16")(top.wt, top.st, top.bt, x, False)[:, :32]
    want = (2**bits - 1) * x.astype(np.float64).sum(1)
    assert np.allclose(got, want[:, None], rtol=1e-6, atol=1e-3)
    assert got[0, 0] == pytest.approx((2**bits - 1) * 3072.0, rel=1e-6)  # not wrapped to a negative


def test_an_x_format_or_dot_the_kernels_do_not_have_is_an_error():
    with pytest.raises(ValueError, match="int4"):
        int8.kernel(8, 64, "int4")
    with pytest.raises(ValueError, match="dot= is for int8"):
        int8.kernel(8, 64, "int16", dot="avx2")


@pytest.mark.parametrize("bits", int8.BITS)
def test_a_row_gets_the_same_floats_alone_and_in_a_prefill(bits, monkeypatch):
    """Prefill rows (many: ROWS to a pass over the weights, quantized on every core, where the
    float path would dequantize and call sgemm) are each what that row gives alone, as a decode
    step computes it: bit for bit, so a prompt's cache does not depend on its chunking. Where
    the int8 kernels leave many rows to the float path (int8.many_rows: without VNNI), a prefill
    gets the float path's floats, and a decode row still the int8 kernel's."""
    from flashmoe.engine.cpu.gemm import GEMM_ROWS

    rng = np.random.default_rng(bits + 3)
    t, wf = _tiled(rng, 40, 256, bits, 64)
    x = rng.standard_normal((GEMM_ROWS + 7, 256)).astype(np.float32)
    assert x.shape[0] >= int8.MANY_ROWS and x.shape[0] % int8.ROWS
    floats = t.matmul(x)  # dequantize + sgemm
    exact = x.astype(np.float64) @ wf.T.astype(np.float64)
    t.int8 = True
    for all_rows in (True, False):
        monkeypatch.setattr(int8, "many_rows", lambda: all_rows)
        t._fn = None  # (found again, as use_int8 does)
        many = t.matmul(x)
        alone = np.concatenate([t.matmul(x[i : i + 1]) for i in range(x.shape[0])])
        assert np.array_equal(many, alone) == all_rows
        assert np.array_equal(many, floats) == (not all_rows)
        assert 0 < np.abs(alone - exact).max() <= 5e-4 * np.abs(exact).max()


def test_cpu_int8_switches_every_resident_matrix_and_stays_close(model_factory):
    path = model_factory("qwen3_moe", 4, converted=True)
    ref = load(path, kernels="cpu", load_tokenizer=False)
    lm = load(path, kernels="cpu-int8", load_tokenizer=False)
    tiled = int8.use_int8(ref.model)  # what there is to switch (switches ref too: counted, not used below)
    assert lm.int8_matrices == tiled > 0
    banks = [s.tiled_bank for s in lm.switches.values()]  # the streamed experts' slot banks too
    assert banks and all(b is not None and b.int8 for b in banks)
    from mlx_lm.models.cache import make_prompt_cache

    logits = []
    for m in (load(path, kernels="cpu", load_tokenizer=False), lm):
        cache = make_prompt_cache(m.model)
        mx.eval(m.model(mx.array([[1, 2, 3, 4]]), cache=cache))
        logits.append(np.array(m.model(mx.array([[5]]), cache=cache)[0, -1]))  # one decode row
    a, b = logits
    assert not np.array_equal(a, b)  # the decode row did go through int8
    assert np.abs(a - b).max() <= 2e-3 * np.abs(a).max()  # two int8 terms: near the float result


@pytest.mark.parametrize("all_rows", [True, False])
def test_a_prompt_chunk_takes_the_float_path_where_int8_leaves_many_rows(model_factory, monkeypatch, all_rows):
    """Without VNNI (int8.many_rows() False) a prompt chunk of cpu-int8 runs on the float path,
    resident matrices and cached experts alike: the float kernels' logits, bit for bit; with
    it, the int8 kernels' own (close, not equal). (The first pass reads the experts, and each
    one's few rows are computed as it lands, a decode-sized call: the second pass is compared.)"""
    from flashmoe.engine.cpu.gemm import GEMM_ROWS
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setattr(int8, "many_rows", lambda: all_rows)
    path = model_factory("qwen3_moe", 4, converted=True)
    prompt = mx.array([list(range(1, GEMM_ROWS + 5))])
    logits = []
    for kernels in ("cpu", "cpu-int8"):
        m = load(path, kernels=kernels, load_tokenizer=False)
        for _ in range(2):
            out = np.array(m.model(prompt, cache=make_prompt_cache(m.model))[0])
        logits.append(out)
    a, b = logits
    assert np.array_equal(a, b) == (not all_rows)
    assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max()  # 68 positions through 4 layers: 0.6% at most here


def test_cli_takes_cpu_int8_and_says_so(model_factory):
    path = model_factory("qwen3_moe", 4, converted=True)
    r = run_cli("run", "-m", path, "--kernels", "cpu-int8", "--max-tokens", "4", "hi")
    assert r.returncode == 0, r.stderr
    assert "cpu-int8 kernels" in r.stderr
