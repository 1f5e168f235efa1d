"""Opening workspace files without a window between the check and the use (TOCTOU).

The sandbox resolves a path (symlinks followed) and checks the result. Between that check and the
open, anything running beside the agent could swap a directory or the file itself for a symlink
leading out. So the file is opened by walking the *resolved* path from a descriptor of its root,
one component at a time with O_NOFOLLOW: the resolved path has no symlinks in it, so meeting one
means it changed after the check, and the open is refused.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flashmoe.tools.errors import PathRefused

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _changed(shown: str) -> PathRefused:
    return PathRefused(
        f"path '{shown}' changed after it was checked (a component is now a symlink or is "
        "no longer a directory); not followed"
    )


def open_beneath(
    root: Path, resolved: Path, flags: int, *, shown: str, mode: int = 0o666, make_dirs: bool = False
) -> int:
    """A descriptor for `resolved` (inside `root`) opened with `flags`, walking from root with no
    symlink followed at any component. Non-blocking, so a FIFO or device never hangs the open."""
    parts = resolved.relative_to(root).parts
    fd = os.open(root, _DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                if last:
                    new = os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC | _NONBLOCK, mode, dir_fd=fd)
                else:
                    new = _open_dir(part, fd, make_dirs)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise _changed(shown) from None
                raise
            os.close(fd)
            fd = new
        return os.dup(fd)
    finally:
        os.close(fd)


def _open_dir(name: str, dir_fd: int, make: bool) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not make:
            raise
        os.mkdir(name, 0o777, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def regular_file(fd: int, shown: str) -> os.stat_result:
    """fstat of fd, refusing anything but a regular file; clears O_NONBLOCK for normal reads."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise PathRefused(f"{shown} is not a regular file")
    if _NONBLOCK:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    return st


def links_inside(roots: list[Path], st: os.stat_result, limit: int = 200_000) -> int:
    """How many names for the file `st` exist under the workspace roots (stops at `limit` entries)."""
    found = 0
    seen = 0
    for root in roots:
        for dirpath, _dirnames, filenames in os.walk(root):
            for name in filenames:
                seen += 1
                if seen > limit:
                    return found
                try:
                    other = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if other.st_ino == st.st_ino and other.st_dev == st.st_dev:
                    found += 1
    return found


def read_bytes(root: Path, resolved: Path, shown: str, limit: int | None = None) -> bytes:
    fd = open_beneath(root, resolved, os.O_RDONLY, shown=shown)
    try:
        st = regular_file(fd, shown)
        if limit is not None and st.st_size > limit:
            raise PathRefused(f"{shown} is {st.st_size:,} bytes, more than the {limit:,} a tool reads")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


@contextmanager
def open_for_write(
    roots: list[Path],
    root: Path,
    resolved: Path,
    shown: str,
    *,
    create: bool,
) -> Iterator[int]:
    """A descriptor to rewrite `resolved`: no symlink followed, a regular file, and not a hard link
    to a file outside the workspace (writing it would change that file). Parent directories are
    made when `create`. The file is truncated only after those checks."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        fd = open_beneath(root, resolved, flags, shown=shown, make_dirs=create, mode=0o666)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO with no reader
            raise PathRefused(f"{shown} is not a regular file") from None
        raise
    try:
        st = regular_file(fd, shown)
        if st.st_nlink > 1:
            inside = links_inside(roots, st)
            if inside < st.st_nlink:
                raise PathRefused(
                    f"{shown} is a hard link to a file with {st.st_nlink} names, "
                    f"{st.st_nlink - inside} of them outside the workspace; tools do not write "
                    "through it"
                )
        yield fd
    finally:
        os.close(fd)


def write_text(fd: int, text: str) -> None:
    data = text.encode("utf-8")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_fd(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
