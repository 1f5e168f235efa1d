"""Writes the README picture: the chat app mid-reply with the layer panel, 100x32, fake engine.

python -m tests.tui.make_screenshot docs/tui.svg
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.helpers.tui import SIZE, make_app, mid_reply, send, wait_for, wait_idle

FIRST = "Which experts does a token use?"
FIRST_REPLY = "The router scores all experts in each layer and keeps the **top-k**; only those are read."
QUESTION = "How does flashmoe run a model bigger than memory?"
ANSWER = (
    "It keeps the attention and router weights in RAM and **streams the routed experts** from the SSD:\n\n"
    "1. the router picks the top-k experts of each layer\n"
    "2. experts already in the cache are reused; the rest are read with parallel `pread`s\n"
    "3. the expert outputs are combined and the next layer starts\n"
)


async def screenshot(path: Path) -> None:
    app, engine, session = make_app([FIRST_REPLY, ANSWER], gate_after=len(ANSWER.split()) - 6)
    async with app.run_test(size=SIZE) as pilot:
        app.theme = "textual-dark"
        await wait_for(pilot, lambda: app.loaded is not None)
        gate, engine.gate_after = engine.gate_after, None
        await send(pilot, FIRST)
        await wait_idle(pilot)
        engine.gate_after = gate
        await mid_reply(pilot, QUESTION)
        path.write_text(app.export_screenshot(title="flashmoe chat"))


if __name__ == "__main__":
    asyncio.run(screenshot(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/tui.svg")))
