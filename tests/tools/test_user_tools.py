"""User tools from JSON/YAML command files and from Python modules."""

from __future__ import annotations

import json
import textwrap

import pytest

from flashmoe.tools.errors import ToolError, ToolFileError
from flashmoe.tools.runner import CommandRunner
from flashmoe.tools.user_tools import load_python_tools, load_tool_file, parse_docstring, schema_for_type

PY_TOOLS = '''
from __future__ import annotations

from typing import Literal, Optional
import os.path
from os.path import join  # imported functions are not tools


def search(query: str, limit: int = 10, ratio: float = 0.5, exact: bool = False,
           tags: list[str] | None = None, opts: dict[str, int] | None = None,
           mode: Literal["fast", "slow"] = "fast", maybe: Optional[int] = None) -> str:
    """Search the notes for a query.

    Matches are ranked
    by score.

    Args:
        query: The text to look for.
        limit (int): How many hits to return;
            at most 100.
        ratio: Minimum score.
        exact: Match whole words only.
        tags: Only notes with these tags.

    Returns:
        The hits, one a line.
    """
    return f"{query}:{limit}:{ratio}:{exact}:{tags}:{opts}:{mode}:{maybe}"


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


add.risk = "read"


def _private(x: int) -> int:
    return x
'''


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_python_tools_schemas(tmp_path):
    tools = {t.name: t for t in load_python_tools(write(tmp_path, "my_tools.py", PY_TOOLS))}
    assert list(tools) == ["search", "add"]
    s = tools["search"]
    assert s.description == "Search the notes for a query."
    assert s.risk == "exec" and tools["add"].risk == "read"
    assert s.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "The text to look for."},
            "limit": {"type": "integer", "description": "How many hits to return; at most 100.", "default": 10},
            "ratio": {"type": "number", "description": "Minimum score.", "default": 0.5},
            "exact": {"type": "boolean", "description": "Match whole words only.", "default": False},
            "tags": {
                "type": ["array", "null"],
                "items": {"type": "string"},
                "description": "Only notes with these tags.",
                "default": None,
            },
            "opts": {"type": ["object", "null"], "additionalProperties": {"type": "integer"}, "default": None},
            "mode": {"type": "string", "enum": ["fast", "slow"], "default": "fast"},
            "maybe": {"type": ["integer", "null"], "default": None},
        },
        "required": ["query"],
        "additionalProperties": False,
    }
    assert tools["add"].parameters["required"] == ["a", "b"]
    assert tools["add"].fn(a=2, b=3) == 5
    assert s.fn(query="q", tags=["x"]) == "q:10:0.5:False:['x']:None:fast:None"


def test_python_tools_all_and_errors(tmp_path):
    p = write(tmp_path, "t.py", "__all__ = ['b']\ndef a(x: int): pass\ndef b(y: str):\n    'B.'\n")
    assert [t.name for t in load_python_tools(p)] == ["b"]
    cases = [
        ("def f(x): pass\n", "t.py: function 'f': parameter 'x' has no type hint"),
        ("def f(x: set): pass\n", "t.py: function 'f': parameter 'x': unsupported type hint set"),
        ("def f(*a: int): pass\n", "t.py: function 'f': *a/**a parameters cannot be tool arguments"),
        ("def f(x: int:\n", "t.py: syntax error at line 1:"),
        ("import not_a_module_xyz\n", "t.py: import failed: ModuleNotFoundError: No module named 'not_a_module_xyz'"),
        ("X = 1\n", "t.py: defines no public top-level functions"),
        (
            "def f(x: int): pass\nf.risk = 'net'\n",
            "t.py: function 'f': risk must be one of read, write, exec, not 'net'",
        ),
        ("def f(x: dict[int, str]): pass\n", "t.py: function 'f': parameter 'x': dict keys must be str in JSON"),
    ]
    for src, msg in cases:
        p = write(tmp_path, "t.py", src)
        with pytest.raises(ToolFileError) as e:
            load_python_tools(p)
        assert str(e.value).startswith(str(tmp_path / msg.split(": ", 1)[0]) + ": " + msg.split(": ", 1)[1]), str(
            e.value
        )
        assert "\n" not in str(e.value)
    with pytest.raises(ToolFileError, match="no such file"):
        load_python_tools(tmp_path / "missing.py")
    assert issubclass(ToolFileError, ToolError)


def test_schema_for_type_misc():
    from typing import Any, List, Union  # noqa: UP035 - the old spellings must work too

    assert schema_for_type(List[int])  # noqa: UP006 == {"type": "array", "items": {"type": "integer"}}
    assert schema_for_type(Union[int, str])  # noqa: UP007 == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert schema_for_type(Any) == {}
    assert schema_for_type(list) == {"type": "array"}


def test_parse_docstring():
    desc, args = parse_docstring("""Do it.

    Args:
        a: first
        b (str): second
            continued
    Raises:
        ValueError: never
    """)
    assert desc == "Do it." and args == {"a": "first", "b": "second continued"}


TOOL_SPEC = [
    {
        "type": "function",
        "function": {
            "name": "echo_args",
            "description": "Print each argument on its own line.",
            "parameters": {
                "type": "object",
                "properties": {
                    "text": {"type": "string"},
                    "count": {"type": "integer"},
                    "flag": {"type": "string", "default": "-n"},
                },
                "required": ["text"],
            },
        },
        "command": ["printf", "%s|\\n", "{text}", "n={count}", "{flag}", "{{literal}}"],
    }
]


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_command_tool_file_runs_argv_without_shell(tmp_path, fmt):
    import yaml

    p = tmp_path / f"tools.{fmt}"
    p.write_text(json.dumps(TOOL_SPEC) if fmt == "json" else yaml.safe_dump(TOOL_SPEC))
    marker = tmp_path / "pwned"
    (t,) = load_tool_file(p, CommandRunner(cwd=tmp_path))
    assert t.risk == "exec" and t.name == "echo_args"
    assert t.definition()["function"]["parameters"]["required"] == ["text"]
    evil = f"; touch {marker}; $(touch {marker}) `touch {marker}` && rm -rf /"
    res = t.fn(text=evil, count=3)
    assert res.ok, res.content
    assert res.content == f"{evil}|\nn=3|\n-n|\n{{literal}}|\n"
    assert not marker.exists()
    # an absent optional argument drops its argv item
    assert t.fn(text="x").content == "x|\n-n|\n{literal}|\n"


def test_flat_yaml_form_and_paths(tmp_path):
    p = write(
        tmp_path,
        "t.yml",
        """
        tools:
          - name: count
            description: Count lines.
            parameters:
              type: object
              properties: {file: {type: string}}
              required: [file]
            command: [wc, -l, "{file}"]
            paths: [file]
            timeout: 5
    """,
    )
    (tmp_path / "f.txt").write_text("a\nb\n")
    (t,) = load_tool_file(p, CommandRunner(cwd=tmp_path))
    assert t.path_args == ("file",)
    assert t.fn(file="f.txt").content.split() == ["2", "f.txt"]


@pytest.mark.parametrize(
    "name, text, msg",
    [
        ("t.json", "[{", "invalid JSON: Expecting property name enclosed in double quotes: line 1 column 3 (char 2)"),
        ("t.yaml", "- a: [1\n", "invalid YAML at line 2 column 1"),
        ("t.toml", "", "unknown tool file type; use .json, .yaml or .yml (or .py for Python tools)"),
        ("t.json", "{}", 'expected a list of tool objects (or {"tools": [...]})'),
        ("t.json", "[1]", "tool #1 is a int, expected an object"),
        (
            "t.json",
            '[{"name": "x", "command": "ls -l"}]',
            "tool 'x': \"command\" must be a non-empty list of strings (an argv, not a shell line)",
        ),
        (
            "t.json",
            '[{"name": "x", "command": ["{p}"], "parameters": {"type": "object", "properties": {"p": {}}}}]',
            "tool 'x': the program (command[0]) must be fixed, not a placeholder",
        ),
        (
            "t.json",
            '[{"name": "x", "command": ["ls", "{q}"]}]',
            "tool 'x': placeholder {q} is not one of its parameters (none)",
        ),
        ("t.json", '[{"name": "x", "command": ["ls", "{"]}]', "tool 'x': unbalanced brace in command item '{'"),
        ("t.json", '[{"name": "x y", "command": ["ls"]}]', "invalid tool name 'x y'"),
        ("t.json", '[{"name": "x", "command": ["ls"]}, {"name": "x", "command": ["ls"]}]', "tool 'x' is defined twice"),
        (
            "t.json",
            '[{"name": "x", "command": ["ls"], "parameters": {"type": "object", "properties": {"a": {"type": 5}}}}]',
            "tool 'x': invalid parameters schema",
        ),
    ],
)
def test_bad_tool_files(tmp_path, name, text, msg):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ToolFileError) as e:
        load_tool_file(p)
    assert str(e.value).startswith(f"{p}: {msg}"), str(e.value)
    assert "\n" not in str(e.value)


def test_missing_tool_file(tmp_path):
    with pytest.raises(ToolFileError, match="no such file"):
        load_tool_file(tmp_path / "nope.json")


RISK_TOOLS = '''
from flashmoe.tools.user_tools import risk


@risk("read")
def lookup(key: str) -> str:
    """Look a key up."""
    return key


def save(key: str, value: str) -> str:
    """Save a value.

    Risk: write

    Args:
        key: Where.
        value: What.
    """
    return "saved"


def launch(target: str) -> str:
    """Launch something (no risk declared)."""
    return target
'''


def test_python_tools_declare_their_risk_by_decorator_or_docstring(tmp_path):
    (tmp_path / "r.py").write_text(RISK_TOOLS)
    tools = {t.name: t for t in load_python_tools(tmp_path / "r.py")}
    assert {n: t.risk for n, t in tools.items()} == {"lookup": "read", "save": "write", "launch": "exec"}
    assert tools["save"].description == "Save a value."  # the field is not part of the description
    assert set(tools["save"].parameters["properties"]) == {"key", "value"}
    assert tools["save"].parameters["properties"]["value"]["description"] == "What."


def test_bad_declared_risks_are_refused(tmp_path):
    from flashmoe.tools.user_tools import risk

    with pytest.raises(ValueError, match="risk must be one of read, write, exec"):
        risk("network")
    (tmp_path / "b.py").write_text('def f(x: int):\n    """Do.\n\n    Risk: sometimes\n    """\n')
    with pytest.raises(ToolFileError, match="risk must be one of read, write, exec, not 'sometimes'"):
        load_python_tools(tmp_path / "b.py")


def test_approval_for_an_undeclared_python_tool_says_how_to_declare_it(tmp_path):
    from flashmoe.tools.executor import ToolExecutor
    from flashmoe.tools.calls import ToolCall
    from flashmoe.tools.policy import Policy
    from flashmoe.tools.registry import ToolRegistry

    (tmp_path / "r.py").write_text(RISK_TOOLS)
    registry = ToolRegistry()
    for t in load_python_tools(tmp_path / "r.py"):
        registry.add(t)
    asked = []

    class Approver:
        interactive = True

        def ask(self, call, reason):
            asked.append((call.name, reason))
            return "no"

    ex = ToolExecutor(registry, Policy(tmp_path, "ask"), Approver())
    res = ex.execute(ToolCall("launch", {"target": "x"}, raw=""))
    assert res.status == "declined"
    name, reason = asked[0]
    assert name == "launch" and "declares no risk" in reason
    assert '@risk("read")' in reason and "Risk: read" in reason
    assert ex.execute(ToolCall("save", {"key": "k", "value": "v"}, raw="")).status == "declined"
    assert "declares no risk" not in asked[1][1]  # a declared write is just a write
    assert ex.execute(ToolCall("lookup", {"key": "k"}, raw="")).content == "k"
