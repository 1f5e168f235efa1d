"""The suite reads nothing outside the repository (issue 43): a public clone has no ../shared, so
a test that read it passed here and failed there (54 tests did, once). conftest.py refuses every
open inside ../shared for the whole run; these check that the refusal is on, and that every
fixture names where it came from."""

from __future__ import annotations

import re

import pytest

from tests.helpers.paths import OUTSIDE, ROOT

FIXTURES = ROOT / "tests" / "fixtures"


def test_opening_a_file_beside_the_repository_fails_the_test():
    with pytest.raises(PermissionError, match="tests must not read"):
        open(OUTSIDE / "reference" / "anything.md", encoding="utf-8")
    with pytest.raises(PermissionError, match="tests must not read"):
        (ROOT / "tests" / ".." / ".." / OUTSIDE.name / "DESIGN.md").read_text()


def test_a_sibling_with_a_similar_name_is_not_refused(tmp_path):
    """Only the folder itself: `shared-other/` beside it is someone else's (and not ours to judge)."""
    with pytest.raises(FileNotFoundError):
        open(str(OUTSIDE) + "-other/x", encoding="utf-8")


def test_every_fixture_is_named_in_a_sources_file():
    """Each file under tests/fixtures/ is named in the SOURCES.md of its folder or of a folder
    above it."""
    unnamed = []
    for f in sorted(p for p in FIXTURES.rglob("*") if p.is_file() and p.name != "SOURCES.md"):
        folders = [d for d in f.parents if d == FIXTURES or FIXTURES in d.parents]
        if not any(_names(d / "SOURCES.md", f.name) for d in folders):
            unnamed.append(str(f.relative_to(FIXTURES)))
    assert not unnamed, f"fixtures that no SOURCES.md names: {unnamed}"


def _names(sources, name: str) -> bool:
    return (
        sources.is_file()
        and re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", sources.read_text(encoding="utf-8")) is not None
    )
