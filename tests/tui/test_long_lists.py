"""Replies that made the chat app crawl: a long list (streamed into more than one Markdown widget,
shown as one would be) and list markers nested on one line (shown as text past the third); both
in widgets/transcript.py."""

from __future__ import annotations

import pytest

from flashmoe.cli.tui.widgets import AssistantMessage
from flashmoe.cli.tui.widgets.transcript import LIST_CUT, MARKER_RUN, html_as_text, list_cut, tame

from tests.helpers.tui import make_app, send, wait_for, wait_idle

SIZE = (100, 32)
ITEMS = 3 * LIST_CUT + 5


def numbered(n: int, start: int = 1) -> str:
    return "".join(f"{i}. Colour {i} is **teal**.\n" for i in range(start, start + n))


def test_only_a_long_list_that_is_still_growing_is_cut():
    parser = html_as_text()
    assert list_cut("Some prose.\n\n" * 40, parser) is None
    assert list_cut(numbered(LIST_CUT), parser) is None  # no more than LIST_CUT items: left whole
    assert list_cut(numbered(LIST_CUT + 5) + "\nAnd then prose.\n", parser) is None  # the list has ended
    fence = "```\n" + numbered(LIST_CUT + 5) + "```\n"
    assert list_cut(fence, parser) is None  # "1. " lines in a code block are no list


@pytest.mark.parametrize("marker", ["{i}. ", "- ", "{i}) "])
def test_a_long_list_is_cut_at_its_last_items_first_line(marker):
    head = "Intro.\n\n"
    items = [marker.format(i=i) + f"item {i}\n" + ("   - nested\n" if i == 3 else "") for i in range(1, LIST_CUT + 3)]
    source = head + "".join(items)
    cut = list_cut(source, html_as_text())
    assert cut == len(source) - len(items[-1])  # before the last item, which may still grow
    assert source[cut:].startswith(marker.format(i=LIST_CUT + 2))  # a nested item is not counted or cut at


def _items(box: AssistantMessage) -> list[tuple[str, str]]:
    """(bullet, text) of every top-level list item the box shows, across its widgets."""
    from textual.containers import Horizontal
    from textual.widgets._markdown import MarkdownBullet, MarkdownList, MarkdownParagraph

    out = []
    for part in box.parts:
        for lst in part.query(MarkdownList):
            if lst.parent is not part:
                continue
            for row in lst.query_children(Horizontal):
                bullet = row.query_one(MarkdownBullet).symbol.strip()
                out.append((bullet, " ".join(str(p.render()) for p in row.query(MarkdownParagraph))))
    return out


@pytest.mark.timeout(120)  # the code before this fix took minutes here: fail, do not stall
@pytest.mark.asyncio
async def test_a_streamed_long_list_is_shown_as_the_same_list_whole():
    reply = "Here are the colours:\n\n" + numbered(ITEMS) + "\nThat is all."
    app, engine, session = make_app([reply], token_delay=0.004)  # a few tokens an append
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None, what="the model")
        await send(pilot, "colours?")
        await wait_idle(pilot, timeout=60)
        [streamed] = list(app.chat.transcript.query(AssistantMessage))
        whole = AssistantMessage(text=reply)  # as a resumed conversation shows it: one widget
        await app.chat.transcript.mount(whole)
        await pilot.pause()
        assert streamed.text == reply and session.history[-1]["content"] == reply
        # went on in new widgets, each re-rendering about LIST_CUT items while it grew (and the
        # items of the append that passed it: a batch of tokens), where one widget re-rendered all
        assert len(streamed.parts) >= 2
        assert max(part.source.count(" is **teal**") for part in streamed.parts) <= 2 * LIST_CUT
        shown = _items(streamed)
        assert shown == _items(whole)  # the numbers go on from widget to widget
        assert [b for b, _ in shown] == [f"{i}." for i in range(1, ITEMS + 1)]
        assert all(text == f"Colour {i} is teal." for i, (_, text) in enumerate(shown, 1))
        assert streamed.parts[-1].source.endswith("That is all.")


@pytest.mark.parametrize(
    "line, shown",
    [
        ("1. 1. 2. 3. 4. 5. six", "1. 1. 2. 3\\. 4\\. 5\\. six"),  # what the demo model wrote
        ("> > > > > quoted", "> > > \\> \\> quoted"),
        ("  - * + - item", "  - * + \\- item"),
        ("- - - -", "- - - -"),  # a thematic break, not a list
        ("1. one\n2. two", "1. one\n2. two"),
        ("Text 1. 2. 3. 4. 5. in a sentence", "Text 1. 2. 3. 4. 5. in a sentence"),
        ("```\n1. 2. 3. 4. 5. x\n```\n", "```\n1. 2. 3. 4. 5. x\n```\n"),  # code is shown as written
    ],
)
def test_tame_escapes_markers_past_the_third_on_a_line(line, shown):
    assert tame(line) == shown


def _depth(widget) -> int:
    """How many Markdown lists deep the widget tree goes."""
    from textual.widgets._markdown import MarkdownList

    return max([_depth(c) for c in widget.children] + [0]) + isinstance(widget, MarkdownList)


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_markers_nested_on_one_line_are_shown_as_text_and_the_reply_kept():
    from textual.widgets._markdown import MarkdownParagraph

    reply = "1. " + " ".join(f"{i}." for i in range(1, 10)) + " the end"
    app, engine, session = make_app([reply], token_delay=0.002)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None, what="the model")
        await send(pilot, "count")
        await wait_idle(pilot, timeout=60)
        [box] = list(app.chat.transcript.query(AssistantMessage))
        assert box.text == reply and session.history[-1]["content"] == reply  # saved as written
        assert _depth(box) == MARKER_RUN  # not 10 lists in each other
        shown = [str(p.render()) for p in box.query(MarkdownParagraph)]
        assert shown == [" ".join(f"{i}." for i in range(3, 10)) + " the end"]  # in the third list's item
