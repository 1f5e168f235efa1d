"""`-m org/name` from the local Hugging Face cache, and `flashmoe pull`.

The caches here are built offline in tmp_path in huggingface_hub's own layout: folder names from
its `repo_folder_name`, blobs with snapshot symlinks into them, refs/ files, and checked with its
`scan_cache_dir`, so what is tested is the layout huggingface_hub writes, not one of ours.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants, scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

from flashmoe.engine.formats import hf_cache
from flashmoe.engine.formats.hf_cache import ModelNotFoundError, hub_cache_dir, resolve, snapshot_path, split_spec
from tests.helpers.cli import run_cli

REPO = "tiny-org/tiny-moe"
C1 = "1111aaaa" + "0" * 32  # commit hashes: 40 hex digits
C2 = "2222bbbb" + "0" * 32
C3 = "2222cccc" + "0" * 32


def repo_dir(cache: Path, repo_id: str = REPO) -> Path:
    return cache / repo_folder_name(repo_id=repo_id, repo_type="model")


def add_snapshot(
    cache: Path,
    commit: str,
    files: dict[str, bytes] | Path,
    *,
    refs=(),
    repo_id: str = REPO,
    mtime: float | None = None,
) -> Path:
    """snapshots/<commit>/ of repo_id as huggingface_hub writes it: each file a relative symlink
    to blobs/<sha256>; each name in refs a refs/ file holding the commit (no newline, as theirs)."""
    repo = repo_dir(cache, repo_id)
    if isinstance(files, Path):
        files = {f.name: f.read_bytes() for f in files.iterdir() if f.is_file()}
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    if mtime is not None:
        os.utime(snap, (mtime, mtime))
    return snap


def marker(commit: str) -> dict[str, bytes]:
    return {"config.json": json.dumps({"model_type": "qwen3_moe", "commit": commit}).encode()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache that HF_HUB_CACHE points at (HF_HOME elsewhere, so only the winner counts)."""
    c = tmp_path / "hub"
    c.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(c))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # each test says whether it is offline
        monkeypatch.delenv(k, raising=False)
    return c


@pytest.fixture(scope="module")
def tiny(model_factory):
    """A real tiny mlx-lm model folder (4-bit qwen3_moe with its tokenizer)."""
    return model_factory("qwen3_moe", 4)


def cli_env(cache: Path) -> dict:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# --- finding a snapshot ---------------------------------------------------------------------------


def test_refs_main_names_the_snapshot_not_the_newest(cache):
    now = time.time()
    add_snapshot(cache, C1, marker(C1), refs=["main"], mtime=now - 100)
    add_snapshot(cache, C2, marker(C2), mtime=now)  # newer, but refs/main does not name it
    info = scan_cache_dir(cache)  # huggingface_hub reads our cache as its own
    (r,) = info.repos
    assert r.repo_id == REPO and {rev.commit_hash for rev in r.revisions} == {C1, C2}
    assert {rev.commit_hash: set(rev.refs) for rev in r.revisions}[C1] == {"main"}
    assert resolve(REPO) == str(repo_dir(cache) / "snapshots" / C1)
    assert json.loads(Path(resolve(REPO), "config.json").read_text())["commit"] == C1


def test_without_refs_main_the_latest_snapshot(cache):
    now = time.time()
    add_snapshot(cache, C2, marker(C2), mtime=now)
    add_snapshot(cache, C1, marker(C1), refs=["v1.0"], mtime=now - 100)
    assert Path(resolve(REPO)).name == C2


def test_at_branch_tag_and_commit_prefix(cache):
    add_snapshot(cache, C1, marker(C1), refs=["main"])
    add_snapshot(cache, C2, marker(C2), refs=["v2", "feature/x"])
    add_snapshot(cache, C3, marker(C3), refs=["refs/pr/3"])  # huggingface_hub keeps a PR's ref as refs/refs/pr/3
    snaps = repo_dir(cache) / "snapshots"
    assert resolve(f"{REPO}@v2") == str(snaps / C2)
    assert resolve(f"{REPO}@feature/x") == str(snaps / C2)
    assert resolve(f"{REPO}@refs/pr/3") == str(snaps / C3)
    assert resolve(f"{REPO}@main") == str(snaps / C1)
    assert resolve(f"{REPO}@{C3}") == str(snaps / C3)  # a full hash
    assert resolve(f"{REPO}@2222c") == str(snaps / C3)  # a unique prefix
    assert resolve(f"{REPO}@1111") == str(snaps / C1)
    with pytest.raises(ModelNotFoundError) as e:
        resolve(f"{REPO}@2222")  # the start of two commits
    assert "2222bbbb" in str(e.value) and "2222cccc" in str(e.value) and "more of the hash" in str(e.value)
    with pytest.raises(ModelNotFoundError) as e:
        resolve(f"{REPO}@v9")
    msg = str(e.value)  # names what is there, and how to get what is not
    assert msg.startswith(f"model '{REPO}@v9': no revision 'v9'") and "\n" not in msg
    assert "v2 -> 2222bbbb" in msg and "main -> 1111aaaa" in msg and f"flashmoe pull {REPO}@v9" in msg
    with pytest.raises(ModelNotFoundError):
        resolve(f"{REPO}@111")  # shorter than 4: not taken as a hash prefix


def test_hf_hub_cache_wins_over_hf_home(tmp_path, monkeypatch):
    home, hub = tmp_path / "home", tmp_path / "elsewhere"
    add_snapshot(home / "hub", C1, marker(C1), refs=["main"])
    add_snapshot(hub, C2, marker(C2), refs=["main"])
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    assert Path(resolve(REPO)).name == C1  # $HF_HOME/hub
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert Path(resolve(REPO)).name == C2  # HF_HUB_CACHE wins


def test_cache_folder_is_huggingface_hubs_and_no_mlx_is_imported(tmp_path):
    """hub_cache_dir() against huggingface_hub.constants itself (read at its import: reloaded per
    environment), and engine.hf_cache imports neither MLX nor huggingface_hub."""
    cases = [
        {},
        {"HF_HOME": "/h"},
        {"HF_HOME": "/h", "HF_HUB_CACHE": "/c"},
        {"XDG_CACHE_HOME": "/x"},
        {"HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HOME": "/h"},
        {"HF_HOME": "~/hf"},
    ]
    code = f"""
import importlib, json, os, sys, types
import flashmoe.engine.formats.hf_cache as h
heavy = [m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "huggingface_hub", "numpy")]
import huggingface_hub.constants as c
out = []
for env in {cases!r}:
    for k in ("HF_HOME", "HF_HUB_CACHE", "XDG_CACHE_HOME", "HUGGINGFACE_HUB_CACHE"):
        os.environ.pop(k, None)
    os.environ.update(env)
    importlib.reload(c)
    out.append([str(h.hub_cache_dir()), c.HF_HUB_CACHE])
print(json.dumps({{"heavy": heavy, "dirs": out}}))
"""
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["heavy"] == []
    for ours, theirs in got["dirs"]:
        assert ours == theirs
    assert got["dirs"][2][0] == "/c"
    assert (hf_cache.DEFAULT_REVISION, hf_cache.REPO_ID_SEPARATOR) == (
        constants.DEFAULT_REVISION,
        constants.REPO_ID_SEPARATOR,
    )
    assert hf_cache.repo_folder_name(REPO) == repo_folder_name(repo_id=REPO, repo_type="model")
    assert hub_cache_dir({"HF_HOME": "/h", "HF_HUB_CACHE": "/c"}) == Path("/c")
    assert hub_cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")


def test_paths_are_paths_and_a_folder_wins(cache, tmp_path, monkeypatch):
    add_snapshot(cache, C1, marker(C1), refs=["main"])
    monkeypatch.chdir(tmp_path)
    assert resolve(f"./{REPO}") == f"./{REPO}"  # not a folder, but written as a path: no cache lookup
    for spec in ("/abs/x/y", "~/x/y", "a/b/c", "name", "../x/y", "x/y@", "x/y@../../z"):
        assert split_spec(spec) is None and resolve(spec) == spec
    (tmp_path / REPO).mkdir(parents=True)
    assert resolve(REPO) == REPO  # the local folder named like org/name wins over the cache
    assert split_spec("org/name@v1.0") == ("org/name", "v1.0") and split_spec("org/name") == ("org/name", None)


def test_no_snapshot_is_one_line_naming_what_is_there(cache):
    repo = repo_dir(cache)
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(C1)  # an interrupted first download: ref written, no snapshot yet
    with pytest.raises(ModelNotFoundError) as e:
        snapshot_path(REPO)
    msg = str(e.value)
    assert msg == (
        f"model '{REPO}': in the Hugging Face cache ({repo}) but with no snapshot (the folder "
        f"holds: blobs/, refs/); download it with: flashmoe pull {REPO}"
    )
    assert e.value.exit_code == 3
    add_snapshot(cache, C2, marker(C2))
    with pytest.raises(ModelNotFoundError) as e:  # refs/main names a commit that has no snapshot
        snapshot_path(REPO)
    assert "refs/main" in str(e.value) and C1[:12] in str(e.value) and C2[:12] in str(e.value)


# --- the commands ---------------------------------------------------------------------------------


def test_info_and_run_from_the_cache(cache, tiny):
    from flashmoe.engine.runtime.tokenizer import Tokenizer
    from tests.helpers.streaming import greedy
    from tests.tiny_models import reference_model

    snap = add_snapshot(cache, C1, tiny, refs=["main"])
    assert all(f.is_symlink() for f in snap.iterdir()) and (snap / "model.safetensors").exists()
    ((rev,),) = [r.revisions for r in scan_cache_dir(cache).repos]
    assert rev.commit_hash == C1 and rev.nb_files == len(list(tiny.iterdir()))

    r = run_cli("info", "-m", REPO, "--json", env=cli_env(cache))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["path"] == str(snap) and "direct" in d["format"] and d["model_type"] == "qwen3_moe"

    r = run_cli(
        "run", "-m", REPO, "hi", "--max-tokens", "3", "--raw", "--json", "-n", "--kernels", "mlx", env=cli_env(cache)
    )  # mlx kernels: mlx-lm's own arithmetic, and half the start-up time
    assert r.returncode == 0, r.stderr
    tokens = [e["id"] for e in map(json.loads, r.stdout.splitlines()) if e["event"] == "token"]
    ids = Tokenizer.from_folder(snap).encode("hi", add_special_tokens=True)
    assert tokens == greedy(reference_model(tiny), ids, 3)  # the snapshot's weights, greedily


def test_convert_from_the_cache(cache, tiny, tmp_path):
    from flashmoe.engine.formats.convert import is_converted

    add_snapshot(cache, C1, tiny, refs=["main"])
    add_snapshot(cache, C2, {"config.json": b"{}"}, refs=["broken"])  # @broken would fail to convert
    out = tmp_path / "out-fm"
    r = run_cli("convert", f"{REPO}@1111aaaa", out, env=cli_env(cache))
    assert r.returncode == 0, r.stderr
    assert is_converted(out) and json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert not (out / "model.safetensors").exists()  # packed, not a copy of the snapshot


def test_not_in_the_cache_is_one_line_and_exit_3(cache):
    r = run_cli("run", "-m", REPO, "hi", "-n", env=cli_env(cache))
    assert r.returncode == 3 and r.stdout == ""
    assert one_line(r.stderr) == (
        f"flashmoe: error: model '{REPO}': not a folder and not in the Hugging Face "
        f"cache ({cache}); download it with: flashmoe pull {REPO}"
    )


def test_every_model_command_resolves_through_the_cache(cache, tmp_path, monkeypatch, capsys):
    """info / verify / bench speed / convert / run / chat / agent / bench tools all reach the lookup
    (in-process: each fails with the same one line for a model that is not there)."""
    import signal

    from flashmoe.cli import cli, models, startup

    monkeypatch.setattr(startup, "make_engine", lambda args: models.resolve_model(args.model) and None)
    script = tmp_path / "session.jsonl"
    script.write_text('{"role": "user", "content": "hi"}\n')
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:  # run, chat and agent install their own SIGTERM / SIGHUP handlers: pytest's are put back below
        for argv in (
            ["info", REPO],
            ["info", "-m", REPO],
            ["verify", "-m", REPO],
            ["bench", "speed", "-m", REPO],
            ["convert", REPO, "out"],
            ["run", "-n", "-m", REPO, "hi"],
            ["chat", "-n", "-m", REPO],
            ["agent", "-n", "-m", REPO, "--tools", "builtin", "--script", str(script)],
            ["bench", "tools", "-m", REPO],
        ):
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi\n")))  # piped: chat answers once
            assert cli.main(argv) == 3, argv
            err = capsys.readouterr().err
            assert err.strip().endswith(f"download it with: flashmoe pull {REPO}"), (argv, err)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert cli.main(["info", "a/b", "-m", "c/d"]) == 2


# --- pull -------------------------------------------------------------------------------------------


def test_pull_offline_is_one_line_and_writes_nothing(cache):
    r = run_cli("pull", f"{REPO}@v1", env=cli_env(cache))
    assert r.returncode == 3 and r.stdout == ""
    line = one_line(r.stderr)
    assert line.startswith(f"flashmoe: error: pull {REPO}@v1: HF_HUB_OFFLINE is set") and str(cache) in line
    assert not (repo_dir(cache) / "snapshots").exists()
    r = run_cli(
        "pull", REPO, env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    )  # nothing listens there: no network
    assert r.returncode == 3 and r.stdout == ""
    assert "cannot reach the Hugging Face Hub" in one_line(r.stderr)
    assert not (repo_dir(cache) / "snapshots").exists()


REPO_FILES = [
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "merges.txt",
    "vocab.json",
    "pytorch_model.bin",
    "model.gguf",
    "consolidated.safetensors",
    "original/model.pt",
    "original/model.safetensors",
    "onnx/model.onnx",
    "assets/logo.png",
    "README.md",
    ".gitattributes",
]
NEEDED = {
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "merges.txt",
    "vocab.json",
}


def test_pull_fetches_only_what_a_model_needs(cache, monkeypatch, capsys):
    """snapshot_download's patterns, applied by huggingface_hub's own filter to a repo's file list."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from flashmoe.cli import cli

    calls = []

    def fake_snapshot_download(
        repo_id, *, revision=None, cache_dir=None, allow_patterns=None, ignore_patterns=None, **kw
    ):
        calls.append((repo_id, revision, cache_dir))
        wanted = list(filter_repo_objects(REPO_FILES, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        return str(
            add_snapshot(
                Path(cache_dir),
                C1,
                {f: b"{}" for f in wanted},
                refs=[revision or constants.DEFAULT_REVISION],
                repo_id=repo_id,
            )
        )

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert cli.main(["pull", f"{REPO}@v1"]) == 0
    out, err = capsys.readouterr()
    snap = repo_dir(cache) / "snapshots" / C1
    assert out == f"{snap}\n" and f"flashmoe run -m {REPO}@v1" in err
    assert calls == [(REPO, "v1", cache)]
    assert {p.name for p in snap.iterdir()} == NEEDED
    assert resolve(f"{REPO}@v1") == str(snap)  # and -m finds what pull wrote
    assert cli.main(["pull", "./not/an-id"]) == 2 and "org/name" in capsys.readouterr().err


def test_pull_offline_of_a_cached_commit_prefix_is_the_snapshot(cache, monkeypatch, capsys):
    """huggingface_hub knows no commit prefixes: offline, pull finds the snapshot as -m does."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from flashmoe.cli import cli

    def offline(repo_id, **kw):
        raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder ...")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    snap = add_snapshot(cache, C1, {"config.json": b"{}", "model.safetensors": b"{}"}, refs=["main"])
    assert cli.main(["pull", f"{REPO}@1111aaaa"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{snap}\n" and "cannot be reached" in err
    assert cli.main(["pull", f"{REPO}@v2"]) == 3  # not cached under that name: the one line
    assert "cannot reach the Hugging Face Hub" in one_line(capsys.readouterr().err)
