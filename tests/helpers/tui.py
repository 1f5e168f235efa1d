"""The Textual chat app under test: a fake engine that makes every figure and frame deterministic,
the app built around it, and what a test does with Pilot (type, wait for a condition, for the reply
to finish, for a reply frozen mid-way)."""

from __future__ import annotations

import dataclasses
import threading
import time

from flashmoe.engine.events import GenerationFinished, LayerTimings, TokenGenerated
from flashmoe.engine.testing import FakeEngine
from flashmoe.cli.chat import ChatOptions, ChatSession

REPLY = (
    "A **mixture of experts** sends each token to a few of its experts.\n\n"
    "- the router picks the *top-k* experts per layer\n"
    "- flashmoe reads those experts from the SSD\n\n"
    "```python\nprint('hello')\n```\n\nThat keeps memory small."
)
SIZE = (100, 32)  # the snapshots' terminal, and the README picture's


class _Events:
    """Stands in for a Handle's queue inside the fake's thread: lets a test change what is put."""

    def __init__(self, handle, hook):
        self._put, self._hook, self._handle = handle.events.put, hook, handle

    def put(self, ev):
        ev = self._hook(self._handle, ev)
        if ev is not None:
            self._put(ev)


class _HandleView:
    def __init__(self, handle, hook):
        self._handle = handle
        self.events = _Events(handle, hook)

    def __getattr__(self, name):
        return getattr(self._handle, name)


class StableFakeEngine(FakeEngine):
    """FakeEngine whose end-of-reply speeds do not depend on the clock, and which can hold a reply
    after `gate_after` tokens until `gate` is set (or the reply is cancelled): a frozen mid-reply."""

    def __init__(
        self,
        *args,
        gate_after: int | None = None,
        load_gate: threading.Event | None = None,
        load_error: BaseException | None = None,
        **kw,
    ):
        super().__init__(*args, **kw)
        self.gate_after = gate_after
        self.gate = threading.Event()
        self.load_gate = load_gate
        self.load_error = load_error
        self.closed = False

    def wait_loaded(self, timeout=None):
        if self.load_gate is not None:
            self.load_gate.wait(timeout)
        if self.load_error is not None:
            raise self.load_error
        return super().wait_loaded(timeout)

    def close(self):
        self.closed = True
        self.gate.set()

    def _hook(self, handle, ev):
        if isinstance(ev, TokenGenerated) and self.gate_after is not None and ev.step >= self.gate_after:
            while not (self.gate.wait(0.01) or handle.cancelled):
                pass
        if isinstance(ev, GenerationFinished):
            ev = dataclasses.replace(
                ev, generation_tps=20.0, decode_s=ev.generation_tokens / 20.0, io_wait_s=ev.generation_tokens / 60.0
            )
        return ev

    def _play(self, handle, reply):
        super()._play(_HandleView(handle, self._hook), reply)


def make_app(replies=None, *, timing: str = "layer", system: str | None = None, tools=None, **engine_kw):
    from flashmoe.cli.tui.app import ChatApp

    engine = StableFakeEngine(replies or [REPLY], **engine_kw)
    session = ChatSession(engine, None, ChatOptions(timing=timing, system=system), model_name="fake")
    app = ChatApp(session, tools=tools, cursor_blink=False, rss=lambda: 256 << 20)
    return app, engine, session


def tool_args(workspace, *extra: str):
    """`flashmoe chat --tools builtin --workspace DIR ...` as the app gets it."""
    from flashmoe.cli.agent_cli import ToolOptions
    from flashmoe.cli.cli import build_parser

    args = build_parser().parse_args(["chat", "--tools", "builtin", "--workspace", str(workspace), *extra])
    return ToolOptions.from_args(args)


async def wait_for(pilot, predicate, timeout: float = 5.0, what: str = "condition"):
    """Let the app run until predicate() holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def send(pilot, text: str):
    pilot.app.chat.prompt.text = text
    await pilot.press("enter")


async def wait_idle(pilot, timeout: float = 5.0):
    """Until the reply has finished and its last timings are drawn."""
    await wait_for(pilot, lambda: pilot.app.chat.reply is None, timeout, "the reply to finish")
    await pilot.pause(0.15)


async def wait_loaded(pilot):
    """Until the model has loaded, in the theme the snapshots were taken in."""
    pilot.app.theme = "textual-dark"
    await wait_for(pilot, lambda: pilot.app.loaded is not None, what="the model")


async def mid_reply(pilot, prompt: str = "How does flashmoe run a model bigger than memory?"):
    """A reply frozen after a few tokens (the fake holds the rest), with the layer panel drawn."""
    app = pilot.app
    await wait_loaded(pilot)
    await send(pilot, prompt)
    gate_after = app.engine.gate_after
    await wait_for(
        pilot,
        lambda: (
            app.chat.reply is not None
            and app.chat.panel.step == gate_after - 1
            and app.chat.status.stats.tok_s is not None
        ),
        what="the layer panel",
    )
    await wait_for(pilot, lambda: len(app.chat.reply.box.text.split()) >= gate_after, what="the reply text")
    await pilot.pause(0.2)


def step_rows(engine, compute: bool = False):
    """The fake reports layer-timing rows; make them step rows as the engine sends them: no
    attention or other time, and expert compute only where the store times it (compute=True: the
    CPU kernels)."""
    hook = engine._hook

    def as_step(handle, ev):
        ev = hook(handle, ev)
        if not isinstance(ev, LayerTimings):
            return ev
        rows = tuple(
            dataclasses.replace(r, attn_ms=0.0, other_ms=0.0, expert_compute_ms=r.expert_compute_ms if compute else 0.0)
            for r in ev.rows
        )
        return dataclasses.replace(ev, mode="step", rows=rows)

    engine._hook = as_step
