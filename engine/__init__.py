"""flashmoe's engine: load a model with streamed experts and generate from it.

Never imports a UI package (textual, prompt_toolkit, rich): front ends sit on top of this.
"""
from __future__ import annotations

from .errors import ConvertError, FlashMoEError, ModelLoadError
from .events import (EngineFailed, GenerationFinished, LayerRow, LayerTimings, ModelLoaded,
                     PrefillProgress, StepFinished, TokenGenerated)
from .options import SamplingParams

__all__ = [
    "load", "convert", "Engine", "GenerationRequest", "Session", "generate", "SamplingParams",
    "FlashMoEError", "ModelLoadError", "ConvertError", "EngineFailed", "GenerationFinished",
    "LayerRow", "LayerTimings", "ModelLoaded", "PrefillProgress", "StepFinished", "TokenGenerated",
]


def __getattr__(name):
    # Heavy modules load on first use, so `import engine` stays cheap.
    if name == "load":
        from .loader import load
        return load
    if name == "convert":
        from .convert import convert
        return convert
    if name == "Engine":
        from .engine import Engine
        return Engine
    if name in ("GenerationRequest", "Session", "generate"):
        from . import generate as g
        return getattr(g, name)
    raise AttributeError(name)
