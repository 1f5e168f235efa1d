"""Which model a command runs: the one given (a folder, org/name in the Hugging Face cache) or
the built-in demo."""

from __future__ import annotations

from .errors import UsageError
from .progress import Progress


DEMO_NOTE = (
    "This is the demo model: SmolLM2-135M, a 135M-parameter toy carved into a 16-expert MoE (8 routed "
    "per token) to show expert streaming. Its answers are often wrong and its tool use is unreliable: do not trust "
    "either. For real work give a real model with -m (docs/models.md)."
)


def is_demo(model: str | None) -> bool:
    """Is this folder the built-in demo (what `-m` defaults to)?"""
    if not model:
        return False
    from pathlib import Path

    from flashmoe.engine.formats.demo import demo_path

    try:
        return Path(model).resolve() == demo_path().resolve()
    except (OSError, RuntimeError):
        return False


def resolve_model(model: str | None) -> str:
    """The model folder to use: the one given (a folder, or org/name[@revision] in the Hugging Face
    cache: engine/formats/hf_cache.py), or the demo model (built on first use)."""
    if model:
        from flashmoe.engine.formats.hf_cache import resolve

        return resolve(model)
    from flashmoe.engine.formats.demo import ensure_demo

    from .paths import ensure_home

    ensure_home()  # the demo is built in it: a bad FLASHMOE_HOME is one line, not a traceback
    return str(ensure_demo(progress=Progress()))


def model_arg(args) -> str | None:
    """info / verify take the model as MODEL or as -m MODEL, like the other commands."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise UsageError(f"two models given: {args.model} and -m {args.model_flag}; give one")
    return args.model_flag or args.model
