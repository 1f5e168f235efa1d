"""2 MiB pages under the expert slots, where Linux gives them on request.

A decode step reads its experts' bytes from RAM once each, in long runs (an expert's tiles), so
the kernels wait on memory. With 4 KiB pages the CPU's prefetchers stop at every page edge and
each page costs a TLB miss; NumPy already asks for transparent huge pages for its arrays of 4 MB
and more (madvise MADV_HUGEPAGE), but the slot pools are MLX arrays, which do not. Asked here,
the upcycled demo's experts ran at 325 instead of 361 us a layer on two cores, and with the
kernels' prefetch (engine/cpu/vector_ir.py) at 272 instead of 334 (a Zen 2 VM, every expert
cached; benchmarks/RESULTS.md).

Where the kernel's setting is "never", or off Linux, nothing changes: a request, never a need.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

HUGE = 2 << 20
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def ask_for_zeroed(address: int, nbytes: int) -> bool:
    """Back the whole 2 MiB pages inside [address, address + nbytes), memory that holds only
    zeros, with huge pages: marked MADV_HUGEPAGE, then its small pages dropped (MADV_DONTNEED: it
    reads as zeros again, and the first write faults in a huge page). True when Linux took both."""
    fn = _madvise()
    start = -(-address // HUGE) * HUGE
    end = (address + nbytes) // HUGE * HUGE
    if fn is None or end <= start:
        return False
    return fn(start, end - start, _MADV_HUGEPAGE) == 0 and fn(start, end - start, _MADV_DONTNEED) == 0
