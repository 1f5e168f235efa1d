"""The test suite never touches the user's state (issue 12, item 15)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from tests.helpers.paths import USER_HOME

from tests.helpers.cli import run_cli


def conversations(home: Path) -> int:
    db = home / "logs.db"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:
        return con.execute("select count(*) from conversations").fetchone()[0]


def test_tests_run_with_a_private_home(tmp_path_factory):
    home = Path(os.environ["FLASHMOE_HOME"])
    assert home != USER_HOME and home.is_relative_to(tmp_path_factory.getbasetemp())


def test_a_cli_run_logs_into_the_private_home_not_the_users():
    before = conversations(USER_HOME)
    r = run_cli("run", "--engine", "fake", "hello")
    assert r.returncode == 0, r.stderr
    assert conversations(Path(os.environ["FLASHMOE_HOME"])) >= 1
    assert conversations(USER_HOME) == before
