"""engine/cpu/tiled_experts.py: streamed experts repacked into tiles in their slots.

Each product is held to test_kernels.py's bounds against the expert's own mx.dequantize'd
weights; the repack must leave exactly the tiles Tiled.from_mlx builds, happen once per fill of a
slot, and happen again when the slot is given to another expert.
"""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from flashmoe.engine.cpu import tiled as T  # noqa: E402
from flashmoe.engine.cpu.tiled_experts import TiledBank  # noqa: E402
from tests.helpers.kernels import check, quantize  # noqa: E402

RNG = np.random.default_rng(7)


def bank_of(S, shapes, bits, gs):
    """A bank over S slots of random experts; returns it, the slots' arrays as read (copies) and
    their dequantized weights, per projection."""
    parts, as_read, dq = {}, {}, {}
    for name, (n, k) in shapes.items():
        w, s, b, d = quantize(RNG.standard_normal((S, n, k)).astype(np.float32), bits, gs)
        parts[name] = (w.copy(), s.copy(), b.copy(), bits, gs)  # writable, as a slot bank is
        as_read[name], dq[name] = (w.copy(), s.copy(), b.copy()), d
    raw = np.ones(S, dtype=bool)
    return TiledBank(parts, raw), parts, as_read, dq, raw


@pytest.mark.parametrize("bits,gs", [(8, 64), (4, 64), (2, 32), (4, 128)])
def test_gather_matches_each_experts_dequantized_weights(bits, gs):
    shapes = {"gate_proj": (32, 2 * gs), "up_proj": (32, 2 * gs), "down_proj": (2 * gs, 32 if gs == 32 else gs)}
    bank, parts, as_read, dq, raw = bank_of(5, shapes, bits, gs)
    assert TiledBank.supports(parts)
    # decode: one row, each of its k slots; a few rows; and 70 rows on one slot (a prefill: grouped)
    for rows, slots in ((1, np.array([3, 0, 4])), (3, np.array([1, 1, 2, 0, 4, 3])), (70, np.full(70, 2))):
        k = slots.size // rows
        x = RNG.standard_normal((rows, 2 * gs)).astype(np.float32)
        bank.ready(slots)
        g, u = bank.gather(x, slots, k, ("gate_proj", "up_proj"))
        for name, got in (("gate_proj", g), ("up_proj", u)):
            for i, slot in enumerate(slots):
                w, s, b = as_read[name]
                check(got[i : i + 1], x[i // k : i // k + 1], w[slot], s[slot], b[slot], dq[name][slot], bits, gs)
        h = RNG.standard_normal((slots.size, shapes["down_proj"][1])).astype(np.float32)
        (d,) = bank.gather(h, slots, 1, ("down_proj",))
        for i, slot in enumerate(slots):
            w, s, b = as_read["down_proj"]
            check(d[i : i + 1], h[i : i + 1], w[slot], s[slot], b[slot], dq["down_proj"][slot], bits, gs)
    assert not raw[[0, 1, 2, 3, 4]].any()


def test_repack_is_in_place_once_per_fill_and_again_after_a_put():
    """Through a real SlotPool: bytes land in a slot as the store writes them, the bank repacks
    that slot in the pool's own memory, and a put() of another expert makes it raw again."""
    from flashmoe.engine.cpu.qmm import to_numpy
    from flashmoe.engine.experts.layout import Part
    from flashmoe.engine.experts.store import SlotPool

    experts = {
        n: quantize(RNG.standard_normal((3, 48, 128)).astype(np.float32), 4, 64)[:3] for n in ("gate_proj", "up_proj")
    }
    layout = [
        Part(f"{n}.{a}", "U32" if a == "weight" else "F32", t.shape[1:])
        for n, ts in experts.items()
        for a, t in zip(("weight", "scales", "biases"), ts)
    ]
    pool = SlotPool(layout, slots=2)
    bank = TiledBank(
        {n: (*(to_numpy(pool.arrays[f"{n}.{a}"]) for a in ("weight", "scales", "biases")), 4, 64) for n in experts},
        pool.raw,
    )

    def land(slot, e):  # what ExpertStore._read does: the on-disk bytes into the slot's views
        pool.put((0, e), slot, 0)
        for view, arr in zip(pool.slot_views(slot, 0, len(layout)), (t[e] for ts in experts.values() for t in ts)):
            view[:] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)

    def tiles(e):
        return T.Tiled.from_mlx(*(t[e] for t in experts["gate_proj"]), 4, 64)

    w = to_numpy(pool.arrays["gate_proj.weight"])
    land(1, 0)
    land(0, 2)
    assert pool.raw.tolist() == [True, True]
    bank.ready(np.array([1]))
    assert np.array_equal(w[1].reshape(-1), tiles(0).wt.reshape(-1))  # the same bytes hold the tiles
    assert np.array_equal(w[0], experts["gate_proj"][0][2]) and pool.raw.tolist() == [True, False]
    bank.ready(np.array([1, 1, 0]))  # slot 1 is not repacked twice (that would scramble it)
    assert np.array_equal(w[1].reshape(-1), tiles(0).wt.reshape(-1))
    assert np.array_equal(w[0].reshape(-1), tiles(2).wt.reshape(-1))
    land(1, 1)  # slot 1 given to another expert: raw again, and repacked again
    assert pool.raw.tolist() == [False, True]
    bank.ready(np.array([1]))
    assert np.array_equal(w[1].reshape(-1), tiles(1).wt.reshape(-1))
    x = RNG.standard_normal((1, 128)).astype(np.float32)
    (g,) = bank.gather(x, np.array([1]), 1, ("gate_proj",))
    assert np.allclose(g, T.Tiled.from_mlx(*(t[1] for t in experts["gate_proj"]), 4, 64).matmul(x), rtol=0, atol=0)


def test_formats_the_tiles_cannot_take_keep_the_row_layout():
    w, s, b, _ = quantize(RNG.standard_normal((2, 24, 64)).astype(np.float32), 4, 64)  # 24 rows: not whole tiles
    assert not TiledBank.supports({"down_proj": (w, s, b, 4, 64)})
    w, s, b, _ = quantize(RNG.standard_normal((2, 32, 64)).astype(np.float32), 3, 64)  # 3-bit: no tiled kernels
    assert not TiledBank.supports({"down_proj": (w, s, b, 3, 64)})
    w, s, b, _ = quantize(RNG.standard_normal((2, 32, 64)).astype(np.float32), 4, 64)
    assert TiledBank.supports({"down_proj": (w, s, b, 4, 64)})


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_gather_is_the_int8_kernel_on_each_slots_tiles(bits):
    """--kernels cpu-int8 switches the bank too; each entry gives what the int8 kernel gives on
    that slot's own tiled matrix, bit for bit (the same arithmetic, per row)."""
    from flashmoe.engine.cpu.int8 import use_int8

    shapes = {"gate_proj": (32, 128), "up_proj": (32, 128), "down_proj": (128, 32 * 2)}
    bank, parts, as_read, dq, raw = bank_of(4, shapes, bits, 64)
    assert use_int8([bank]) == 1 and bank.int8
    slots = np.array([2, 0, 3, 2])
    x = RNG.standard_normal((2, 128)).astype(np.float32)
    bank.ready(slots)
    g, u = bank.gather(x, slots, 2, ("gate_proj", "up_proj"))
    for name, got in (("gate_proj", g), ("up_proj", u)):
        for i, slot in enumerate(slots):
            t = T.Tiled.from_mlx(*(a[slot] for a in as_read[name]), bits, 64)
            t.int8 = True
            assert np.array_equal(got[i], t.matmul(x[i // 2 : i // 2 + 1])[0])
            ref = x[i // 2] @ dq[name][slot].T
            assert np.abs(got[i] - ref).max() <= 1e-3 * (1 + np.abs(ref).max())


@pytest.mark.parametrize("int8, all_rows", [(False, True), (True, True), (True, False)])
def test_a_prefill_entry_gets_what_it_gets_alone(int8, all_rows, monkeypatch):
    """A prefill's entries (GEMM_ROWS or more) are grouped by slot, each expert's weights read
    once for its rows, each entry reading its token's row (k of them per token) and writing its
    own: every entry is still what it gives alone in a decode step, bit for bit. Where the int8
    kernels leave a prefill's many rows to the float ones (int8.many_rows() False: without VNNI),
    an int8 bank's prefill entries are what the float kernels give alone."""
    from flashmoe.engine.cpu import int8 as int8_kernels
    from flashmoe.engine.cpu.gemm import GEMM_ROWS

    monkeypatch.setattr(int8_kernels, "many_rows", lambda: all_rows)
    bank, *_ = bank_of(5, {"gate_proj": (32, 128), "up_proj": (32, 128), "down_proj": (128, 64)}, 8, 64)
    bank.int8 = int8
    k, tokens = 2, GEMM_ROWS // 2 + 3
    idx = np.concatenate([RNG.choice(5, k, replace=False) for _ in range(tokens)]).astype(np.int64)
    x = RNG.standard_normal((tokens, 128)).astype(np.float32)
    bank.ready(np.arange(5))
    g, u = bank.gather(x, idx, k, ("gate_proj", "up_proj"))
    h = RNG.standard_normal((idx.size, 64)).astype(np.float32)
    (d,) = bank.gather(h, idx, 1, ("down_proj",))
    bank.int8 = int8 and all_rows  # the kernels a decode step of what the prefill ran on would take
    for i in range(idx.size):
        ag, au = bank.gather(x[i // k : i // k + 1], idx[i : i + 1], 1, ("gate_proj", "up_proj"))
        assert np.array_equal(g[i], ag[0]) and np.array_equal(u[i], au[0])
    assert np.array_equal(
        d, np.concatenate([bank.gather(h[i : i + 1], idx[i : i + 1], 1, ("down_proj",))[0] for i in range(idx.size)])
    )


@pytest.mark.parametrize("int8", [False, True])
def test_swiglu_in_one_call_is_the_three_gathers(int8):
    """A decode step's experts in one kernel call give what gate, up, SiLU and down give one
    gather at a time, bit for bit; formats that differ between projections decline (None)."""
    from flashmoe.engine.cpu.attn import silu_mul

    bank, *_ = bank_of(6, {"gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}, 8, 64)
    bank.int8 = int8
    bank.ready(np.arange(6))
    # one token's 4 experts; then 3 tokens of 2 experts each, entry i reading token i // 2's row
    for slots, rows in ((np.array([5, 1, 0, 3]), 1), (np.array([5, 1, 0, 5, 2, 4]), 3)):
        k = slots.size // rows
        x = RNG.standard_normal((rows, 128)).astype(np.float32)
        got = bank.swiglu(x, slots, k)
        g, u = bank.gather(x, slots, k, ("gate_proj", "up_proj"))
        (want,) = bank.gather(silu_mul(g, u), slots, 1, ("down_proj",))
        assert got.shape == (slots.size, 128) and np.array_equal(got, want)
        for i in range(slots.size):  # and each entry is what it gives alone, on its token's row
            assert np.array_equal(got[i], bank.swiglu(x[i // k : i // k + 1], slots[i : i + 1], 1)[0])
    slots = np.array([5, 1, 0, 3])
    x = x[:1]
    mixed, *_ = bank_of(6, {"gate_proj": (64, 128), "up_proj": (64, 128)}, 8, 64)
    _, parts, *_ = bank_of(6, {"down_proj": (128, 64)}, 8, 32)  # down quantized otherwise
    mixed = TiledBank(
        {**{n: (*mixed._mlx[n], 8, 64) for n in ("gate_proj", "up_proj")}, "down_proj": parts["down_proj"]},
        np.ones(6, dtype=bool),
    )
    mixed.ready(slots)
    assert mixed.swiglu(x, slots, 4) is None


@pytest.mark.parametrize("int8", [False, True])
def test_swiglu_sum_is_swiglu_then_combine(int8):
    """One token's experts weighted and summed in one call give what `swiglu` then
    routing.combine give, bit for bit, with a shared expert's output added and without; formats
    that differ between projections decline (None)."""
    from flashmoe.engine.cpu.routing import combine

    bank, *_ = bank_of(6, {"gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}, 8, 64)
    bank.int8 = int8
    bank.ready(np.arange(6))
    slots = np.array([5, 1, 0, 3])
    x = RNG.standard_normal((1, 128)).astype(np.float32)
    scores = RNG.random(4).astype(np.float32)
    shared = RNG.standard_normal((1, 128)).astype(np.float32)
    y = bank.swiglu(x, slots, 4)[None]
    assert np.array_equal(bank.swiglu_sum(x, slots, scores), combine(y, scores[None]))
    assert np.array_equal(bank.swiglu_sum(x, slots, scores, shared), combine(y, scores[None], shared))
    mixed, *_ = bank_of(6, {"gate_proj": (64, 128), "up_proj": (64, 128)}, 8, 64)
    _, parts, *_ = bank_of(6, {"down_proj": (128, 64)}, 8, 32)
    mixed = TiledBank(
        {**{n: (*mixed._mlx[n], 8, 64) for n in ("gate_proj", "up_proj")}, "down_proj": parts["down_proj"]},
        np.ones(6, dtype=bool),
    )
    assert mixed.swiglu_sum(x, slots, scores) is None


def test_experts_land_in_tiles_on_the_reader_threads_and_change_no_token(model_factory):
    """A read lands in its slot already repacked into tiles (SlotPool.land, run by the reader
    thread that landed the expert's last piece): experts fetched ahead of any token (a
    benchmark's prewarm) are ready to compute, the decode thread repacks nothing, and the greedy
    tokens are those of a cache that reads each expert on demand."""
    from flashmoe.engine.cpu import tiled
    from flashmoe.engine.experts.switch import StreamingSwitchGLU
    from flashmoe.engine.runtime.loader import load
    from tests.helpers.streaming import PROMPT, greedy

    packed = model_factory("qwen3_moe", 8, converted=True, expert_layout="mlx")
    eager = load(packed, load_tokenizer=False, kernels="cpu")
    for layer in eager.layers:
        eager.store.fetch(layer.layer, list(range(layer.num_experts)))
    eager.store.step_done()
    blocks = [m for m in eager.model.modules() if isinstance(m, StreamingSwitchGLU) and m.tiled_bank is not None]
    held = [(m, np.array(sorted(m._store.pool(m._layer).table.values()))) for m in blocks]
    assert held and not any(m.tiled_bank._raw[slots].any() for m, slots in held)  # landed in tiles
    assert eager.store.land_s > 0
    calls = []
    real = tiled._repack
    tiled._repack = lambda *a: calls.append(1) or real(*a)
    try:
        tokens = greedy(eager.model, PROMPT, 8)
    finally:
        tiled._repack = real
    assert not calls  # nothing left to repack on the decode thread
    assert tokens == greedy(load(packed, load_tokenizer=False, kernels="cpu", expert_cache=0).model, PROMPT, 8)


@pytest.mark.parametrize("bits", [4, 8])
def test_experts_stored_in_tiles_are_used_as_read_and_give_the_same_tokens(model_factory, bits):
    """convert stores experts in the CPU kernels' tiles (layout "tiles"): the CPU kernels use a
    read as it lands (no repack anywhere), the MLX kernels put it back in rows as it lands, and
    both give the tokens of the same model stored in MLX's rows, and of the resident mlx-lm model."""
    from flashmoe.engine.cpu import tiled
    from flashmoe.engine.runtime.loader import load
    from tests.helpers.streaming import PROMPT, greedy
    from tests.tiny_models import reference_model

    tiles = model_factory("qwen3_moe", bits, converted=True)
    rows = model_factory("qwen3_moe", bits, converted=True, expert_layout="mlx")
    want = greedy(reference_model(model_factory("qwen3_moe", bits)), PROMPT, 12)
    assert greedy(load(rows, load_tokenizer=False, kernels="cpu").model, PROMPT, 12) == want
    lm = load(tiles, load_tokenizer=False, kernels="cpu")
    assert all(l.layout == "tiles" for l in lm.layers) and all(p.reads_tiles and p.land is None for p in lm.store.pools)
    calls = []
    real = tiled._repack
    tiled._repack = lambda *a: calls.append(1) or real(*a)
    try:
        assert greedy(lm.model, PROMPT, 12) == want
    finally:
        tiled._repack = real
    assert not calls and lm.store.land_s == 0  # nothing repacked: the bytes landed as the kernels read them
    mlx = load(tiles, load_tokenizer=False, kernels="mlx", expert_cache=0)  # untiled as each read lands
    assert all(p.land is not None for p in mlx.store.pools)
    assert greedy(mlx.model, PROMPT, 12) == want


@pytest.mark.parametrize("int8", [False, True])
def test_bfloat16_scales_tile_into_half_their_bytes_for_the_same_floats(int8):
    """Experts whose scales and biases are stored as bfloat16 (the slots hold them widened to
    float32) are tiled back into their 16 bits, in the first half of the slot's own scale bytes:
    a decode step's one-call SwiGLU, the gathers and a grouped prefill give what float32 tiles
    of the same experts give, bit for bit."""
    from flashmoe.engine.cpu.gemm import GEMM_ROWS
    from tests.helpers.kernels import quantize_bf16

    S, shapes, parts = 5, {"gate_proj": (32, 128), "up_proj": (32, 128), "down_proj": (128, 32)}, {}
    for name, (n, k) in shapes.items():
        wq, s, b = quantize_bf16(RNG.standard_normal((S, n, k)).astype(np.float32), 8, 32)
        parts[name] = (wq, s, b, 8, 32)
    banks = []
    for bf16 in (True, False):
        copies = {n: (w.copy(), s.copy(), b.copy(), bits, gs) for n, (w, s, b, bits, gs) in parts.items()}
        bank = TiledBank(copies, np.ones(S, dtype=bool), bf16)
        bank.int8 = int8
        bank.ready(np.arange(S))
        banks.append((bank, copies))
    (half, copies), (full, _) = banks
    assert half.tiles["gate_proj"][1].dtype == np.uint16
    assert np.shares_memory(half.tiles["gate_proj"][1], copies["gate_proj"][1])  # in the slot's own bytes
    x = RNG.standard_normal((3, 128)).astype(np.float32)
    for slots, rows in ((np.array([4, 1, 0]), 1), (np.array([4, 1, 0, 4, 2, 3]), 3)):
        k = slots.size // rows
        assert np.array_equal(half.swiglu(x[:rows], slots, k), full.swiglu(x[:rows], slots, k))
        for a, b in zip(
            half.gather(x[:rows], slots, k, ("gate_proj", "up_proj")),
            full.gather(x[:rows], slots, k, ("gate_proj", "up_proj")),
        ):
            assert np.array_equal(a, b)
    tokens = GEMM_ROWS // 2 + 3
    idx = np.concatenate([RNG.choice(S, 2, replace=False) for _ in range(tokens)]).astype(np.int64)
    xs = RNG.standard_normal((tokens, 128)).astype(np.float32)
    for a, b in zip(
        half.gather(xs, idx, 2, ("gate_proj", "up_proj")), full.gather(xs, idx, 2, ("gate_proj", "up_proj"))
    ):
        assert np.array_equal(a, b)
    h = RNG.standard_normal((idx.size, 32)).astype(np.float32)
    assert np.array_equal(half.gather(h, idx, 1, ("down_proj",))[0], full.gather(h, idx, 1, ("down_proj",))[0])


def test_a_model_with_bfloat16_scales_keeps_them_so_and_the_same_tokens(model_factory, tmp_path):
    """Converted with bfloat16 scales (as MLX checkpoints are) and loaded on the CPU kernels in
    float32: resident matrices and streamed experts keep their scales' 16 bits, and the greedy
    tokens are MLX's own on the same weights."""
    from flashmoe.engine.cpu.install import CpuQuantizedLinear
    from flashmoe.engine.experts.switch import StreamingSwitchGLU
    from flashmoe.engine.formats.convert import convert
    from flashmoe.engine.runtime.loader import load
    from tests.helpers.streaming import PROMPT, greedy

    out = convert(model_factory("qwen3_moe"), tmp_path / "bf16", bits=4, dtype="bfloat16")
    ref = load(out, load_tokenizer=False, dtype="float32", kernels="mlx")
    want = greedy(ref.model, PROMPT, 8)
    for kernels in ("cpu", "cpu-int8"):
        lm = load(out, load_tokenizer=False, dtype="float32", kernels=kernels)
        assert greedy(lm.model, PROMPT, 8) == want, kernels
        banks = [m.tiled_bank for m in lm.model.modules() if isinstance(m, StreamingSwitchGLU)]
        assert banks and all(b is not None and b.bf16 for b in banks)
        tiles = [m.tiled for m in lm.model.modules() if isinstance(m, CpuQuantizedLinear) and m.tiled is not None]
        assert tiles and all(t.st.dtype == t.bt.dtype == np.uint16 for t in tiles)
