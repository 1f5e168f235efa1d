"""How the suite's own files import each other (issue 43): what several test modules share lives in
tests/helpers/, so no file under tests/ imports a test module (tests/test_*.py, tests/*/test_*.py)
or a conftest.py, and every helper there is used.

The imports are read with `ast`, relative ones resolved against the file's package, and each is
matched to the file it loads: `from tests import test_x` and `from .conftest import y` count as
much as `from tests.test_x import y`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT

TESTS = ROOT / "tests"
HELPERS = TESTS / "helpers"


def _module_file(dotted: str) -> Path | None:
    """The file under the repository that `import dotted` loads, if it is one of ours."""
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_files(path: Path) -> list[tuple[int, Path]]:
    """(line, file) for every import in `path`, at any depth (inside functions too), of a file in
    this repository."""
    return _imports(path.read_text(encoding="utf-8"), path.parent.relative_to(ROOT).parts)


def _imports(source: str, package: tuple[str, ...]) -> list[tuple[int, Path]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            # `from package import module` loads the module too
            names = [module, *(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")]
        else:
            continue
        for name in names:
            file = _module_file(name)
            if file is not None:
                found.append((node.lineno, file))
    return found


def _suite_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "fixtures" not in p.relative_to(TESTS).parts)


def _is_test_module(path: Path) -> bool:
    return path.name.startswith("test_") and path.suffix == ".py"


def test_no_file_under_tests_imports_a_test_module_or_a_conftest():
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {file.relative_to(ROOT)}"
        for path in _suite_files()
        for line, file in imported_files(path)
        if file.is_relative_to(TESTS) and (_is_test_module(file) or file.name == "conftest.py")
    ]
    assert not bad, "move what is shared into tests/helpers/:\n" + "\n".join(bad)


def test_every_helper_is_used_by_a_test_module_or_a_conftest():
    users: dict[Path, list[Path]] = {}
    for path in _suite_files():
        if _is_test_module(path) or path.name == "conftest.py":
            for _, file in imported_files(path):
                users.setdefault(file, []).append(path)
    helpers = sorted(p for p in HELPERS.glob("*.py") if p.name != "__init__.py")
    assert helpers
    unused = [str(p.relative_to(ROOT)) for p in helpers if p not in users]
    assert not unused, f"helpers no test module or conftest.py imports: {unused}"


def test_the_check_sees_relative_nested_and_package_imports():
    """The reading itself: a relative import inside a function, a module imported from its
    package, and absolute ones are all found, each as the file it loads."""
    code = (
        "def f():\n    from .conftest import x\n"
        "from tests import test_cli\n"
        "import tests.tools.test_runner\n"
        "from tests.helpers.paths import ROOT\n"
        "from flashmoe.cli import cli\n"
    )
    got = {file.relative_to(ROOT).as_posix() for _, file in _imports(code, ("tests", "tui"))}
    assert {"tests/tui/conftest.py", "tests/test_cli.py", "tests/tools/test_runner.py", "tests/helpers/paths.py"} <= got
