from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import save_folder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """Builds (once per session) tiny mlx-lm folders and their flashmoe conversions."""
    cache: dict = {}
    base = tmp_path_factory.mktemp("models")

    def make(arch: str, bits: int | None = None, group_size: int = 64, converted: bool = False) -> Path:
        key = (arch, bits, group_size)
        if key not in cache:
            cache[key] = save_folder(base / f"{arch}-{bits}-{group_size}", arch, bits=bits, group_size=group_size)
        src = cache[key]
        if not converted:
            return src
        out = src.with_name(src.name + "-fm")
        if not out.exists():
            from engine.convert import convert

            convert(src, out)
        return out

    return make


def run_cli(*args, input: str | None = None, timeout: float = 120, env: dict | None = None):
    """Run `python -m flashmoe_cli ARGS` the way a user's shell would."""
    e = dict(os.environ, **(env or {}))
    e.pop("FORCE_COLOR", None)
    return subprocess.run([sys.executable, "-m", "flashmoe_cli", *map(str, args)], input=input,
                          capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
