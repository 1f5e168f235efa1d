"""Where flashmoe keeps its state. FLASHMOE_HOME relocates all of it (tests use that too)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from flashmoe.engine.formats.demo import flashmoe_home


def home() -> Path:
    return flashmoe_home()


def ensure_home() -> Path:
    """The state folder, created if missing (said once on stderr), private to the user (0700; its
    files 0600: conversations, history and caches are nobody else's). One that is a file, cannot
    be created or cannot be written is a configuration mistake: ConfigError, one line, exit 2.
    An existing one that others may read is made private, said once if it held files others could
    read."""
    from .errors import ConfigError

    h = home()
    name = f"FLASHMOE_HOME {h}" if os.environ.get("FLASHMOE_HOME") else f"flashmoe's data folder {h}"
    if h.exists() and not h.is_dir():
        raise ConfigError(f"{name}: not a folder")
    if not h.exists():
        try:
            h.mkdir(mode=0o700, parents=True, exist_ok=True)  # (the mode is the folder's own, not its parents')
        except OSError as e:
            raise ConfigError(f"{name}: cannot create it ({e.strerror or e})") from None
        where = " (FLASHMOE_HOME)" if os.environ.get("FLASHMOE_HOME") else ""
        print(f"flashmoe: created {h}{where} for the config, logs and history", file=sys.stderr)
    if not os.access(h, os.W_OK | os.X_OK):  # a read-only file system says no even to root
        raise ConfigError(f"{name}: not writable")
    make_private(h, 0o700)
    exposed = [f for f in STATE_FILES if make_private(h / f, 0o600)]
    if exposed:  # (a folder alone, as a test or a script made it, held nothing to say so about)
        print(
            f"flashmoe: made {h} and its files private (0700 / 0600): others could read your conversations",
            file=sys.stderr,
        )
    return h


# Files of the state folder that hold what the user wrote or was told.
STATE_FILES = ("logs.db", "logs.db-wal", "logs.db-shm", "history", "config.toml")


def make_private(path: Path, mode: int) -> bool:
    """Take group and other permissions off a file or folder of ours; whether that changed it."""
    try:
        st = os.lstat(path)
        if st.st_uid != os.geteuid() or not st.st_mode & 0o077:
            return False
        os.chmod(path, mode, follow_symlinks=False)
        return True
    except (OSError, NotImplementedError):
        return False


def private_file(path: Path) -> None:
    """Create `path` (and its folder) if missing, readable and writable by the user only."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600))
    make_private(path, 0o600)


def config_file() -> Path:
    return home() / "config.toml"


def logs_db() -> Path:
    return home() / "logs.db"


def history_file() -> Path:
    return home() / "history"
