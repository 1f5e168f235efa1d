"""The expert store's slot pools: reads land in memory that is already there."""

from __future__ import annotations

import resource

import numpy as np

from flashmoe.engine.experts.layout import Part
from flashmoe.engine.experts.store import SlotPool


def test_a_landing_read_takes_no_page_fault():
    """Every slot's pages are present from the start: a miss's preadv copies into them instead of
    faulting each page in (a cold cache of 8 GB of experts decoded at half speed when each read
    paid its faults: engine/experts/store.py). Writing all of a fresh 40 MiB pool must take a
    handful of minor faults, not one per page (10,000) or per 2 MiB page (20)."""
    parts = [Part("w", "U32", (512, 1024)), Part("s", "F32", (512, 16))]
    pool = SlotPool(parts, slots=18)
    arrays = [np.frombuffer(v, np.uint8) for slot in range(pool.slots) for v in pool.slot_views(slot, 0, 2)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for a in arrays:
        a[:] = 7
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 10, faults
    assert int(np.array(pool.arrays["w"][17]).view(np.uint8).min()) == 7  # MLX sees what landed
