"""flashmoe's engine: load a model with streamed experts and generate from it.

    formats/    safetensors I/O, convert, GGUF import, the Hugging Face cache, the demo's build
    experts/    streaming: expert blocks, the packed layout, the expert store, the streamed block
    cpu/        the CPU fast path: numba kernels, their install, fused one-token layers,
                batched prefill (dequantize + sgemm, BLAS attention)
    runtime/    loader, engine thread, generation (decode.py under generate.py), sampling,
                tokenizer, timing
    options.py  the option lists and SamplingParams (imports no MLX: the front ends use it)
    testing.py  FakeEngine, the test double the front ends' tests drive (the hidden --engine fake)
    benchmark.py  what `flashmoe bench speed` and benchmarks/ share: timed runs, disk, eviction

Never imports a UI package (textual, prompt_toolkit, rich) or flashmoe.tools: front ends sit
on top of this (docs/architecture.md).
"""

from __future__ import annotations

from flashmoe.engine.errors import ConvertError, FlashMoEError, ModelLoadError
from flashmoe.engine.events import (
    EngineFailed,
    GenerationFinished,
    LayerRow,
    LayerTimings,
    ModelLoaded,
    PrefillProgress,
    StepFinished,
    TokenGenerated,
)
from flashmoe.engine.options import SamplingParams

__all__ = [
    "load",
    "convert",
    "Engine",
    "GenerationRequest",
    "Session",
    "generate",
    "SamplingParams",
    "FlashMoEError",
    "ModelLoadError",
    "ConvertError",
    "EngineFailed",
    "GenerationFinished",
    "LayerRow",
    "LayerTimings",
    "ModelLoaded",
    "PrefillProgress",
    "StepFinished",
    "TokenGenerated",
]


def __getattr__(name):
    # Heavy modules load on first use, so `import engine` stays cheap.
    if name == "load":
        from flashmoe.engine.runtime.loader import load

        return load
    if name == "convert":
        from flashmoe.engine.formats.convert import convert

        return convert
    if name == "Engine":
        from flashmoe.engine.runtime.engine import Engine

        return Engine
    if name in ("GenerationRequest", "Session", "generate"):
        from flashmoe.engine.runtime import generate as g

        return getattr(g, name)
    raise AttributeError(name)
