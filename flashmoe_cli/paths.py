"""Where flashmoe keeps its state. FLASHMOE_HOME relocates all of it (tests use that too)."""
from __future__ import annotations

from pathlib import Path

from engine.demo import flashmoe_home


def home() -> Path:
    return flashmoe_home()


def config_file() -> Path:
    return home() / "config.toml"


def logs_db() -> Path:
    return home() / "logs.db"


def history_file() -> Path:
    return home() / "history"
