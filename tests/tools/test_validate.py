"""Validation and repair messages, asserted in full."""

from __future__ import annotations

import pytest

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers import json_tools, mistral, qwen3_coder
from flashmoe.tools.registry import Tool, ToolRegistry
from flashmoe.tools.validate import (
    RepairLoop,
    Verdict,
    check_call,
    looks_backslash_quoted,
    repair_backslash_quotes,
    validator_for,
)

BACKSLASH = "the arguments use backslashes where JSON needs double quotes (a known low-bit quantization failure)"


@pytest.fixture
def reg():
    return ToolRegistry(
        [
            Tool(
                "read_file",
                "Read a file.",
                {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "offset": {"type": "integer", "minimum": 1}},
                    "required": ["path"],
                    "additionalProperties": False,
                },
                lambda **a: "x",
            ),
            Tool("list_dir", "List.", {"type": "object", "properties": {"path": {"type": "string"}}}, lambda **a: "x"),
            Tool(
                "tag",
                "Tag.",
                {
                    "type": "object",
                    "properties": {
                        "items": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {"name": {"type": "string"}},
                                "required": ["name"],
                            },
                        }
                    },
                },
                lambda **a: "x",
            ),
        ]
    )


def one(text, parser=json_tools, tools=None):
    calls = parser.parse_tool_call(text, tools)
    assert len(calls) == 1
    return calls[0]


def test_valid(reg):
    v = check_call(one('<tool_call>{"name": "read_file", "arguments": {"path": "a", "offset": 2}}</tool_call>'), reg)
    assert v == Verdict(True, {"path": "a", "offset": 2}, "")


def test_unknown_tool(reg):
    v = check_call(ToolCall("write_it", {}, "raw"), reg)
    assert not v.ok and v.kind == "unknown-tool"
    assert v.message == "unknown tool 'write_it'; available: read_file, list_dir, tag"
    assert check_call(ToolCall("x", {}, "raw"), ToolRegistry()).message == "unknown tool 'x'; no tools are available"


def test_unparseable_call(reg):
    v = check_call(one('<tool_call>{"arguments": {}}</tool_call>'), reg)
    assert v.message == 'could not parse the tool call: the tool call has no "name"'


def test_malformed_json_with_position(reg):
    v = check_call(one('<tool_call>{"name": "read_file", "arguments": {"path": "a" "offset": 1}}</tool_call>'), reg)
    assert v.kind == "malformed-json"
    assert v.message == (
        "malformed JSON in the arguments for 'read_file': Expecting ',' delimiter: line 1 column 14 (char 13)"
    )
    v = check_call(ToolCall.from_openai({"function": {"name": "read_file", "arguments": '{"path": '}}), reg)
    assert v.message == ("malformed JSON in the arguments for 'read_file': Expecting value: line 1 column 10 (char 9)")


@pytest.mark.parametrize("args", ["", "   "])
def test_empty_arguments_mean_empty_object(reg, args):
    v = check_call(ToolCall.from_openai({"function": {"name": "list_dir", "arguments": args}}), reg)
    assert v == Verdict(True, {}, "")
    v = check_call(one(f"[TOOL_CALLS]list_dir[ARGS]{args}", mistral), reg)
    assert v == Verdict(True, {}, "")


def test_schema_messages(reg):
    cases = [
        ({"path": 3}, "invalid arguments for 'read_file': $.path: 3 is not of type 'string'"),
        ({}, "invalid arguments for 'read_file': $: 'path' is a required property"),
        ({"path": "a", "offset": 0}, "invalid arguments for 'read_file': $.offset: 0 is less than the minimum of 1"),
        (
            {"path": "a", "mode": "x"},
            "invalid arguments for 'read_file': $: Additional properties are not allowed ('mode' was unexpected)",
        ),
    ]
    for args, msg in cases:
        v = check_call(ToolCall("read_file", args, "raw"), reg)
        assert (v.ok, v.kind, v.message) == (False, "schema", msg)
    v = check_call(ToolCall("tag", {"items": [{"name": "a"}, {"nam": "b"}]}, "raw"), reg)
    assert v.message == "invalid arguments for 'tag': $.items[1]: 'name' is a required property"


def test_not_an_object(reg):
    v = check_call(one('<tool_call>{"name": "read_file", "arguments": [1]}</tool_call>'), reg)
    assert v.message == "the arguments for 'read_file' must be a JSON object, not an array"


def test_xml_type_errors_reach_validation(reg):
    xml = "<tool_call><function=read_file><parameter=path>a</parameter><parameter=offset>two</parameter></function></tool_call>"
    v = check_call(one(xml, qwen3_coder, reg), reg)
    assert v.message == "invalid arguments for 'read_file': $.offset: 'two' is not of type 'integer'"


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{\\name\\: \\read_file\\, \\arguments\\: {\\path\\: \\x.txt\\}}\n</tool_call>",
        "<tool_call>\n{\\\\name\\\\: \\\\read_file\\\\, \\\\arguments\\\\: {\\\\path\\\\: \\\\x.txt\\\\}}\n</tool_call>",
        '<tool_call>{"name": "read_file", "arguments": {\\path\\: \\x.txt\\}}</tool_call>',
        '<tool_call>{"name": "read_file", "arguments": {\\"path\\": \\"x.txt\\"}}</tool_call>',
    ],
)
def test_backslash_quoting_is_named_and_repaired(reg, text):
    call = one(text)
    assert call.name == "read_file"
    v = check_call(call, reg)
    assert v.message == f"malformed JSON in the arguments for 'read_file': {BACKSLASH}"
    assert (v.ok, v.repaired, v.kind, v.arguments) == (False, True, "backslash-quotes", {"path": "x.txt"})


def test_backslash_quoting_repair_still_invalid(reg):
    v = check_call(ToolCall("read_file", None, "raw", arguments_text="{\\path\\: 5}"), reg)
    assert (v.ok, v.repaired, v.arguments) == (False, False, None)
    assert v.message == (
        f"malformed JSON in the arguments for 'read_file': {BACKSLASH}; with double quotes "
        "instead they are still invalid: $.path: 5 is not of type 'string'"
    )
    v = check_call(ToolCall("read_file", None, "raw", arguments_text="{\\path\\: \\a \\b\\}"), reg)
    assert (v.repaired, v.message) == (False, f"malformed JSON in the arguments for 'read_file': {BACKSLASH}")


def test_backslash_helpers():
    assert looks_backslash_quoted("{\\name\\: \\x.txt\\}")
    assert repair_backslash_quotes("{\\name\\: \\x.txt\\}") == '{"name": "x.txt"}'
    assert repair_backslash_quotes("{\\\\a\\\\: 1, \\\\b\\\\: [\\\\c\\\\]}") == '{"a": 1, "b": ["c"]}'
    assert not looks_backslash_quoted('{"path": "C:\\\\dir"}')
    assert not looks_backslash_quoted('{"a": 1,}')


def test_validator_cached(reg):
    t = reg.get("read_file")
    assert validator_for(t) is validator_for(t)


def test_repair_loop_messages_and_bound():
    loop = RepairLoop(max_repairs=2)
    loop.begin_turn()
    bad = ToolCall("read_file", None, '<tool_call>{"name": "read_file", "arguments": {</tool_call>', arguments_text="{")
    v = Verdict(
        False,
        None,
        "malformed JSON in the arguments for 'read_file': Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1)",
    )
    m1 = loop.reject(bad, v)
    assert m1 == v.message + "\nFix the call and try again (repair 1 of 2)."
    assert not loop.exhausted
    assert loop.reject(bad, v) == v.message + "\nFix the call and try again (repair 2 of 2)."
    assert not loop.exhausted
    assert loop.reject(bad, v) == (
        v.message + "\nThe repair limit (2) is reached for this turn: stop calling tools and answer with what you have."
    )
    assert loop.exhausted
    assert [r.raw for r in loop.rejected] == [bad.raw] * 3
    loop.begin_turn()
    assert not loop.exhausted and loop.rounds == 0
    assert len(loop.rejected) == 3  # the log keeps everything


def test_repair_loop_counts_replies_not_calls():
    loop = RepairLoop(max_repairs=1)
    c = ToolCall("x", None, "raw")
    loop.reject(c, "bad", reply=1)
    loop.reject(c, "bad", reply=1)
    assert loop.rounds == 1 and not loop.exhausted
    loop.reject(c, "bad", reply=2)
    assert loop.exhausted


def test_repair_loop_zero():
    loop = RepairLoop(max_repairs=0)
    msg = loop.reject(ToolCall("x", None, "raw"), "bad")
    assert (
        msg == "bad\nThe repair limit (0) is reached for this turn: stop calling tools and answer with what you have."
    )
    assert loop.exhausted


@pytest.mark.parametrize("pattern", ["^(a+)+$", "^(a|a)*$", "^(a|aa)+$"])
def test_a_backtracking_pattern_is_matched_with_a_time_limit(pattern):
    """Issue 41: Python's re (through jsonschema) took 11 s on 27 characters of 'a' against
    ^(a+)+$, the GIL held. The regex engine, with a time limit, decides in well under a second;
    a match out of time fails the value."""
    import time

    tool = Tool(
        "check", "", {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}, lambda **a: "x"
    )
    reg = ToolRegistry([tool])
    t0 = time.monotonic()
    verdict = check_call(ToolCall("check", {"s": "a" * 60 + "!"}, ""), reg)
    assert not verdict.ok and "$.s" in verdict.message and time.monotonic() - t0 < 1.5
    assert check_call(ToolCall("check", {"s": "aaaa"}, ""), reg).ok


def test_a_value_under_format_regex_that_re_cannot_compile_fails_its_schema():
    reg = ToolRegistry(
        [
            Tool(
                "check",
                "",
                {"type": "object", "properties": {"r": {"type": "string", "format": "regex"}}},
                lambda **a: "x",
            )
        ]
    )
    for bad in ("a{99999999999999999999}", "(" * 3000 + ")" * 3000, "[z-a]"):
        verdict = check_call(ToolCall("check", {"r": bad}, ""), reg)
        assert not verdict.ok and "'regex'" in verdict.message, bad
    assert check_call(ToolCall("check", {"r": "^a+$"}, ""), reg).ok
