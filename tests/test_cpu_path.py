"""`--kernels cpu` (numba) against `--kernels mlx`: same greedy tokens, logits within float32
rounding of different summation orders, on every tiny architecture and bit width; overlapped
expert reads change nothing and keep the budget."""

from __future__ import annotations

import concurrent.futures

import mlx.core as mx
import numpy as np
import pytest

import numba  # noqa: E402,F401 - required: a missing one fails here, never skips

from flashmoe.engine.runtime.loader import load  # noqa: E402
from tests.helpers.streaming import CASES, PROMPT, greedy, small_budget  # noqa: E402

QUANTIZED = [(a, b) for a, b in CASES if b is not None]


def rel_diff(a: mx.array, b: mx.array) -> float:
    return mx.abs(a - b).max().item() / max(1.0, mx.abs(b).max().item())


@pytest.mark.parametrize("arch,bits", QUANTIZED, ids=[f"{a}-{b}" for a, b in QUANTIZED])
def test_cpu_kernels_match_mlx_kernels(model_factory, arch, bits):
    path = model_factory(arch, bits, converted=True)
    ref = load(path, kernels="mlx", load_tokenizer=False)
    want = ref.model(mx.array([PROMPT]))
    want_tokens = greedy(ref.model, PROMPT, 32)
    probe = ref
    for budget in (None, 0, small_budget(probe)):  # all cached; streamed; grouped prefill
        cpu = load(path, kernels="cpu", expert_cache=budget, load_tokenizer=False)
        assert cpu.kernels == "cpu"
        got = cpu.model(mx.array([PROMPT]))
        # Different summation order: float32 rounding, relative to the logits' size.
        assert rel_diff(got, want) <= 1e-4, (budget, rel_diff(got, want))
        assert greedy(cpu.model, PROMPT, 32) == want_tokens, budget
        if budget is not None:
            assert (
                cpu.store.peak_used_bytes
                <= cpu.store.capacity_bytes
                <= max(budget, cpu.top_k * cpu.layers[0].expert_bytes)
            )
        cpu.close()


def test_cpu_kernels_really_replace_the_matmuls(model_factory):
    from flashmoe.engine.cpu.install import CpuQuantizedLinear

    lm = load(model_factory("qwen3_moe", 4, converted=True), kernels="cpu", load_tokenizer=False)
    layer = lm.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, CpuQuantizedLinear)
    assert isinstance(layer.mlp.gate, CpuQuantizedLinear)  # the router
    assert layer.mlp.switch_mlp._cpu is not None  # the streamed experts
    stats = lm.store.take_stats()
    lm.model(mx.array([PROMPT]))
    stats = lm.store.take_stats()
    assert all(s.compute_s > 0 for s in stats.values())


def test_overlap_reads_land_while_computing(model_factory):
    """With cache 0 every decode step misses: each expert is computed as its read lands, and the
    store still reads exactly K experts per MoE layer per token."""
    path = model_factory("mixtral", 4, converted=True)
    lm = load(path, kernels="cpu", expert_cache=0, load_tokenizer=False)
    greedy(lm.model, PROMPT, 4)
    lm.store.take_stats()
    lm.model(mx.array([[5]]))
    stats = lm.store.take_stats()
    assert all(s.misses + s.hits == lm.top_k for s in stats.values())
    assert sum(s.bytes_read for s in stats.values()) == sum(
        s.misses * l.expert_bytes for s, l in zip(stats.values(), lm.layers)
    )


@pytest.mark.parametrize("kernels,mode", [("mlx", True), ("cpu", "slots"), ("cpu", "hint")])
def test_prefetch_changes_no_token_and_keeps_the_budget(model_factory, kernels, mode):
    from flashmoe.engine.runtime.generate import GenerationRequest, Session, generate

    path = model_factory("qwen3_moe", 4, converted=True)
    ref = load(path, load_tokenizer=False)
    want = greedy(ref.model, PROMPT, 24)
    budget = 6 * ref.layers[0].expert_bytes
    lm = load(path, kernels=kernels, expert_cache=budget, prefetch=mode)
    assert lm.store.prefetch_mode == ("slots" if mode is True else mode)
    assert len(lm.store.routers) == len(lm.layers)
    assert greedy(lm.model, PROMPT, 24) == want
    assert lm.store.peak_used_bytes <= lm.store.capacity_bytes <= budget
    done = list(generate(lm, Session(lm), GenerationRequest(prompt="hello there", max_tokens=16)))[-1]
    assert 0 < done.prefetch_hit_rate <= 1  # reported, and some guesses were right


@pytest.mark.parametrize("layout", ["tiles", "mlx"])
def test_a_read_ahead_in_flight_is_never_computed(model_factory, monkeypatch, layout):
    """A read-ahead's slot is in the table while its read is in flight; the one-call decode path
    (route_slots) must not take it for a hit. Each guess's read is held back 50 ms, so guesses
    are in flight when later tokens route to them: no expert counted as a hit may still be in
    flight (with tiled experts one was, and was computed from the slot's old bytes), and the
    tokens are the resident model's."""
    import threading

    from flashmoe.engine.experts import store as store_mod

    path = model_factory("qwen3_moe", 4, converted=True, expert_layout=layout)
    ref = load(path, load_tokenizer=False)
    want = greedy(ref.model, PROMPT, 24)
    lm = load(path, kernels="cpu", expert_cache=8 * ref.layers[0].expert_bytes, prefetch="slots", load_tokenizer=False)
    store, real, early = lm.store, store_mod.ExpertStore._read_all, []

    def slow(self, jobs, landing):
        threading.Event().wait(0.05)
        return real(self, jobs, landing)

    def note_hits(layer, experts, slots, note=store.note_hits):
        early.extend((layer, e) for e in experts if not store._inflight.get((layer, e), done).done())
        return note(layer, experts, slots)

    done = concurrent.futures.Future()
    done.set_result(None)
    monkeypatch.setattr(store_mod.ExpertStore, "_read_all", slow)
    monkeypatch.setattr(store, "note_hits", note_hits)
    assert greedy(lm.model, PROMPT, 24) == want
    assert sum(s.prefetched for s in store.stats.values()) > 0
    assert early == []


def test_prefetch_hint_asks_the_kernel_and_takes_no_slot(model_factory, monkeypatch):
    """--prefetch hint: the next layer's guesses not already in slots are handed to
    posix_fadvise(WILLNEED) over exactly their bytes, from a reader thread; the slot table is
    not touched, and with O_DIRECT (no page cache) nothing is hinted."""
    import os

    from flashmoe.engine.experts import store as store_mod

    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        store_mod.os,
        "posix_fadvise",
        lambda fd, off, n, advice: calls.append((off, n, advice)) or real(fd, off, n, advice),
    )
    path = model_factory("qwen3_moe", 4, converted=True)
    lm = load(path, kernels="cpu", expert_cache=6 * 10**6, prefetch="hint", load_tokenizer=False)
    store, layer = lm.store, lm.layers[1].layer
    store.fetch(layer, [0, 2])
    cached = {e for (l, e) in store.pool(layer).table if l == layer}
    assert cached == {0, 2}
    calls.clear()
    table = dict(store.pool(layer).table)
    store.hint(layer, range(lm.layers[1].num_experts)).result()  # the reader thread's advice
    want = {
        (ext.offset, ext.nbytes)
        for e in range(lm.layers[1].num_experts)
        if e not in cached
        for ext in lm.layers[1].extents(store.root, e)
    }
    assert {(o, n) for o, n, a in calls if a == os.POSIX_FADV_WILLNEED} == want
    assert dict(store.pool(layer).table) == table
    assert store.stats[layer].prefetched == len(want)

    calls.clear()
    direct = load(path, kernels="cpu", direct_io=True, prefetch="hint", load_tokenizer=False)
    assert direct.store.hint(direct.layers[0].layer, [0, 1]) is None
    assert not [c for c in calls if c[2] == os.POSIX_FADV_WILLNEED]


def test_pieces_cover_the_read_exactly():
    from flashmoe.engine.experts.layout import Extent
    from flashmoe.engine.experts.store import pieces

    bufs = [bytearray(n) for n in (700, 300, 1500)]
    views = [memoryview(b) for b in bufs]
    job = (Extent("f", 4096, 2500, 0, 3), views, [None] * 3)
    split = pieces(job, 1000)
    assert [(p[0].offset, p[0].nbytes) for p in split] == [(4096, 1000), (5096, 1000), (6096, 500)]
    assert all(sum(len(v) for v in p[1]) == p[0].nbytes and len(p[2]) == len(p[1]) for p in split)
    for i, p in enumerate(split):  # writing through the pieces fills the original views in order
        for v in p[1]:
            v[:] = bytes([i + 1]) * len(v)
    assert b"".join(bufs) == b"\x01" * 1000 + b"\x02" * 1000 + b"\x03" * 500
    assert pieces(job, 2500) == [job]
    widened = (job[0], views, ["BF16", None, None])  # converted parts are read whole
    assert pieces(widened, 1000) == [widened]


@pytest.mark.parametrize("kernels", ["mlx", "cpu"])
def test_misses_read_in_pieces_change_no_token(model_factory, monkeypatch, kernels):
    """Pieces far smaller than an expert, of an odd size: each expert is computed once all of
    its pieces have landed, and the tokens are the resident model's."""
    from flashmoe.engine.experts import store as store_mod

    path = model_factory("qwen3_moe", 4, converted=True)
    ref = load(path, load_tokenizer=False)
    want = greedy(ref.model, PROMPT, 12)
    monkeypatch.setattr(store_mod, "READ_PIECE", 777)
    assert ref.layers[0].expert_bytes > 4 * 777
    lm = load(path, kernels=kernels, expert_cache=0, load_tokenizer=False)
    assert greedy(lm.model, PROMPT, 12) == want
    lm.model(mx.array([[5]]))
    stats = lm.store.take_stats()
    assert sum(s.misses for s in stats.values()) > 0
    assert sum(s.bytes_read for s in stats.values()) == sum(
        s.misses * l.expert_bytes for s, l in zip(stats.values(), lm.layers)
    )


def test_an_expert_is_ready_once_all_its_pieces_landed(model_factory, monkeypatch):
    from flashmoe.engine.experts import store as store_mod

    monkeypatch.setattr(store_mod, "READ_PIECE", 777)
    path = model_factory("qwen3_moe", 4, converted=True)
    lm = load(path, kernels="cpu", expert_cache=0, load_tokenizer=False)
    store, info = lm.store, lm.layers[0]
    pool = store.pool(info.layer)
    seen = []

    assert info.layout == "tiles" and pool.reads_tiles and pool.land is None  # (convert's default here)
    mlx_rows = load(
        model_factory("qwen3_moe", 4, converted=True, expert_layout="mlx"),
        kernels="cpu",
        expert_cache=0,
        load_tokenizer=False,
    )
    assert mlx_rows.layers[0].layout == "mlx" and mlx_rows.store.pool(info.layer).land is not None

    def landed(e):
        """Expert e's bytes from the file, through the landing step, as its slot must hold them:
        tiles, as stored (convert's default) or as the reader thread repacks MLX's rows."""
        from flashmoe.engine.cpu.tiled_experts import TiledBank

        (ext,) = info.extents(store.root, e)
        with open(ext.path, "rb") as f:
            f.seek(ext.offset)
            data, pos, arrays = f.read(ext.nbytes), 0, {}
        for part, _held in zip(pool.parts, pool.held):
            arrays[part.name] = np.frombuffer(data, np.uint8, part.nbytes, pos).copy()
            pos += part.nbytes
        one = {
            n: tuple(
                arrays[f"{n}.{a}"].view(m.dtype).reshape(1, *m.shape[1:])
                for a, m in zip(("weight", "scales", "biases"), bank.w[n][:3])
            )
            + bank.w[n][3:]
            for n in bank.w
        }
        if not pool.reads_tiles:
            TiledBank(one, np.ones(1, bool), bank.bank.bf16).land(0)
        return b"".join(one[n][i].tobytes() for n in bank.w for i in range(3))

    bank = lm.switches[info.module]._cpu

    def ready(lut, experts, more=False):
        for e in experts:
            slot = int(lut[e])
            assert not pool.raw[slot], f"expert {e} computed before it landed"
            got = b"".join(
                pool.numpy(f"{n}.{a}")[slot].tobytes() for n in bank.w for a in ("weight", "scales", "biases")
            )
            assert got == landed(e), f"expert {e} computed before all its bytes landed and were repacked"
            seen.append(e)

    want = list(range(1, 1 + pool.slots))
    store.fetch(info.layer, want, ready=ready)
    assert sorted(seen) == want


LONG = [(a, b) for a in ("qwen3_moe", "mixtral", "olmoe") for b in (4, 3)] + [("deepseek_v3", 4)]


@pytest.mark.parametrize("arch,bits", LONG, ids=[f"{a}-{b}" for a, b in LONG])
def test_batched_prefill_matches_mlx_kernels(model_factory, arch, bits):
    """A 300-token prompt in chunks of 160 and 140 takes the batched prefill path: matmuls of 64 or
    more rows as dequantize + sgemm (cpu/gemm.py), experts chosen by 64 or more tokens likewise,
    causal attention on numpy's BLAS in query tiles (cpu/attn.py attend_causal), the output head
    on the last position only: the logits after each chunk and the greedy continuation match
    MLX's kernels."""
    import threading

    from mlx_lm.models.cache import make_prompt_cache

    from flashmoe.engine.runtime.decode import prefill
    from flashmoe.engine.runtime.generate import Session

    path = model_factory(arch, bits, converted=True)
    ids = [int(i) for i in mx.random.randint(3, 250, (300,), key=mx.random.key(1)).tolist()]
    ref = load(path, kernels="mlx", load_tokenizer=False)
    cache = make_prompt_cache(ref.model)
    want = [ref.model(mx.array([ids[:160]]), cache=cache)[0, -1], ref.model(mx.array([ids[160:]]), cache=cache)[0, -1]]
    want_tokens = greedy(ref.model, ids, 8)
    cpu = load(path, kernels="cpu", load_tokenizer=False)
    # the prefill path belongs to the fused attention; DeepSeek's latent attention keeps MLX's
    assert (cpu.fused.get("attention", 0) > 0) == (arch != "deepseek_v3")
    session = Session(cpu)
    session.prepare(ids)
    got = [logits for _, logits in prefill(cpu.model, session, ids, 160, threading.Event())]
    assert len(got) == 2 and session.tokens == ids
    for g, w in zip(got, want):
        assert rel_diff(g, w) <= 1e-4, rel_diff(g, w)
    assert greedy(cpu.model, ids, 8) == want_tokens
    cpu.close()


def test_dequantize_equals_mlx_bit_for_bit():
    import numpy as np

    from flashmoe.engine.cpu.gemm import dequantize

    w = mx.random.normal((96, 256), key=mx.random.key(3))
    for bits in (2, 3, 4, 8):
        for gs in (32, 64, 128):
            q, s, b = mx.quantize(w, group_size=gs, bits=bits)
            got = dequantize(np.array(q).view(np.uint32), np.array(s), np.array(b), bits, gs)
            assert np.array_equal(got, np.array(mx.dequantize(q, s, b, group_size=gs, bits=bits))), (bits, gs)


def test_gather_sends_busy_experts_to_sgemm_and_the_rest_to_the_kernels(monkeypatch):
    """Expert 0 is chosen by 100 rows (one sgemm, for a pair of weight sets too), the others by a
    few (the kernels): the result equals the kernels' for every row."""
    import numpy as np

    from flashmoe.engine.cpu import gemm
    from flashmoe.engine.cpu.qmm import gather_qmm, gather_qmm_pair

    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((4, 64, 128)).astype(np.float32))
    q, s, b = (np.array(t) for t in mx.quantize(w, group_size=64, bits=4))
    q = q.view(np.uint32)
    ids = np.concatenate([np.zeros(100, np.int64), rng.integers(1, 4, 20)]).reshape(60, 2)
    x = rng.standard_normal((60, 128)).astype(np.float32)
    products = []
    real = gemm.matmul_rows
    monkeypatch.setattr(gemm, "matmul_rows", lambda x2, wt: products.append(1) or real(x2, wt))
    monkeypatch.setattr(gemm, "GEMM_ROWS", 10**9)
    want = gather_qmm(x, q, s, b, ids, 4, 64)  # all on the kernels
    assert products == []
    monkeypatch.setattr(gemm, "GEMM_ROWS", 64)
    got = gather_qmm(x, q, s, b, ids, 4, 64)
    assert products == [1]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    ga, gb = gather_qmm_pair(x, (q, s, b), (q, s, b), ids, 4, 64)
    # one sgemm over [gate|up] side by side: OpenBLAS's AVX-512 kernels give the same bits as two
    # calls, its AVX2 ones (another VM type) do not; the same result to float rounding either way
    assert products == [1, 1]
    for g in (ga, gb):
        assert np.abs(g - got).max() <= 1e-6 * np.abs(got).max()


def test_many_row_products_split_rows_among_our_threads_with_blas_on_one(monkeypatch):
    """A prefill's sgemm (a resident matrix's, causal attention's) runs its rows on every core
    through gemm.by_rows, each part on BLAS's single thread: raising BLAS's own thread count woke
    OpenBLAS's worker, which then spun beside numba's kernel threads. Same result as one call."""
    import threading

    import numpy as np
    from threadpoolctl import threadpool_info, threadpool_limits

    from flashmoe.engine.cpu import gemm
    from flashmoe.engine.cpu.attn import attend_causal
    from flashmoe.engine.cpu.tiled import Tiled

    def blas_threads():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    seen = []
    real = np.matmul

    def spy(*args, **kw):
        seen.append((threading.get_ident(), tuple(blas_threads())))
        return real(*args, **kw)

    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((96, 128)).astype(np.float32))
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    tiled = Tiled.from_mlx(np.array(q).view(np.uint32), np.array(s), np.array(b), 4, 64)
    x = rng.standard_normal((gemm.GEMM_ROWS + 37, 128)).astype(np.float32)
    want = x @ np.array(mx.dequantize(q, s, b, group_size=64, bits=4)).T
    qh, K, V = (rng.standard_normal(shape).astype(np.float32) for shape in ((4, 150, 16), (2, 170, 16), (2, 170, 16)))
    with threadpool_limits(1, user_api="blas"):
        monkeypatch.setattr(gemm.numba, "get_num_threads", lambda: 2)
        attn_want = attend_causal(qh, K, V, 0.25)
        monkeypatch.setattr(np, "matmul", spy)
        got = tiled.matmul(x)
        attn_got = attend_causal(qh, K, V, 0.25)
        monkeypatch.setattr(gemm.numba, "get_num_threads", lambda: 1)
        attn_one = attend_causal(qh, K, V, 0.25)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.array_equal(attn_got, attn_want)
    assert np.abs(attn_one - attn_got).max() <= 1e-6 * np.abs(attn_got).max()
    assert len({ident for ident, _ in seen}) == 2  # the caller and one pool thread
    assert seen and all(n == 1 for _, threads in seen for n in threads)  # (every BLAS loaded: torch's too)


def test_causal_attention_matches_mlx():
    import numpy as np

    from flashmoe.engine.cpu.attn import attend_causal

    rng = np.random.default_rng(0)
    H, Hk, T, S, D = 6, 2, 300, 340, 16  # 40 positions cached before the chunk; 3 query tiles
    q = rng.standard_normal((H, T, D)).astype(np.float32)
    K = rng.standard_normal((Hk, S, D)).astype(np.float32)
    V = rng.standard_normal((Hk, S, D)).astype(np.float32)
    mask = mx.array(np.arange(S)[None, :] <= np.arange(S - T, S)[:, None])
    want = mx.fast.scaled_dot_product_attention(
        mx.array(q)[None], mx.array(K)[None], mx.array(V)[None], scale=0.25, mask=mask
    )[0]
    got = attend_causal(q, K, V, 0.25)  # [T, H, D]
    assert np.abs(got.transpose(1, 0, 2) - np.array(want)).max() <= 1e-5
