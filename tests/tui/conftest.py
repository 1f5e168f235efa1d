"""The Textual app's tests: the tmux marker and the app_factory fixture (the deterministic fake
engine and the Pilot helpers are in tests/helpers/tui.py)."""

from __future__ import annotations

import pytest

from tests.helpers.tui import make_app


def pytest_configure(config):
    config.addinivalue_line("markers", "tmux: drives the real CLI in a private tmux server (skipped without tmux)")


@pytest.fixture
def app_factory():
    return make_app
