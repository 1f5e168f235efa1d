"""What numba's disk cache needs before any of this package's kernels is defined or loaded.
Every module here that defines a cached kernel imports this one first.

1. An entry is stale when any kernel source changed, not only its own file. numba checks a
   cached function against the file that defines it, but the entry holds the compiled code of
   what it calls from other files: the loops of tiled.py and int8.py call attn.silu_mul and
   vector_ir's intrinsics, and int8.py compiles tiled.py's loop template. After an edit of
   attn.py (or an upgrade that changed only it) those loops came back from the cache with the
   old silu_mul inside, and silu_mul then failed in every process ("'descr' is NULL"). Here each
   entry's stamp also holds a hash of every source in the kernels' folder (`SourcesLocator`), so
   a change anywhere compiles them all again, once.
2. numba (0.68) saves a cached function that calls a parallel one, compiled while that callee
   was loaded from the cache, without the hook that starts the thread pool when it loads: loaded
   first in a process, it segfaulted (attn.silu_mul -> _silu_mul_rows, the loops' _gather ->
   _grouped, int8's _prepare -> quantize_rows). The pool is started here, before any kernel loads
   (and after numba is shown the `tbb` wheel's library: `_preload_tbb`).

tests/test_kernel_cache.py runs both cases in fresh processes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import sys
from pathlib import Path

import numba
from numba.core import caching

_COVERED: set[Path] = set()


@functools.lru_cache(maxsize=None)
def sources_hash(directory: Path) -> str:
    """A hash of every Python source in `directory` (read once a process)."""
    h = hashlib.sha256()
    for f in sorted(directory.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _cache_impl():
    return getattr(caching, "CacheImpl", None) or caching._CacheImpl  # (named _CacheImpl before numba 0.68)


class SourcesLocator(caching._CacheLocator):
    """numba's own locator for a kernel's file (the same folder and file names), with the hash of
    every source in the file's folder added to the stamp numba checks an entry against."""

    def __init__(self, inner, directory: Path):
        self._inner, self._dir = inner, directory

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return self._inner.get_source_stamp(), sources_hash(self._dir)

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        directory = Path(py_file).resolve().parent
        if directory not in _COVERED:
            return None
        for other in _cache_impl()._locator_classes:
            inner = other.from_function(py_func, py_file) if other is not cls else None
            if inner is not None:
                return cls(inner, directory)
        return None


def cover(directory) -> None:
    """Stamp the cached functions defined from now on in `directory`'s files with the hash of all
    its sources as well."""
    _COVERED.add(Path(directory).resolve())
    classes = _cache_impl()._locator_classes
    if SourcesLocator not in classes:
        classes.insert(0, SourcesLocator)


def _preload_tbb() -> str | None:
    """Let numba use its TBB threading layer when the `tbb` wheel is installed.

    numba tries TBB first, but finds libtbb.so.12 only on the loader's path, where pip does not
    put it (it goes to <prefix>/lib). Loading it here by path, before numba starts its threads,
    makes numba's own lookup succeed. TBB matters on a busy machine: OpenMP splits the rows
    statically, so a call waits whenever its second thread is not scheduled (we measured calls of
    0.15 ms taking 8-16 ms while other processes ran), while with TBB the calling thread takes the
    work a descheduled worker has not started. Returns the path loaded, or None. Does nothing if
    NUMBA_THREADING_LAYER is set (numba then uses that layer)."""
    if sys.platform != "linux" or os.environ.get("NUMBA_THREADING_LAYER"):
        return None
    try:
        dist = importlib.metadata.distribution("tbb")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "libtbb.so.12":
            path = str(dist.locate_file(f))
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                return None
            return path
    return None


cover(Path(__file__).parent)
_TBB = _preload_tbb()
numba.get_num_threads()  # (2. above)
