"""SVG snapshots of the chat app (pytest-textual-snapshot), 100x32, with the deterministic fake.

Regenerate with `python -m pytest tests/tui/test_snapshots.py --snapshot-update` and look at
the SVGs under __snapshots__/ before committing them.
"""

from __future__ import annotations

from tests.helpers.tui import SIZE, make_app, mid_reply, send, step_rows, tool_args, wait_for, wait_idle, wait_loaded


def test_main_screen_after_a_reply(snap_compare):
    app, engine, session = make_app()

    async def run_before(pilot):
        await wait_loaded(pilot)
        await send(pilot, "What is a mixture of experts?")
        await wait_idle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_main_screen_mid_reply(snap_compare):
    app, engine, session = make_app(gate_after=9)
    assert snap_compare(app, terminal_size=SIZE, run_before=mid_reply)


def test_interrupted_reply(snap_compare):
    app, engine, session = make_app(gate_after=5)

    async def run_before(pilot):
        await mid_reply(pilot, "Tell me everything.")
        await pilot.press("escape")
        await wait_idle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_engine_error(snap_compare):
    app, engine, session = make_app(fail="layer 3 expert 17: read failed (I/O error)")

    async def run_before(pilot):
        await wait_loaded(pilot)
        await send(pilot, "hi")
        await wait_idle(pilot)
        pilot.app.clear_notifications()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare):
    app, engine, session = make_app()

    async def run_before(pilot):
        await wait_loaded(pilot)
        await pilot.press("f1")

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


class _Clock:
    """Stands in for the tool executor's clock: every call takes 12.5 ms, so titles read 0.01 s."""

    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        self.t += 0.0125
        return self.t


def test_tool_call_and_approval(snap_compare, tmp_path, monkeypatch):
    """A read ran (a collapsed block), and the write after it asks."""
    import json

    import flashmoe.tools.executor
    from flashmoe.cli.tui.screens import ApproveScreen

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "todo.txt").write_text("- eggs\n- bread\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(flashmoe.tools.executor, "time", _Clock())

    def call(name, **arguments):
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    replies = [
        "I'll check the list first.\n" + call("read_file", path="todo.txt"),
        "It has eggs and bread. Adding milk:\n"
        + call("write_file", path="todo.txt", content="- eggs\n- bread\n- milk\n"),
        "Done.",
    ]
    app, engine, session = make_app(replies, timing="off", tools=tool_args(ws))

    async def run_before(pilot):
        await wait_loaded(pilot)
        await send(pilot, "Add milk to my todo list.")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ApproveScreen), what="the question")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    assert (ws / "todo.txt").read_text() == "- eggs\n- bread\n"  # quitting while it asks answers no


# -- the layer panel's width (issue 13, item 7): 30 layers, as the demo has ------------------------------
def test_80x24_hides_the_layer_panel(snap_compare):
    """Below 100 columns the transcript gets the whole width; F2 would show the panel."""
    app, engine, session = make_app(layers=30, gate_after=9)
    assert snap_compare(app, terminal_size=(80, 24), run_before=mid_reply)


def test_80x24_layer_panel_on_f2(snap_compare):
    app, engine, session = make_app(layers=30, gate_after=9)

    async def run_before(pilot):
        await mid_reply(pilot)
        await pilot.press("f2")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_100x30_step_timing_panel_says_which_rows_show(snap_compare):
    """Step timing (as with the CPU kernels): no attention column; the title says which of the 30
    rows are in view."""
    app, engine, session = make_app(layers=30, gate_after=9, timing="step")
    step_rows(engine, compute=True)
    assert snap_compare(app, terminal_size=(100, 30), run_before=mid_reply)
