"""The chat app shows reasoning apart from the answer: dimmed, in a collapsible block above it that
collapses once the answer starts, Ctrl+T shows or hides it; live token figures; a context meter."""

from __future__ import annotations

import pytest

from flashmoe.cli.tui.widgets import AssistantMessage, ToolBlock
from flashmoe.cli.tui.widgets.transcript import ReasoningBlock
from tests.helpers.templates import XML_READ, XML_WRITE, qwen35_template

from tests.helpers.tui import make_app, send, tool_args, wait_for, wait_idle

pytestmark = pytest.mark.asyncio
SIZE = (100, 32)


async def test_reasoning_is_a_collapsed_block_above_the_answer():
    app, engine, session = make_app(
        ["Weighing the options carefully.</think>\n\nParis."], chat_template=qwen35_template()
    )
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "capital?")
        await wait_idle(pilot)
        [box] = app.chat.transcript.query(AssistantMessage)
        assert box.text.strip() == "Paris."
        [block] = box.query(ReasoningBlock)
        assert block.text == "Weighing the options carefully." and block.collapsed
        assert list(box.children).index(block) < list(box.children).index(box.markdown)
        await pilot.press("ctrl+t")
        assert not block.collapsed
        await pilot.press("ctrl+t")
        assert block.collapsed
    # the history keeps the reply as the model wrote it
    assert session.history[-1]["content"] == "Weighing the options carefully.</think>\n\nParis."


async def test_reasoning_stays_open_while_it_streams_and_figures_stay_live():
    app, engine, session = make_app(
        ["one two three four five six seven</think>done"], gate_after=4, chat_template=qwen35_template(), timing="off"
    )
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "hi")
        await wait_for(pilot, lambda: list(app.chat.transcript.query(ReasoningBlock)), what="the reasoning block")
        [block] = app.chat.transcript.query(ReasoningBlock)
        assert not block.collapsed
        await wait_for(pilot, lambda: "4 tok" in app.chat.status.render_stats().plain, what="a live token count")
        assert "thinking" in app.chat.activity
        engine.gate.set()
        await wait_idle(pilot)
        assert block.collapsed


async def test_context_meter():
    app, engine, session = make_app(["a b c"], context=1000)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        assert "ctx 0/1.0k" in app.chat.status.render_stats().plain
        await send(pilot, "hi")
        await wait_idle(pilot)
        assert "ctx 15/1.0k" in app.chat.status.render_stats().plain  # 12 prompt tokens, 3 generated


async def test_call_inside_reasoning_is_not_run_in_the_app(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("hello\n")
    reply = f"I could {XML_WRITE} no.</think>\n\n{XML_READ}"
    app, engine, session = make_app(
        [reply, "ok</think>Your notes say hello."],
        chat_template=qwen35_template(),
        tools=tool_args(ws, "--mode", "workspace-write"),
    )
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.chat.loop is not None, what="the agent loop")
        await send(pilot, "notes?")
        await wait_idle(pilot)
        tools = list(app.chat.transcript.query(ToolBlock))
        assert [t.call.name for t in tools] == ["read_file"]
        assert not (ws / "x.txt").exists()
        blocks = list(app.chat.transcript.query(ReasoningBlock))
        assert blocks and blocks[0].text.startswith("I could <tool_call>") and all(b.collapsed for b in blocks)


async def test_thinking_command():
    app, engine, session = make_app(["a"], chat_template=qwen35_template())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "/thinking off")
        await send(pilot, "hi")
        await wait_idle(pilot)
        assert engine.requests[-1].template_kwargs == {"enable_thinking": False}
        await send(pilot, "/thinking sometimes")
        await pilot.pause(0.05)
        assert "usage: /thinking on|off" in app.chat.transcript.query("Note").last().text
