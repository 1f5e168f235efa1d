"""Hardening of the front ends (issue 12): control sequences never reach a terminal, a crash loses
nothing shown, `agent --approve ask` asks on a real terminal, and user mistakes are one line with
their exit code. Terminals are real ptys; crashes are real signals sent to real processes."""
from __future__ import annotations

import json
import os
import pty
import select
import signal
import sqlite3
import subprocess
import sys
import termios
import time
import tty

import pytest

from flashmoe_cli.store import Store
from flashmoe_cli.term_safe import safe
from tests.conftest import ROOT, run_cli

# What a hostile model writes: a clipboard write (OSC 52), a title change (OSC 0), a screen clear,
# 8-bit CSI and OSC, a right-to-left override, a bell, a carriage return that hides the line.
ATTACK = ("look \x1b]52;c;cm0gLXJmIH4=\x07 here \x1b]0;pwned\x07 \x1b[2J\x1b[H \x9b2J \x9d0;x\x9c "
          "\u202eevil\u202c \x07\rgone \x7f")
FORBIDDEN = ["\x1b", "\x07", "\x9b", "\x9d", "\x9c", "\u202e", "\u202c", "\r", "\x7f"]


def fake_env(tmp_path, replies, **extra):
    env = {"FLASHMOE_HOME": str(tmp_path / "home"), "FLASHMOE_FAKE_REPLIES": json.dumps(replies)}
    env.update(extra)
    return env


def spawn_on_pty(args, env, *, stdin=subprocess.DEVNULL):
    """The CLI with its stdout on a pty (raw, so the bytes are the program's), stderr piped."""
    master, slave = pty.openpty()
    tty.setraw(slave)
    e = dict(os.environ, **env)
    e.pop("FORCE_COLOR", None)
    p = subprocess.Popen([sys.executable, "-m", "flashmoe_cli", *map(str, args)], stdin=stdin, stdout=slave,
                         stderr=subprocess.PIPE, env=e, cwd=ROOT)
    os.close(slave)
    return p, master


def run_bytes(args, env) -> subprocess.CompletedProcess:
    """The CLI with stdout piped, read as bytes (run_cli's text mode would turn \\r into \\n)."""
    e = dict(os.environ, **env)
    e.pop("FORCE_COLOR", None)
    return subprocess.run([sys.executable, "-m", "flashmoe_cli", *map(str, args)], capture_output=True,
                          stdin=subprocess.DEVNULL, env=e, cwd=ROOT, timeout=60)


def read_all(master, p, timeout=60) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.1)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the other side is closed
                break
            if not chunk:
                break
            out += chunk
        elif p.poll() is not None:
            break
    os.close(master)
    return out


# -- item 3: control sequences -------------------------------------------------------------------
def test_safe_escapes_every_control_but_newline_and_tab():
    assert safe("a\tb\nc") == "a\tb\nc"
    assert safe("\x1b]52;c;eA==\x07") == "\\x1b]52;c;eA==\\x07"
    assert safe("\x9b2J\x9d\x7f\x00\r") == "\\x9b2J\\x9d\\x7f\\x00\\x0d"
    assert safe("\u202eabc\u2066\u2069") == "\\u202eabc\\u2066\\u2069"
    assert safe("ünïcødé ok ✓ 日本") == "ünïcødé ok ✓ 日本"
    # a sequence split over two tokens is caught in each half
    assert safe("\x1b") + safe("]0;t\x07") == safe("\x1b]0;t\x07")
    assert not any(c in safe(ATTACK) for c in FORBIDDEN)


def test_headless_on_a_terminal_escapes_and_a_pipe_gets_the_bytes(tmp_path):
    env = fake_env(tmp_path, [ATTACK])
    p, master = spawn_on_pty(["run", "--engine", "fake", "-n", "hi"], env)
    shown = read_all(master, p).decode()
    err = p.stderr.read().decode()
    assert p.wait(10) == 0, err
    assert not any(c in shown for c in FORBIDDEN), repr(shown)
    assert "\\x1b]52;c;cm0gLXJmIH4=\\x07" in shown and "\\u202eevil" in shown
    piped = run_bytes(["run", "--engine", "fake", "-n", "hi"], env)
    assert piped.returncode == 0 and piped.stdout == (ATTACK + "\n").encode()


def test_tool_activity_on_stderr_is_escaped(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    call = '<tool_call>\n' + json.dumps({"name": "read_file", "arguments": {"path": "\x9d0;pwned\x9c.txt"}}) + \
        '\n</tool_call>'
    r = run_cli("run", "--engine", "fake", "-n", "--tools", "builtin", "--workspace", ws, "x",
                env=fake_env(tmp_path, [call, "done"]))
    assert "read_file" in r.stderr and "\\x9d0;pwned" in r.stderr, r.stderr
    assert not any(c in r.stderr for c in FORBIDDEN), repr(r.stderr)


def test_logs_show_escapes_on_a_terminal_only(tmp_path):
    env = fake_env(tmp_path, [ATTACK])
    assert run_cli("run", "--engine", "fake", "hi \x1b[2J", env=env).returncode == 0
    p, master = spawn_on_pty(["logs", "show"], env)
    shown = read_all(master, p).decode()
    assert p.wait(10) == 0
    assert not any(c in shown for c in FORBIDDEN), repr(shown)
    assert "hi \\x1b[2J" in shown and "\\x1b]52;c;" in shown
    p, master = spawn_on_pty(["logs"], env)
    listed = read_all(master, p).decode()
    assert p.wait(10) == 0 and "hi \\x1b[2J" in listed and "\x1b" not in listed
    piped = run_bytes(["logs", "show"], env)
    assert ATTACK.encode() in piped.stdout


def test_repl_escapes_replies_and_tool_questions(tmp_path, monkeypatch):
    from tests.test_repl import CTRL_D, ENTER, drive

    monkeypatch.setenv("FLASHMOE_HOME", str(tmp_path / "home"))
    from engine.fake import FakeEngine

    t = drive("hi" + ENTER + CTRL_D, FakeEngine([ATTACK]))
    assert t.code == 0, t
    assert not any(c in t.out for c in FORBIDDEN), repr(t.out)
    assert "\\x1b]52;c;" in t.out


def test_repl_approval_question_is_escaped(tmp_path, monkeypatch):

    from flashmoe_cli.repl import LineRepl

    captured = {}

    class Prompt:
        def __init__(self, **kw):
            pass

        def prompt(self, message):
            captured["message"] = message
            return "n"

    monkeypatch.setattr("flashmoe_cli.repl.PromptSession", Prompt)
    repl = LineRepl.__new__(LineRepl)
    repl.out, repl._input, repl._output = sys.stdout, None, None

    class Call:
        name = "run_shell\x1b[2J"
        arguments = {"command": "echo \x9d52;c;eA==\x9c"}  # 8-bit OSC: json.dumps leaves it as it is

    assert repl.ask(Call(), "runs a \u202ecommand") == "no"
    assert not any(c in captured["message"] for c in FORBIDDEN), repr(captured["message"])
    assert "\\x9d52;c;eA==" in captured["message"] and "\\u202e" in captured["message"]


# The TUI: what the compositor would write to the terminal. Textual writes its own CSI sequences
# (colours, cursor placement), so the check is for what only the model could have put there.
MODEL_ONLY = ["\x1b]52", "\x1b]0;", "\x1b[2J", "\x9b", "\x9d", "\x9c", "\u202e", "\u202c", "\x07", "\x7f"]


def rendered(app) -> str:
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True, color_system="truecolor", width=app.size.width)
    update = app.screen._compositor.render_update(full=True)
    return "".join(update.render_segments(console))


def tui_call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


@pytest.mark.asyncio
async def test_tui_transcript_shows_control_sequences_escaped():
    from tests.tui.conftest import make_app, send, wait_idle

    app, engine, session = make_app([ATTACK])
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.1)
        await send(pilot, "hi \x1b]0;mine\x07")
        await wait_idle(pilot)
        out = rendered(app)
        assert not any(s in out for s in MODEL_ONLY), [s for s in MODEL_ONLY if s in out]
        assert "\\x1b]52;c;cm0gLXJmIH4=" in out and "hi \\x1b]0;mine\\x07" in out
    assert session.history[-1]["content"] == ATTACK  # what is kept is the model's text itself


@pytest.mark.asyncio
async def test_tui_tool_blocks_and_approval_show_control_sequences_escaped(tmp_path):
    from flashmoe_cli.tui.screens import ApproveScreen
    from flashmoe_cli.tui.widgets import ToolBlock
    from tests.tui.conftest import make_app, send, tool_args, wait_for, wait_idle

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text(ATTACK)
    replies = [tui_call("read_file", path="notes.txt"), tui_call("write_file", path="t.txt", content=ATTACK), "ok"]
    app, engine, session = make_app(replies, args=tool_args(ws))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "go")
        await wait_for(pilot, lambda: isinstance(app.screen, ApproveScreen), what="the approval screen")
        out = rendered(app)
        assert not any(s in out for s in MODEL_ONLY), [s for s in MODEL_ONLY if s in out]
        assert "x9b2J" in out
        app.screen._armed_at = 0.0
        await pilot.press("n")
        await wait_idle(pilot)
        for block in app.transcript.query(ToolBlock):
            block.collapsed = False
        await pilot.pause(0.2)
        out = rendered(app)
        assert not any(s in out for s in MODEL_ONLY), [s for s in MODEL_ONLY if s in out]
        assert "x9b2J" in out


# -- item 10: `agent --approve ask` asks on the terminal -----------------------------------------
def spawn_with_terminal(args, env):
    """The CLI as a session leader whose controlling terminal is a pty: /dev/tty is that pty."""
    e = dict(os.environ, **env)
    e.pop("FORCE_COLOR", None)
    pid, master = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr are the pty
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "flashmoe_cli", *map(str, args)], e)
    return pid, master


def read_until(master, needle: bytes, timeout=30) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while needle not in out and time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.1)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


def wait_exit(pid, master, timeout=30) -> tuple[int, bytes]:
    rest = read_until(master, b"\0never\0", timeout=timeout)  # drain until the child closes the pty
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            os.close(master)
            return os.waitstatus_to_exitcode(status), rest
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the CLI did not exit")


@pytest.mark.parametrize("answer,written", [(b"y\n", True), (b"n\n", False)])
def test_agent_approve_ask_asks_on_the_terminal(tmp_path, answer, written):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "s.jsonl").write_text(json.dumps({"role": "user", "content": "make a todo"}) + "\n")
    write = tui_call("write_file", path="todo.txt", content="buy milk \x1b]52;c;eA==\x07\u202e")
    env = fake_env(tmp_path, [write, "Done."])
    pid, master = spawn_with_terminal(["agent", "--engine", "fake", "--tools", "builtin", "--workspace", ws,
                                       "--script", tmp_path / "s.jsonl", "--approve", "ask"], env)
    asked = read_until(master, b"Run it?")
    assert b"write_file" in asked and b"Run it? [y/N/a(lways)]" in asked, asked
    assert b"\x1b]52" not in asked and "\u202e".encode() not in asked, asked  # the question is escaped
    os.write(master, answer)
    code, rest = wait_exit(pid, master)
    assert code == 0, asked + rest
    assert (ws / "todo.txt").exists() == written
    assert b"Traceback" not in asked + rest


def test_agent_approve_ask_without_a_terminal_says_so(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "s.jsonl").write_text(json.dumps({"role": "user", "content": "make a todo"}) + "\n")
    env = fake_env(tmp_path, [tui_call("write_file", path="todo.txt", content="x"), "Done."])
    e = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-m", "flashmoe_cli", "agent", "--engine", "fake", "--tools", "builtin",
                        "--workspace", str(ws), "--script", str(tmp_path / "s.jsonl"), "--approve", "ask"],
                       capture_output=True, text=True, env=e, cwd=ROOT, timeout=60, start_new_session=True,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 5 and not (ws / "todo.txt").exists(), r.stderr
    lines = [l for l in r.stderr.splitlines() if "no terminal" in l]
    assert lines == ["flashmoe: warning: --approve ask: no terminal to ask on (/dev/tty: No such device or address); "
                     "tool calls that need approval are refused"], r.stderr
