"""The engine's option values, the one home both the engine and the front ends import.

Imports nothing heavy (no MLX), so `flashmoe --help`, usage errors and the config file are
checked against the engine's own lists without loading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TIMING_MODES = ("off", "step", "layer")  # what a generation reports: nothing, per token, per layer
KERNELS = ("auto", "mlx", "cpu", "cpu-int8")  # who computes the quantized matmuls ("auto": cpu on a CPU device)
KV_CACHES = ("float32", "float16")  # the CPU kernels' KV cache: exact (MLX's, of a float32 model), or half the bytes
PREFETCH_MODES = ("off", "hint", "slots")  # reading the next layer's likely experts ahead
CACHE_POLICIES = ("lfu", "lru")  # which cached expert a miss evicts
TRUNCATE_MODES = ("off", "left")  # a prompt longer than the context: refuse, or drop its start
THINKING_CHOICES = ("on", "off")  # the chat template's reasoning switch (unset: its default)
DTYPES = ("auto", "float32", "keep")  # resident weights: float32 on CPU, as stored, or as told
# Reader threads for expert reads. 16, not 8: a decoding layer misses 4-5 experts, 11 pieces of
# 1 MiB, which 16 readers put at the device in one wave; the drive gives no more bandwidth past 8
# in flight, but each layer waits less (the synthetic MoE at a quarter of its size: 10% faster
# decode, 68-72% of the disk roof against 56-58%; commit 899e624's message, issue 39).
IO_THREADS = 16


def resolve_dtype(choice: str) -> str | None:
    """A DTYPES choice as the loader takes it: a dtype name, or None to keep the stored one.
    "auto" is float32 on the CPU, where MLX is many times faster in float32 than in 16 bits."""
    if choice == "auto":
        import mlx.core as mx  # only here: the rest of this module imports no MLX

        return "float32" if mx.default_device() == mx.cpu else None
    return None if choice == "keep" else choice


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # <= 0 means greedy
    top_p: float = 1.0  # 1 disables
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # 0 disables
    repetition_penalty: float = 1.0  # 1 disables
    repetition_context: int = 64  # how many recent ids the penalty looks at
    seed: int | None = None  # None: a fresh random seed per Sampler

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not is_int(self.repetition_context) or self.repetition_context < 0:
            raise ValueError(f"repetition_context must be an integer >= 0, got {self.repetition_context}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0
