#!/usr/bin/env python3
"""What streaming a long list costs the chat app's UI, and so the decode beside it.

A reply that is one long numbered list is streamed, in fragments of a few characters arriving
every few milliseconds as tokens do, into a reply box of the chat app (headless, Textual's
run_test), two ways in one run:

- reference: Textual's MarkdownStream on one Markdown widget (what the app did before), which
  re-renders the whole list, one widget per item, at every append;
- flashmoe: the box's own stream (widgets/transcript.py), which goes on in a new Markdown widget
  past LIST_CUT items.

Printed for each: the wall time to show the whole reply, the time at each fifth of it, and the
process's CPU time (what the UI takes from the engine's threads in the real app), then the ratios.

    python benchmarks/tui_stream.py [--items 200] [--gap-ms 4]

A benchmark, not a test: it asserts only that both showed the whole text.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_common import cpu_model, source_revision  # noqa: E402


def reply_text(items: int) -> str:
    return (
        "Here are the colours:\n\n"
        + "".join(f"{i}. Colour number {i} is a **shade** of blue-green.\n" for i in range(1, items + 1))
        + "\nThat is all.\n"
    )


async def stream_once(mode: str, text: str, gap_s: float) -> dict:
    from textual.app import App
    from textual.widgets import Markdown

    from flashmoe.cli.tui.widgets.transcript import AssistantMessage, Transcript

    class Bench(App):
        def compose(self):
            yield Transcript()

    frags = [text[i : i + 4] for i in range(0, len(text), 4)]
    app = Bench()
    async with app.run_test(size=(120, 40)) as pilot:
        box = AssistantMessage()
        await app.query_one(Transcript).mount(box)
        stream = Markdown.get_stream(box.markdown) if mode == "reference" else box.stream()
        fifths, t0, cpu0 = [], time.perf_counter(), time.process_time()
        for i, f in enumerate(frags, 1):
            await stream.write(f)
            await asyncio.sleep(gap_s)
            if i % max(1, len(frags) // 5) == 0:
                fifths.append(time.perf_counter() - t0)
        await stream.stop()
        await pilot.pause()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        held = box.markdown.source if mode == "reference" else box.text  # (the reference skips the box's own record)
        assert held == text, "the box does not hold the reply"
        return {"wall": wall, "cpu": cpu, "fifths": fifths, "widgets": len(box.parts), "fragments": len(frags)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=200, help="list items in the reply (default 200)")
    ap.add_argument("--gap-ms", type=float, default=4.0, help="time between fragments (default 4 ms)")
    args = ap.parse_args()
    text = reply_text(args.items)
    print(
        f"{cpu_model()}; {source_revision()}; a {args.items}-item list, {len(text)} characters in 4-character "
        f"fragments {args.gap_ms:g} ms apart (the arrival alone: "
        f"{len(text) / 4 * args.gap_ms / 1000:.1f} s)"
    )
    got = {}
    for mode in ("reference", "flashmoe"):
        r = got[mode] = asyncio.run(stream_once(mode, text, args.gap_ms / 1000))
        fifths = ", ".join(f"{t:.1f}" for t in r["fifths"])
        print(
            f"  {mode:9}: shown in {r['wall']:.2f} s (at each fifth: {fifths} s), UI CPU {r['cpu']:.2f} s, "
            f"{r['widgets']} Markdown widget(s)"
        )
    ref, new = got["reference"], got["flashmoe"]
    print(
        f"  flashmoe vs reference: wall {ref['wall'] / new['wall']:.2f}x faster, CPU {ref['cpu'] / new['cpu']:.2f}x less"
    )


if __name__ == "__main__":
    main()
