"""Issue 41, items 2, 12 and 13: flashmoe's own state. A prompt cache that cannot be saved costs the
cache and never the engine; FLASHMOE_HOME and what is in it are private to the user; damaged or
planted files in kv/ are skipped and deleted with one line, never a hang, a traceback or a write
through a symlink.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading

import pytest

from flashmoe.engine.events import EngineFailed, GenerationFinished
from flashmoe.engine.runtime.generate import GenerationRequest
from flashmoe.engine.runtime.sampling import SamplingParams
from tests.helpers.paths import ROOT
from tests.helpers.cli import run_cli

GREEDY = SamplingParams(temperature=0.0)
SYSTEM = {"role": "system", "content": "You answer in one short sentence. " * 8}


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def finished(engine, content: str, session="c1", wait: float = 120):
    """One request to its last event; fails (instead of hanging) if the engine never answers."""
    import queue

    handle = engine.submit(
        GenerationRequest(messages=[SYSTEM, {"role": "user", "content": content}], max_tokens=3, sampling=GREEDY),
        session=session,
    )
    while True:
        try:
            ev = handle.get(timeout=wait)
        except queue.Empty:
            pytest.fail(f"no answer in {wait:g} s: the engine thread is gone")
        if isinstance(ev, (GenerationFinished, EngineFailed)):
            return ev


# ---- item 2: a failed prompt-cache save never ends the engine thread -------------------------------


@pytest.mark.parametrize("damage", ["removed", "a file", "read-only"])
@pytest.mark.parametrize("session", ["c1", None], ids=["conversation", "pool"])
def test_a_prompt_cache_that_cannot_be_saved_costs_the_cache_not_the_engine(
    model_factory, tmp_path, damage, session, caplog
):
    from flashmoe.engine.runtime.engine import Engine

    kv = tmp_path / "kv"
    engine = Engine(model_factory("qwen3_moe"), prompt_cache_dir=kv)
    try:
        engine.wait_loaded()
        shutil.rmtree(kv)
        if damage == "a file":
            kv.write_text("not a folder")
        elif damage == "read-only":
            kv.mkdir()
            kv.chmod(0o500)
            if os.geteuid() == 0:  # root writes anyway: a folder it cannot create files in
                kv.rmdir()
                os.symlink("/proc/self/fdinfo", kv)
        first = finished(engine, "Tell me about the sea.", session)
        second = finished(engine, "Tell me about the sky.", session, wait=30)
        assert isinstance(first, GenerationFinished) and isinstance(second, GenerationFinished)
    finally:
        engine.close()
    assert "prompt cache not saved" in caplog.text


def test_a_full_disk_while_saving_a_prompt_cache(model_factory, tmp_path):
    """RLIMIT_FSIZE as `ulimit -f` sets it: MLX's write fails with a RuntimeError, not an OSError."""
    code = (
        "import resource, sys\n"
        "from flashmoe.engine.runtime.engine import Engine\n"
        "from tests.test_hardening_state import finished\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "e = Engine(sys.argv[1], prompt_cache_dir=sys.argv[2])\n"
        "e.wait_loaded()\n"
        "print(type(finished(e, 'Tell me about the sea.', wait=60)).__name__)\n"
        "print(type(finished(e, 'Tell me about the sky.', wait=60)).__name__, flush=True)\n"
        "e.close()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(model_factory("qwen3_moe")), str(tmp_path / "kv")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.stdout.split() == ["GenerationFinished", "GenerationFinished"], r.stderr[-3000:]
    assert "prompt cache not saved" in r.stderr


# ---- item 12: FLASHMOE_HOME 0700, its files 0600 ---------------------------------------------------


def test_a_new_flashmoe_home_and_its_files_are_private(tmp_path):
    home = tmp_path / "state"
    r = run_cli("run", "--engine", "fake", "hello", env={"FLASHMOE_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert mode(home) == 0o700
    files = [p for p in home.iterdir() if p.name.startswith("logs.db")]
    assert files and all(mode(p) == 0o600 for p in files), {p.name: oct(mode(p)) for p in files}


def test_an_existing_home_and_its_files_are_made_private(tmp_path):
    home = tmp_path / "state"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    r = run_cli("run", "--engine", "fake", "hello", env={"FLASHMOE_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    for p in [home, *home.iterdir()]:
        if p.is_file():
            p.chmod(0o644)
    home.chmod(0o755)
    r = run_cli("run", "--engine", "fake", "again", env={"FLASHMOE_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert mode(home) == 0o700
    assert all(mode(p) == 0o600 for p in home.iterdir() if p.is_file()), [
        (p.name, oct(mode(p))) for p in home.iterdir()
    ]
    assert "private" in r.stderr  # said once, when it changed something


def test_the_history_file_is_private(tmp_path):
    from flashmoe.cli.repl import open_history

    path = tmp_path / "state" / "history"
    open_history(path).append_string("a secret typed at the prompt")
    assert mode(path) == 0o600 and mode(path.parent) == 0o700


@pytest.fixture(scope="module")
def loaded(model_factory):
    from flashmoe.engine.runtime.loader import load

    return load(model_factory("qwen3_moe"))


def saved_session(loaded, text="Tell me about the sea."):
    from flashmoe.engine.runtime.decode import prefill
    from flashmoe.engine.runtime.generate import Session, render_prompt

    ids = render_prompt(loaded, GenerationRequest(messages=[SYSTEM, {"role": "user", "content": text}]))
    s = Session(loaded)
    s.prepare(ids)
    for _ in prefill(loaded.model, s, ids, 512, threading.Event()):
        pass
    return s, ids


def test_saved_prompt_caches_are_private(loaded, tmp_path):
    from flashmoe.engine.runtime.prompt_cache import DiskPromptCache

    disk = DiskPromptCache(tmp_path / "kv", loaded.path)
    disk.save(saved_session(loaded)[0])
    files = list((tmp_path / "kv").iterdir())
    assert mode(tmp_path / "kv") == 0o700 and len(files) == 1 and mode(files[0]) == 0o600


# ---- item 13: damaged kv/ files are skipped and deleted; a planted .partial is not written through --


def safetensors_with(header) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


DAMAGED = {
    "header a list": safetensors_with([1, 2, 3]),
    "metadata a string": safetensors_with({"__metadata__": "x"}),
    "metadata values not strings": safetensors_with({"__metadata__": {"0.model": 5}}),
    "nested 100,000 deep": safetensors_with(b"[" * 100_000 + b"]" * 100_000),
    "not JSON": safetensors_with(b"\xff\xfe{"),
    "header past the end": struct.pack("<Q", 1 << 20) + b"{}",
    "header length absurd": struct.pack("<Q", 1 << 62),
    "too short": b"\x01",
    "tokens not numbers": None,  # these two are made from a real cache, below
    "tensor past the end": None,
}


def damaged_file(kind: str, good: bytes) -> bytes:
    if DAMAGED[kind] is not None:
        return DAMAGED[kind]
    n = struct.unpack("<Q", good[:8])[0]
    header = json.loads(good[8 : 8 + n])
    if kind == "tokens not numbers":
        header["__metadata__"]["0.tokens"] = "1,x,3"
    else:  # a tensor whose data offsets lie past the end of the file
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 1 << 30
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + good[8 + n :]


@pytest.mark.parametrize("kind", [*DAMAGED, "fifo", "directory", "symlink out"])
def test_a_damaged_saved_cache_is_skipped_and_deleted_with_one_line(loaded, tmp_path, kind, caplog):
    from flashmoe.engine.runtime.prompt_cache import DiskPromptCache

    kv = tmp_path / "kv"
    session, ids = saved_session(loaded)
    DiskPromptCache(kv, loaded.path).save(session)
    (good,) = kv.glob("*.safetensors")
    bad = kv / ("0" * 32 + ".safetensors")
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "directory":
        bad.mkdir()
    elif kind == "symlink out":
        target = tmp_path / "elsewhere.safetensors"
        target.write_bytes(good.read_bytes())
        bad.symlink_to(target)
    else:
        bad.write_bytes(damaged_file(kind, good.read_bytes()))
        good.unlink()  # the damaged one is the only candidate, so load() reads it too
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(disk=DiskPromptCache(kv, loaded.path)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "reading kv/ hung"
    disk = box["disk"]
    f, _ = disk.best(ids)
    reused = disk.load(f, loaded) if f is not None else None
    assert (reused is not None) == (kind in ("fifo", "directory", "symlink out"))  # the good one, where kept
    lines = [r.getMessage() for r in caplog.records if bad.name in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert ("deleted" in lines[0]) != (kind == "directory"), lines[0]  # a folder is left where it is
    assert not os.path.lexists(bad) or kind == "directory"
    if kind == "symlink out":
        assert target.exists()  # the link went, not what it pointed at


def test_a_symlink_at_the_partial_name_is_not_written_through(loaded, tmp_path):
    from flashmoe.engine.runtime.prompt_cache import DiskPromptCache

    kv = tmp_path / "kv"
    disk = DiskPromptCache(kv, loaded.path)
    session, _ = saved_session(loaded)
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    # every name a save could pick for its temporary file, planted
    import hashlib

    tokens = list(session.tokens)
    key = hashlib.sha256(f"{disk.model}:{tokens}".encode()).hexdigest()[:32]
    (kv / f"{key}.partial.safetensors").symlink_to(victim)
    disk.save(session)
    assert victim.read_text() == "keep\n"
    assert [p.name for p in kv.glob("*.safetensors") if ".partial" not in p.name] == [f"{key}.safetensors"]
