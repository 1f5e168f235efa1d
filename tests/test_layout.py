"""How the repository's folders install: one `flashmoe` package, and a front end that starts
without MLX.

flashmoe_cli/ -> flashmoe.cli, engine/ -> flashmoe.engine, tools/ -> flashmoe.tools,
prompts/ -> flashmoe.prompts (pyproject.toml's package-dir), so no generic name (engine, tools)
lands at the top of site-packages, and a tools/ folder in the user's workspace shadows nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "flashmoe_cli": "flashmoe.cli",
    "engine": "flashmoe.engine",
    "tools": "flashmoe.tools",
    "prompts": "flashmoe.prompts",
}


def _python(code: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_every_package_folder_is_installed_under_flashmoe():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {pkg: folder for folder, pkg in FOLDERS.items()}
    found = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert set(setup["packages"]) == found  # a new subpackage missing here would be left out of the wheel


def test_no_generic_top_level_name_and_a_workspace_tools_folder_shadows_nothing(tmp_path):
    for name in ("tools", "engine", "prompts"):  # what an agent's workspace (a repository) may hold
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise SystemExit('the workspace folder was imported')\n")
    code = textwrap.dedent("""
        import importlib.util, flashmoe.tools, flashmoe.engine.options, flashmoe.prompts
        from importlib import resources
        assert resources.files("flashmoe.prompts").joinpath("tool_instructions.md").read_text().strip()
        print(flashmoe.tools.__file__, importlib.util.find_spec("flashmoe_cli"))
    """)
    r = _python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    ours, old_name = r.stdout.split()
    assert Path(ours).is_relative_to(ROOT / "tools")
    assert old_name == "None"
    r = subprocess.run(
        [sys.executable, "-m", "flashmoe.cli", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "usage: flashmoe" in r.stdout, r.stderr


# Imported with MLX, mlx-lm and numba made unimportable (as on a machine without them).
_NO_MLX = textwrap.dedent("""
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("mlx", "mlx_lm", "numba"):
                raise ImportError(f"{name} is not allowed here")
    sys.meta_path.insert(0, Refuse())
    from flashmoe.cli.cli import main
    argv = sys.argv[1:]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    heavy = sorted({m.split(".")[0] for m in sys.modules} & {"mlx", "mlx_lm", "numba", "torch", "textual"})
    print("CODE", code, "HEAVY", ",".join(heavy))
""")

COMMANDS = [
    [],
    ["run"],
    ["chat"],
    ["agent"],
    ["bench"],
    ["bench", "tools"],
    ["bench", "speed"],
    ["bench", "cache"],
    ["bench", "quality"],
    ["logs"],
    ["convert"],
    ["info"],
    ["verify"],
    ["pull"],
    ["demo"],
]


def _no_mlx(args: list[str], home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _NO_MLX, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "FLASHMOE_HOME": str(home)},
    )


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "flashmoe")
def test_help_imports_no_mlx(command, tmp_path):
    r = _no_mlx([*command, "--help"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "usage: flashmoe" in r.stdout
    assert r.stdout.strip().endswith("CODE 0 HEAVY"), r.stdout[-300:]


@pytest.mark.parametrize(
    "args,config,code",
    [
        (["run", "--temp", "hot"], "", 2),
        (["run", "--temperature", "1"], "", 2),
        (["chat", "--kernels", "gpu"], "", 2),
        (["run", "hi"], 'kernels = "gpu"\n', 2),
        (["run", "hi"], "max_tokens = [\n", 2),
        (["logs"], "", 0),
        (["logs", "path"], "", 0),
    ],
    ids=["bad value", "unknown flag", "bad choice", "bad config value", "bad config file", "logs", "logs path"],
)
def test_usage_errors_logs_and_config_import_no_mlx(args, config, code, tmp_path):
    if config:
        (tmp_path / "config.toml").write_text(config)
    r = _no_mlx(args, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"CODE {code} " in r.stdout, (r.stdout[-300:], r.stderr[-300:])
    assert r.stdout.rstrip().endswith("HEAVY"), r.stdout[-300:]
    assert "Traceback" not in r.stderr, r.stderr


# -- the import graph, function-local imports included ---------------------------------------
UI = ("textual", "prompt_toolkit", "rich")
MLX = ("mlx", "mlx_lm", "numba")


def _modules() -> dict[str, tuple[Path, bool]]:
    """import name -> (file, is a package)."""
    out = {}
    for folder, pkg in FOLDERS.items():
        for p in (ROOT / folder).rglob("*.py"):
            parts = list(p.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join([pkg, *(parts[:-1] if is_pkg else parts)])] = (p, is_pkg)
    return out


def _imports(name: str, path: Path, is_pkg: bool):
    """(imported module or module.name, line) for every import statement, wherever it is."""
    import ast

    base = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module
            if node.level:
                b = base
                for _ in range(node.level - 1):
                    b = b.rpartition(".")[0]
                mod = f"{b}.{node.module}" if node.module else b
            yield mod, node.lineno
            yield from ((f"{mod}.{a.name}", node.lineno) for a in node.names)


MODULES = _modules()
IMPORTS = {n: list(_imports(n, p, k)) for n, (p, k) in MODULES.items()}


def _rule_breaks(importer: str, banned) -> list[str]:
    return [
        f"{n}:{line} imports {m}"
        for n, found in IMPORTS.items()
        if n.startswith(importer)
        for m, line in found
        if banned(m)
    ]


def _top(m: str) -> str:
    return m.split(".")[0]


def test_engine_imports_no_front_end_and_no_tools():
    assert (
        _rule_breaks("flashmoe.engine", lambda m: _top(m) in UI or m.startswith(("flashmoe.cli", "flashmoe.tools")))
        == []
    )


def test_tools_import_no_engine_no_front_end_no_mlx():
    assert (
        _rule_breaks(
            "flashmoe.tools", lambda m: _top(m) in UI + MLX or m.startswith(("flashmoe.cli", "flashmoe.engine"))
        )
        == []
    )


def test_front_ends_reach_mlx_only_through_the_engine():
    assert _rule_breaks("flashmoe.cli", lambda m: _top(m) in MLX) == []


def test_no_front_end_module_imports_the_entry_point_back():
    breaks = _rule_breaks("flashmoe.cli", lambda m: m == "flashmoe.cli.cli" or m.startswith("flashmoe.cli.cli."))
    assert [b for b in breaks if not b.startswith("flashmoe.cli.__main__:")] == []


def test_no_import_cycle_in_the_front_end():
    graph = {
        n: {m for m, _ in found if m in MODULES and m != n and m.startswith("flashmoe.cli")}
        for n, found in IMPORTS.items()
        if n.startswith("flashmoe.cli")
    }
    # a module's own package (__init__) is imported by Python first, not a dependency it chose
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    state, cycles = {}, []

    def visit(n: str, path: list[str]) -> None:
        state[n] = "open"
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                cycles.append(path[path.index(m) :] + [m] if m in path else [n, m])
            elif m not in state:
                visit(m, path + [m])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert cycles == []
