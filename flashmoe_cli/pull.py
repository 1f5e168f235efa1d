"""`flashmoe pull org/name[@revision]`: download a model into the Hugging Face cache.

Only what flashmoe reads is fetched (config, safetensors weights and their index, tokenizer and
chat template files; no .bin / .pt / .gguf / .onnx copies, images or subfolders), through
huggingface_hub's own `snapshot_download`, so the files land in the ordinary cache (the one
`-m org/name` looks in, and transformers and mlx-lm share) with its progress bars on stderr.
The snapshot folder is printed on stdout. Every failure (no network, HF_HUB_OFFLINE, no such
repo or revision, a gated repo, a full disk) is one line and exit code 3.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from flashmoe.engine.errors import FlashMoEError
from flashmoe.engine.formats.hf_cache import hub_cache_dir, split_spec

from .exit_codes import ExitCode

ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "chat_template.json",
    "chat_template.jinja",
    "*.jinja",
]
# Top-level files only (original/, onnx/, gguf/ ... hold other formats of the same weights), and not
# Mistral's consolidated.safetensors, a second copy of the weights in its own format.
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]


class PullError(FlashMoEError):
    exit_code = ExitCode.MODEL


def cmd_pull(args) -> int:
    spec = args.repo
    parsed = split_spec(spec)
    if parsed is None:
        from .errors import UsageError

        raise UsageError(
            f"pull {spec}: give a Hugging Face model id, org/name or org/name@revision "
            f"(e.g. mlx-community/Qwen3-30B-A3B-4bit)"
        )
    repo_id, revision = parsed
    path = download(repo_id, revision)
    print(path)
    print(
        f'flashmoe: {repo_id} is in the Hugging Face cache; run it with: flashmoe run -m {spec} "PROMPT"',
        file=sys.stderr,
    )
    return ExitCode.OK


def download(repo_id: str, revision: str | None) -> Path:
    """The snapshot folder, after fetching what is missing from it; PullError otherwise."""
    spec = repo_id + (f"@{revision}" if revision else "")
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS
        )
    except Exception as e:  # noqa: BLE001  (each kind huggingface_hub raises becomes one line)
        problem = explain(e, repo_id, revision, cache)
        if problem is None:
            raise
        cached = _cached(e, repo_id, revision, cache)
        if cached is None:
            raise PullError(f"pull {spec}: {problem}") from None
        print(f"flashmoe: the Hugging Face Hub cannot be reached; {spec} is in the cache already", file=sys.stderr)
        folder = cached
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise PullError(
            f"pull {spec}: the repo has no config.json at its top level, so it is not a model "
            f"flashmoe can load (what was fetched is in {folder})"
        )
    if not any(folder.glob("*.safetensors")):
        raise PullError(
            f"pull {spec}: the repo has no .safetensors weights at its top level (flashmoe reads "
            f"safetensors only; a .gguf file can be given to `flashmoe convert`)"
        )
    return folder


def _cached(e: BaseException, repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """Offline, a snapshot the cache holds under a name huggingface_hub does not resolve (a commit
    hash prefix): -m finds it, so pull has nothing to do."""
    from huggingface_hub import errors as hf

    from flashmoe.engine.formats.hf_cache import snapshot_path

    incomplete = getattr(hf, "IncompleteSnapshotError", ())
    if not isinstance(e, hf.LocalEntryNotFoundError) or isinstance(e, incomplete):
        return None
    try:
        return snapshot_path(repo_id, revision, cache=cache)
    except FlashMoEError:
        return None


def _offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub.constants reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _causes(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def explain(e: BaseException, repo_id: str, revision: str | None, cache: Path) -> str | None:
    """One line for what went wrong, or None for an exception that is not a download failure (a bug)."""
    from huggingface_hub import errors as hf

    chain = list(_causes(e))
    kinds = tuple(type(c) for c in chain)
    rev = revision or "main"
    incomplete = getattr(hf, "IncompleteSnapshotError", ())  # huggingface_hub 1.x and later
    if any(issubclass(k, incomplete) for k in kinds):
        return (
            f"the cached snapshot is incomplete and the Hugging Face Hub cannot be reached "
            f"({'HF_HUB_OFFLINE is set' if _offline() else 'no network'}); run it again with network access"
        )
    if any(issubclass(k, hf.OfflineModeIsEnabled) for k in kinds) or (
        isinstance(e, hf.LocalEntryNotFoundError) and _offline()
    ):
        return (
            f"HF_HUB_OFFLINE is set and {repo_id} (revision {rev}) is not in the Hugging Face cache "
            f"({cache}); unset HF_HUB_OFFLINE to download it"
        )
    if isinstance(e, hf.GatedRepoError):
        return (
            f"{repo_id} is gated: accept its terms at https://huggingface.co/{repo_id} and log in "
            f"(`hf auth login`, or set HF_TOKEN)"
        )
    if isinstance(e, hf.RepositoryNotFoundError):
        return (
            f"no model {repo_id} on the Hugging Face Hub (or it is private: log in with `hf auth login`, "
            f"or set HF_TOKEN)"
        )
    if isinstance(e, hf.RevisionNotFoundError):
        return f"{repo_id} has no revision {rev!r} on the Hugging Face Hub"
    if isinstance(e, hf.LocalEntryNotFoundError):
        cause = next((c for c in chain[1:]), None)
        why = f" ({_first_line(cause)})" if cause is not None else ""
        return (
            f"cannot reach the Hugging Face Hub{why} and {repo_id} (revision {rev}) is not in the cache "
            f"({cache}); check the network (or HF_ENDPOINT) and run it again"
        )
    if isinstance(e, hf.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return f"the Hugging Face Hub answered {f'HTTP {status}' if status else 'with an error'} ({_first_line(e)})"
    if isinstance(e, hf.HFValidationError):
        return f"not a valid Hugging Face model id or revision ({_first_line(e)})"
    if isinstance(e, OSError):  # a full disk, an unwritable cache folder...
        where = getattr(e, "filename", None) or cache
        return f"cannot write {where}: {e.strerror or _first_line(e)}"
    if any(
        type(c).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3") for c in chain
    ):  # a network error huggingface_hub let through (a proxy error...)
        return f"cannot reach the Hugging Face Hub ({_first_line(e)}); check the network (or HF_ENDPOINT)"
    return None
