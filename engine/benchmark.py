"""Measurements behind `flashmoe bench`: the disk itself, and generation warm and cold.

Cold means: the expert slots are emptied and the expert files are dropped from the page cache
(posix_fadvise DONTNEED) right before the run, so the first read of every expert goes to the
device. A later read of an expert the slots have evicted in between may find it in the page cache
again: how much came from the device is measured (/proc/self/io), not assumed.
"""

from __future__ import annotations

import mmap
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from flashmoe.engine.events import StepFinished, TokenGenerated
from flashmoe.engine.runtime.generate import GenerationRequest, Session, generate

FILLER = (
    "Mixture-of-experts models route each token to a few experts; the rest stay on the disk "
    "until a token asks for them. We talked about the weather in Paris, the time of day, and "
    "what to eat for dinner. Numbers like 12, 345 and 6789 appear too. "
)


def cpu_model() -> str:
    """The processor's name and the vector instructions the CPU kernels use on it, for the
    conditions line of every benchmark (VMs of one name expose AVX-512 or only AVX2)."""
    import platform

    from flashmoe.engine.cpu.int8 import dot_name

    name = platform.processor() or platform.machine()
    try:
        name = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return f"{name}, {dot_name()}"


def expert_files(loaded) -> list[Path]:
    files = set()
    for l in loaded.layers:
        for ext in l.extents(loaded.store.root, 0):
            files.add(Path(ext.path))
    return sorted(files)


def disk_read_bytes() -> int | None:
    """Bytes this process has made the kernel fetch from storage (/proc/self/io read_bytes);
    None where the counter does not exist."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (they are clean, so this only forgets them)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass
class DiskResult:
    sequential_gbps: float
    random_gbps: float
    block_bytes: int
    threads: int
    bytes_read: int


def measure_disk(files: list[Path], block: int, threads: int = 8, seconds: float = 2.0) -> DiskResult:
    """Cold sequential (8 MiB reads) and random (expert-sized reads, `threads` in flight) GB/s.

    Where to read is drawn afresh on every call: a virtual disk's host may still cache what the
    last measurement read, and the same offsets again would measure that cache."""
    rng = random.Random()
    evict(files)
    total = 0
    buf = mmap.mmap(-1, 8 << 20)
    start = rng.randrange(len(files)) if files else 0
    t0 = time.perf_counter()
    for f in files[start:] + files[:start]:
        fd = os.open(f, os.O_RDONLY)
        try:
            off = 0
            while time.perf_counter() - t0 < seconds / 2:
                n = os.preadv(fd, [buf], off)
                if n <= 0:
                    break
                total += n
                off += n
        finally:
            os.close(fd)
        if time.perf_counter() - t0 >= seconds / 2:
            break
    seq = total / (time.perf_counter() - t0) / 1e9

    evict(files)
    sizes = [(f, f.stat().st_size) for f in files if f.stat().st_size >= block]
    fds = {f: os.open(f, os.O_RDONLY) for f, _ in sizes}
    for fd in fds.values():
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    bufs = [bytearray(block) for _ in range(threads)]

    def one(i):
        f, size = rng.choice(sizes)
        off = rng.randrange(0, max(1, size - block + 1)) // 4096 * 4096
        return os.preadv(fds[f], [bufs[i % threads]], off)

    done = 0
    t1 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        while time.perf_counter() - t1 < seconds / 2:
            done += sum(pool.map(one, range(threads * 4)))
    rand = done / (time.perf_counter() - t1) / 1e9
    for fd in fds.values():
        os.close(fd)
    return DiskResult(seq, rand, block, threads, total + done)


def prompt_of(tokenizer, n_tokens: int) -> str:
    """Raw text of about `n_tokens` tokens (the same for every run)."""
    text = FILLER
    while len(tokenizer.encode(text)) < n_tokens:
        text += FILLER
    ids = tokenizer.encode(text)[:n_tokens]
    return tokenizer.decode(ids)


@dataclass
class RunResult:
    cache_state: str  # cold | warm
    prompt_tokens: int
    generated_tokens: int
    prefill_tps: float
    decode_tps: float
    bytes_per_token: float
    theory_bytes_per_token: float
    hit_rate: float
    io_wait_share: float
    seconds: float
    prefetch_hit_rate: float = 0.0
    device_bytes_per_token: float | None = None  # from the storage device during decode (Linux)
    page_cache_dropped_every_token: bool = False
    verify_prefill_s: float = 0.0  # reader-thread seconds spent on expert checksums during prefill
    verify_decode_s: float = 0.0  # ... and during decode (the first read of each expert is checked)
    overlap: float = 0.0  # share of decode with a read at the device (ExpertStore.busy)

    def roof_fraction(self, disk_gbps: float) -> float | None:
        """Of the disk's roof for the bytes this run took from the device per token: decode
        tok/s x device bytes per token / the disk's GB/s (None where nothing came from it)."""
        if not self.device_bytes_per_token or not disk_gbps:
            return None
        return self.decode_tps * self.device_bytes_per_token / (disk_gbps * 1e9)

    def as_dict(self) -> dict:
        return asdict(self)


def run_generation(loaded, prompt: str, tokens: int, cold: bool, drop_every_token: bool = False) -> RunResult:
    """One greedy generation in a fresh session; cold evicts slots and page cache first.

    drop_every_token: drop the expert files from the page cache before every decode step as well,
    so that every expert read comes from the device, as with a model larger than RAM; the time
    the dropping takes is left out of decode speed and io wait share."""
    files = expert_files(loaded) if loaded.store is not None else []
    if cold and loaded.store is not None:
        loaded.store.evict_all()
        evict(files)
    t0 = time.perf_counter()
    request = GenerationRequest(prompt=prompt, max_tokens=tokens, timing="step")
    done = None
    device0 = None
    step_s = dropped_s = drop = 0.0  # drop: the latest page-cache drop, not yet inside a step
    store = loaded.store
    verify0 = verify1 = store.verify_s if store is not None else 0.0
    busy0 = 0.0
    for ev in generate(loaded, Session(loaded), request):
        if isinstance(ev, TokenGenerated):
            if device0 is None:
                device0 = disk_read_bytes()  # decode starts after the first token
                verify1 = store.verify_s if store is not None else 0.0
                busy0 = store.busy.now() if store is not None else 0.0
            if drop_every_token and files:
                t = time.perf_counter()
                evict(files)
                drop = time.perf_counter() - t
        elif isinstance(ev, StepFinished):  # its wall time includes the drop before it
            step_s += ev.wall_ms / 1e3
            dropped_s, drop = dropped_s + drop, 0.0
        done = ev
    device1 = disk_read_bytes()
    verify2 = store.verify_s if store is not None else 0.0
    busy = (store.busy.now() - busy0) if store is not None else 0.0
    decoded = max(0, done.generation_tokens - 1)
    device = (device1 - device0) / decoded if device0 is not None and device1 is not None and decoded else None
    decode_tps, decode_s = done.generation_tps, done.decode_s
    if drop_every_token and step_s > dropped_s:
        decode_s = step_s - dropped_s
        decode_tps = decoded / decode_s
    miss = 1.0 - done.hit_rate
    per_expert = (sum(l.expert_bytes for l in loaded.layers) / len(loaded.layers)) if loaded.layers else 0
    theory = loaded.top_k * per_expert * len(loaded.layers) * miss
    return RunResult(
        "cold" if cold else "warm",
        done.prompt_tokens,
        done.generation_tokens,
        done.prompt_tps,
        decode_tps,
        done.bytes_per_token,
        theory,
        done.hit_rate,
        done.io_wait_s / decode_s if decode_s else 0.0,
        time.perf_counter() - t0,
        done.prefetch_hit_rate,
        device,
        drop_every_token,
        verify1 - verify0,
        verify2 - verify1,
        busy / decode_s if decode_s else 0.0,
    )
