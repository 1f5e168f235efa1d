"""engine/cpu/tiled.py: matrices repacked in tiles of 16 rows, against MLX's quantize / dequantize.

The products are held to test_kernels.py's two bounds (the brief's 1e-4 relative one, and the
float32 summation bound against a float64 reference); dequantized rows must be mx.dequantize's
bit for bit, since prefill multiplies them with sgemm and an embedding lookup returns them.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx  # noqa: E402

from flashmoe.engine.cpu import tiled as T  # noqa: E402
from flashmoe.engine.cpu.qmm import qmm  # noqa: E402
from tests.helpers.kernels import check, quantize, quantize_bf16  # noqa: E402

RNG = np.random.default_rng(99)


# every width at groups of 64 (MLX's default), and each other group size once: a kernel is
# generated per (bits, group size), and each costs seconds to compile
@pytest.mark.parametrize("bits,gs", [(2, 64), (4, 64), (8, 64), (4, 32), (8, 128), (2, 32)])
def test_matmul_matches_mlx(bits, gs):
    # rows: fewer than a tile, a tile and a bit, many tiles; x rows in passes of 4 and 1
    for out, k in ((3, gs), (17, 3 * gs), (64, 1024)):
        wq, s, b, dq = quantize(RNG.standard_normal((out, k)).astype(np.float32), bits, gs)
        t = T.Tiled.from_mlx(wq, s, b, bits, gs)
        assert (t.n, t.k) == (out, k)
        for m in (1, 2, 3, 7, 64):  # 64 rows: dequantize + sgemm
            x = RNG.standard_normal((m, k)).astype(np.float32)
            check(np.ascontiguousarray(t.matmul(x)), x, wq, s, b, dq, bits, gs)


def test_serial_and_parallel_give_the_same_numbers(monkeypatch):
    """Lanes are rows: how rows are split over threads cannot change a row's sum."""
    from flashmoe.engine.cpu import qmm as Q

    wq, s, b, _ = quantize(RNG.standard_normal((100, 1024)).astype(np.float32), 4, 64)
    x = RNG.standard_normal((5, 1024)).astype(np.float32)
    got = {}
    for parallel in (False, True):
        for name in ("SERIAL_BELOW", "SERIAL_BELOW_WITHOUT_TBB"):
            monkeypatch.setattr(Q, name, 0 if parallel else 1 << 62)
        t = T.Tiled.from_mlx(wq, s, b, 4, 64)  # a new one: the choice is made on first use
        got[parallel] = t.matmul(x)
        assert (1 >= t._parallel_rows) == (5 >= t._parallel_rows) == parallel
        # one row at a time: the same sums as in passes of 4
        assert np.array_equal(got[parallel], np.concatenate([t.matmul(x[i : i + 1]) for i in range(5)]))
    assert np.array_equal(got[False], got[True])


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 32), (2, 128)])
def test_dequantize_and_rows_are_mlx_bit_for_bit(bits, gs):
    wq, s, b, dq = quantize(RNG.standard_normal((37, 2 * gs)).astype(np.float32), bits, gs)
    t = T.Tiled.from_mlx(wq, s, b, bits, gs)
    assert np.array_equal(t.dequantize(), dq)
    ids = np.array([[36, 0, 5], [16, 16, 15]])
    got = t.rows(ids)
    assert got.shape == (2, 3, 2 * gs) and np.array_equal(got, dq[ids])
    emb = mx.dequantize(
        mx.array(wq)[mx.array(ids)], mx.array(s)[mx.array(ids)], mx.array(b)[mx.array(ids)], group_size=gs, bits=bits
    )
    assert np.array_equal(got, np.array(emb))


def test_stack_gives_each_part_and_views_that_stand_alone():
    parts = [quantize(RNG.standard_normal((n, 128)).astype(np.float32), 4, 64) for n in (20, 16, 3)]
    tiles = [T.Tiled.from_mlx(wq, s, b, 4, 64) for wq, s, b, _ in parts]
    whole, views, starts = T.Tiled.stack(tiles)
    assert starts == [0, 32, 48] and whole.n == 64
    x = RNG.standard_normal((2, 128)).astype(np.float32)
    out = whole.matmul(x)
    for (wq, _s, _b, _dq), view, start, tile in zip(parts, views, starts, tiles):
        n = wq.shape[0]
        assert np.array_equal(out[:, start : start + n], tile.matmul(x))
        assert np.array_equal(view.matmul(x), tile.matmul(x))
        assert np.shares_memory(view.wt, whole.wt)
    assert np.array_equal(whole.matmul(x)[:, 20:32], np.zeros((2, 12), np.float32))  # padding rows
    with pytest.raises(ValueError, match="differ"):
        T.Tiled.stack(
            [tiles[0], T.Tiled.from_mlx(*quantize(RNG.standard_normal((4, 64)).astype(np.float32), 4, 64)[:3], 4, 64)]
        )


def test_tiled_and_mlx_layout_kernels_agree():
    """The two CPU kernels (tiles for resident weights, MLX's layout for streamed experts) give
    the same products to float32 rounding."""
    wq, s, b, _ = quantize(RNG.standard_normal((200, 576)).astype(np.float32), 8, 64)
    x = RNG.standard_normal((3, 576)).astype(np.float32)
    a, ref = T.Tiled.from_mlx(wq, s, b, 8, 64).matmul(x), qmm(x, wq, s, b, 8, 64)
    assert np.abs(a - ref).max() <= 1e-5 * np.abs(ref).max()


def test_unsupported_formats_are_refused():
    assert not T.supports(3, 64) and not T.supports(4, 16) and T.supports(8, 128)
    wq, s, b, _ = quantize(RNG.standard_normal((4, 64)).astype(np.float32), 3, 32)
    with pytest.raises(ValueError, match="3-bit"):
        T.Tiled.from_mlx(wq, s, b, 3, 32)


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 64), (2, 32)])
def test_bfloat16_scales_are_kept_as_bfloat16_for_the_same_floats(bits, gs):
    """Scales and biases that are all bfloat16 values keep their 16 bits in the tiles (fewer
    bytes read) and give what float32 tiles of them give, bit for bit: decode rows, many rows,
    int8 activations, dequantized rows; a float32 scale keeps float32 tiles, and a stack of
    both kinds multiplies as its parts do."""
    from flashmoe.engine.cpu import int8

    wq, s, b = quantize_bf16(RNG.standard_normal((40, 256)).astype(np.float32), bits, gs)
    half, full = T.Tiled.from_mlx(wq, s, b, bits, gs), T.Tiled.from_mlx(wq, s, b, bits, gs, bf16=False)
    assert half.st.dtype == half.bt.dtype == np.uint16 and full.st.dtype == np.float32
    assert half.nbytes < full.nbytes
    for rows in (1, 3, 9, 70):  # (70: dequantize + sgemm)
        x = RNG.standard_normal((rows, 256)).astype(np.float32)
        assert np.array_equal(half.matmul(x), full.matmul(x))
        if int8.supports(bits, gs):
            h8, f8 = (T.Tiled(t.wt, t.st, t.bt, t.n, bits, gs) for t in (half, full))
            h8.int8 = f8.int8 = True
            assert np.array_equal(h8.matmul(x), f8.matmul(x))
    ids = np.array([[0, 39], [7, 7]])
    assert np.array_equal(half.rows(ids), full.rows(ids))
    s2 = s.copy()
    s2.view(np.uint32)[3, 0] |= 1  # no longer a bfloat16 value
    assert T.Tiled.from_mlx(wq, s2, b, bits, gs).st.dtype == np.float32
    whole, views, starts = T.Tiled.stack([half, T.Tiled.from_mlx(wq, s2, b, bits, gs)])
    assert whole.st.dtype == np.float32
    x = RNG.standard_normal((2, 256)).astype(np.float32)
    assert np.array_equal(whole.matmul(x)[:, :40], full.matmul(x))
