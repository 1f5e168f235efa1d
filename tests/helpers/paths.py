"""Where things are: the repository, the workspace folder beside it the suite must never read, and
the FLASHMOE_HOME the user's own runs use."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The workspace's research notes beside the repository: a public clone has no such folder, so
# the suite must never read it (everything a test needs is in tests/fixtures/, SOURCES.md says
# from where). tests/conftest.py fails every open of a path inside it.
OUTSIDE = ROOT.parent / "shared"


def _user_home() -> Path:
    """The FLASHMOE_HOME the user's own runs use (as engine.demo.flashmoe_home finds it)."""
    env = os.environ.get("FLASHMOE_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("flashmoe", appauthor=False))


# Read when this module is first imported: tests/conftest.py imports it before its session fixture
# replaces FLASHMOE_HOME with the run's own.
USER_HOME = _user_home()
