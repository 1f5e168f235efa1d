"""Parser tables: every format, valid / multiple calls / malformed; template sniffing."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers import (
    deepseek_v3,
    PARSERS,
    get_parser,
    json_tools,
    mistral,
    parser_for_template,
    plain_json,
    qwen3_coder,
    sniff_template,
)

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "tests" / "fixtures" / "reference" / "chat_templates"
FIXTURES = REPO / "tests" / "fixtures" / "templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "offset": {"type": "integer"},
                    "limit": {"type": ["integer", "null"]},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "configure",
            "description": "",
            "parameters": {
                "type": "object",
                "properties": {
                    "ratio": {"type": "number"},
                    "verbose": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "label": {"type": "string"},
                    "mode": {"enum": ["fast", "slow"]},
                    "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                },
            },
        },
    },
]


def _simple(calls: list[ToolCall]) -> list[tuple]:
    return [(c.name, c.arguments, c.error is not None, c.arguments_text) for c in calls]


# ---- Qwen3 / Hermes JSON -------------------------------------------------------------------------

HERMES_ONE = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, expected",
    [
        (HERMES_ONE, [("read_file", {"path": "a.txt"}, False, None)]),
        # the inside of a call only, as mlx-lm hands it over
        ('{"name": "read_file", "arguments": {"path": "a.txt"}}', [("read_file", {"path": "a.txt"}, False, None)]),
        # arguments as a JSON string (OpenAI habit)
        (
            '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"b\\"}"}</tool_call>',
            [("read_file", {"path": "b"}, False, None)],
        ),
        # no arguments -> {}
        ('<tool_call>{"name": "list_dir"}</tool_call>', [("list_dir", {}, False, None)]),
        # "parameters" instead of "arguments"
        (
            '<tool_call>{"name": "read_file", "parameters": {"path": "c"}}</tool_call>',
            [("read_file", {"path": "c"}, False, None)],
        ),
        # fenced
        (
            '<tool_call>\n```json\n{"name": "read_file", "arguments": {"path": "d"}}\n```\n</tool_call>',
            [("read_file", {"path": "d"}, False, None)],
        ),
        # a stray closing brace after a complete object
        (
            '<tool_call>{"name": "read_file", "arguments": {"path": "e"}}}</tool_call>',
            [("read_file", {"path": "e"}, False, None)],
        ),
        # two blocks
        (
            HERMES_ONE + "\n" + '<tool_call>\n{"name": "list_dir", "arguments": {}}\n</tool_call>',
            [("read_file", {"path": "a.txt"}, False, None), ("list_dir", {}, False, None)],
        ),
        # two objects in one block
        (
            '<tool_call>\n{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>',
            [("a", {}, False, None), ("b", {"x": 1}, False, None)],
        ),
        # malformed: truncated JSON keeps name and the arguments text for validation
        (
            '<tool_call>{"name": "read_file", "arguments": {"path": "a.txt"</tool_call>',
            [("read_file", None, True, '{"path": "a.txt"')],
        ),
        # malformed: the low-bit backslash quoting
        (
            "<tool_call>\n{\\name\\: \\read_file\\, \\arguments\\: {\\path\\: \\x.txt\\}}\n</tool_call>",
            [("read_file", None, True, "{\\path\\: \\x.txt\\}")],
        ),
        # malformed: no name
        ('<tool_call>{"arguments": {}}</tool_call>', [(None, None, True, None)]),
        ("<tool_call>[1, 2]</tool_call>", [(None, None, True, None), (None, None, True, None)]),
        ("<tool_call>\n\n</tool_call>", [(None, None, True, None)]),
        # arguments that are not an object
        ('<tool_call>{"name": "read_file", "arguments": [1]}</tool_call>', [("read_file", None, True, "[1]")]),
        # unterminated block (reply cut off)
        ('<tool_call>\n{"name": "read_file", "arguments": {"path": "z"}}', [("read_file", {"path": "z"}, False, None)]),
    ],
)
def test_json_tools(text, expected):
    assert _simple(json_tools.parse_tool_call(text)) == expected


def test_raw_is_verbatim():
    text = "Let me look.\n" + HERMES_ONE + "\n  " + '<tool_call> {"name":"b","arguments":{}} </tool_call>'
    calls = json_tools.parse_tool_call(text)
    assert [c.raw for c in calls] == [HERMES_ONE, '<tool_call> {"name":"b","arguments":{}} </tool_call>']
    assert json_tools.parse_tool_call(HERMES_ONE)[0].raw == HERMES_ONE


# ---- Qwen3.5 / Qwen3-Coder XML -------------------------------------------------------------------


def xml(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize(
    "text, expected",
    [
        (xml("read_file", path="a.txt"), [("read_file", {"path": "a.txt"}, False, None)]),
        # coercion by schema
        (
            xml("read_file", path="12", offset="3", limit="null"),
            [("read_file", {"path": "12", "offset": 3, "limit": None}, False, None)],
        ),
        (xml("read_file", path="p", limit="7"), [("read_file", {"path": "p", "limit": 7}, False, None)]),
        (
            xml(
                "configure",
                ratio="0.5",
                verbose="True",
                opts='{"a": [1, 2]}',
                tags='["x", "y"]',
                label="42",
                mode="fast",
                n="9",
            ),
            [
                (
                    "configure",
                    {
                        "ratio": 0.5,
                        "verbose": True,
                        "opts": {"a": [1, 2]},
                        "tags": ["x", "y"],
                        "label": "42",
                        "mode": "fast",
                        "n": 9,
                    },
                    False,
                    None,
                )
            ],
        ),
        (
            xml("configure", ratio="3", verbose="false", n="null"),
            [("configure", {"ratio": 3, "verbose": False, "n": None}, False, None)],
        ),
        # uncoercible stays a string (validation reports it)
        (xml("read_file", path="p", offset="three"), [("read_file", {"path": "p", "offset": "three"}, False, None)]),
        # unknown tool / param: strings
        (xml("other", count="5"), [("other", {"count": "5"}, False, None)]),
        # multi-line value kept verbatim apart from the template's own newlines
        (
            xml("write_file", path="f.py", content="def f():\n    return 1\n"),
            [("write_file", {"path": "f.py", "content": "def f():\n    return 1\n"}, False, None)],
        ),
        # no newlines around values
        (
            "<tool_call><function=read_file><parameter=path>a b</parameter></function></tool_call>",
            [("read_file", {"path": "a b"}, False, None)],
        ),
        # missing </parameter> and </function>
        (
            "<tool_call>\n<function=read_file>\n<parameter=path>\nq.txt\n<parameter=offset>\n4\n</tool_call>",
            [("read_file", {"path": "q.txt", "offset": 4}, False, None)],
        ),
        # two calls, separate blocks
        (
            xml("list_dir") + "\n" + xml("read_file", path="a"),
            [("list_dir", {}, False, None), ("read_file", {"path": "a"}, False, None)],
        ),
        # two functions in one block
        (
            "<tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
            [("a", {}, False, None), ("b", {"x": "1"}, False, None)],
        ),
        # JSON fallback inside <tool_call>
        (
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "j"}}\n</tool_call>',
            [("read_file", {"path": "j"}, False, None)],
        ),
        # malformed
        ("<tool_call>\nread_file path=a\n</tool_call>", [(None, None, True, None)]),
        ("<tool_call><function=>\n</function></tool_call>", [(None, None, True, None)]),
        (
            "<tool_call><function=f><parameter=a>1</parameter><parameter=a>2</parameter></function></tool_call>",
            [("f", None, True, None)],
        ),
    ],
)
def test_qwen3_coder(text, expected):
    assert _simple(qwen3_coder.parse_tool_call(text, TOOLS)) == expected


def test_qwen3_coder_accepts_registry():
    from flashmoe.tools.registry import Tool, ToolRegistry

    reg = ToolRegistry([Tool("t", "", {"type": "object", "properties": {"n": {"type": "integer"}}}, lambda n: n)])
    assert qwen3_coder.parse_tool_call(xml("t", n="5"), reg)[0].arguments == {"n": 5}


def test_qwen3_coder_without_schema_keeps_strings():
    assert qwen3_coder.parse_tool_call(xml("read_file", offset="3"))[0].arguments == {"offset": "3"}


# ---- Mistral -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            '[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "a"}}]',
            [("read_file", {"path": "a"}, False, None)],
        ),
        (
            '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 2}, "id": "abc123XYZ"}]',
            [("a", {}, False, None), ("b", {"x": 2}, False, None)],
        ),
        ('[TOOL_CALLS]read_file[ARGS]{"path": "a"}', [("read_file", {"path": "a"}, False, None)]),
        ('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"x": 1}', [("a", {}, False, None), ("b", {"x": 1}, False, None)]),
        ('[TOOL_CALLS]read_file[CALL_ID]k3Y9abcde[ARGS]{"path": "a"}', [("read_file", {"path": "a"}, False, None)]),
        # malformed
        ('[TOOL_CALLS]read_file[ARGS]{"path": ', [("read_file", None, True, '{"path":')]),
        ("[TOOL_CALLS]read_file[ARGS]{\\path\\: \\a\\}", [("read_file", None, True, "{\\path\\: \\a\\}")]),
        ('[TOOL_CALLS]read_file{"path": "a"}', [("read_file", {"path": "a"}, False, None)]),  # [ARGS] dropped
        ('[TOOL_CALLS]  junk [{"name": "a", "arguments": {}}] trail', [("a", {}, False, None)]),
        ("[TOOL_CALLS]read_file", [(None, None, True, None)]),
        ('[TOOL_CALLS][{"name": "a", "arguments": {"x": }]', [("a", None, True, '{"x": }')]),
        ("[TOOL_CALLS]", [(None, None, True, None)]),
    ],
)
def test_mistral(text, expected):
    assert _simple(mistral.parse_tool_call(text)) == expected


def test_mistral_call_id_kept():
    assert mistral.parse_tool_call("[TOOL_CALLS]f[CALL_ID]id9[ARGS]{}")[0].id == "id9"


# ---- DeepSeek V3 ---------------------------------------------------------------------------------

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds(name, args_json):
    return f"{CB}function{SEP}{name}\n```json\n{args_json}\n```{CE}"


@pytest.mark.parametrize(
    "text, expected",
    [
        (B + ds("read_file", '{"path": "a"}') + E, [("read_file", {"path": "a"}, False, None)]),
        (B + ds("a", "{}") + "\n" + ds("b", '{"x": 1}') + E, [("a", {}, False, None), ("b", {"x": 1}, False, None)]),
        # V3.1 style
        (f'{B}{CB}read_file{SEP}{{"path": "a"}}{CE}{E}', [("read_file", {"path": "a"}, False, None)]),
        # unterminated (cut off)
        (
            B + CB + "function" + SEP + 'read_file\n```json\n{"path": "a"}\n```',
            [("read_file", {"path": "a"}, False, None)],
        ),
        # malformed
        (B + ds("read_file", '{"path": ') + E, [("read_file", None, True, '{"path":')]),
        (B + ds("read_file", "[1]") + E, [("read_file", None, True, "[1]")]),
        (B + CB + "function read_file" + CE + E, [(None, None, True, None)]),
    ],
)
def test_deepseek_v3(text, expected):
    assert _simple(deepseek_v3.parse_tool_call(text)) == expected


# ---- plain JSON fallback -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"name": "read_file", "arguments": {"path": "a"}}', [("read_file", {"path": "a"}, False, None)]),
        (
            '```json\n{"name": "read_file", "arguments": {"path": "a"}}\n```',
            [("read_file", {"path": "a"}, False, None)],
        ),
        (
            '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]',
            [("a", {}, False, None), ("b", {}, False, None)],
        ),
        (
            "{\\name\\: \\read_file\\, \\arguments\\: {\\path\\: \\x\\}}",
            [("read_file", None, True, "{\\path\\: \\x\\}")],
        ),
        # not calls
        ("The answer is 4.", []),
        ('{"name": "Ada", "born": 1815}', []),
        ('Here: {"name": "read_file", "arguments": {}}', []),
    ],
)
def test_plain_json(text, expected):
    assert _simple(plain_json.parse_tool_call(text)) == expected


def test_plain_json_requires_known_tool_when_tools_given():
    assert plain_json.parse_tool_call('{"name": "Ada", "arguments": {}}', TOOLS) == []
    assert plain_json.parse_tool_call('{"name": "read_file", "arguments": {"path": "a"}}', TOOLS)[0].name == "read_file"


# ---- sniffing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fname, module",
    [
        ("qwen3_official_tokenizer_config.chat_template.jinja", json_tools),
        ("qwen3.5-family_xml_toolcall.from_gguf.jinja", qwen3_coder),
        ("deepseek_v3_tokenizer_config.chat_template.jinja", deepseek_v3),
        ("smollm2_from_gguf.chat_template.jinja", plain_json),
    ],
)
def test_parser_for_reference_templates(fname, module):
    assert parser_for_template((TEMPLATES / fname).read_text(encoding="utf-8")) is module


@pytest.mark.parametrize(
    "fname, name",
    [
        ("GLM-4.6.jinja", "glm47"),  # holds <tool_call> too: must not be taken for Hermes JSON
        ("moonshotai-Kimi-K2-Thinking.jinja", "kimi_k2"),
        ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v3"),
    ],
)
def test_sniff_fixture_templates(fname, name):
    assert sniff_template((FIXTURES / fname).read_text(encoding="utf-8")) == name


@pytest.mark.parametrize(
    "template, name",
    [
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{- '<tool_call>\\n' + tool_call | tojson }}", "json_tools"),
        ("{{- '<tool_call>\\n<function=' + name }}", "qwen3_coder"),
        ("<minimax:tool_call>\n<invoke name=", "minimax_m2"),
        ("{{ '<|tool_call>call:' }}...{{ '<tool_call|>' }}", "gemma4"),
        ("<start_function_call>call:", "function_gemma"),
        ("<longcat_tool_call>{{ name }}<longcat_arg_key>", "longcat"),
        ("<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key>", "glm47"),
        ("<|tool_call_start|>[", "pythonic"),
        ("<|tool_calls_section_begin|><|tool_call_begin|>", "kimi_k2"),
        ('<function name="{{ n }}"><param name="', "minicpm5"),
        ("<atem:function_calls>", "muse_spark"),
        ("<|open|>tools<|sep|>", "kimi_k3"),
        ("<|im_start|>", None),
        ("", None),
    ],
)
def test_sniff(template, name):
    assert sniff_template(template) == name


def test_parser_for_template_fallback_and_names():
    assert parser_for_template(None) is plain_json
    assert parser_for_template("", fallback=json_tools) is json_tools
    assert get_parser("hermes") is json_tools
    with pytest.raises(Exception, match="unknown tool-call format 'nope'"):
        get_parser("nope")


@pytest.mark.parametrize("module", list(PARSERS.values()), ids=list(PARSERS))
def test_module_surface(module):
    assert isinstance(module.tool_call_start, str) and isinstance(module.tool_call_end, str)
    assert callable(module.parse_tool_call)


# ---- the formats added for issue 13 ---------------------------------------------------------------

from flashmoe.tools.parsers import (  # noqa: E402
    function_gemma,
    gemma4,
    glm47,
    kimi_k2,
    kimi_k3,
    longcat,
    minicpm5,
    minimax_m2,
    muse_spark,
    parse_reply,
    pythonic,
)

GLM_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "s": {"type": "string"},
                    "n": {"type": "integer"},
                    "o": {"type": "object"},
                    "ns": {"type": ["string", "null"]},
                },
            },
        },
    }
]


@pytest.mark.parametrize(
    "module, text, expected",
    [
        (
            glm47,
            "<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>42</arg_value>\n<arg_key>n</arg_key>\n<arg_value>42"
            "</arg_value>\n<arg_key>o</arg_key><arg_value>{'a': 1}</arg_value></tool_call>",
            [("f", {"s": "42", "n": 42, "o": {"a": 1}}, False, None)],
        ),
        (
            glm47,
            "<tool_call>f<arg_key>ns</arg_key><arg_value>null</arg_value></tool_call>",
            [("f", {"ns": None}, False, None)],
        ),
        (
            glm47,
            "<tool_call>f<arg_key>s</arg_key><arg_value>a</arg_value><arg_key>s</arg_key><arg_value>b</arg_value>"
            "</tool_call>",
            [("f", None, True, None)],
        ),
        (glm47, "<tool_call><arg_key>s</arg_key><arg_value>a</arg_value></tool_call>", [(None, None, True, None)]),
        (
            longcat,
            "<longcat_tool_call>f<longcat_arg_key>n</longcat_arg_key><longcat_arg_value>7</longcat_arg_value>"
            "</longcat_tool_call>",
            [("f", {"n": 7}, False, None)],
        ),
        (
            minimax_m2,
            '<minimax:tool_call><invoke name="f"><parameter name="n">3</parameter><parameter name="s">3'
            "</parameter></invoke></minimax:tool_call>",
            [("f", {"n": 3, "s": "3"}, False, None)],
        ),
        (minimax_m2, "<minimax:tool_call>\n</minimax:tool_call>", [(None, None, True, None)]),
        (
            minicpm5,
            '<function name="f"><param name="s"><![CDATA[a < b & c]]></param><param name="n">2</param></function>',
            [("f", {"s": "a < b & c", "n": 2}, False, None)],
        ),
        (
            muse_spark,
            '<atem:function_calls><atem:invoke name="f"><atem:parameter name="s">x</atem:parameter>'
            "</atem:invoke></atem:function_calls>",
            [("f", {"s": "x"}, False, None)],
        ),
        (
            kimi_k2,
            '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"n": 1}'
            "<|tool_call_end|><|tool_calls_section_end|>",
            [("f", {"n": 1}, False, None)],
        ),
        (
            kimi_k2,
            '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"n": '
            "<|tool_call_end|><|tool_calls_section_end|>",
            [("f", None, True, '{"n":')],
        ),
        (
            kimi_k3,
            '<|open|>tools<|sep|><|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>{"n": 1}'
            "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
            [("f", None, False, '{"n": 1}')],
        ),
        (gemma4, '<|tool_call>call:f{s:<|"|>a, b}<|"|>,n:1}<tool_call|>', [("f", {"s": "a, b}", "n": 1}, False, None)]),
        (gemma4, '<|tool_call>call:f{s:<|"|>open<tool_call|>', [("f", None, True, None)]),
        (
            function_gemma,
            "<start_function_call>call:f{s:<escape>x<escape>}<end_function_call>",
            [("f", {"s": "x"}, False, None)],
        ),
        (
            pythonic,
            "<|tool_call_start|>[f(s='x', o={'a': null})]<|tool_call_end|>",
            [("f", {"s": "x", "o": {"a": None}}, False, None)],
        ),
        (pythonic, "<|tool_call_start|>[f(__import__('os'))]<|tool_call_end|>", [("f", None, True, None)]),
        (pythonic, "<|tool_call_start|>[f(s=open('x'))]<|tool_call_end|>", [("f", None, True, None)]),
    ],
)
def test_new_formats(module, text, expected):
    assert _simple(module.parse_tool_call(text, GLM_TOOLS)) == expected


# Qwen3-Coder, structure-aware: a value holding the format's own closing tags or a whole call.
INNER = "<tool_call>\n<function=read_file>\n<parameter=path>\na\n</parameter>\n</function>\n</tool_call>"
WRITE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "meta": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    }
]


@pytest.mark.parametrize(
    "content",
    [
        INNER,  # a file that documents a tool call
        "x = '</parameter>'\ny = 1",  # a lone closing tag, not followed by a parameter or </function>
        "see </function> and </tool_call> in the docs",
    ],
)
def test_qwen3_coder_value_holding_tags(content):
    text = xml("write_file", path="doc.md", content=content)
    assert _simple(qwen3_coder.parse_tool_call(text, WRITE_TOOLS)) == [
        ("write_file", {"path": "doc.md", "content": content}, False, None)
    ]


@pytest.mark.parametrize(
    "value, expected",
    [
        ('"{\\"a\\": 1}"', {"a": 1}),  # JSON encoded twice
        ("{'a': True, 'b': None}", {"a": True, "b": None}),  # a Python literal
    ],
)
def test_qwen3_coder_object_values(value, expected):
    assert qwen3_coder.parse_tool_call(xml("write_file", meta=value), WRITE_TOOLS)[0].arguments == {"meta": expected}


def test_qwen3_coder_nullable_and_plain_strings():
    args = qwen3_coder.parse_tool_call(xml("write_file", note="null", content="null"), WRITE_TOOLS)[0].arguments
    assert args == {"note": None, "content": "null"}  # only a nullable string turns null into None


def test_qwen3_coder_without_tool_call_wrapper():
    text = "<function=read_file>\n<parameter=path>\na\n</parameter>\n</function>"
    assert _simple(qwen3_coder.parse_tool_call(text, TOOLS)) == [("read_file", {"path": "a"}, False, None)]


@pytest.mark.parametrize(
    "start", ["<｜tool_calls_begin｜>", "<｜tool calls begin｜>", "<｜tool\\_calls\\_begin｜>", "<｜tool▁calls｜>"]
)
def test_deepseek_r1_marker_variants(start):
    text = start + ds("read_file", '{"path": "a"}') + E
    assert _simple(deepseek_v3.parse_tool_call(text)) == [("read_file", {"path": "a"}, False, None)]


def test_parse_reply_drops_nameless_blocks_next_to_calls():
    good = '<tool_call>{"name": "read_file", "arguments": {"path": "a"}}</tool_call>'
    calls = parse_reply(json_tools, ["<tool_call>\n</tool_call>", good, "<tool_call>garbage</tool_call>"])
    assert [(c.name, c.arguments) for c in calls] == [("read_file", {"path": "a"})]
    broken = '<tool_call>{"name": "read_file", "arguments": {"path": </tool_call>'
    assert [c.name for c in parse_reply(json_tools, [good, broken])] == ["read_file", "read_file"]  # named: kept
    assert [c.error for c in parse_reply(json_tools, ["<tool_call></tool_call>"])] == ["empty tool call"]
