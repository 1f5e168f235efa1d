"""The documentation's generated parts match what generates them, and its links lead somewhere.

docs/cli.md is the CLI's own `--help` (regenerate: python -m tests.cli_docs); the figures tables
of README.md, docs/speed.md and benchmarks/README.md come from the newest benchmark JSON under
benchmarks/log/ (regenerate: python benchmarks/tables.py); the architecture table of
docs/models.md is checked by tests/test_arch_zoo.py.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests import cli_docs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP = (
    'python -m pip install -e . && flashmoe run "What is the capital of France?"',
    'python -m pip install -e ".[test]" && python -m pytest -q',
)


def _tables():
    spec = importlib.util.spec_from_file_location("benchmark_tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_md_is_the_clis_help():
    text = cli_docs.DOC.read_text(encoding="utf-8")
    wrote = cli_docs.recorded_version(text)
    if wrote != cli_docs.python_version():
        pytest.skip(
            f"docs/cli.md was written under Python {wrote}; argparse lays help out differently "
            f"under {cli_docs.python_version()}"
        )
    assert text == cli_docs.render(), "docs/cli.md differs from the CLI's --help: run python -m tests.cli_docs"


def test_cli_md_has_every_command():
    text = cli_docs.DOC.read_text(encoding="utf-8")
    for path in cli_docs.commands():
        assert f"\n## {' '.join(['flashmoe', *path])}\n" in text, path


@pytest.mark.parametrize("target", _tables().TARGETS)
def test_figures_tables_are_generated_from_the_latest_benchmark_json(target):
    tables = _tables()
    path = ROOT / target
    assert path.read_text(encoding="utf-8") == tables.render(path), (
        f"{target}'s figures tables are stale: run python benchmarks/tables.py"
    )


def test_readme_has_the_speed_table_and_the_bigger_than_memory_figure():
    text = README.read_text(encoding="utf-8")
    for name in _tables().TABLES:
        start, end = _tables().markers(name)
        assert start in text and end in text, name


def test_readme_is_short_and_keeps_the_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    for command in SETUP:  # CI (.ci/run) and people run these as written
        assert f"\n{command}\n" in text, command


def test_every_benchmark_log_is_in_the_index():
    index = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    logs = sorted((ROOT / "benchmarks" / "log").glob("*.md"))
    assert logs
    for log in logs:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d-[a-z0-9-]+\.md", log.name), log.name
        assert f"(log/{log.name})" in index, log.name


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files_and_headings_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        assert dest.exists(), f"{page.name}: {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: {target}"


def test_nothing_points_at_the_old_results_file():
    """benchmarks/RESULTS.md became benchmarks/log/ (one file a sitting) and benchmarks/README.md."""
    history = ROOT / "benchmarks" / "README.md"  # its index says where the old file's sections went
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "pyproject.toml"]
    for folder in ("docs", "benchmarks", "engine", "flashmoe_cli", "tools", "prompts", "tests"):
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.suffix in (".py", ".md")
            and "fixtures" not in p.parts
            and p.parent.name != "log"
            and p not in (history, Path(__file__))
        ]
    stale = [str(p.relative_to(ROOT)) for p in files if "RESULTS.md" in p.read_text(encoding="utf-8", errors="replace")]
    assert not stale, stale


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
