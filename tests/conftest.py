from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import save_folder

ROOT = Path(__file__).resolve().parents[1]


def _user_home() -> Path:
    """The FLASHMOE_HOME the user's own runs use (as engine.demo.flashmoe_home finds it)."""
    env = os.environ.get("FLASHMOE_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("flashmoe", appauthor=False))


USER_HOME = _user_home()  # read before the session fixture below replaces it


@pytest.fixture(scope="session", autouse=True)
def private_flashmoe_home(tmp_path_factory):
    """Every test runs with a FLASHMOE_HOME of its own, so `flashmoe logs` after pytest shows nothing
    the user did not do. The user's demo model (and the wheel it was built from) are linked in
    when they exist, so the demo is not rebuilt; otherwise it is built once, here."""
    from flashmoe.engine.formats.convert import is_converted
    from flashmoe.engine.formats.demo import DEMO_NAME

    home = tmp_path_factory.mktemp("flashmoe-home")
    demo = f"models/{DEMO_NAME}"
    for sub in (demo, "downloads"):
        if (USER_HOME / sub).is_dir() and (sub != demo or is_converted(USER_HOME / sub)):
            (home / sub).parent.mkdir(parents=True, exist_ok=True)
            (home / sub).symlink_to(USER_HOME / sub, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("FLASHMOE_HOME", str(home))
    yield home
    mp.undo()


@pytest.fixture(scope="module", autouse=True)
def close_expert_stores():
    """Tests load models and mostly leave closing to the garbage collector, which keeps their
    expert files open until a full collection. Close every store a test module opened when the
    module ends, so open descriptors do not pile up past CI's limit (EMFILE at 1024)."""
    from flashmoe.engine.experts.store import ExpertStore

    opened, init = [], ExpertStore.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(self)

    ExpertStore.__init__ = recording_init
    yield
    ExpertStore.__init__ = init
    for store in opened:
        store.close()


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
            from flashmoe.engine.formats.convert import convert

            convert(src, out)
        return out

    return make


def run_cli(*args, input: str | None = None, timeout: float = 120, env: dict | None = None):
    """Run `python -m flashmoe.cli ARGS` the way a user's shell would."""
    e = dict(os.environ, **(env or {}))
    e.pop("FORCE_COLOR", None)
    return subprocess.run([sys.executable, "-m", "flashmoe.cli", *map(str, args)], input=input,
                          capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
