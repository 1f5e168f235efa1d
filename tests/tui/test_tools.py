"""Tool use in the chat app (--tools): the AgentLoop's calls as collapsed blocks, the approval
screen, and stopping or quitting while it asks. The fake engine "calls" a tool by replying with
<tool_call> markup."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from flashmoe.cli.tui.messages import ReplyText
from flashmoe.cli.tui.screens import ApproveScreen
from flashmoe.cli.tui.widgets import AssistantMessage, Note, ToolBlock

from tests.helpers.tui import make_app, send, tool_args, wait_for, wait_idle

pytestmark = pytest.mark.asyncio
SIZE = (100, 32)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


READ = "Let me look at your notes.\n" + call("read_file", path="notes.txt")
WRITE = call("write_file", path="todo.txt", content="buy milk")


def boxes(app, kind):
    return list(app.chat.transcript.query(kind))


@pytest.fixture
def ws(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("remember the milk\n")
    return ws


async def loaded(pilot):
    await wait_for(pilot, lambda: pilot.app.loaded is not None, what="the model")


async def asking(pilot) -> ApproveScreen:
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ApproveScreen), what="the approval screen")
    screen = pilot.app.screen
    screen._armed_at = 0.0  # past the guard against keys typed as it pops up
    return screen


async def test_a_read_runs_without_asking_and_shows_a_collapsed_block(ws):
    app, engine, session = make_app([READ, "Your note says: remember the milk."], tools=tool_args(ws))
    messages = []
    async with app.run_test(size=SIZE, message_hook=messages.append) as pilot:
        await loaded(pilot)
        assert any(n.border_title == "tools" and "read_file" in n.text for n in boxes(app, Note))
        await send(pilot, "what is in my notes?")
        await wait_idle(pilot)
        assert not any(isinstance(s, ApproveScreen) for s in app.screen_stack)
        [block] = boxes(app, ToolBlock)
        assert block.collapsed
        assert block.title_plain.startswith("⚙ read_file · ok · ") and block.title_plain.endswith(" s")
        first, last = boxes(app, AssistantMessage)
        assert first.text.strip() == "Let me look at your notes."  # the call markup is not shown
        assert last.text == "Your note says: remember the milk."
        assert "tok/s" in str(last.border_subtitle)
        # the transcript order: reply, tool block, reply
        order = [w for w in app.chat.transcript.children if isinstance(w, (AssistantMessage, ToolBlock))]
        assert order == [first, block, last]
        await pilot.click(block._title)
        await pilot.pause()
        assert not block.collapsed
        body = " ".join(str(s.render()) for s in block.query(".tool-args, .tool-result"))
        assert '"path": "notes.txt"' in body and "remember the milk" in body
        assert app.chat.activity == "ready"
    texts = [m.text for m in messages if isinstance(m, ReplyText)]
    assert "".join(texts) == "Let me look at your notes.\nYour note says: remember the milk."
    # the result went back to the model before its second reply
    assert "remember the milk" in engine.requests[1].messages[-1]["content"]
    assert session.history[-1] == {"role": "assistant", "content": "Your note says: remember the milk."}


@pytest.mark.parametrize("key,written", [("y", True), ("n", False), ("escape", False)])
async def test_a_write_asks_and_runs_only_on_yes(ws, key, written):
    app, engine, session = make_app([WRITE, "Done."], tools=tool_args(ws))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "make a todo")
        screen = await asking(pilot)
        shown = " ".join(str(s.render()) for s in screen.query("Static"))
        assert screen.tool_name == "write_file" and '"content": "buy milk"' in shown
        assert "changes files in the workspace" in shown
        assert "approval" in app.chat.activity
        await pilot.press(key)
        await wait_idle(pilot)
        assert not isinstance(app.screen, ApproveScreen)
        [block] = boxes(app, ToolBlock)
        if written:
            assert block.title_plain.startswith("⚙ write_file · ok · ")
        else:
            assert block.title_plain == "⚙ write_file · declined" and block.has_class("-declined")
        assert [b.text for b in boxes(app, AssistantMessage)] == ["Done."]  # the call-only reply left no box
        assert app.focused is app.chat.prompt
    assert (ws / "todo.txt").exists() == written
    if written:
        assert (ws / "todo.txt").read_text() == "buy milk"
    assert "<tool_response>" in engine.requests[-1].messages[-1]["content"]


async def test_keys_are_ignored_just_after_the_question_appears_and_always_sticks(ws):
    app, engine, session = make_app([WRITE, "Done.", WRITE, "Again."], tools=tool_args(ws))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "make a todo")
        screen = await asking(pilot)
        screen._armed_at = time.monotonic() + 60
        await pilot.press("y", "a")
        assert app.screen is screen
        screen._armed_at = 0.0
        await pilot.press("a")
        await wait_idle(pilot)
        (ws / "todo.txt").unlink()
        await send(pilot, "once more")  # "always": no question this time
        await wait_idle(pilot)
        assert not isinstance(app.screen, ApproveScreen)
        assert [b.title_plain.split(" · ")[1] for b in boxes(app, ToolBlock)] == ["ok", "ok"]
    assert (ws / "todo.txt").read_text() == "buy milk"


async def test_ctrl_c_while_asking_stops_the_turn(ws):
    app, engine, session = make_app([WRITE, "Done."], tools=tool_args(ws))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "make a todo")
        await asking(pilot)
        await pilot.press("ctrl+c")
        await wait_idle(pilot)
        assert not isinstance(app.screen, ApproveScreen) and app.is_running
        [block] = boxes(app, ToolBlock)
        assert block.title_plain == "⚙ write_file · declined"
        assert app.chat.activity.startswith("stopped")
        assert len(engine.requests) == 1  # no reply after the cancel
        await send(pilot, "never mind")  # the next message works
        await wait_idle(pilot)
        assert boxes(app, AssistantMessage)[-1].text == "Done."
    assert not (ws / "todo.txt").exists()


async def test_quitting_while_asking_exits_and_ends_the_worker(ws):
    app, engine, session = make_app([WRITE, "Done."], tools=tool_args(ws))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "make a todo")
        await asking(pilot)
        turn = app.chat.agent_turn
        await pilot.press("ctrl+q")
        await pilot.pause()
    assert app.return_code == 0
    deadline = time.monotonic() + 5
    while not turn._ended:  # the worker thread got its "no" and finished the turn
        assert time.monotonic() < deadline, "the worker thread still waits"
        await asyncio.sleep(0.02)
    assert turn.pending is None and not (ws / "todo.txt").exists()
    assert len(engine.requests) == 1


async def test_chain_limit_is_an_error_note_and_the_app_goes_on(ws):
    app, engine, session = make_app([READ], tools=tool_args(ws, "--chain-limit", "1"))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "read it forever")
        await wait_idle(pilot)
        titles = [b.title_plain for b in boxes(app, ToolBlock)]
        assert titles[0].startswith("⚙ read_file · ok") and titles[-1].endswith("not run: the chain limit is reached")
        [error] = [n for n in boxes(app, Note) if n.kind == "error"]
        assert "chain limit" in error.text
        assert app.is_running and app.chat.reply is None


async def test_engine_failure_with_tools_is_a_note(ws):
    app, engine, session = make_app(tools=tool_args(ws), fail="layer 3: read failed")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "hi")
        await wait_idle(pilot)
        [error] = [n for n in boxes(app, Note) if n.kind == "error"]
        assert "The engine failed (RuntimeError): layer 3: read failed" in error.text
        assert boxes(app, AssistantMessage) == []
        assert app.is_running


async def test_bad_tool_options_refuse_to_send(tmp_path):
    app, engine, session = make_app(tools=tool_args(tmp_path / "missing"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.load_error is not None)
        assert "not a folder" in [n for n in boxes(app, Note) if n.kind == "error"][-1].text
        await send(pilot, "hi")
        assert engine.requests == []
        await send(pilot, "/exit")
    assert app.return_code == 2


async def test_escape_stops_a_tool_turn_and_keeps_the_text(ws):
    app, engine, session = make_app(["The answer is " + "very " * 20 + "long."], tools=tool_args(ws), gate_after=3)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await send(pilot, "go")
        await wait_for(
            pilot,
            lambda: (
                app.chat.reply is not None
                and app.chat.reply.box is not None
                and app.chat.reply.box.text.count(" ") >= 2
            ),
            what="the first words",
        )
        await pilot.press("escape")
        await wait_idle(pilot)
        [box] = boxes(app, AssistantMessage)
        assert box.has_class("-interrupted") and box.text.startswith("The answer")
        assert app.chat.activity.startswith("stopped") and app.is_running
    assert session.history[-1]["role"] == "assistant" and session.history[-1]["content"].startswith("The answer")


async def test_a_resumed_tool_conversation_shows_results_as_blocks(ws):
    app, engine, session = make_app(tools=tool_args(ws))
    session.history = [
        {"role": "user", "content": "what is in my notes?"},
        {"role": "assistant", "content": READ},
        {"role": "user", "content": "<tool_response>\nremember the milk\n</tool_response>"},
        {"role": "assistant", "content": "It says: remember the milk."},
    ]
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert [b.text for b in boxes(app, AssistantMessage)] == [
            "Let me look at your notes.",
            "It says: remember the milk.",
        ]
        [block] = boxes(app, ToolBlock)
        assert block.collapsed and block.title_plain == "⚙ tool · result"
        assert "remember the milk" in str(block.query_one(".tool-result").render())


async def test_run_tui_checks_the_tool_options_before_loading(tmp_path, monkeypatch):
    from flashmoe.cli.cli import UsageError, apply_settings, build_parser
    from flashmoe.cli.tui.app import run_tui

    monkeypatch.setenv("FLASHMOE_HOME", str(tmp_path / "home"))
    args = build_parser().parse_args(
        ["chat", "--engine", "fake", "-n", "--tools", "builtin", "--workspace", str(tmp_path / "missing")]
    )
    apply_settings(args)
    with pytest.raises(UsageError, match="not a folder"):
        run_tui(args)
