"""engine/huge_pages.py: 2 MiB pages under the expert slots (MLX arrays, which do not ask)."""
from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from flashmoe.engine.experts.layout import Part
from flashmoe.engine.experts.store import SlotPool
from flashmoe.engine.huge_pages import HUGE, ask_for_zeroed

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise huge pages are Linux's")
def test_zeroed_mlx_memory_keeps_its_zeros_and_takes_writes_on_huge_pages():
    a = mx.zeros((6 * HUGE,), dtype=mx.uint8)
    mx.eval(a)
    view = memoryview(a).cast("B")
    assert ask_for_zeroed(_address(view), view.nbytes)
    arr = np.frombuffer(view, np.uint8)
    assert not arr.any()  # the dropped pages read as zeros
    pattern = (np.arange(arr.size) % 251).astype(np.uint8)
    arr[:] = pattern
    assert np.array_equal(np.array(a), pattern)  # MLX sees what was written through the view
    if THP.exists() and "[never]" not in THP.read_text():
        assert _huge_kb(_address(view) + 2 * HUGE) >= 2048  # the first writes faulted in 2 MiB pages


def test_a_range_without_a_whole_huge_page_is_left_alone():
    a = np.zeros(HUGE, np.uint8)  # at most part of two 2 MiB pages (unless aligned: then one)
    address = a.ctypes.data + 1
    assert not ask_for_zeroed(address, HUGE - 2)
    assert not a.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise huge pages are Linux's")
def test_a_slot_pool_asks_for_them_and_its_slots_still_hold_what_lands():
    parts = [Part("w", "U32", (512, 1024)), Part("s", "F32", (512, 16))]
    pool = SlotPool(parts, slots=4)
    views = pool.slot_views(2, 0, 2)
    data = [np.frombuffer(v, np.uint8) for v in views]
    for d in data:
        d[:] = 7
    assert int(np.array(pool.arrays["w"][2]).view(np.uint8).min()) == 7
    assert not np.array(pool.arrays["w"][1]).any()
    if THP.exists() and "[never]" not in THP.read_text():
        assert _huge_kb(_address(views[0])) >= 2048
