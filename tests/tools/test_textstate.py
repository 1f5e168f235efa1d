"""The streaming state machine: markers split at every offset never leak into visible text."""

from __future__ import annotations

import pytest

from flashmoe.tools.parsers import deepseek_v3, json_tools, mistral, plain_json, qwen3_coder
from flashmoe.tools.textstate import Segment, TextState, split_reply

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_CALL = f'{B}{CB}function{SEP}read_file\n```json\n{{"path": "a"}}\n```{CE}{E}'
HERMES = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a<b>.txt"}}\n</tool_call>'
XML = "<tool_call>\n<function=read_file>\n<parameter=path>\n<tool>.txt\n</parameter>\n</function>\n</tool_call>"
BARE = "<function=read_file>\n<parameter=path>\na\n</parameter>\n</function>"
R1_CALL = f'<｜tool_calls_begin｜>{CB}function{SEP}read_file\n```json\n{{"path": "a"}}\n```{CE}{E}'
R1_SHORT = f"<｜tool▁calls｜>{CB}function{SEP}list_dir\n```json\n{{}}\n```{CE}{E}"
# A file whose content shows a tool call, and a value holding a stray </tool_call>.
NESTED = (
    "<tool_call>\n<function=write_file>\n<parameter=path>\nREADME.md\n</parameter>\n"
    "<parameter=content>\nCall it so:\n<tool_call>\n<function=read_file>\n<parameter=path>\nx\n"
    "</parameter>\n</function>\n</tool_call>\nThat is all.\n</parameter>\n</function>\n</tool_call>"
)
STRAY = (
    "<tool_call>\n<function=write_file>\n<parameter=content>\nend with </tool_call> here\n</parameter>\n"
    "</function>\n</tool_call>"
)
NO_PARAM_END = "<tool_call>\n<function=read_file>\n<parameter=path>\na\n</function>\n</tool_call>"
PJ_A = '{"name": "read_file", "arguments": {"path": "a"}}'
PJ_B = '{"name": "list_dir", "arguments": {}}'
PJ_UNKNOWN = '{"name": "delete_all", "arguments": {}}'
PJ_BAD_ARGS = '{"name": "read_file", "arguments": {"path": 3}}'
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": p}}
    for n, p in (
        ("read_file", {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
        ("list_dir", {"type": "object", "properties": {}}),
    )
]

# (parser, reply, kwargs, expected visible text, expected reasoning, expected raw calls)
CASES = [
    (
        json_tools,
        "<think>Let me <b>check</b> the <tool_call> idea.</think>I'll read it.\n" + HERMES + "\nDone <t.",
        {},
        "I'll read it.\n\nDone <t.",
        "Let me <b>check</b> the <tool_call> idea.",
        [HERMES],
    ),
    (json_tools, HERMES + HERMES, {}, "", "", [HERMES, HERMES]),
    (
        json_tools,
        "a < b and <tool but not a call; </thinking> <thin",
        {},
        "a < b and <tool but not a call; </thinking> <thin",
        "",
        [],
    ),
    (json_tools, "reasoning first</think>answer", {"in_reasoning": True}, "answer", "reasoning first", []),
    (json_tools, 'cut off <tool_call>\n{"name": "x"', {}, "cut off ", "", ['<tool_call>\n{"name": "x"']),
    (qwen3_coder, "<think>\n\n</think>\n\nSure.\n" + XML, {}, "\n\nSure.\n", "\n\n", [XML]),
    (
        mistral,
        'Checking. [TOOL_CALLS]read_file[ARGS]{"path": "[x]"}[TOOL_CALLS]list_dir[ARGS]{}',
        {},
        "Checking. ",
        "",
        ['[TOOL_CALLS]read_file[ARGS]{"path": "[x]"}[TOOL_CALLS]list_dir[ARGS]{}'],
    ),
    (mistral, "An [TOOL] that is not [TOOL_CALL", {}, "An [TOOL] that is not [TOOL_CALL", "", []),
    (
        deepseek_v3,
        "<think>hm</think>Reading.<｜tool▁call" + "s are odd " + DS_CALL + " ok",
        {},
        "Reading.<｜tool▁calls are odd  ok",
        "hm",
        [DS_CALL],
    ),
    (
        plain_json,
        '<think>x</think>\n{"name": "read_file", "arguments": {"path": "a"}}\n',
        {},
        "",
        "x",
        ['\n{"name": "read_file", "arguments": {"path": "a"}}\n'],
    ),
    (
        plain_json,
        '```json\n{"name": "read_file", "arguments": {}}\n```',
        {},
        "",
        "",
        ['```json\n{"name": "read_file", "arguments": {}}\n```'],
    ),
    (plain_json, '{"a": 1} is a JSON object.', {}, '{"a": 1} is a JSON object.', "", []),
    (plain_json, "  Just text with {braces}.", {}, "  Just text with {braces}.", "", []),
    (plain_json, "```python\nprint(1)\n```", {}, "```python\nprint(1)\n```", "", []),
    # Reasoning the prompt opened: a call written inside it is not a call; the one after it is.
    (
        qwen3_coder,
        "Maybe " + XML + " first?</think>\n\nReading.\n" + XML,
        {"in_reasoning": "<think>"},
        "\n\nReading.\n",
        "Maybe " + XML + " first?",
        [XML],
    ),
    (
        deepseek_v3,
        "try " + DS_CALL + "</think>Now." + DS_CALL,
        {"in_reasoning": "<think>"},
        "Now.",
        "try " + DS_CALL,
        [DS_CALL],
    ),
    # Mistral / Magistral reasoning, written by the model or opened by the prompt.
    (
        mistral,
        "[THINK]use [TOOL_CALLS]x[ARGS]{}?[/THINK]Sure.[TOOL_CALLS]list_dir[ARGS]{}",
        {},
        "Sure.",
        "use [TOOL_CALLS]x[ARGS]{}?",
        ["[TOOL_CALLS]list_dir[ARGS]{}"],
    ),
    (mistral, "hm </think>[/THINK]ok", {"in_reasoning": "[THINK]"}, "ok", "hm </think>", []),
    # A call shown in a fenced code block is text; the real one after the fence is a call.
    (
        json_tools,
        "Like this:\n```xml\n" + HERMES + "\n```\nNow:\n" + HERMES,
        {},
        "Like this:\n```xml\n" + HERMES + "\n```\nNow:\n",
        "",
        [HERMES],
    ),
    (
        qwen3_coder,
        "~~~~\n" + XML + "\n~~~\nstill in\n~~~~\n" + XML,
        {},
        "~~~~\n" + XML + "\n~~~\nstill in\n~~~~\n",
        "",
        [XML],
    ),
    (
        mistral,
        "  ```\n[TOOL_CALLS]f[ARGS]{}\n  ```\n[TOOL_CALLS]g[ARGS]{}",
        {},
        "  ```\n[TOOL_CALLS]f[ARGS]{}\n  ```\n",
        "",
        ["[TOOL_CALLS]g[ARGS]{}"],
    ),
    # Backticks inside a line open no fence; a fence left open runs to the end as text.
    (
        json_tools,
        "say ``` here " + HERMES + " and\n```\n" + HERMES,
        {},
        "say ``` here  and\n```\n" + HERMES,
        "",
        [HERMES],
    ),
    (deepseek_v3, "```\n" + DS_CALL, {}, "```\n" + DS_CALL, "", []),
    # Issue 13.1: several start markers. Qwen3-Coder without the <tool_call> wrapper (a stray
    # </tool_call> after it belongs to the call); DeepSeek-R1's variant opening markers.
    (qwen3_coder, "Sure.\n" + BARE + "\nDone <fun.", {}, "Sure.\n\nDone <fun.", "", [BARE]),
    (qwen3_coder, BARE + "\n</tool_call>" + BARE, {}, "", "", [BARE + "\n</tool_call>", BARE]),
    (qwen3_coder, "```\n" + BARE + "\n```", {}, "```\n" + BARE + "\n```", "", []),
    (deepseek_v3, "Ok." + R1_CALL + " done", {}, "Ok. done", "", [R1_CALL]),
    (deepseek_v3, R1_SHORT + "\n" + R1_CALL, {}, "\n", "", [R1_SHORT, R1_CALL]),
    # Issue 13.2: a Qwen3-Coder call ends at its own </tool_call>, not at one inside a value.
    (qwen3_coder, NESTED + " after", {}, " after", "", [NESTED]),
    (qwen3_coder, STRAY + "\n" + XML, {}, "\n", "", [STRAY, XML]),
    (
        qwen3_coder,
        "<tool_call>\n" + HERMES[12:-13] + "\n</tool_call> ok",
        {},
        " ok",
        "",
        ["<tool_call>\n" + HERMES[12:-13] + "\n</tool_call>"],
    ),
    # ... and a call whose value lost its </parameter> ends where parse_tool_call reads it.
    (qwen3_coder, NO_PARAM_END + "\nDone.", {}, "\nDone.", "", [NO_PARAM_END]),
    (qwen3_coder, NESTED[:60], {}, "", "", [NESTED[:60]]),
    # Issue 13.3: plain JSON with several call objects.
    (plain_json, PJ_A + ";\n" + PJ_B, {}, "", "", [PJ_A + ";\n" + PJ_B]),
    (plain_json, PJ_A + "\n" + PJ_B + "\n", {}, "", "", [PJ_A + "\n" + PJ_B + "\n"]),
    # Issue 40: Llama 3.x calls with prose around them are calls (vLLM's llama3_json, SGLang);
    # the text stays text too.
    (plain_json, PJ_A + "\nThat is the call.", {}, PJ_A + "\nThat is the call.", "", [PJ_A]),
    (plain_json, PJ_A + '\n{"answer": 1}', {}, PJ_A + '\n{"answer": 1}', "", [PJ_A]),
    # Issue 13.4: Hermes near-misses, accepted only when the whole reply is the call.
    (json_tools, PJ_A, {"tools": TOOLS}, "", "", [PJ_A]),
    (json_tools, " ```json\n" + PJ_A + "\n```\n", {"tools": TOOLS}, "", "", [" ```json\n" + PJ_A + "\n```\n"]),
    (
        json_tools,
        "Like this:\n```json\n" + PJ_A + "\n```",
        {"tools": TOOLS},
        "Like this:\n```json\n" + PJ_A + "\n```",
        "",
        [],
    ),
    (
        json_tools,
        "```json\n" + PJ_A + "\n```\nThat reads it.",
        {"tools": TOOLS},
        "```json\n" + PJ_A + "\n```\nThat reads it.",
        "",
        [],
    ),
    (json_tools, PJ_A + "\nThen I will answer.", {"tools": TOOLS}, PJ_A + "\nThen I will answer.", "", []),
    (json_tools, PJ_A, {}, PJ_A, "", []),  # no tools: nothing to check the name against
    (json_tools, PJ_UNKNOWN, {"tools": TOOLS}, PJ_UNKNOWN, "", []),
    (json_tools, PJ_BAD_ARGS, {"tools": TOOLS}, PJ_BAD_ARGS, "", []),  # fails the schema
    (json_tools, PJ_A + "\n" + PJ_B, {"tools": TOOLS}, PJ_A + "\n" + PJ_B, "", []),  # more than one
    (json_tools, '{"name": "read_file"}', {"tools": TOOLS}, '{"name": "read_file"}', "", []),  # no arguments
    (json_tools, PJ_A + "\n" + HERMES, {"tools": TOOLS}, PJ_A + "\n", "", [HERMES]),
]


def run(parser, chunks, **kw):
    st = TextState(parser, **kw)
    segs: list[Segment] = []
    for c in chunks:
        segs += st.feed(c)
    segs += st.finish()
    text = "".join(s.text for s in segs if s.kind == "text")
    reasoning = "".join(s.text for s in segs if s.kind == "reasoning")
    calls = [s.text for s in segs if s.kind == "tool_call"]
    assert (text, reasoning, calls) == (st.text, st.reasoning, st.tool_calls)
    return text, reasoning, calls


@pytest.mark.parametrize("parser, reply, kw, text, reasoning, calls", CASES)
def test_unsplit(parser, reply, kw, text, reasoning, calls):
    assert run(parser, [reply], **kw) == (text, reasoning, calls)
    r = split_reply(reply, parser, **kw)
    assert (r.text, r.reasoning, r.tool_calls) == (text, reasoning, calls)


@pytest.mark.parametrize("parser, reply, kw, text, reasoning, calls", CASES)
def test_split_at_every_offset(parser, reply, kw, text, reasoning, calls):
    expected = (text, reasoning, calls)
    for i in range(len(reply) + 1):
        assert run(parser, [reply[:i], reply[i:]], **kw) == expected, f"split at {i}"
    assert run(parser, list(reply), **kw) == expected, "one character at a time"


@pytest.mark.parametrize("parser, reply, kw, text, reasoning, calls", CASES)
def test_split_three_ways(parser, reply, kw, text, reasoning, calls):
    expected = (text, reasoning, calls)
    n = len(reply)
    for i in range(0, n + 1, 3):
        for j in range(i, min(n, i + 30) + 1):
            assert run(parser, [reply[:i], reply[i:j], reply[j:]], **kw) == expected, f"split at {i},{j}"


def test_utf8_bytes_split_anywhere():
    """Bytes decoded incrementally (as a streaming detokenizer would) give the same result."""
    import codecs

    reply = "<think>…</think>Ça va " + DS_CALL + " fin"
    data = reply.encode()
    expected = run(deepseek_v3, [reply])
    for i in range(len(data) + 1):
        dec = codecs.getincrementaldecoder("utf-8")()
        chunks = [dec.decode(data[:i]), dec.decode(data[i:], final=True)]
        assert run(deepseek_v3, chunks) == expected


def test_partial_marker_held_back_then_released():
    st = TextState(json_tools)
    assert st.feed("Hello <tool") == [Segment("text", "Hello ")]
    assert st.feed("box>") == [Segment("text", "<toolbox>")]
    assert st.feed(" <tool_") == [Segment("text", " ")]
    out = st.feed("call>{}")
    assert out == [Segment("tool_call_begin", "<tool_call>")]
    assert st.feed("</tool_call>") == [Segment("tool_call", "<tool_call>{}</tool_call>")]


def test_unterminated_call_is_flagged():
    st = TextState(json_tools)
    st.feed("<tool_call>{")
    assert st.finish() == [Segment("tool_call", "<tool_call>{", closed=False)]
    st = TextState(mistral)
    st.feed("[TOOL_CALLS]f[ARGS]{}")
    assert st.finish() == [Segment("tool_call", "[TOOL_CALLS]f[ARGS]{}", closed=True)]


def test_bare_json_reply_is_held_until_decided():
    st = TextState(plain_json)
    assert st.feed('{"name": "x", "arguments": {}') == []
    assert st.feed("} and more") == [Segment("text", '{"name": "x", "arguments": {}} and more')]
    st = TextState(plain_json)
    assert st.feed("Hi {") == [Segment("text", "Hi {")]


def test_reply_cut_off_inside_reasoning():
    st = TextState(qwen3_coder, in_reasoning="<think>")
    segs = st.feed("I will call <tool_call>\n<function=read_file>") + st.finish()
    assert st.ended_in_reasoning and st.tool_calls == [] and st.text == ""
    assert [s.kind for s in segs] == ["reasoning"] * len(segs)
    st = TextState(qwen3_coder, in_reasoning="<think>")
    st.feed("done</think>ok")
    st.finish()
    assert not st.ended_in_reasoning


def test_unknown_opening_marker_starts_in_text():
    st = TextState(json_tools, in_reasoning="<nothing>")
    assert st.feed("hello") == [Segment("text", "hello")]


def test_feed_after_finish_raises():
    st = TextState(json_tools)
    st.finish()
    with pytest.raises(RuntimeError):
        st.feed("x")


@pytest.mark.parametrize(
    "reply", ["[see the docs](http://x) for more", '{"answer": 42} it is.', "{ not json", "```python\nx = 1"]
)
def test_non_call_replies_stream_before_the_end(reply):
    st = TextState(plain_json)
    out = st.feed(reply)
    assert "".join(s.text for s in out if s.kind == "text") == reply


def test_bare_call_prefix_is_held():
    st = TextState(plain_json)
    assert st.feed('```json\n[{"na') == []
    assert st.feed('me": "list_dir", "arguments": {}}]\n```') == []
    assert st.finish() == [Segment("tool_call", '```json\n[{"name": "list_dir", "arguments": {}}]\n```')]


def test_nested_tool_call_in_a_value_does_not_close_the_call():
    """Streamed, the inner </tool_call> of a file's content leaves the call open (issue 13.2)."""
    st = TextState(qwen3_coder)
    inner_end = NESTED.index("</tool_call>") + len("</tool_call>")
    assert st.feed(NESTED[:inner_end] + "\n") == [Segment("tool_call_begin", "<tool_call>")]
    assert st.feed(NESTED[inner_end + 1 :] + " ok") == [Segment("tool_call", NESTED), Segment("text", " ok")]
    calls = qwen3_coder.parse_tool_call(st.tool_calls[0])
    assert [c.name for c in calls] == ["write_file"] and "<tool_call>" in calls[0].arguments["content"]


def test_bare_function_opens_a_call():
    st = TextState(qwen3_coder)
    assert st.feed("Ok <function=") == [Segment("text", "Ok "), Segment("tool_call_begin", "<function=")]
    assert st.feed(BARE[len("<function=") :]) == []  # a </tool_call> may still follow
    assert st.feed(" next") == [Segment("tool_call", BARE), Segment("text", " next")]


def test_plain_json_several_calls_held_until_the_end():
    st = TextState(plain_json)
    assert st.feed(PJ_A + "\n") == []
    assert st.feed(PJ_B) == []
    assert st.finish() == [Segment("tool_call", PJ_A + "\n" + PJ_B)]
    assert [c.name for c in plain_json.parse_tool_call(st.tool_calls[0])] == ["read_file", "list_dir"]


def test_near_miss_is_held_then_decided():
    st = TextState(json_tools, tools=TOOLS)
    assert st.feed("```json\n" + PJ_A) == []
    assert st.feed("\n```") == []
    assert st.finish() == [Segment("tool_call", "```json\n" + PJ_A + "\n```")]
    assert [(c.name, c.arguments) for c in json_tools.parse_tool_call(st.tool_calls[0])] == [
        ("read_file", {"path": "a"})
    ]
    st = TextState(json_tools, tools=TOOLS)
    assert st.feed("```json\n" + PJ_A + "\n```\nLike") == [Segment("text", "```json\n" + PJ_A + "\n```\nLike")]
    st = TextState(json_tools, tools=TOOLS)  # prose first: streams at once, never a call
    assert st.feed("Use ") == [Segment("text", "Use ")]


def test_long_value_streams_in_linear_time():
    """find_call_end is not re-run over the whole call for every token."""
    import time

    body = "<tool_call>\n<function=write_file>\n<parameter=content>\n" + "<div>a</div>\n" * 8000  # tags galore
    st = TextState(qwen3_coder)
    t = time.perf_counter()
    for i in range(0, len(body), 4):
        st.feed(body[i : i + 4])
    st.feed("</parameter>\n</function>\n</tool_call>")
    assert time.perf_counter() - t < 5 and len(st.tool_calls) == 1
