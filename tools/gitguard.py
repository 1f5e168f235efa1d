"""Repository metadata must not be written by tools: a directory holding HEAD with objects/ or
refs/ is a git directory to git, and its `config` chooses programs git runs (core.fsmonitor,
hooks, pagers). A model that could write one into the workspace could make an allowed `git status`
run anything. The runner also neutralises config from the workspace (tools/runner.py); this is the
check on writes.
"""

from __future__ import annotations

import os
import re
import subprocess
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


# Keys of a repository's own config that make git run a program, or reach one (a driver for the
# files .gitattributes names, an external diff, an ssh or proxy command, a credential helper, an
# alias, an include that may set any of these). The runner's command-line guard (runner.GIT_GUARD)
# outranks six of them; these are too many, some are lists and driver names are the repository's
# own, so instead an allow rule does not cover git in a repository whose config sets one.
_PROGRAM_KEY = re.compile(
    r"^(?:core\.(?:sshcommand|gitproxy|askpass|editor|pager|fsmonitor|hookspath|attributesfile)"
    r"|diff\.external|diff\..+\.(?:command|textconv)|filter\..+\.(?:clean|smudge|process)|merge\..+\.driver"
    r"|gpg(?:\..+)?\.program|credential\..*helper|include\.path|includeif\..+\.path|alias\..+|sequence\.editor"
    r"|pager\..+|interactive\.difffilter|uploadpack\..+|protocol\..*allow"
    r"|remote\..+\.(?:uploadpack|receivepack|vcs|proxy)"
    r"|url\..+\.(?:insteadof|pushinsteadof)|ssh\.variant|http\..*proxy|difftool\..+|mergetool\..+|web\.browser"
    r"|browser\..+\.(?:cmd|path)|sendemail\..+)$",
    re.IGNORECASE,
)


def program_keys(workspace: Path) -> list[str]:
    """The keys of the workspace's repository config (.git/config and what it includes) that name
    a program git would run: [] outside a repository or without git. Read by git itself, with no
    system or global config and no inherited GIT_* variables; reading config runs nothing."""
    from flashmoe.tools.runner import guarded_env

    env = guarded_env({k: v for k, v in os.environ.items() if not k.startswith("GIT_")})
    try:
        out = subprocess.run(
            ["git", "-C", str(workspace), "config", "--local", "--includes", "--name-only", "--list"],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [k for k in out.stdout.split() if _PROGRAM_KEY.match(k)]
