"""Real chat templates: flashmoe's rendering equals transformers' `apply_chat_template`, for the
conversations the agent loop builds (system prompt, tools, an assistant tool call with its
arguments in the form the template expects, the tool's result, a follow-up).

Templates available offline: tests/fixtures/reference/chat_templates (Qwen3, the Qwen3.5 family's XML
calls, DeepSeek-V3, SmolLM2), and GLM-4.6, Kimi-K2-Thinking and DeepSeek-V3.1 as published in
llama.cpp's models/templates (tests/fixtures/templates, sources in SOURCES.md there). No Mistral
template could be had offline (none ships in an installed package), so Mistral is not compared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from flashmoe.engine.runtime.tokenizer import Tokenizer
from flashmoe.cli.agent import AgentLoop
from flashmoe.tools.calls import ToolCall
from flashmoe.tools.parsers import parser_for_template

REFERENCE = Path(__file__).resolve().parent / "fixtures/reference"
TEMPLATES = REFERENCE / "chat_templates"
TOKENIZERS = REFERENCE / "tokenizers"
FIXTURES = Path(__file__).resolve().parent / "fixtures/templates"

# (template file, tokenizer folder it is rendered with, bos_token to use)
CASES = {
    "qwen3": ("qwen3_official_tokenizer_config.chat_template.jinja", "qwen3", None),
    "qwen3.5": ("qwen3.5-family_xml_toolcall.from_gguf.jinja", "qwen3", None),
    "deepseek_v3": ("deepseek_v3_tokenizer_config.chat_template.jinja", "qwen3", "<｜begin▁of▁sentence｜>"),
    "smollm2": ("smollm2_from_gguf.chat_template.jinja", "smollm2", "<|im_start|>"),
    "glm4.6": (FIXTURES / "GLM-4.6.jinja", "qwen3", None),
    "kimi_k2": (FIXTURES / "moonshotai-Kimi-K2-Thinking.jinja", "qwen3", None),
    "deepseek_v3.1": (FIXTURES / "deepseek-ai-DeepSeek-V3.1.jinja", "qwen3", "<｜begin▁of▁sentence｜>"),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather <in °C> & wind",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]


def folder_for(tmp: Path, case: str) -> Path:
    template, tok, bos = CASES[case]
    out = tmp / case
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZERS / tok / name, out / name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    cfg["bos_token"] = bos
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    shutil.copy(TEMPLATES / template, out / "chat_template.jinja")  # a Path in CASES stays as it is
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def both(request, tmp_path_factory):
    """(case, flashmoe's Tokenizer, transformers' tokenizer) on the same folder."""
    folder = folder_for(tmp_path_factory.mktemp("templates"), request.param)
    return request.param, Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))


class RecordingSession:
    """What AgentLoop adds to a conversation, as messages."""

    def __init__(self):
        self.messages: list[dict] = []

    def add(self, msg, **_):
        self.messages.append(msg)


class Registry:
    def definitions(self):
        return TOOLS


class Executor:
    registry = Registry()


def agent_messages(template: str, reply: str, calls: list[ToolCall], results: list[str]) -> tuple[list[dict], bool]:
    """The messages the agent loop records for one reply with calls and their results (its own
    code path: native templates get `tool_calls` and `tool` messages), and whether it hands the
    template `tools`."""
    session = RecordingSession()
    from flashmoe.tools.textstate import TextState

    parser = parser_for_template(template)
    loop = AgentLoop(session, Executor(), parser, template=template)
    state = TextState(parser, tools=TOOLS)  # what the loop fed the reply through
    state.feed(reply)
    state.finish()
    loop._record_calls(reply, calls, None, state)
    for call, content in zip(calls, results):
        loop._record_result(call, content)
    return session.messages, loop.native


def conversation(case: str, tok: Tokenizer) -> tuple[list[dict], list[dict] | None]:
    calls = [
        ToolCall("get_weather", {"city": "Paris & <Île>", "days": 2}, raw=""),
        ToolCall("read_file", {"path": "notes.txt"}, raw=""),
    ]
    # the reply as the model wrote it, in its own format
    if case == "glm4.6":
        reply = "Let me check." + "".join(
            f"<tool_call>{c.name}\n"
            + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in c.arguments.items())
            + "</tool_call>"
            for c in calls
        )
    elif case == "kimi_k2":
        reply = (
            "Let me check.<|tool_calls_section_begin|>"
            + "".join(
                f"<|tool_call_begin|>functions.{c.name}:{i}<|tool_call_argument_begin|>"
                f"{json.dumps(c.arguments, ensure_ascii=False)}<|tool_call_end|>"
                for i, c in enumerate(calls)
            )
            + "<|tool_calls_section_end|>"
        )
    elif case.startswith("deepseek_v3"):
        reply = (
            "Let me check.<｜tool▁calls▁begin｜>"
            + "\n".join(
                f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{c.name}\n```json\n{json.dumps(c.arguments, ensure_ascii=False)}"
                "\n```<｜tool▁call▁end｜>"
                for c in calls
            )
            + "<｜tool▁calls▁end｜>"
        )
    else:
        reply = "Let me check." + "".join(
            f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=False)}\n</tool_call>"
            for c in calls
        )
    recorded, native = agent_messages(
        tok.template_source, reply, calls, ['{"temp_c": 18, "wind": "3 m/s"}', "hello <|im_end|> notes"]
    )
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris, and what is in notes.txt?"},
        *recorded,
        {"role": "assistant", "content": "It is 18 °C; the notes say hello."},
        {"role": "user", "content": "Thanks. And Rome?"},
    ]
    return messages, TOOLS if native else None


def test_rendering_with_tools_calls_and_results_equals_transformers(both):
    case, ours, theirs = both
    messages, tools = conversation(case, ours)
    want = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    assert got == want
    assert "Paris & <Île>" in got  # the call's arguments reach the prompt, unescaped
    assert "hello <|im_end|> notes" in got


def test_rendering_ending_at_a_tool_result_equals_transformers(both):
    """The prompt of the reply that reads the results (the generation prompt follows a tool turn)."""
    case, ours, theirs = both
    messages, tools = conversation(case, ours)
    messages = messages[:-2]
    want = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True) == want


def test_rendering_without_tools_equals_transformers(both):
    case, ours, theirs = both
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == want


def test_deepseek_gets_its_arguments_as_a_json_string_and_qwen_as_an_object(tmp_path):
    """DeepSeek's template concatenates `arguments` (a dict would raise), Qwen's iterates it."""
    ds = Tokenizer.from_folder(folder_for(tmp_path, "deepseek_v3"))
    messages, _ = conversation("deepseek_v3", ds)
    call = next(m for m in messages if m.get("tool_calls"))["tool_calls"][0]["function"]
    assert isinstance(call["arguments"], str) and json.loads(call["arguments"])["city"] == "Paris & <Île>"
    text = ds.apply_chat_template(messages)
    assert '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris & <Île>", "days": 2}\n```' in text
    qw = Tokenizer.from_folder(folder_for(tmp_path, "qwen3"))
    messages, _ = conversation("qwen3", qw)
    call = next(m for m in messages if m.get("tool_calls"))["tool_calls"][0]["function"]
    assert call["arguments"] == {"city": "Paris & <Île>", "days": 2}


def test_deepseek_system_prompt_and_parser_agree(tmp_path):
    """DeepSeek's template renders no tool definitions, so the agent describes the tools in the
    system prompt: in the format its parser reads (DeepSeek's markers), not Qwen's <tool_call>."""
    from flashmoe.cli.agent import tool_instructions

    ds = Tokenizer.from_folder(folder_for(tmp_path, "deepseek_v3"))
    parser = parser_for_template(ds.template_source)
    assert parser.name == "deepseek_v3"
    session = RecordingSession()
    loop = AgentLoop(session, Executor(), parser, template=ds.template_source)
    assert not loop.native  # the template has no `tools`
    instructions = tool_instructions(TOOLS, parser, native_results=loop.native_calls)
    assert parser.tool_call_start in instructions
    assert "<tool_call>" not in instructions
    assert "get_weather" in instructions and "<tool_response>" not in instructions  # results come natively
    # and a call written the way the instructions say parses
    example = instructions[instructions.index(parser.tool_call_start) :].split("\n\n")[0]
    written = example.replace("<function-name>", "get_weather").replace("<args-json-object>", '{"city": "Rome"}')
    [call] = parser.parse_tool_call(written)
    assert (call.name, call.arguments) == ("get_weather", {"city": "Rome"})
