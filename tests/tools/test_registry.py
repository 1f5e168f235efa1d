"""Tool, ToolRegistry and the built-in tools."""

from __future__ import annotations

import pytest

from flashmoe.tools.builtin import builtin_tools, register_builtins
from flashmoe.tools.errors import ToolDefinitionError, ToolRunError
from flashmoe.tools.policy import Policy, Sandbox
from flashmoe.tools.registry import Tool, ToolRegistry

OBJ = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}


def test_definitions_are_openai_style():
    reg = ToolRegistry([Tool("echo", "Echo x.", OBJ, lambda x: x)])
    assert reg.definitions() == [
        {"type": "function", "function": {"name": "echo", "description": "Echo x.", "parameters": OBJ}}
    ]
    assert reg.get("echo").primary_arg == "x" and reg.get("nope") is None
    assert "echo" in reg and len(reg) == 1 and reg.names() == ["echo"]


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"name": "bad name"}, "invalid tool name 'bad name'"),
        ({"risk": "net"}, "risk must be one of read, write, exec, not 'net'"),
        ({"parameters": {"type": "array"}}, 'parameters must have "type": "object"'),
        ({"parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}, "invalid parameters schema"),
        ({"primary": "y"}, "'y' is not one of its parameters"),
        # issue 41: these were a RecursionError or an OverflowError out of the definition's check, or
        # validation that recursed until the stack ran out
        ({"parameters": {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}}}, "references loop"),
        (
            {
                "parameters": {
                    "type": "object",
                    "$defs": {"a": {"anyOf": [{"$ref": "#"}]}},
                    "allOf": [{"$ref": "#/$defs/a"}],
                }
            },
            "references loop",
        ),
        (
            {"parameters": {"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}}},
            "only references inside the schema",
        ),
        (
            {
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "string", "pattern": "a{99999999999999999999}"}},
                }
            },
            "is not a 'regex'",
        ),
        (
            {
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "string", "pattern": "(" * 3000 + ")" * 3000}},
                }
            },
            "is not a 'regex'",
        ),
    ],
)
def test_bad_tools(kwargs, msg):
    args = {"name": "t", "description": "", "parameters": OBJ, "fn": lambda **a: None, **kwargs}
    with pytest.raises(ToolDefinitionError, match=None) as e:
        Tool(**args)
    assert msg in str(e.value)


def test_duplicates_and_subset():
    reg = ToolRegistry([Tool("a", "", {}, lambda: 1), Tool("b", "", {}, lambda: 2)])
    with pytest.raises(ToolDefinitionError, match="duplicate tool name 'a'"):
        reg.add(Tool("a", "", {}, lambda: 3))
    reg.add(Tool("a", "new", {}, lambda: 3), replace=True)
    assert reg.get("a").description == "new"
    assert reg.subset(["b"]).names() == ["b"]
    with pytest.raises(ToolDefinitionError, match="unknown tool 'c'; available: a, b"):
        reg.subset(["c"])


def test_builtin_definitions(tmp_path):
    reg = register_builtins(ToolRegistry(), Policy(tmp_path))
    assert reg.names() == ["read_file", "list_dir", "search_files", "write_file", "edit_file", "run_shell"]
    risks = {t.name: t.risk for t in reg}
    assert risks == {
        "read_file": "read",
        "list_dir": "read",
        "search_files": "read",
        "write_file": "write",
        "edit_file": "write",
        "run_shell": "exec",
    }
    for d in reg.definitions():
        assert d["function"]["description"] and d["function"]["parameters"]["type"] == "object"


@pytest.fixture
def b(tmp_path):
    (tmp_path / "a.txt").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("def f():\n    return 42\n")
    (tmp_path / "src" / "n.txt").write_text("return nothing\n")
    (tmp_path / ".env").write_text("return SECRET\n")
    (tmp_path / "bin.dat").write_bytes(b"\x00\x01return")
    return {t.name: t.fn for t in builtin_tools(Sandbox(tmp_path))}, tmp_path


def test_read_file(b):
    fns, root = b
    assert fns["read_file"](path="a.txt") == "".join(f"line {i}\n" for i in range(1, 11))
    assert fns["read_file"](path="a.txt", offset=3, limit=2) == "line 3\nline 4\n\n[lines 3-4 of 10]"
    with pytest.raises(ToolRunError, match="offset 20 is past the end of a.txt \\(10 lines\\)"):
        fns["read_file"](path="a.txt", offset=20)
    with pytest.raises(ToolRunError, match="no such file: nope.txt"):
        fns["read_file"](path="nope.txt")
    with pytest.raises(ToolRunError, match="src is a directory; use list_dir"):
        fns["read_file"](path="src")
    with pytest.raises(ToolRunError, match="binary file"):
        fns["read_file"](path="bin.dat")


def test_read_file_long_is_paged(tmp_path):
    (tmp_path / "big.txt").write_text("".join(f"{i:05d}\n" for i in range(5000)))
    fn = {t.name: t.fn for t in builtin_tools(Sandbox(tmp_path), max_output=600)}["read_file"]
    out = fn(path="big.txt")
    assert out.endswith("\n[showing lines 1-100 of 5000; call read_file with offset=101 to read on]")


def test_list_dir(b):
    fns, _ = b
    assert fns["list_dir"]() == ".env\na.txt\nbin.dat\nsrc/"
    assert fns["list_dir"](path="src") == "m.py\nn.txt"


def test_search_files(b):
    fns, _ = b
    assert fns["search_files"](pattern=r"return \w+") == "src/m.py:2:     return 42\nsrc/n.txt:1: return nothing"
    assert fns["search_files"](pattern="return", glob="*.py") == "src/m.py:2:     return 42"
    assert fns["search_files"](pattern="return", max_results=1) == (
        "src/m.py:2:     return 42\n[stopped at 1 matches; narrow the pattern, path or glob]"
    )
    assert fns["search_files"](pattern="zzz") == "no matches for 'zzz'"
    with pytest.raises(ToolRunError, match="invalid regular expression"):
        fns["search_files"](pattern="(")


def test_write_and_edit(b):
    fns, root = b
    assert fns["write_file"](path="new/dir/x.txt", content="a\nb\n") == "created new/dir/x.txt (4 characters, 2 lines)"
    assert (root / "new/dir/x.txt").read_text() == "a\nb\n"
    assert (
        fns["edit_file"](path="new/dir/x.txt", old_string="b", new_string="c")
        == "replaced 1 occurrence in new/dir/x.txt"
    )
    assert (root / "new/dir/x.txt").read_text() == "a\nc\n"
    (root / "d.txt").write_text("x x x\r\n")
    with pytest.raises(ToolRunError) as e:
        fns["edit_file"](path="d.txt", old_string="x", new_string="y")
    assert str(e.value) == (
        "old_string occurs 3 times in d.txt; include more surrounding text to make it unique, "
        "or set replace_all to true"
    )
    assert (
        fns["edit_file"](path="d.txt", old_string="x", new_string="y", replace_all=True)
        == "replaced 3 occurrences in d.txt"
    )
    assert (root / "d.txt").read_bytes() == b"y y y\r\n"
    with pytest.raises(ToolRunError) as e:
        fns["edit_file"](path="d.txt", old_string="zz", new_string="y")
    assert str(e.value) == (
        "old_string was not found in d.txt; read the file and copy the exact text, whitespace included"
    )
    with pytest.raises(ToolRunError, match="nothing to change"):
        fns["edit_file"](path="d.txt", old_string="y", new_string="y")


def test_builtins_check_the_sandbox_themselves(b):
    from flashmoe.tools.errors import PathRefused

    fns, _ = b
    with pytest.raises(PathRefused):
        fns["read_file"](path=".env")
    with pytest.raises(PathRefused):
        fns["write_file"](path=".git/config", content="")
    with pytest.raises(PathRefused):
        fns["write_file"](path="../x", content="")


def test_run_shell(b):
    fns, root = b
    res = fns["run_shell"](command="cat a.txt | wc -l")
    assert res.ok and res.content.strip() == "10" and res.exit_code == 0
