"""The expert store: a fixed bank of slots per expert shape, filled from disk on demand.

The graph never sees a new tensor: each MoE layer computes over a slot bank of fixed shape
([S, out, in] per part) and we only change which slot holds which expert, reading straight into
the slot's memory (MLX CPU arrays expose a writable buffer). Slots are shared by all layers of the
same shape, and a miss reuses the slot its policy gives up (CACHE_POLICIES), so the byte budget
is a hard limit.
"""

from __future__ import annotations

import concurrent.futures
import errno
import itertools
import mmap
import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import mlx.core as mx
import numpy as np
from zlib_ng.zlib_ng import crc32  # zlib's CRC-32, 6-10x faster (PCLMULQDQ): every first read is checked

from flashmoe.engine.errors import ModelLoadError
from flashmoe.engine.options import CACHE_POLICIES, IO_THREADS
from flashmoe.engine.experts.layout import Extent, LayerExperts, Part, from_tiles

PAGE = 4096
# Misses are read in pieces of at most this many bytes, each its own request, so that a layer's
# two or three misses keep more reads in flight at the device. With every read from the device,
# decode ran 11% faster with 1 MiB pieces than with one read per expert, 5% with the page cache
# dropped only at the start (512 KiB: no better;
# benchmarks/log/2026-11-30-kernel-latency-cold-reads.md).
READ_PIECE = 1 << 20
# Which cached expert a miss evicts. "lfu": the least often asked for (counts halve every
# LFU_HALF_LIFE tokens); "lru": the least recently used, which a cache smaller than one pass
# over the layers turns into no hits at all (each layer's experts are evicted just before the
# next token asks for them again). Measured in benchmarks/log/2026-11-30-lfu-cache-policy.md.
LFU_HALF_LIFE = 128
_HALF = ("BF16", "F16")


def _to_float32(src: memoryview, dtype: str, dst: memoryview) -> None:
    out = np.frombuffer(dst, dtype=np.float32)
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        out.view(np.uint32)[:] = np.frombuffer(src, dtype=np.uint16).astype(np.uint32) << 16
    else:
        out[:] = np.frombuffer(src, dtype=np.float16)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


def pieces(job, size: int) -> list:
    """Split one read job (extent, slot views, conversions) into jobs of at most `size` bytes
    that together read the same bytes into the same places. Jobs that widen 16-bit parts read
    whole (the conversion works part by part on a staged copy)."""
    ext, views, conversions = job
    if any(conversions) or ext.nbytes <= size:
        return [job]
    out, cur, start, filled = [], [], ext.offset, 0
    for view in views:
        pos = 0
        while pos < len(view):
            n = min(len(view) - pos, size - filled)
            cur.append(view[pos : pos + n])
            pos, filled = pos + n, filled + n
            if filled == size:
                out.append((Extent(ext.path, start, filled, ext.first, ext.last), cur, [None] * len(cur)))
                cur, start, filled = [], start + filled, 0
    if cur:
        out.append((Extent(ext.path, start, filled, ext.first, ext.last), cur, [None] * len(cur)))
    return out


class _Landing:
    """One expert's read into its slot. Pieces land in any order, on any reader thread; the thread
    that lands the last one checks the expert's CRC-32 (its first read in this process, when the
    manifest has one) and runs the pool's landing step (SlotPool.land: the CPU kernels' repack
    into tiles), so the expert is ready to compute when its read completes, off the decode
    thread."""

    __slots__ = ("layer", "expert", "pool", "slot", "check", "path", "left")

    def __init__(self, layer: int, expert: int, pool: "SlotPool", slot: int, check: int | None, path: str):
        self.layer, self.expert, self.pool, self.slot = layer, expert, pool, slot
        self.check, self.path = check, path  # the manifest's CRC-32, or None: nothing to check
        self.left = 1  # pieces not landed yet


DEMAND, AHEAD = 0, 1  # reader priorities: what a layer waits for now, then guesses for the next


class Readers:
    """The reader threads: a pool like ThreadPoolExecutor's whose queue is ordered by priority,
    so a layer's demand reads always go before read-ahead guesses (a wrong guess never delays
    a miss), and a guess not yet started can be cancelled (Future.cancel) when its layer turns
    out not to want it."""

    def __init__(self, threads: int, name: str):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args, priority: int = DEMAND) -> concurrent.futures.Future:
        fut = concurrent.futures.Future()
        self._queue.put((priority, next(self._seq), fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            _, _, fut, fn, args = self._queue.get()
            if fut is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Cancel what has not started, let what has finish, and end the threads."""
        while True:
            try:
                _, _, fut, _, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                fut.cancel()
        for _ in self._threads:
            self._queue.put((DEMAND - 1, next(self._seq), None, None, None))
        for t in self._threads:
            t.join()


class BusyClock:
    """Seconds during which at least one read was at the device (a reader thread inside preadv):
    with the decode's wall time, the share of it the drive was kept busy (the overlap)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self.busy_s = 0.0

    def __enter__(self):
        with self._lock:
            if self._active == 0:
                self._since = perf_counter()
            self._active += 1

    def __exit__(self, *exc):
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self.busy_s += perf_counter() - self._since

    def now(self) -> float:
        """busy_s, counting a stretch still under way."""
        with self._lock:
            return self.busy_s + (perf_counter() - self._since if self._active else 0.0)


@dataclass
class LayerStats:
    """Counters of one layer since the last reset (one decode step, usually)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    io_wait_s: float = 0.0
    route_s: float = 0.0
    compute_s: float = 0.0
    prefetched: int = 0  # experts read ahead for this layer (--prefetch slots or hint)
    prefetch_used: int = 0  # of those, ones this layer then asked for
    prefetch_cancelled: int = 0  # of those, ones not read: cancelled before they started


def _page_aligned_zeros(shape: tuple, dtype) -> mx.array:
    """mx.zeros whose data starts on a page, so that O_DIRECT reads land in it directly (MLX's
    own arrays start 24 bytes past one): a view into a slightly larger array."""
    n = int(np.prod(shape))
    flat = mx.zeros((n + PAGE // dtype.size,), dtype=dtype)
    mx.eval(flat)
    skip = (-_address(memoryview(flat).cast("B")) % PAGE) // dtype.size
    out = flat[skip : skip + n].reshape(shape)
    mx.eval(out)
    return out


def held_parts(parts, upcast: bool, keep_bf16: bool = False) -> list[Part]:
    """The parts as the slots hold them: 16-bit floats widened to float32 when upcasting, except
    bfloat16 with `keep_bf16` (kernels that take bfloat16 scales as they are: no bytes widened
    on read, and the cache holds more experts)."""
    return [
        Part(p.name, "F32", p.shape) if upcast and p.dtype in _HALF and not (keep_bf16 and p.dtype == "BF16") else p
        for p in parts
    ]


class SlotPool:
    """S slots for experts of one signature: one MLX array of shape [S, *part.shape] per part."""

    def __init__(self, parts, slots: int, upcast: bool = False, keep_bf16: bool = False):
        self.parts = parts  # as stored on disk
        # MLX's CPU gather_mm takes float32 only (and half-precision scales are slow there):
        # with `upcast`, 16-bit float parts live in the slots as float32, converted on read.
        self.held = held_parts(parts, upcast, keep_bf16)
        self.slots = slots
        self.expert_bytes = sum(p.nbytes for p in self.held)
        self.arrays = {p.name: _page_aligned_zeros((slots, *p.shape), p.mx_dtype) for p in self.held}
        # Writable byte views of each slot of each part: reads land here directly. MLX wrote the
        # zeros, so every page is present and a landing read takes no page fault. (The slots
        # used to be dropped and asked for 2 MiB pages, faulted in by the first write: a decode
        # step's experts computed 5-7% faster on them, but each fault was paid inside a reader's
        # preadv, and with a cold cache of 8 GB, every miss landing in a fresh slot, decode ran
        # at 4.1-5.5 tok/s against 8.2-8.8 (the synthetic MoE at a 1.5x limit). Faulting them in
        # ahead instead, 2 MiB pages included, added 25 s to the load on this VM.)
        self._views = [memoryview(self.arrays[p.name]).cast("B") for p in self.held]
        self.table: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, least recent first
        self.free = list(range(slots - 1, -1, -1))
        # The same, per slot, as arrays: LFU picks its victim with one vectorised pass.
        self.layer_of = np.full(slots, -1, dtype=np.int64)
        self.expert_of = np.zeros(slots, dtype=np.int64)
        self.used_at = np.zeros(slots, dtype=np.float64)
        # True while a slot is not ready for the CPU kernels as it stands: from every put until
        # its read has landed (a read-ahead's slot is in the table while its read is in flight:
        # the one-call decode path must not take it for a hit), and after that while it holds
        # bytes as read that a compute path repacks in place (engine/cpu/tiled_experts.py).
        self.raw = np.ones(slots, dtype=bool)
        # What a reader thread does to a slot once its expert has landed and been checked
        # (land(slot)): the CPU kernels' repack into tiles, or `untile`; None: used as read.
        self.land = None
        self.layout = "mlx"  # how the experts' bytes are ordered on disk (LayerExperts.layout)
        self._scratch = threading.local()  # untile's copies, per reader thread
        self.reads_tiles = False  # the bytes as read are the CPU kernels' tiles: ready once landed

    def put(self, key: tuple[int, int], slot: int, tick: int) -> None:
        self.raw[slot] = True
        self.table[key] = slot
        self.layer_of[slot], self.expert_of[slot], self.used_at[slot] = key[0], key[1], tick

    def clear(self) -> None:
        self.table.clear()
        self.free = list(range(self.slots - 1, -1, -1))
        self.layer_of[:] = -1

    def untile(self, slot: int) -> None:
        """A landing step: a slot read from a tiled layer (LayerExperts.layout "tiles") back in
        MLX's row order, for the MLX kernels (the copy goes through this thread's scratch)."""
        scratch = self._scratch.__dict__
        for p in self.held:
            a = self.numpy(p.name)[slot]
            copy = scratch.get(p.name)
            if copy is None:
                copy = scratch[p.name] = np.empty_like(a)
            np.copyto(copy, a)
            from_tiles(copy.reshape(a.shape[0] // 16, a.shape[1], 16), a)

    def numpy(self, name: str) -> np.ndarray:
        """The part `name` of every slot as a numpy array [S, *shape] over the slots' own bytes
        (bfloat16 as its uint16 bits)."""
        i = next(i for i, p in enumerate(self.held) if p.name == name)
        dtype = {"F32": np.float32, "U32": np.uint32, "BF16": np.uint16, "F16": np.float16}.get(self.held[i].dtype)
        return np.frombuffer(self._views[i], dtype if dtype is not None else np.uint8).reshape(
            self.slots, *self.held[i].shape
        )

    def slot_views(self, slot: int, first: int, last: int) -> list[memoryview]:
        return [
            self._views[i][slot * p.nbytes : (slot + 1) * p.nbytes]
            for i, p in enumerate(self.held[first:last], start=first)
        ]

    def conversions(self, first: int, last: int) -> list[str | None]:
        """Per part: the on-disk dtype to convert from, or None when it is read as is."""
        return [p.dtype if p.dtype != h.dtype else None for p, h in zip(self.parts[first:last], self.held[first:last])]

    @property
    def used_bytes(self) -> int:
        return len(self.table) * self.expert_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.slots * self.expert_bytes


class ExpertStore:
    """Owns the slot pools, the open files and the reader threads."""

    def __init__(
        self,
        root: Path,
        layers: list[LayerExperts],
        top_k: int,
        budget_bytes: int,
        io_threads: int = IO_THREADS,
        direct_io: bool | None = None,
        upcast: bool = False,
        cpu_kernels: bool = False,
        policy: str = "lfu",
        verify_reads: bool = True,
        keep_bf16=None,
    ):
        """keep_bf16(layer experts) -> whether their pool keeps bfloat16 parts as stored when
        upcasting (the CPU kernels' tiles take them so); None: never."""
        if policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy must be one of {CACHE_POLICIES}, got {policy!r}")
        self.policy = policy
        self.root = root
        self.layers = {l.layer: l for l in layers}
        # O_DIRECT (None: wherever the system and the file system take it): the drive's bytes
        # land in the slots with no page-cache copy, charged to no cgroup, and evicting nothing
        # else's pages. Measured against buffered reads with the synthetic MoE under memory
        # limits (benchmarks/bigger_than_ram.py): decode 4.4 against 4.0 tok/s at a quarter of
        # the model, 12.0 against 9.2 at 1x, the same at 1.5x.
        self.direct_io = direct_io
        self._direct_fds: set[int] = set()  # the files opened with O_DIRECT
        self.top_k = max(1, top_k)
        self.stats: dict[int, LayerStats] = {l.layer: LayerStats() for l in layers}
        self.pending: list[mx.array] = []
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()  # reader threads open files lazily: one fd per file
        self._local = threading.local()
        self._pool_of: dict[int, SlotPool] = {}
        self.upcast = upcast
        self.keep_bf16 = keep_bf16 or (lambda layer: False)
        self._inflight: dict[tuple[int, int], concurrent.futures.Future] = {}
        self.routers: dict[int, np.ndarray] = {}  # layer -> router weight [E, H], for --prefetch
        self.prefetch_mode = "off"  # "slots": read guesses into slots; "hint": into the page cache
        self._hinted: dict[int, set[int]] = {}  # layer -> experts hinted for its next fetch
        self.next_layer = {a.layer: b.layer for a, b in zip(layers, layers[1:])}
        self.cpu_kernels = cpu_kernels  # experts computed by the numba kernels (engine/cpu/install.py)
        self.pools: list[SlotPool] = []
        self.budget_bytes = self._make_pools(layers, budget_bytes)
        # How often each (layer, expert) was asked for, all halved every LFU_HALF_LIFE tokens'
        # worth of fetches so that a change of topic is followed; and a clock (fetches) for recency.
        self.freq = np.zeros((max(l.layer for l in layers) + 1, max(l.num_experts for l in layers)))
        # The same counts never halved, and how many tokens' worth of fetches they cover: what
        # the usage file (usage.py) learns from this process.
        self.asked = np.zeros_like(self.freq)
        self.asked_steps = 0
        self._first_layer = min(l.layer for l in layers)
        self.preloaded = 0  # experts read into free slots at start from the usage file (preload)
        self.preloaded_bytes = 0
        self.misses_total = 0  # experts read on demand since load (every layer, every step)
        self._fetches = 0
        self._tick = 0
        # `flashmoe bench cache` sets these to lists to record routing: every fetch's
        # (layer, experts), and every read-ahead guess as (len(trace) then, layer, experts)
        self.trace: list | None = None
        self.guesses: list | None = None
        self._exec = Readers(io_threads, "flashmoe-io")
        # preload's reads get threads of their own: a miss is never queued behind them
        self._preload_exec: ThreadPoolExecutor | None = None
        self.peak_used_bytes = 0
        self.busy = BusyClock()  # the drive kept busy by this store's reads (benchmarks' overlap)
        # Each expert block of a packed folder is checked against the manifest's CRC-32 the first
        # time this process reads it (direct mode has no checksums): a flipped bit on the disk is
        # an error naming layer and expert, not garbage output. One flag per (layer, expert).
        self.verify_reads = verify_reads
        self._verified = {
            l.layer: np.zeros(l.num_experts, dtype=bool) for l in layers if l.file is not None and l.checksums
        }
        self._verify_lock = threading.Lock()
        self.verify_s = 0.0  # seconds the reader threads spent computing checksums, in total
        self.land_s = 0.0  # ... and in the pools' landing steps (the CPU kernels' repack into tiles)
        self.verified_bytes = 0

    # -- sizing --------------------------------------------------------------------------
    def _make_pools(self, layers, budget_bytes) -> int:
        groups: dict[tuple, list[LayerExperts]] = {}
        for l in layers:
            groups.setdefault(l.signature, []).append(l)
        total = sum(l.expert_bytes * l.num_experts for l in layers)
        granted = 0
        for _sig, ls in groups.items():
            group_total = sum(l.expert_bytes * l.num_experts for l in ls)
            share = budget_bytes * group_total // total if total else 0
            keep = self.keep_bf16(ls[0])
            eb = sum(p.nbytes for p in held_parts(ls[0].parts, self.upcast, keep))
            # Never below one token's experts; never above every expert of these layers.
            slots = min(max(self.top_k, share // eb), sum(l.num_experts for l in ls))
            slots = max(slots, min(self.top_k, max(l.num_experts for l in ls)))
            pool = SlotPool(ls[0].parts, slots, self.upcast, keep)
            pool.layout = ls[0].layout
            if pool.layout == "tiles":  # back in rows on landing, unless a CPU bank takes the tiles as read
                pool.land = pool.untile
            self.pools.append(pool)
            for l in ls:
                self._pool_of[l.layer] = pool
            granted += pool.capacity_bytes
        return max(budget_bytes, granted)

    def pool(self, layer: int) -> SlotPool:
        return self._pool_of[layer]

    @property
    def used_bytes(self) -> int:
        return sum(p.used_bytes for p in self.pools)

    @property
    def capacity_bytes(self) -> int:
        return sum(p.capacity_bytes for p in self.pools)

    # -- the hot path --------------------------------------------------------------------
    def holds(self, layer: int, experts) -> bool:
        """Whether every one of `experts` of `layer` has a slot (cached, or read ahead into one:
        fetch waits for those)."""
        table = self._pool_of[layer].table
        return all((layer, int(e)) in table for e in experts)

    def note_hits(self, layer: int, experts: list[int], slots) -> None:
        """fetch's bookkeeping for `experts` (distinct ids) of `layer` that sit in `slots`, every
        one cached: a decoding token's experts that its caller found itself (switch.route_cached)."""
        pool, stats = self._pool_of[layer], self.stats[layer]
        wanted = set(experts)
        self._count(layer, wanted)
        slot_of = dict(zip(experts, slots))
        for e in wanted:  # (fetch's order: the LRU order of one token's experts is the same)
            pool.table.move_to_end((layer, e))
            pool.used_at[slot_of[e]] = self._tick
        stats.hits += len(wanted)
        self._settle_prefetches(layer, wanted, stats)
        self._hinted.pop(layer, None)

    def fetch(self, layer: int, experts, ready=None, during=None) -> np.ndarray:
        """Make sure `experts` (distinct ids, at most pool.slots of them) of `layer` sit in slots.

        Returns a lookup table expert id -> slot id (0 for experts not asked for). With `ready`,
        the caller computes while the reads are in flight: ready(lut, ids, more) is called first
        with the experts already cached (maybe none), then with the missing experts that have
        landed since the last call; `more` says whether more calls follow.
        `during()` is called once, after that first ready call: while the misses are being read
        when there are any.
        """
        pool = self._pool_of[layer]
        info = self.layers[layer]
        stats = self.stats[layer]
        wanted = {int(e) for e in experts}
        assert len(wanted) <= pool.slots, "caller must chunk to the pool size"
        self._count(layer, wanted)
        lut = np.zeros(info.num_experts, dtype=np.uint32)
        ahead = self._settle_prefetches(layer, wanted, stats)  # expert -> its read-ahead, still in flight
        hits, misses = [], []
        for e in wanted:
            slot = pool.table.get((layer, e))
            if slot is None:
                misses.append(e)
            else:
                pool.table.move_to_end((layer, e))
                pool.used_at[slot] = self._tick
                lut[e] = slot
                if e not in ahead:
                    hits.append(e)
        stats.hits += len(hits) + len(ahead)
        hinted = self._hinted.pop(layer, None)
        if hinted:
            stats.prefetch_used += len(hinted.intersection(misses))
        if not misses and not ahead:
            if ready is not None:
                ready(lut, hits, False)
            if during is not None:
                during()
            return lut
        # Slots are about to be overwritten: finish every computation that reads them.
        if self.pending and misses:
            mx.eval(self.pending)
            self.pending.clear()
        slots = self._take_slots(pool, layer, wanted, len(misses))
        if len(slots) < len(misses):  # read-ahead holds the rest: let it land, then evict as usual
            self._drain_inflight()
            slots += self._take_slots(pool, layer, wanted, len(misses) - len(slots))
        futures = {fut: e for e, fut in ahead.items()}  # a read (a piece, or a whole read-ahead) -> expert
        for e, slot in zip(misses, slots):
            pool.put((layer, e), slot, self._tick)
            lut[e] = slot
            landing, split = self._pieces(info, pool, e, slot)
            for p in split:
                futures[self._exec.submit(self._read, *p, landing)] = e
        unread = {e: 0 for e in futures.values()}
        for e in futures.values():
            unread[e] += 1
        if ready is not None:
            ready(lut, hits, True)  # cached experts compute while the misses are read
        if during is not None:
            during()  # and so does the caller's other work (a shared expert)
        wait = 0.0
        pending = set(futures)
        try:
            while pending:
                t0 = perf_counter()
                done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                wait += perf_counter() - t0
                landed = []
                for f in done:
                    e = futures[f]
                    if e in ahead:
                        self._landed((layer, e), f)  # (a failed one is forgotten, then raises)
                    f.result()  # a read error or a checksum mismatch surfaces here
                    unread[e] -= 1
                    if not unread[e]:
                        landed.append(e)
                if ready is not None and landed:
                    ready(lut, landed, bool(pending))  # what landed since the last wait, in one call
        except BaseException:
            # No slot may keep a half-read or corrupted expert for a later request to find:
            # let every read finish, then forget all of this call's misses.
            concurrent.futures.wait(pending)
            for e in [*misses, *ahead]:
                self._forget(pool, (layer, e))
            raise
        stats.io_wait_s += wait
        stats.misses += len(misses)
        stats.bytes_read += len(misses) * info.expert_bytes
        self.misses_total += len(misses)
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        return lut

    def _pieces(
        self, info: LayerExperts, pool: SlotPool, expert: int, slot: int, whole: bool = False
    ) -> tuple[_Landing, list]:
        """The read jobs (extent, slot views, conversions) that bring `expert` into `slot`, in
        pieces of at most READ_PIECE (or `whole`: one read per extent, for one reader thread),
        and the _Landing that counts them."""
        jobs = [
            (ext, pool.slot_views(slot, ext.first, ext.last), pool.conversions(ext.first, ext.last))
            for ext in info.extents(self.root, expert)
        ]
        split = jobs if whole else [p for job in jobs for p in pieces(job, READ_PIECE)]
        landing = _Landing(
            info.layer,
            expert,
            pool,
            slot,
            self._check_for(info, expert),
            str(self.root / info.file) if info.file else str(self.root),
        )
        landing.left = len(split)
        return landing, split

    def _read_all(self, jobs, landing: _Landing) -> None:
        for job in jobs:
            self._read(*job, landing)

    def _forget(self, pool: SlotPool, key: tuple[int, int]) -> None:
        """Drop an expert whose read failed from the cache; its slot becomes free."""
        slot = pool.table.pop(key, None)
        if slot is not None:
            pool.layer_of[slot] = -1
            pool.free.append(slot)

    # -- checksums -----------------------------------------------------------------------
    @property
    def has_checksums(self) -> bool:
        """Whether there is anything to check (packed folders; direct mode has no checksums)."""
        return bool(self._verified)

    def _check_for(self, info: LayerExperts, expert: int) -> int | None:
        """The CRC-32 a read of `expert` must have, or None: verified before, or nothing to check."""
        done = self._verified.get(info.layer)
        if not self.verify_reads or done is None or done[expert]:
            return None
        return info.checksums[expert]

    def _landed_piece(self, landing: _Landing, staged: list[memoryview] | None) -> None:
        """Count a landed piece; after the last one, check the expert's CRC-32 against the
        manifest's and run the pool's landing step, on this reader thread. `staged`: the on-disk
        bytes when they were staged (parts widened to float32 on read); else the slot holds them."""
        with self._verify_lock:
            landing.left -= 1
            if landing.left:
                return
        pool, slot = landing.pool, landing.slot
        if landing.check is not None:
            t0 = perf_counter()
            crc, n = 0, 0
            for v in staged if staged is not None else pool.slot_views(slot, 0, len(pool.held)):
                crc = crc32(v, crc)  # releases the GIL
                n += len(v)
            took = perf_counter() - t0
            with self._verify_lock:
                self.verify_s += took
                self.verified_bytes += n
            if crc != landing.check:
                raise ModelLoadError(
                    landing.path,
                    f"layer {landing.layer} expert {landing.expert}: checksum "
                    "mismatch, the file is corrupted (`flashmoe verify` checks every expert)",
                )
            self._verified[landing.layer][landing.expert] = True
        if pool.land is not None:
            t0 = perf_counter()
            pool.land(slot)
            took = perf_counter() - t0
            with self._verify_lock:
                self.land_s += took
        if pool.reads_tiles:
            pool.raw[slot] = False  # landed as the kernels take it: ready now, not before

    def _count(self, layer: int, wanted: set[int]) -> None:
        self._tick += 1
        self._fetches += 1
        if self._fetches >= LFU_HALF_LIFE * len(self.layers):
            self.freq *= 0.5
            self._fetches = 0
        row, asked = self.freq[layer], self.asked[layer]
        for e in wanted:  # a handful: cheaper than a fancy-indexed add
            row[e] += 1
            asked[e] += 1
        if layer == self._first_layer:
            self.asked_steps += 1
        if self.trace is not None:
            self.trace.append((layer, tuple(sorted(wanted))))

    def _take_slots(self, pool: SlotPool, layer: int, wanted: set[int], n: int) -> list[int]:
        """Up to n slots for new experts: free ones, then the victims the policy picks. Never a
        slot of an expert `layer` wants now, nor one still being read into by read-ahead (fewer
        than n only when read-ahead holds every other slot; callers chunk to the pool size)."""
        taken = [pool.free.pop() for _ in range(min(n, len(pool.free)))]
        n -= len(taken)
        if n <= 0:
            return taken
        if self.policy == "lru":
            victims = []
            for key in pool.table:  # least recently used first
                if (key[0] != layer or key[1] not in wanted) and key not in self._inflight:
                    victims.append(key)
                    if len(victims) == n:
                        break
            return taken + [pool.table.pop(key) for key in victims]
        # lfu: the least often asked-for experts, the least recently used among equals. The
        # clock counts fetches, far below 2**32, so one float64 key orders both.
        score = self.freq[pool.layer_of, pool.expert_of] * 2.0**32 + pool.used_at
        keep = taken + [pool.table[k] for k in [*((layer, e) for e in wanted), *self._inflight] if k in pool.table]
        score[keep] = np.inf
        # a slot with no expert is one an earlier call took for a read not yet put (fetch asks
        # twice when read-ahead or preload held too many slots): never a victim
        score[pool.layer_of < 0] = np.inf
        order = np.argpartition(score, n - 1)[:n] if n < len(score) else np.arange(len(score))
        victims = [int(i) for i in order[np.argsort(score[order])] if score[i] != np.inf]
        for slot in victims:
            del pool.table[(int(pool.layer_of[slot]), int(pool.expert_of[slot]))]
        return taken + victims

    # -- read-ahead (--prefetch) -----------------------------------------------------------
    def prefetch(self, layer: int, experts, protect: tuple[int, set[int]]) -> None:
        """Start reading experts of `layer` in the background, into free slots or those the cache
        policy gives up, never those of `protect` = (layer, experts) that a computation is using
        now. A guess nobody asks for has no count, so LFU gives its slot up first. The reads go
        after every demand read (Readers' priority); one not started when its layer is fetched
        and turns out not to want it is cancelled (_settle_prefetches)."""
        pool, info = self._pool_of[layer], self.layers[layer]
        for e in experts:
            key = (layer, int(e))
            if key in pool.table:
                continue
            slots = self._take_slots(pool, protect[0], protect[1], 1)
            if not slots:
                return
            slot = slots[0]
            pool.put(key, slot, self._tick)
            self._inflight[key] = self._exec.submit(
                self._read_all, *self._pieces(info, pool, key[1], slot, whole=True)[::-1], priority=AHEAD
            )
            stats = self.stats[layer]
            stats.prefetched += 1
            stats.bytes_read += info.expert_bytes

    def hint(self, layer: int, experts) -> concurrent.futures.Future | None:
        """Ask the kernel to start reading these experts of `layer` into the page cache
        (posix_fadvise WILLNEED, issued from a reader thread) and return at once. No slot is
        taken and nothing waits: a wrong guess costs disk bandwidth only (and leaves the expert
        in the page cache for later), a right one turns the later demand read into a copy from
        memory. Experts already in slots are skipped. Nothing to do with O_DIRECT reads.
        Returns the reader thread's job (None when there was nothing to hint)."""
        if self._direct_fds or self.direct_io or not hasattr(os, "posix_fadvise"):
            return None
        pool, info = self._pool_of[layer], self.layers[layer]
        todo = [int(e) for e in experts if (layer, int(e)) not in pool.table]
        if not todo:
            return None
        self._hinted[layer] = set(todo)
        self.stats[layer].prefetched += len(todo)
        return self._exec.submit(self._advise, [ext for e in todo for ext in info.extents(self.root, e)])

    def _advise(self, extents) -> None:
        for ext in extents:
            os.posix_fadvise(self._fd(ext.path), ext.offset, ext.nbytes, os.POSIX_FADV_WILLNEED)

    def _drain_inflight(self) -> None:
        inflight, self._inflight = self._inflight, {}
        failed = None
        for key, fut in inflight.items():
            try:
                self._landed(key, fut)
            except BaseException as e:
                failed = failed or e  # the others still land before we report it
        if failed is not None:
            raise failed

    def _landed(self, key: tuple[int, int], fut) -> None:
        """Wait for one read-ahead; if it failed, its slot holds nothing usable."""
        try:
            fut.result()
        except BaseException:
            self._forget(self._pool_of[key[0]], key)
            raise

    def _settle_prefetches(self, layer: int, wanted: set[int], stats: LayerStats) -> dict:
        """The read-ahead (and preload) of `layer` as a fetch of `wanted` finds it. Returns those
        it wants that are still in flight (expert -> future: the fetch waits for them beside its
        own misses, after submitting those); settles finished ones, and cancels those it does not want that have not started (a
        wrong guess costs no read; its slot is free again). Started ones it does not want stay
        in flight: a preload of hundreds of experts is not waited for by the first token."""
        ahead = {}
        for key in [k for k in self._inflight if k[0] == layer]:
            fut = self._inflight[key]
            if key[1] in wanted:
                del self._inflight[key]
                stats.prefetch_used += 1
                if fut.done():
                    self._landed(key, fut)  # (raises what a failed one raised)
                else:
                    ahead[key[1]] = fut
            elif fut.done():
                self._landed(key, self._inflight.pop(key))
            elif fut.cancel():
                del self._inflight[key]
                self._forget(self._pool_of[layer], key)
                stats.bytes_read -= self.layers[layer].expert_bytes
                stats.prefetch_cancelled += 1
        return ahead

    # -- preload (usage.py) ----------------------------------------------------------------
    def preload(self, hot, counts: np.ndarray | None = None, steps: int = 0) -> int:
        """Start reading `hot` ((layer, expert) pairs, hottest first) into free slots, leaving
        each pool top_k slots free for the first misses, and return at once; returns how many
        reads started. `counts` (shaped as self.freq) over `steps` tokens (the usage file's) seed the
        LFU counts, scaled to one half-life's worth of tokens, so that what was hot in earlier
        runs is not the first thing evicted. Reads land while generation runs; a fetch that
        wants one waits for it (like read-ahead), others are settled as they finish."""
        if counts is not None and steps > 0:
            self.freq += counts * (LFU_HALF_LIFE / steps)
        if self._preload_exec is None:
            self._preload_exec = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flashmoe-preload")
        started = 0
        for layer, e in hot:
            pool, info = self._pool_of.get(layer), self.layers.get(layer)
            if pool is None or not 0 <= e < info.num_experts or (layer, e) in pool.table:
                continue
            if len(pool.free) <= self.top_k:
                continue  # this pool is full; another may not be
            slot = pool.free.pop()
            pool.put((layer, e), slot, self._tick)
            self._inflight[(layer, e)] = self._preload_exec.submit(
                self._read_all, *self._pieces(info, pool, e, slot, whole=True)[::-1]
            )
            started += 1
            self.preloaded_bytes += info.expert_bytes
        self.preloaded += started
        return started

    def note_output(self, y: mx.array) -> None:
        """Remember a lazy result that reads the slots, so a later eviction evaluates it first.

        Only the latest is kept, and the one it replaces is evaluated first. Within a forward
        pass that costs nothing (the next layer's expert ids depend on it, so it was computed
        when they were read); across calls it matters: the last layer's output of one call feeds
        only that call's logits, which a caller may leave unevaluated (scoring forced tokens)
        while the next call evicts the slots it reads. Holding every result instead would keep
        each layer's activations alive in a loop that calls the model directly."""
        if self.pending:
            mx.eval(self.pending)
        self.pending[:] = [y]

    # -- reading -------------------------------------------------------------------------
    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        with self._fds_lock:
            fd = self._fds.get(path)
            if fd is not None:
                return fd
            flags = os.O_RDONLY | os.O_CLOEXEC
            fd = None
            if self.direct_io is not False and hasattr(os, "O_DIRECT"):
                try:
                    fd = os.open(path, flags | os.O_DIRECT)
                    self._direct_fds.add(fd)
                except OSError as e:  # a file system without O_DIRECT says EINVAL
                    if self.direct_io or e.errno != errno.EINVAL:
                        raise ModelLoadError(
                            path, f"cannot open{' with O_DIRECT' if self.direct_io else ''}: {e.strerror or e}"
                        ) from None
            if fd is None:
                try:
                    fd = os.open(path, flags)
                except OSError as e:
                    raise ModelLoadError(path, f"cannot open: {e.strerror or e}") from None
                if hasattr(os, "posix_fadvise"):
                    # Expert reads are scattered: readahead past an expert is wasted bandwidth.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds[path] = fd
        return fd

    def _read(self, ext: Extent, views: list[memoryview], conversions: list, landing: _Landing) -> None:
        fd = self._fd(ext.path)
        targets = views
        if any(conversions):
            # Parts to widen are read into a staging buffer, then widened into their slots; the
            # others straight into theirs.
            stage = memoryview(bytearray(sum(len(v) // 2 for v, c in zip(views, conversions) if c)))
            views, pos = [], 0
            for v, c in zip(targets, conversions):
                if c:
                    views.append(stage[pos : pos + len(v) // 2])
                    pos += len(v) // 2
                else:
                    views.append(v)
        try:
            with self.busy:
                if fd in self._direct_fds:
                    got = self._read_direct(fd, ext, views)
                else:
                    got = os.preadv(fd, views, ext.offset)
        except OSError as e:
            raise ModelLoadError(ext.path, f"read failed at offset {ext.offset}: {e.strerror or e}") from None
        if got != ext.nbytes:
            raise ModelLoadError(ext.path, f"truncated: wanted {ext.nbytes} bytes at offset {ext.offset}, got {got}")
        for src, dst, conv in zip(views, targets, conversions):
            if conv:
                _to_float32(src, conv, dst)
        # the checksum is of the bytes on disk: the staged ones where they were widened
        self._landed_piece(landing, views if any(conversions) else None)

    def _read_direct(self, fd: int, ext: Extent, views: list[memoryview]) -> int:
        # O_DIRECT needs aligned offsets, sizes and memory. Slots whose parts are page-aligned
        # in address and size (a packed folder's usually are) are read into directly; else an
        # aligned window goes through a page-aligned staging buffer (one per reader thread).
        if ext.offset % PAGE == 0 and all(len(v) % PAGE == 0 and _address(v) % PAGE == 0 for v in views):
            return os.preadv(fd, views, ext.offset)
        start = ext.offset - ext.offset % PAGE
        end = -(-(ext.offset + ext.nbytes) // PAGE) * PAGE
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < end - start:
            buf = mmap.mmap(-1, end - start)
            self._local.buf = buf
        mv = memoryview(buf)[: end - start]
        skip = ext.offset - start
        got = max(0, min(os.preadv(fd, [mv], start) - skip, ext.nbytes))
        data = mv[skip : skip + got]
        pos = 0
        for v in views:
            n = max(0, min(len(v), got - pos))
            v[:n] = data[pos : pos + n]
            pos += len(v)
        return got

    # -- telemetry -----------------------------------------------------------------------
    def take_stats(self) -> dict[int, LayerStats]:
        """Counters since the last call, per layer; resets them."""
        out = self.stats
        self.stats = {k: LayerStats() for k in out}
        return out

    def step_done(self) -> dict[int, LayerStats]:
        """A forward pass has been evaluated: no lazy result reads the slots any more (see
        note_output). Returns its counters, per layer."""
        self.pending.clear()
        return self.take_stats()

    def evict_all(self) -> None:
        """Forget every cached expert (a cold start for benchmarks): checksums are checked again
        too, so that a cold run costs what the first run of a new process does."""
        self._drain_inflight()
        for p in self.pools:
            p.clear()
        self.freq[:] = 0
        for done in self._verified.values():
            done[:] = False

    def close(self) -> None:
        if self._preload_exec is not None:
            self._preload_exec.shutdown(wait=True, cancel_futures=True)
        self._exec.shutdown()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._direct_fds.clear()
