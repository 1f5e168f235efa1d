"""Where flashmoe keeps its state. FLASHMOE_HOME relocates all of it (tests use that too)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from flashmoe.engine.formats.demo import flashmoe_home


def home() -> Path:
    return flashmoe_home()


def ensure_home() -> Path:
    """The state folder, created if missing (said once on stderr). One that is a file, cannot be
    created or cannot be written is a configuration mistake: ConfigError, one line, exit 2."""
    from .errors import ConfigError

    h = home()
    name = f"FLASHMOE_HOME {h}" if os.environ.get("FLASHMOE_HOME") else f"flashmoe's data folder {h}"
    if h.exists() and not h.is_dir():
        raise ConfigError(f"{name}: not a folder")
    if not h.exists():
        try:
            h.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{name}: cannot create it ({e.strerror or e})") from None
        where = " (FLASHMOE_HOME)" if os.environ.get("FLASHMOE_HOME") else ""
        print(f"flashmoe: created {h}{where} for the config, logs and history", file=sys.stderr)
    if not os.access(h, os.W_OK | os.X_OK):  # a read-only file system says no even to root
        raise ConfigError(f"{name}: not writable")
    return h


def config_file() -> Path:
    return home() / "config.toml"


def logs_db() -> Path:
    return home() / "logs.db"


def history_file() -> Path:
    return home() / "history"
