"""Repository metadata must not be written by tools: a directory holding HEAD with objects/ or
refs/ is a git directory to git, and its `config` chooses programs git runs (core.fsmonitor,
hooks, pagers). A model that could write one into the workspace could make an allowed `git status`
run anything. The runner also neutralises config from the workspace (tools/runner.py); this is the
check on writes.
"""
from __future__ import annotations

import os
from pathlib import Path

# Entries git's repository discovery looks for (setup.c: is_git_directory), lower-cased for
# case-insensitive file systems.
_MARKERS = frozenset({"objects", "refs", "commondir"})


def _names(d: Path) -> set[str]:
    try:
        return {n.lower() for n in os.listdir(d)}
    except OSError:
        return set()


def looks_like_git_dir(d: Path, extra: str | None = None) -> bool:
    """Whether git would take d for a repository (with `extra` added to its entries)."""
    names = _names(d) | ({extra.lower()} if extra else set())
    return "head" in names and bool(names & _MARKERS)


def git_metadata_write(root: Path, path: Path) -> Path | None:
    """The directory that writing `path` would make (or keep) a git directory, or None.

    Every directory between the workspace root and the file is checked with the entry the write
    would add, so `sub/HEAD`, `sub/refs/x` and `sub/objects/ab/cd` each count for `sub`.
    """
    try:
        rel = path.relative_to(root)
    except ValueError:
        return None
    parts = rel.parts
    d = root
    for part in parts:
        if looks_like_git_dir(d, part):
            return d
        d = d / part
    return None
