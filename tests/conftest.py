from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers.paths import OUTSIDE, USER_HOME
from tests.tiny_models import save_folder

# USER_HOME is read as tests.helpers.paths is imported here, before the session fixture below
# replaces FLASHMOE_HOME. Every open of a path inside OUTSIDE (the workspace's research notes beside
# the repository) fails the test that tried, in this process.


def _refuse_outside(event: str, args) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if (os.path.abspath(path) + os.sep).startswith(str(OUTSIDE) + os.sep):
            raise PermissionError(
                f"tests must not read {OUTSIDE} (copy what a test needs into tests/fixtures/ with its source): {path}"
            )


sys.addaudithook(_refuse_outside)


def _build_demo(home: Path) -> None:
    from flashmoe.engine.formats.demo import ensure_demo

    try:
        ensure_demo(home=home, compile_kernels=False)  # the fixture compiles them all
    except Exception as e:  # noqa: BLE001 - the tests that need the demo fail on their own
        print(f"conftest: building the demo failed ({e}); the tests that need it will say why")


@pytest.fixture(scope="session", autouse=True)
def private_flashmoe_home(tmp_path_factory):
    """Every test runs with a FLASHMOE_HOME of its own, so `flashmoe logs` after pytest shows nothing
    the user did not do. The demo model (and the wheel it was built from) are linked in: the user's
    when they exist, else one built for this run, once for all workers. Before any test, the CPU
    kernels are compiled once (numba's disk cache), by whichever worker comes first: otherwise
    every worker and every subprocess that needed a kernel before it was cached compiled it
    again (about 100 s of compiling in all, on two cores)."""
    import fcntl

    from flashmoe.engine.cpu.warm import warm
    from flashmoe.engine.formats.demo import DEMO_NAME, is_current

    demo = f"models/{DEMO_NAME}"
    source = USER_HOME
    shared = tmp_path_factory.getbasetemp().parent  # one folder for all of this run's workers
    with open(shared / "flashmoe-setup.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build = None
        if not is_current(USER_HOME / demo):  # built, and from the fit this checkout ships
            source = shared / "flashmoe-demo-home"
            if not is_current(source / demo):
                build = threading.Thread(target=_build_demo, args=(source,))
                build.start()  # beside the compiling, which runs in two processes of its own
        warm()
        if build is not None:
            build.join()
    home = tmp_path_factory.mktemp("flashmoe-home")
    for sub in (demo, "downloads"):
        if (source / sub).is_dir():
            (home / sub).parent.mkdir(parents=True, exist_ok=True)
            (home / sub).symlink_to(source / sub, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("FLASHMOE_HOME", str(home))
    # No usage files (engine/experts/usage.py) unless a test asks: the demo folder is shared by
    # every worker, and what one test's run learned would change another's cache figures.
    mp.setenv("FLASHMOE_EXPERT_USAGE", "off")
    yield home
    mp.undo()


@pytest.fixture(scope="session")
def demo_references(tmp_path_factory, private_flashmoe_home):
    """(the demo's float32 carve, the dense float32 SmolLM2): mlx-lm folders the demo tests compare
    against, built once for all of this run's workers (about 16 s each)."""
    import fcntl

    from flashmoe.engine.formats.demo import carved_reference, dense_reference

    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / "flashmoe-setup.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        dense = dense_reference(shared / "demo-dense")
        return carved_reference(shared / "demo-carved", dense=dense), dense


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

    def make(
        arch: str, bits: int | None = None, group_size: int = 64, converted: bool = False, expert_layout: str = "auto"
    ) -> Path:
        key = (arch, bits, group_size)
        if key not in cache:
            cache[key] = save_folder(base / f"{arch}-{bits}-{group_size}", arch, bits=bits, group_size=group_size)
        src = cache[key]
        if not converted:
            return src
        out = src.with_name(src.name + "-fm" + ("" if expert_layout == "auto" else f"-{expert_layout}"))
        if not out.exists():
            from flashmoe.engine.formats.convert import convert

            convert(src, out, expert_layout=expert_layout)
        return out

    return make


def pytest_collection_modifyitems(config, items):
    """The slow tier: tests/helpers/tiers.py decides which tests are in it."""
    from tests.helpers.tiers import is_slow, slow_ids

    listed = slow_ids()
    for item in items:
        if is_slow(item.nodeid, listed):
            item.add_marker(pytest.mark.slow)
