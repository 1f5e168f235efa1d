#!/usr/bin/env python3
"""What an expert read costs here: device GB/s and CPU seconds per GB, buffered vs O_DIRECT.

On a machine with few cores the CPU time the kernel spends on a read matters as much as the
device's speed: it is taken from the matmuls. For the expert files of a packed model this reads
expert-sized blocks at random offsets (after dropping the files from the page cache), with
`--threads` reads in flight, through the page cache and with O_DIRECT, alternating, and then
times single expert reads split into 1..8 pieces read in parallel (does splitting one read
lower its latency?).

    python benchmarks/read_cost.py -m MODEL [--reads 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import resource
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_common import cpu_model, evict, source_revision  # noqa: E402

PAGE = 4096


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def random_reads(files, block: int, reads: int, threads: int, direct: bool):
    """GB/s and process CPU seconds per GB of `reads` random block reads, cold."""
    evict(files)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = [os.open(f, flags) for f in files]
    if not direct:
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as the expert store opens them
    size = min(f.stat().st_size for f in files)
    rng = random.Random()  # fresh offsets: a virtual disk's host may cache what the last run read
    jobs = [(rng.choice(fds), rng.randrange(0, size // block) * block) for _ in range(reads)]
    local = threading.local()

    def one(job):
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        return os.preadv(job[0], [local.buf], job[1])

    c0, t0 = cpu_seconds(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(one, jobs))
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    for fd in fds:
        os.close(fd)
    return total / wall / 1e9, cpu / (total / 1e9)


def split_latency(files, block: int, pieces: int, samples: int) -> float:
    """Median ms to read one cold block as `pieces` parallel reads."""
    evict(files)
    fds = [os.open(f, os.O_RDONLY) for f in files]
    for fd in fds:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    size = min(f.stat().st_size for f in files)
    rng = random.Random()
    buf = memoryview(mmap.mmap(-1, block))
    step = -(-block // pieces // PAGE) * PAGE
    times = []
    with ThreadPoolExecutor(8) as pool:
        for _ in range(samples):
            fd, off = rng.choice(fds), rng.randrange(0, size // block) * block
            t = time.perf_counter()
            for f in [pool.submit(os.preadv, fd, [buf[i : i + step]], off + i) for i in range(0, block, step)]:
                f.result()
            times.append(time.perf_counter() - t)
    for fd in fds:
        os.close(fd)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", required=True, help="a packed flashmoe model folder (experts/*.bin)")
    p.add_argument("--reads", type=int, default=200, help="random reads per measurement (default 200)")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    from flashmoe.engine.errors import ModelLoadError
    from flashmoe.engine.experts.layout import read_manifest
    from flashmoe.engine.runtime.loader import EXPERTS_DIR

    model = Path(args.model)
    try:
        layers = read_manifest(model / EXPERTS_DIR)
    except ModelLoadError as e:
        print(f"read_cost.py: not a packed flashmoe model: {e}", file=sys.stderr)
        return 2
    files = sorted({Path(ext.path) for l in layers for ext in l.extents(model / EXPERTS_DIR, 0)})
    block = -(-layers[0].expert_bytes // PAGE) * PAGE
    print(
        f"model   : {model}: {len(files)} expert files, expert {layers[0].expert_bytes / 1e6:.2f} MB "
        f"(read as {block / 1e6:.2f} MB blocks)"
    )
    print(f"machine : {os.cpu_count()}x {cpu_model()}; flashmoe {source_revision()}")
    print(f"random reads, cold, {args.reads} x {block / 1e6:.2f} MB, {args.threads} in flight:")
    for _r in range(args.rounds):
        for direct in (False, True):
            gbps, cpu = random_reads(files, block, args.reads, args.threads, direct)
            print(f"  {'O_DIRECT' if direct else 'buffered'}: {gbps:.2f} GB/s, {cpu:.3f} CPU s per GB")
    print("one cold expert read split in parallel pieces (median of 30):")
    for pieces in (1, 2, 4, 8):
        print(f"  {pieces} piece(s): {split_latency(files, block, pieces, 30):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
