"""`-m org/name`: a model in the local Hugging Face cache, found by looking at the filesystem only.

The cache is huggingface_hub's own layout (what `snapshot_download`, `hf download` and
transformers write):

    $HF_HUB_CACHE/models--org--name/
        refs/main                    a text file holding a commit hash (also refs/<tag or branch>)
        snapshots/<commit>/...       the model's files (symlinks into blobs/)
        blobs/<sha>

The cache folder is found the way huggingface_hub.constants finds it: $HF_HUB_CACHE, else the
legacy $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub. Read from the environment at each call (huggingface_hub reads it once,
at import), and without importing huggingface_hub or MLX, so the CLI can call it cheaply.

Nothing here touches the network: a model that is not on disk is one ModelNotFoundError line
that says how to get it (`flashmoe pull`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flashmoe.engine.errors import ModelLoadError

DEFAULT_REVISION = "main"  # huggingface_hub.constants.DEFAULT_REVISION
REPO_ID_SEPARATOR = "--"  # huggingface_hub.constants.REPO_ID_SEPARATOR
MIN_PREFIX = 4  # a commit hash prefix shorter than this is not looked up (as git)
SHORT = 12  # commit hashes in messages

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_ID = re.compile(rf"^{_PART}/{_PART}$")
_HEX = re.compile(r"^[0-9a-f]+$")


class ModelNotFoundError(ModelLoadError):
    """`-m org/name` names neither a folder nor a model in the Hugging Face cache (exit code 3)."""

    def __init__(self, spec: str, problem: str):
        super().__init__(f"model {spec!r}", problem)
        self.spec = spec


def hub_cache_dir(environ=None) -> Path:
    """The Hugging Face hub cache folder, by huggingface_hub's rules (HF_HUB_CACHE wins over HF_HOME)."""
    env = os.environ if environ is None else environ

    def expand(p: str) -> str:
        return os.path.expandvars(os.path.expanduser(p))

    home = expand(
        env.get("HF_HOME")
        or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    )
    legacy = env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(expand(env.get("HF_HUB_CACHE") or legacy))


def repo_folder_name(repo_id: str) -> str:
    """models--org--name, as huggingface_hub.file_download.repo_folder_name(repo_type="model")."""
    return REPO_ID_SEPARATOR.join(["models", *repo_id.split("/")])


def split_spec(spec: str) -> tuple[str, str | None] | None:
    """("org/name", revision or None) when `spec` reads as a Hub model id (org/name or
    org/name@revision); None when it reads as a path (./x, /x, ~/x, x, a/b/c...)."""
    repo_id, at, revision = spec.partition("@")
    if not _REPO_ID.match(repo_id) or ".." in repo_id or REPO_ID_SEPARATOR in repo_id:
        return None
    if at and not _safe_revision(revision):
        return None
    return repo_id, (revision if at else None)


def _safe_revision(revision: str) -> bool:
    """A branch, tag or commit that stays inside refs/ or snapshots/ when joined to them."""
    parts = revision.split("/")
    return (
        bool(revision)
        and "\\" not in revision
        and "\0" not in revision
        and all(p and p not in (".", "..") for p in parts)
    )


def resolve(spec: str, environ=None) -> str:
    """The folder `-m spec` means: `spec` itself when it exists on disk or does not read as a Hub
    model id (the loader then names what is wrong with it); otherwise the cached snapshot of
    org/name (raises ModelNotFoundError when there is none)."""
    if not spec or os.path.lexists(spec):
        return spec
    parsed = split_spec(spec)
    if parsed is None:
        return spec
    return str(snapshot_path(parsed[0], parsed[1], environ=environ))


def snapshot_path(repo_id: str, revision: str | None = None, *, cache: Path | None = None, environ=None) -> Path:
    """snapshots/<commit> of repo_id in the cache: the commit refs/<revision> names, a commit hash
    or a unique prefix of one; with no revision, refs/main's, or the latest snapshot when there is
    no refs/main."""
    cache = Path(cache) if cache is not None else hub_cache_dir(environ)
    spec = repo_id + (f"@{revision}" if revision is not None else "")
    pull = f"flashmoe pull {spec}"
    repo = cache / repo_folder_name(repo_id)
    if not repo.is_dir():
        raise ModelNotFoundError(
            spec, f"not a folder and not in the Hugging Face cache ({cache}); download it with: {pull}"
        )
    snaps = _snapshots(repo)
    refs = _refs(repo)
    if not snaps:
        held = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in _entries(repo))) or "nothing"
        raise ModelNotFoundError(
            spec,
            f"in the Hugging Face cache ({repo}) but with no snapshot "
            f"(the folder holds: {held}); download it with: {pull}",
        )
    there = _what_is_there(refs, snaps)
    name = revision or DEFAULT_REVISION
    if name in refs:
        commit = refs[name]
        if commit in snaps:
            return repo / "snapshots" / commit
        raise ModelNotFoundError(
            spec,
            f"refs/{name} in the Hugging Face cache ({repo}) names commit "
            f"{commit[:SHORT]}, which has no snapshot ({there}); download it with: {pull}",
        )
    if revision is None:
        return repo / "snapshots" / max(snaps, key=lambda s: _mtime(repo / "snapshots" / s))
    if revision in snaps:
        return repo / "snapshots" / revision
    if len(revision) >= MIN_PREFIX and _HEX.match(revision):
        matches = sorted(s for s in snaps if s.startswith(revision))
        if len(matches) == 1:
            return repo / "snapshots" / matches[0]
        if matches:
            raise ModelNotFoundError(
                spec,
                f"revision {revision!r} is the start of {len(matches)} cached commits "
                f"({', '.join(m[:SHORT] for m in matches)}); give more of the hash",
            )
    raise ModelNotFoundError(
        spec, f"no revision {revision!r} in the Hugging Face cache ({repo}: {there}); download it with: {pull}"
    )


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _snapshots(repo: Path) -> set[str]:
    return {p.name for p in _entries(repo / "snapshots") if p.is_dir()}


def _refs(repo: Path) -> dict[str, str]:
    """Every refs/ file (refs/main, refs/v1.0, refs/refs/pr/1 ...) and the commit it holds."""
    out = {}
    root = repo / "refs"
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            try:
                commit = p.read_text(encoding="utf-8", errors="replace").strip()
            except OSError:
                continue
            if commit:
                out[p.relative_to(root).as_posix()] = commit
    return out


def _what_is_there(refs: dict[str, str], snaps: set[str]) -> str:
    r = ", ".join(f"{k} -> {v[:SHORT]}" for k, v in sorted(refs.items())) or "none"
    s = ", ".join(sorted(x[:SHORT] for x in snaps)) or "none"
    return f"refs: {r}; snapshots: {s}"


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0
