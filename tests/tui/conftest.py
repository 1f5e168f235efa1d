"""Fixtures for the Textual app: fake engines that make every figure and frame deterministic."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from flashmoe.engine.events import GenerationFinished, TokenGenerated
from flashmoe.engine.testing import FakeEngine
from flashmoe.cli.chat import ChatOptions, ChatSession

REPLY = (
    "A **mixture of experts** sends each token to a few of its experts.\n\n"
    "- the router picks the *top-k* experts per layer\n"
    "- flashmoe reads those experts from the SSD\n\n"
    "```python\nprint('hello')\n```\n\nThat keeps memory small."
)


def pytest_configure(config):
    config.addinivalue_line("markers", "tmux: drives the real CLI in a private tmux server (skipped without tmux)")


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


@pytest.fixture
def app_factory():
    return make_app


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
