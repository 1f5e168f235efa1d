"""numba's on-disk kernel cache across processes and source changes (engine/cpu/numba_cache.py).

An entry saved in one process must load in another: numba (0.68) saves a cached function that
calls a parallel one, compiled while that callee was loaded from the cache, without the hook that
starts the thread pool on load, and loading such an entry first in a new process segfaulted
(fresh-clone CI crashed in attn.warmup). And an entry must not outlive a change of what it calls
from another file: numba checks only the defining file, so after an edit of attn.py the tiled
loops came back from the cache with the old silu_mul inside, and silu_mul failed in every process
("'descr' is NULL"). Each case runs in fresh processes, on a cache of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PRE = "import numpy as np; from flashmoe.engine.cpu import attn; x = np.ones(({rows}, 8), np.float32); "

# 1. cache the parallel callee; 2. compile its caller (few rows: the callee is loaded, not run);
# 3. in a fresh process, the caller's cached entry takes the parallel branch first
STEPS = (
    _PRE.format(rows=32) + "attn._silu_mul_rows(x, x, np.empty_like(x))",
    _PRE.format(rows=1) + "attn.silu_mul(x, x)",
    _PRE.format(rows=32) + "print(float(attn.silu_mul(x, x).sum()))",
)


def test_a_cached_caller_of_a_parallel_kernel_loads_in_a_new_process(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    for i, step in enumerate(STEPS, 1):
        done = subprocess.run([sys.executable, "-c", step], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"step {i} exited {done.returncode}: {done.stderr[-2000:]}"
    silu1 = 1.0 / (1.0 + 2.718281828459045**-1.0)
    assert float(done.stdout) == pytest.approx(32 * 8 * silu1, rel=1e-6)
    assert any(f.name.startswith("attn.silu_mul-") for f in tmp_path.rglob("*.nbi")), "step 2 cached nothing"


CALLEE = """from numba import njit


@njit(cache=True)
def f(x):
    return x + {add}
"""

CALLER = """from pathlib import Path

from flashmoe.engine.cpu import numba_cache

numba_cache.cover(Path(__file__).parent)

from numba import njit  # noqa: E402

from callee import f  # noqa: E402


@njit(cache=True)
def g(x):
    return f(x) * 2
"""


def test_an_entry_is_compiled_again_when_a_callee_in_another_file_changes(tmp_path):
    """g (caller.py) calls f (callee.py); the first run caches both. f then changes (the same
    size and lines, so only its content tells): g must not come back with the old f inside."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "caller.py").write_text(CALLER)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    got = []
    for add in (1, 2):
        (pkg / "callee.py").write_text(CALLEE.format(add=add))
        done = subprocess.run(
            [sys.executable, "-c", "import caller; print(caller.g(1))"],
            cwd=pkg,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        got.append(int(done.stdout))
    assert got == [4, 6]
