"""Driving the line REPL (`flashmoe chat --no-tui`) through prompt-toolkit's pipe input: the keys,
a private FLASHMOE_HOME, and drive(), which types keys and returns the whole transcript.

`private_home` is the autouse fixture `home`: a test module gets it by importing it
(`from tests.helpers.repl import private_home  # noqa: F401`), and a test asks for `home` to know
the folder."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from flashmoe.engine.testing import FakeEngine
from flashmoe.cli import cli
from flashmoe.cli.repl import run_repl

ENTER, ALT_ENTER, CTRL_C, CTRL_D, CTRL_R, RIGHT = "\r", "\x1b\r", "\x03", "\x04", "\x12", "\x1b[C"


@pytest.fixture(autouse=True, name="home")
def private_home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMOE_HOME", str(tmp_path / "home"))
    for var in [v for v in os.environ if v.startswith("FLASHMOE_") and v != "FLASHMOE_HOME"]:
        monkeypatch.delenv(var)
    return tmp_path / "home"


def chat_args(*flags):
    args = cli.build_parser().parse_args(["chat", "--no-tui", "--engine", "fake", *flags])
    cli.apply_settings(args)
    return args


class Transcript:
    def __init__(self, code, out, err, engine):
        self.code, self.out, self.err, self.engine = code, out, err, engine

    def __repr__(self):  # shown by pytest when an assertion fails
        return f"exit {self.code}\n--- stdout\n{self.out}--- stderr\n{self.err}"


def drive(keys: str | list[str], engine=None, *flags, clock=time.monotonic) -> Transcript:
    """Run the REPL on `keys` (which must end by quitting) and capture everything it printed.

    A list of chunks is typed one chunk at a time, 0.1 s apart, for what needs a pause (a
    suggestion from the history is computed in the background after each keystroke).
    """
    engine = engine or FakeEngine(["Hello there."])
    out, err = io.StringIO(), io.StringIO()
    with create_pipe_input() as inp:
        if isinstance(keys, str):
            inp.send_text(keys)
        else:

            def typist():
                for chunk in keys:
                    time.sleep(0.1)
                    inp.send_text(chunk)

            threading.Thread(target=typist, daemon=True).start()
        code = run_repl(
            chat_args(*flags), engine=engine, input=inp, output=DummyOutput(), stdout=out, stderr=err, clock=clock
        )
    return Transcript(code, out.getvalue(), err.getvalue(), engine)
