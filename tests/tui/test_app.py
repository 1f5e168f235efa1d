"""The chat app driven with Pilot and the fake engine."""

from __future__ import annotations

import threading

import pytest

from flashmoe.engine.errors import ModelLoadError
from flashmoe.cli.tui.app import ChatApp
from flashmoe.cli.tui.messages import ReplyText
from flashmoe.cli.tui.screens import HelpScreen
from flashmoe.cli.tui.widgets import AssistantMessage, Note, UserMessage

from tests.helpers.tui import REPLY, make_app, send, step_rows, wait_for, wait_idle

pytestmark = pytest.mark.asyncio
SIZE = (100, 32)


def boxes(app: ChatApp, kind):
    return list(app.chat.transcript.query(kind))


async def test_send_streams_the_reply_in_batches():
    app, engine, session = make_app(token_delay=0.002)
    messages = []
    async with app.run_test(size=SIZE, message_hook=messages.append) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None, what="the model")
        await pilot.press(*"hi")
        await pilot.press("enter")
        assert app.chat.prompt.text == ""
        await wait_idle(pilot)
        [user] = boxes(app, UserMessage)
        [reply] = boxes(app, AssistantMessage)
        assert user.text == "hi"
        assert reply.text == REPLY
        assert not reply.has_class("-interrupted") and "tok/s" in str(reply.border_subtitle)
        assert session.history == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": REPLY}]
        assert engine.requests[0].timing == "layer"
    batches = [m for m in messages if isinstance(m, ReplyText)]
    tokens = len(REPLY.split())
    assert 1 <= len(batches) < tokens, "token text should reach the Markdown in batches"
    assert "".join(m.text for m in batches) == REPLY


async def test_status_bar_shows_the_figures():
    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "hi")
        await wait_idle(pilot)
        status = app.chat.status.render_stats().plain
    for part in ("fake (fake_moe)", "4-bit", "K=4", "20.0 tok/s", "4.0 MB/tok", "hits 75%", "RSS 256.0 MB"):
        assert part in status, (part, status)


@pytest.mark.parametrize("key", ["escape", "ctrl+c"])
async def test_interrupt_keeps_the_partial_reply(key):
    app, engine, session = make_app(gate_after=3)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "tell me")
        await wait_for(
            pilot,
            lambda: app.chat.reply is not None and app.chat.reply.box.text.count(" ") >= 2,
            what="the first tokens",
        )
        await pilot.press(key)
        await wait_idle(pilot)
        [reply] = boxes(app, AssistantMessage)
        assert reply.has_class("-interrupted")
        assert reply.border_subtitle == "(interrupted)"
        assert reply.text and REPLY.startswith(reply.text) and reply.text != REPLY
        assert session.history[-1] == {"role": "assistant", "content": reply.text}
        assert app.is_running  # stopping a reply never quits
        # and the next message works
        engine.gate_after = None
        await send(pilot, "again")
        await wait_idle(pilot)
        assert boxes(app, AssistantMessage)[-1].text == REPLY


async def test_layer_panel_has_a_row_per_layer_and_coalesces():
    app, engine, session = make_app(layers=8)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        assert app.chat.panel.display
        assert app.chat.panel.row_texts() == []
        await send(pilot, "hi")
        await wait_idle(pilot)
        rows = app.chat.panel.row_texts()
        steps = len(REPLY.split())
        assert 1 <= app.chat.panel.updates < steps, "the panel is redrawn at most ~10 times a second"
        assert app.chat.panel.step == steps - 1
    assert len(rows) == 8
    for i, row in enumerate(rows):
        fields = row.split()
        assert fields[0] == str(i)
        attn, route, io, comp = map(float, fields[1:5])
        assert route == 0.3 and comp == 3.0 and attn in (1.0, 1.5, 2.0) and 2.0 <= io <= 6.0
        assert fields[5] == "3/1"
        assert "█" in row


async def test_step_timing_drops_the_columns_it_cannot_fill():
    app, engine, session = make_app(timing="step")
    step_rows(engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        assert app.chat.panel.header.render().plain.split() == ["L", "route", "I/O", "hit/mis", "ms"]
        await send(pilot, "hi")
        await wait_idle(pilot)
        row = app.chat.panel.row_texts()[0].split()
        total = app.chat.panel.rows_widget.row_text(8).plain.split()
        legend = app.chat.panel.border_subtitle
        header = app.chat.panel.header.render().plain.split()
        await send(pilot, "/timing layer")
        layer_header = app.chat.panel.header.render().plain.split()
    assert row[:4] == ["0", "0.3", "2.0", "3/1"] and "█" in row[4] and len(row) == 5
    assert total[:3] == ["all", "2.4", "32.0"]  # 8 layers' route and I/O
    assert "attn" not in legend and "comp" not in legend and "route" in legend and "I/O" in legend
    assert header == ["L", "route", "I/O", "hit/mis", "ms"]
    assert layer_header == ["L", "attn", "route", "I/O", "comp", "hit/mis", "ms"]


async def test_step_timing_shows_expert_compute_where_the_store_times_it():
    app, engine, session = make_app(timing="step")
    step_rows(engine, compute=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "hi")
        await wait_idle(pilot)
        row = app.chat.panel.row_texts()[0].split()
        header = app.chat.panel.header.render().plain.split()
        legend = app.chat.panel.border_subtitle
    assert header == ["L", "route", "I/O", "comp", "hit/mis", "ms"]
    assert row[:5] == ["0", "0.3", "2.0", "3.0", "3/1"]
    assert "comp" in legend and "attn" not in legend and "other" not in legend


async def test_f2_and_timing_command_toggle_the_panel():
    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        assert app.chat.panel.display
        await pilot.press("f2")
        assert not app.chat.panel.display
        await pilot.press("f2")
        assert app.chat.panel.display
        await send(pilot, "/timing")
        assert not app.chat.panel.display
        await send(pilot, "/timing")
        assert app.chat.panel.display
        await send(pilot, "/timing off")
        assert not app.chat.panel.display and session.options.timing == "off"
        await send(pilot, "/timing step")
        assert app.chat.panel.display and session.options.timing == "step"
        await send(pilot, "hi")
        await wait_idle(pilot)
        assert engine.requests[-1].timing == "step"
        await send(pilot, "/timing sometimes")
        assert boxes(app, Note)[-1].kind == "error"


async def test_engine_error_is_shown_in_the_app():
    app, engine, session = make_app(fail="the expert file is unreadable")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "hi")
        await wait_idle(pilot)
        errors = [n for n in boxes(app, Note) if n.kind == "error"]
        assert errors and "the expert file is unreadable" in errors[-1].text
        assert boxes(app, AssistantMessage) == []  # no empty reply box left behind
        assert any("unreadable" in n.message for n in app._notifications)
        assert app.is_running


async def test_load_failure_is_shown_and_exit_code_is_3():
    app, engine, session = make_app(load_error=ModelLoadError("/models/x", "config.json is missing"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.load_error is not None)
        errors = [n for n in boxes(app, Note) if n.kind == "error"]
        assert "config.json is missing" in errors[-1].text
        await send(pilot, "hi")  # refused, not sent
        assert engine.requests == []
        await send(pilot, "/exit")
    assert app.return_code == 3


async def test_message_typed_while_loading_is_sent_when_loaded():
    gate = threading.Event()
    app, engine, session = make_app(load_gate=gate)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "early")
        assert engine.requests == []
        gate.set()
        await wait_for(pilot, lambda: len(engine.requests) == 1)
        await wait_idle(pilot)
        assert [u.text for u in boxes(app, UserMessage)] == ["early"]
        assert boxes(app, AssistantMessage)[0].text == REPLY


async def test_clear_and_system_commands():
    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "hi")
        await wait_idle(pilot)
        await send(pilot, "/clear")
        await pilot.pause()
        assert session.history == []
        assert boxes(app, UserMessage) == [] and boxes(app, AssistantMessage) == []
        assert [n.text for n in boxes(app, Note)] == ["started a new conversation"]
        await send(pilot, "/system")
        assert "no system prompt" in boxes(app, Note)[-1].text
        await send(pilot, "/system You are terse.")
        assert session.system == "You are terse."
        await send(pilot, "hello")
        await wait_idle(pilot)
        assert engine.requests[-1].messages[0] == {"role": "system", "content": "You are terse."}
        assert engine.requests[-1].messages[1:] == [{"role": "user", "content": "hello"}]
        await send(pilot, "/system")
        assert "You are terse." in boxes(app, Note)[-1].text


async def test_help_save_and_unknown_commands(tmp_path):
    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "/help")
        assert "/timing" in boxes(app, Note)[-1].text
        await send(pilot, "/frobnicate")
        assert boxes(app, Note)[-1].kind == "error" and "/frobnicate" in boxes(app, Note)[-1].text
        await send(pilot, "hi")
        await wait_idle(pilot)
        out = tmp_path / "chat.md"
        await send(pilot, f"/save {out}")
        assert "**assistant**" in out.read_text() and str(out) in boxes(app, Note)[-1].text
        await send(pilot, "/save")
        assert boxes(app, Note)[-1].kind == "error"


async def test_enter_sends_and_newline_keys_insert_newlines():
    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await pilot.press("a", "ctrl+j", "b", "alt+enter", "c")
        assert app.chat.prompt.text == "a\nb\nc"
        await pilot.press("enter")
        await wait_idle(pilot)
        assert engine.requests[0].messages[-1]["content"] == "a\nb\nc"


async def test_ctrl_d_quits_only_on_an_empty_box():
    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await pilot.press("x", "left", "ctrl+d")  # deletes the x
        assert app.is_running and app.chat.prompt.text == ""
        await pilot.press("ctrl+d")
        await pilot.pause()
    assert app.return_code == 0


async def test_ctrl_c_twice_quits_but_once_does_not():
    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await pilot.press("ctrl+c")
        await pilot.pause(0.05)
        assert app.is_running
        assert any("again" in n.message for n in app._notifications)
        await pilot.press("ctrl+c")
        await pilot.pause()
    assert app.return_code == 0


async def test_help_screen_and_command_palette():
    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"timing: layer")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert session.options.timing == "layer"
        await pilot.press("ctrl+p")
        await pilot.press(*"set system")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert app.chat.prompt.text == "/system "


async def test_prefill_progress_is_shown():
    app, engine, session = make_app(gate_after=0, prompt_tokens=3000)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "a long prompt")
        await wait_for(pilot, lambda: "3000/3000 tokens" in app.chat.activity, what="the prefill bar")
        assert app.chat.activity.startswith("prefill")
        engine.gate.set()
        await wait_idle(pilot)
        assert app.chat.activity == "ready"


async def test_quitting_mid_reply_cancels_it():
    app, engine, session = make_app(gate_after=2)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "go on")
        await wait_for(pilot, lambda: app.chat.reply is not None and app.chat.reply.box.text, what="the first tokens")
        handle = app.chat.reply.handle
        await pilot.press("ctrl+d")
        await pilot.pause()
    assert handle.cancelled and app.return_code == 0


async def test_resumed_conversation_is_shown():
    app, engine, session = make_app()
    session.history = [
        {"role": "user", "content": "earlier question"},
        {"role": "assistant", "content": "earlier **answer**"},
    ]
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        assert [u.text for u in boxes(app, UserMessage)] == ["earlier question"]
        assert [a.text for a in boxes(app, AssistantMessage)] == ["earlier **answer**"]
        await send(pilot, "and now?")
        await wait_idle(pilot)
        assert [m["content"] for m in engine.requests[0].messages] == [
            "earlier question",
            "earlier **answer**",
            "and now?",
        ]


async def test_ctrl_c_copies_a_selection_when_idle():
    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await pilot.press(*"copy me", "shift+home")
        assert app.chat.prompt.selected_text == "copy me"
        await pilot.press("ctrl+c")
        assert app.clipboard == "copy me"
        assert app.is_running and not any("again" in n.message for n in app._notifications)


async def test_engine_warnings_become_notifications_not_stderr(capsys):
    # The engine warns through logging (a prompt truncated to fit the context) from its own
    # thread; in the TUI stderr is the screen, so the warning must arrive as a notification.
    import logging

    app, engine, session = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        t = threading.Thread(
            target=logging.getLogger("flashmoe").warning,
            args=("flashmoe: warning: prompt truncated: dropped its oldest %d tokens", 7),
        )
        t.start()
        t.join()
        await wait_for(
            pilot,
            lambda: any("dropped its oldest 7 tokens" in n.message for n in app._notifications),
            what="the notification",
        )
    assert "dropped its oldest" not in capsys.readouterr().err


# -- what a new user hit (issue 13, item 7) --------------------------------------------------------
async def test_raw_html_and_unknown_tags_in_a_reply_are_shown_as_text():
    from textual.widgets._markdown import MarkdownBlock

    reply = "<div>hi there</div>\n\nText with <b>bold</b>, <br> and <tool_result>x</tool_result>."
    app, engine, session = make_app([reply])
    session.history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<p>saved</p>"}]
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "hi")
        await wait_idle(pilot)
        shown = [[str(b.render()) for b in box.markdown.query(MarkdownBlock)] for box in boxes(app, AssistantMessage)]
    assert shown == [
        ["<p>saved</p>"],
        ["<div>hi there</div>", "Text with <b>bold</b>, <br> and <tool_result>x</tool_result>."],
    ]


async def test_a_resumed_interrupted_reply_keeps_its_mark(tmp_path):
    from flashmoe.cli.chat import ChatOptions, ChatSession
    from flashmoe.cli.store import Store

    store = Store(tmp_path / "logs.db")
    cid = store.new_conversation("fake")
    store.add_message(cid, "user", "first")
    store.add_message(cid, "assistant", "stopped half", interrupted=True)
    store.add_message(cid, "user", "second")
    store.add_message(cid, "assistant", "cut by a crash", interrupted=True, complete=False)
    store.add_message(cid, "user", "third")
    store.add_message(cid, "assistant", "whole")
    app, engine, _ = make_app()
    app.session = ChatSession(engine, store, ChatOptions(timing="layer"), cid=cid, model_name="fake")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        shown = [
            (a.text, str(a.border_subtitle or ""), a.has_class("-interrupted")) for a in boxes(app, AssistantMessage)
        ]
    assert shown == [
        ("stopped half", "(interrupted)", True),
        ("cut by a crash", "(incomplete)", True),
        ("whole", "", False),
    ]


@pytest.mark.parametrize("size,shown", [((80, 24), False), ((99, 30), False), ((100, 30), True)])
async def test_the_layer_panel_is_hidden_below_100_columns(size, shown):
    app, engine, session = make_app()
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        assert app.chat.panel.display is shown
        await pilot.press("f2")  # F2 still shows (hides) it at any width
        assert app.chat.panel.display is not shown
        await pilot.resize_terminal(120, 30)  # the user chose: a resize does not undo it
        await pilot.pause(0.1)
        assert app.chat.panel.display is not shown


async def test_the_layer_panel_follows_the_width_until_the_user_toggles_it():
    app, engine, session = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        assert not app.chat.panel.display
        await pilot.resize_terminal(120, 30)
        await pilot.pause(0.1)
        assert app.chat.panel.display
        await pilot.resize_terminal(90, 30)
        await pilot.pause(0.1)
        assert not app.chat.panel.display


async def test_the_layer_panel_says_which_rows_are_in_view():
    app, engine, session = make_app(layers=30)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        assert app.chat.panel.border_title == "layers · timing layer"
        await send(pilot, "hi")
        await wait_idle(pilot)
        await pilot.pause(0.1)
        window = app.chat.panel.scrollable_content_region.height - 1
        title = app.chat.panel.border_title
        app.chat.panel.scroll_to(y=5, animate=False)
        await pilot.pause(0.1)
        scrolled = app.chat.panel.border_title
        app.chat.panel.scroll_end(animate=False)
        await pilot.pause(0.1)
        end = app.chat.panel.border_title
    assert 10 < window < 30
    assert title.startswith(f"rows 0-{window - 1} of 30 · step ") and title.endswith(" · timing layer"), title
    assert scrolled.startswith(f"rows 5-{window + 4} of 30 · "), scrolled
    assert end.startswith(f"rows {31 - window}-29 of 30 · "), end  # the sum row is the last line


async def test_few_layers_that_fit_need_no_row_count():
    app, engine, session = make_app(layers=8)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "hi")
        await wait_idle(pilot)
        assert app.chat.panel.border_title.startswith("layers · step ")


async def test_the_demo_says_it_is_a_toy_not_to_be_trusted():
    import dataclasses

    from flashmoe.engine.formats.demo import demo_path

    from flashmoe.cli.models import DEMO_NOTE

    app, engine, session = make_app()
    engine.loaded_info = dataclasses.replace(engine.loaded_info, model=str(demo_path()))
    other, *_ = make_app()  # any other model: no such note
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        welcome = boxes(app, Note)[0].text
    async with other.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: other.loaded is not None)
        plain = boxes(other, Note)[0].text
    assert DEMO_NOTE in welcome and "135M" in DEMO_NOTE and "do not trust" in DEMO_NOTE
    assert "tool use" in DEMO_NOTE and DEMO_NOTE not in plain
