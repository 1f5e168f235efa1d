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
import time
import tty

import pytest

from flashmoe.cli.store import Store
from flashmoe.cli.term_safe import safe
from tests.helpers.paths import ROOT
from tests.helpers.cli import run_cli

# What a hostile model writes: a clipboard write (OSC 52), a title change (OSC 0), a screen clear,
# 8-bit CSI and OSC, a right-to-left override, a bell, a carriage return that hides the line.
ATTACK = (
    "look \x1b]52;c;cm0gLXJmIH4=\x07 here \x1b]0;pwned\x07 \x1b[2J\x1b[H \x9b2J \x9d0;x\x9c "
    "\u202eevil\u202c \x07\rgone \x7f"
)
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
    p = subprocess.Popen(
        [sys.executable, "-m", "flashmoe.cli", *map(str, args)],
        stdin=stdin,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=e,
        cwd=ROOT,
    )
    os.close(slave)
    return p, master


def run_bytes(args, env) -> subprocess.CompletedProcess:
    """The CLI with stdout piped, read as bytes (run_cli's text mode would turn \\r into \\n)."""
    e = dict(os.environ, **env)
    e.pop("FORCE_COLOR", None)
    return subprocess.run(
        [sys.executable, "-m", "flashmoe.cli", *map(str, args)],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        env=e,
        cwd=ROOT,
        timeout=60,
    )


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
    call = (
        "<tool_call>\n"
        + json.dumps({"name": "read_file", "arguments": {"path": "\x9d0;pwned\x9c.txt"}})
        + "\n</tool_call>"
    )
    r = run_cli(
        "run",
        "--engine",
        "fake",
        "-n",
        "--tools",
        "builtin",
        "--workspace",
        ws,
        "x",
        env=fake_env(tmp_path, [call, "done"]),
    )
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
    from tests.helpers.repl import CTRL_D, ENTER, drive

    monkeypatch.setenv("FLASHMOE_HOME", str(tmp_path / "home"))
    from flashmoe.engine.testing import FakeEngine

    t = drive("hi" + ENTER + CTRL_D, FakeEngine([ATTACK]))
    assert t.code == 0, t
    assert not any(c in t.out for c in FORBIDDEN), repr(t.out)
    assert "\\x1b]52;c;" in t.out


def test_repl_approval_question_is_escaped(tmp_path, monkeypatch):

    from flashmoe.cli.repl import LineRepl

    captured = {}

    class Prompt:
        def __init__(self, **kw):
            pass

        def prompt(self, message):
            captured["message"] = message
            return "n"

    monkeypatch.setattr("flashmoe.cli.repl.PromptSession", Prompt)
    repl = LineRepl.__new__(LineRepl)
    repl.out, repl._input, repl._output = sys.stdout, None, None

    class Call:
        name = "run_shell\x1b[2J"
        arguments = {"command": "echo \x9d52;c;eA==\x9c"}  # 8-bit OSC: json.dumps leaves it as it is

    assert repl.approver.ask(Call(), "runs a \u202ecommand") == "no"
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
    from tests.helpers.tui import make_app, send, wait_idle

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
    from flashmoe.cli.tui.screens import ApproveScreen
    from flashmoe.cli.tui.widgets import ToolBlock
    from tests.helpers.tui import make_app, send, tool_args, wait_for, wait_idle

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text(ATTACK)
    replies = [tui_call("read_file", path="notes.txt"), tui_call("write_file", path="t.txt", content=ATTACK), "ok"]
    app, engine, session = make_app(replies, tools=tool_args(ws))
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
        os.execve(sys.executable, [sys.executable, "-m", "flashmoe.cli", *map(str, args)], e)
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
    pid, master = spawn_with_terminal(
        [
            "agent",
            "--engine",
            "fake",
            "--tools",
            "builtin",
            "--workspace",
            ws,
            "--script",
            tmp_path / "s.jsonl",
            "--approve",
            "ask",
        ],
        env,
    )
    asked = read_until(master, b"Run it?")
    assert b"write_file" in asked and b"Run it? [y/N/a(lways)]" in asked, asked
    assert b"\x1b]52" not in asked and "\u202e".encode() not in asked, asked  # the question is escaped
    os.write(master, answer)
    code, rest = wait_exit(pid, master)
    assert code == (0 if written else 5), asked + rest  # a declined call shows in the exit code
    assert (ws / "todo.txt").exists() == written
    assert b"Traceback" not in asked + rest


def test_agent_approve_ask_without_a_terminal_says_so(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "s.jsonl").write_text(json.dumps({"role": "user", "content": "make a todo"}) + "\n")
    env = fake_env(tmp_path, [tui_call("write_file", path="todo.txt", content="x"), "Done."])
    e = dict(os.environ, **env)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashmoe.cli",
            "agent",
            "--engine",
            "fake",
            "--tools",
            "builtin",
            "--workspace",
            str(ws),
            "--script",
            str(tmp_path / "s.jsonl"),
            "--approve",
            "ask",
        ],
        capture_output=True,
        text=True,
        env=e,
        cwd=ROOT,
        timeout=60,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 5 and not (ws / "todo.txt").exists(), r.stderr
    lines = [l for l in r.stderr.splitlines() if "no terminal" in l]
    assert lines == [
        "flashmoe: warning: --approve ask: no terminal to ask on (/dev/tty: No such device or address); "
        "tool calls that need approval are refused"
    ], r.stderr


# -- item 8: a crash loses nothing shown ---------------------------------------------------------
LONG = " ".join(f"w{i}" for i in range(400))


def stream_env(tmp_path):
    (tmp_path / "home").mkdir(exist_ok=True)  # so that stderr has no "created" line
    return fake_env(tmp_path, [LONG], FLASHMOE_FAKE_DELAY="0.03")


def read_words(stream_fd, n: int, timeout=30) -> bytes:
    """Read the child's stdout until n words have been printed."""
    out = b""
    deadline = time.monotonic() + timeout
    while len(out.split()) < n and time.monotonic() < deadline:
        r, _, _ = select.select([stream_fd], [], [], 0.1)
        if r:
            chunk = os.read(stream_fd, 4096)
            if not chunk:
                break
            out += chunk
    assert len(out.split()) >= n, out
    return out


def saved(tmp_path):
    store = Store(tmp_path / "home" / "logs.db")
    return store.messages(store.latest())


def start_run(tmp_path, *extra):
    e = dict(os.environ, **stream_env(tmp_path))
    return subprocess.Popen(
        [sys.executable, "-m", "flashmoe.cli", "run", "--engine", "fake", *extra, "count"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=e,
        cwd=ROOT,
    )


def test_sigkill_keeps_the_reply_shown_before_the_last_save(tmp_path):
    p = start_run(tmp_path)
    shown = read_words(p.stdout.fileno(), 20).decode()
    time.sleep(0.6)  # longer than SAVE_EVERY_S: the text read above has been saved
    p.kill()
    p.wait(10)
    user, reply = saved(tmp_path)
    assert (user.role, user.content) == ("user", "count")
    assert reply.role == "assistant" and not reply.complete and reply.interrupted
    assert reply.content.startswith(shown.rstrip()) and LONG.startswith(reply.content)
    # -c goes on from a consistent conversation: the partial reply is in it, and is answered after
    r = run_cli("run", "--engine", "fake", "-c", "next", env=fake_env(tmp_path, ["ok"]))
    assert r.returncode == 0, r.stderr
    roles = [(m.role, m.complete) for m in saved(tmp_path)]
    assert roles == [("user", True), ("assistant", False), ("user", True), ("assistant", True)]
    shown_log = run_cli("logs", "show", env=fake_env(tmp_path, [])).stdout
    assert "[assistant (incomplete)]" in shown_log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_save_everything_shown_and_exit_128_plus_signal(tmp_path, sig):
    p = start_run(tmp_path)
    shown = read_words(p.stdout.fileno(), 20)
    p.send_signal(sig)
    rest = p.stdout.read()
    code = p.wait(10)
    err = p.stderr.read().decode()
    assert code == 128 + sig, err
    assert "Traceback" not in err
    user, reply = saved(tmp_path)
    assert reply.complete and reply.interrupted
    assert reply.content == (shown + rest).decode().rstrip("\n")  # exactly what was printed
    assert LONG.startswith(reply.content) and len(reply.content.split()) >= 20


def test_terminal_closing_saves_the_reply_and_exits_129(tmp_path):
    pid, master = spawn_with_terminal(["run", "--engine", "fake", "count"], stream_env(tmp_path))
    shown = read_until(master, b"w20 ")
    assert b"w20 " in shown, shown
    os.close(master)  # the terminal goes away: the kernel sends SIGHUP
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("did not exit after the terminal closed")
    assert os.waitstatus_to_exitcode(status) == 129
    user, reply = saved(tmp_path)
    assert reply.complete and reply.interrupted
    assert reply.content.startswith(shown.decode().replace("\r\n", "\n").rstrip()) and LONG.startswith(reply.content)


def test_resumed_history_never_has_two_user_turns_in_a_row(tmp_path):
    from flashmoe.cli.chat import NO_REPLY, ChatSession

    store = Store(tmp_path / "logs.db")
    cid = store.new_conversation("m")
    store.add_message(cid, "user", "first")  # a crash before the reply's row was written (older versions)
    store.add_message(cid, "user", "second")
    store.add_message(cid, "assistant", "", interrupted=True, complete=False)  # died before its first token
    store.add_message(cid, "user", "third")
    history = ChatSession(None, store, cid=cid).history
    assert [(m["role"], m["content"]) for m in history] == [
        ("user", "first"),
        ("assistant", NO_REPLY),
        ("user", "second"),
        ("assistant", NO_REPLY),
        ("user", "third"),
    ]


def test_a_failed_reply_leaves_no_lonely_user_turn(tmp_path):
    env = fake_env(tmp_path, ["x"], FLASHMOE_FAKE_FAIL="boom")
    r = run_cli("run", "--engine", "fake", "hi", env=env)
    assert r.returncode == 1 and "boom" in r.stderr
    assert run_cli("logs", "--json", env=env).stdout.strip() in ("[]", "[\n]") or all(
        c["messages"] % 2 == 0 for c in json.loads(run_cli("logs", "--json", env=env).stdout)
    )


def test_streaming_saves_are_throttled(tmp_path):
    """Every token goes through stream(); the database is written at most every SAVE_EVERY_S."""
    from flashmoe.cli.chat import SAVE_EVERY_S, ChatSession

    store = Store(tmp_path / "logs.db")
    writes = []
    update = store.update_message
    store.update_message = lambda *a, **k: (writes.append(a[1]), update(*a, **k))
    session = ChatSession(None, store)
    session._record("user", "hi")
    session._begin_reply()
    start = time.perf_counter()
    for i in range(20000):
        session.stream(f"t{i} ")
    elapsed = time.perf_counter() - start
    assert len(writes) <= 2 + elapsed / SAVE_EVERY_S, (len(writes), elapsed)
    assert elapsed / 20000 < 50e-6, f"{elapsed / 20000 * 1e6:.1f} us per token"
    session.finish("all", None)
    assert [m.content for m in store.messages(session.cid)] == ["hi", "all"]
    assert store.messages(session.cid)[-1].complete


@pytest.mark.asyncio
async def test_tui_saves_the_reply_as_it_streams_and_when_quitting_mid_reply(tmp_path):
    from flashmoe.cli.chat import ChatOptions, ChatSession
    from flashmoe.cli.tui.app import ChatApp
    from tests.helpers.tui import StableFakeEngine, send, wait_for

    store = Store(tmp_path / "logs.db")
    engine = StableFakeEngine([LONG], gate_after=30)  # holds the reply after 30 tokens
    session = ChatSession(engine, store, ChatOptions(timing="step"), model_name="fake")
    app = ChatApp(session, cursor_blink=False, rss=lambda: 0)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: app.loaded is not None)
        await send(pilot, "count")
        await wait_for(pilot, lambda: "w29" in (app.reply.text if app.reply else ""), what="30 tokens")
        await pilot.pause(0.4)  # the redraw timer saves what is shown within SAVE_EVERY_S
        user, reply = store.messages(session.cid)
        assert not reply.complete and reply.content == app.reply.text  # a SIGKILL now would keep all of it
        app._terminated(signal.SIGTERM)  # what the event loop's SIGTERM handler calls
        await pilot.pause(0.2)
    user, reply = store.messages(session.cid)
    assert reply.complete and reply.interrupted and reply.content.split() == LONG.split()[:30]
    from flashmoe.cli import signals

    assert signals.received == signal.SIGTERM
    signals.received = None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# -- item 13: every user mistake is one line with its exit code -----------------------------------
def one_error_line(r) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_flashmoe_home_that_is_a_file_or_under_one_is_exit_2(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for home, why in ((f, "not a folder"), (f / "sub", "cannot create it (Not a directory)")):
        for args in (["run", "--engine", "fake", "hi"], ["logs"], ["logs", "show"]):
            r = run_cli(*args, env=fake_env(tmp_path, ["ok"], FLASHMOE_HOME=str(home)))
            assert r.returncode == 2, (args, r.stderr)
            assert one_error_line(r) == f"flashmoe: error: FLASHMOE_HOME {home}: {why}"


def test_read_only_flashmoe_home_is_exit_2(tmp_path):
    # /proc/self is read-only even to root (tests run as root: chmod would not stop it)
    for home, why in (
        ("/proc/self", "not writable"),
        ("/proc/self/fm", "cannot create it (No such file or directory)"),
    ):
        r = run_cli("run", "--engine", "fake", "hi", env=fake_env(tmp_path, ["ok"], FLASHMOE_HOME=home))
        assert r.returncode == 2 and one_error_line(r) == f"flashmoe: error: FLASHMOE_HOME {home}: {why}"
    # -n saves nothing, so it does not need the folder
    r = run_cli("run", "--engine", "fake", "-n", "hi", env=fake_env(tmp_path, ["ok"], FLASHMOE_HOME="/proc/self"))
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


def test_a_missing_flashmoe_home_is_created_and_said(tmp_path):
    home = tmp_path / "new" / "home"
    r = run_cli("run", "--engine", "fake", "hi", env=fake_env(tmp_path, ["ok"], FLASHMOE_HOME=str(home)))
    assert r.returncode == 0 and r.stdout == "ok\n"
    assert r.stderr.splitlines()[0] == f"flashmoe: created {home} (FLASHMOE_HOME) for the config, logs and history"
    assert (home / "logs.db").exists()
    r = run_cli("run", "--engine", "fake", "again", env=fake_env(tmp_path, ["ok"], FLASHMOE_HOME=str(home)))
    assert "created" not in r.stderr


def test_non_utf8_stdin_and_arguments_are_replaced_and_said_once(tmp_path):
    env = fake_env(tmp_path, ["ok"])
    e = dict(os.environ, **env)
    r = subprocess.run(
        [sys.executable, "-m", "flashmoe.cli", "run", "--engine", "fake", "caf\xe9".encode("latin-1")],
        input=b"na\xefve \xff\xfe text\n",
        capture_output=True,
        env=e,
        cwd=ROOT,
        timeout=60,
    )
    err = r.stderr.decode()
    assert r.returncode == 0 and r.stdout == b"ok\n", err
    assert "Traceback" not in err
    assert [l for l in err.splitlines() if "UTF-8" in l] == [
        "flashmoe: warning: stdin is not UTF-8: undecodable bytes are replaced with U+FFFD",
        "flashmoe: warning: the prompt argument is not UTF-8: undecodable bytes are replaced with U+FFFD",
    ]
    [user, _] = saved(tmp_path)
    assert user.content == "na\ufffdve \ufffd\ufffd text\n\ncaf\ufffd"


def test_non_utf8_agent_script_is_replaced_and_said(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "s.jsonl").write_bytes(b'{"role": "user", "content": "caf\xe9"}\n')
    r = run_cli(
        "agent",
        "--engine",
        "fake",
        "--tools",
        "builtin",
        "--workspace",
        ws,
        "--script",
        tmp_path / "s.jsonl",
        "--approve",
        "never",
        env=fake_env(tmp_path, ["ok"]),
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (
        f"flashmoe: warning: --script {tmp_path / 's.jsonl'} is not UTF-8: undecodable bytes are replaced "
        "with U+FFFD" in r.stderr.splitlines()
    )


def test_a_locked_log_database_waits_then_says_so_and_still_answers(tmp_path):
    env = fake_env(tmp_path, ["the answer"])
    assert run_cli("run", "--engine", "fake", "first", env=env).returncode == 0
    holder = sqlite3.connect(tmp_path / "home" / "logs.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another flashmoe (or a sqlite3 shell) holds the database
    try:
        start = time.monotonic()
        r = run_cli("run", "--engine", "fake", "--timing", "off", "second", env=env)
        waited = time.monotonic() - start
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert r.returncode == 0 and r.stdout == "the answer\n", r.stderr
    assert waited >= 5
    assert one_error_line(r) == (
        f"flashmoe: warning: the conversation is not saved "
        f"({tmp_path / 'home' / 'logs.db'}: database is locked; waited 5 s)"
    )


# -- the line REPL: SIGTERM / SIGHUP quit it, at the prompt and mid-reply --------------------------
def spawn_repl(tmp_path, replies):
    """`flashmoe chat --no-tui` on a pty it controls (TERM=dumb: plain "> " prompts)."""
    env = dict(stream_env(tmp_path), TERM="dumb", PROMPT_TOOLKIT_NO_CPR="1")
    env["FLASHMOE_FAKE_REPLIES"] = json.dumps(replies)
    return spawn_with_terminal(["chat", "--no-tui", "--engine", "fake"], env)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_repl_at_its_prompt_quits_on_sigterm_and_sighup(tmp_path, sig):
    pid, master = spawn_repl(tmp_path, ["first answer"])
    seen = read_until(master, b"\n> ")
    os.write(master, b"hi\r")
    seen += read_until(master, b"first answer")
    seen += read_until(master, b"\n> ")
    assert seen.endswith(b"\n> "), seen
    time.sleep(0.2)
    os.kill(pid, sig)
    code, rest = wait_exit(pid, master, timeout=10)
    assert code == 128 + sig, seen + rest
    assert b"press Ctrl-C again" not in rest and b"Traceback" not in rest, rest
    assert [(m.role, m.content, m.interrupted) for m in saved(tmp_path)] == [
        ("user", "hi", False),
        ("assistant", "first answer", False),
    ]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_repl_mid_reply_saves_what_was_shown_and_exits_on_sigterm_and_sighup(tmp_path, sig):
    pid, master = spawn_repl(tmp_path, [LONG])
    read_until(master, b"\n> ")
    os.write(master, b"count\r")
    shown = read_until(master, b"w20 ")
    assert b"w20 " in shown, shown
    os.kill(pid, sig)
    code, rest = wait_exit(pid, master, timeout=10)
    assert code == 128 + sig, shown + rest
    assert b"Traceback" not in rest and b"\n> " not in rest, rest  # no new prompt: it quit
    user, reply = saved(tmp_path)
    assert (user.role, user.content) == ("user", "count")
    # what was shown, marked interrupted ("[interrupted]" on the terminal, like run and the TUI)
    assert reply.interrupted and reply.complete, reply
    assert LONG.startswith(reply.content) and len(reply.content.split()) >= 20
    screen = (shown + rest).decode().replace("\r", "")
    shown_text = screen[screen.index("w0 ") :]
    if sig == signal.SIGTERM:  # the terminal is still there: it shows exactly what was saved
        assert shown_text.startswith(reply.content + "\n[interrupted]"), (shown_text, reply.content)
    else:  # after a hangup nothing more reaches the terminal, but the reply is saved past what it got
        assert reply.content.startswith(shown_text.rstrip()), (shown_text, reply.content)


# -- non-UTF-8 text in every argument, not only the prompt -----------------------------------------
def run_argv_bytes(args, env, stdin=b""):
    e = dict(os.environ, **env)
    e.pop("FORCE_COLOR", None)
    r = subprocess.run(
        [sys.executable, "-m", "flashmoe.cli", *args], input=stdin, capture_output=True, env=e, cwd=ROOT, timeout=60
    )
    return r, r.stderr.decode()


def utf8_warnings(err: str) -> list[str]:
    return [l for l in err.splitlines() if "UTF-8" in l]


def test_non_utf8_system_stop_and_cid_are_replaced_and_said(tmp_path):
    env = fake_env(tmp_path, ["ok"])
    r, err = run_argv_bytes(
        [
            "run",
            "--engine",
            "fake",
            "--timing",
            "off",
            "--system",
            b"be \xff brief",
            "--stop",
            b"\xfe",
            "--stop",
            b"\xfd",
            "hi",
        ],
        env,
    )
    assert r.returncode == 0 and r.stdout == b"ok\n" and "Traceback" not in err, err
    assert utf8_warnings(err) == [  # one line per argument, however often it is given
        "flashmoe: warning: --system is not UTF-8: undecodable bytes are replaced with U+FFFD",
        "flashmoe: warning: --stop is not UTF-8: undecodable bytes are replaced with U+FFFD",
    ]
    store = Store(tmp_path / "home" / "logs.db")
    assert store.get(store.latest()).system == "be \ufffd brief"
    r, err = run_argv_bytes(["run", "--engine", "fake", "--cid", b"x\xff", "hi"], env)
    assert r.returncode == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "flashmoe: error: --cid x\ufffd: no such conversation (see `flashmoe logs`)"


def test_non_utf8_system_from_the_environment_is_replaced_and_said(tmp_path):
    r, err = run_argv_bytes(
        ["run", "--engine", "fake", "--timing", "off", "hi"], fake_env(tmp_path, ["ok"], FLASHMOE_SYSTEM=b"caf\xe9")
    )
    assert r.returncode == 0 and "Traceback" not in err, err
    assert utf8_warnings(err) == [
        "flashmoe: warning: FLASHMOE_SYSTEM is not UTF-8: undecodable bytes are replaced with U+FFFD"
    ]
    store = Store(tmp_path / "home" / "logs.db")
    assert store.get(store.latest()).system == "caf\ufffd"


def test_lone_surrogates_in_an_agent_script_are_replaced_and_said(tmp_path):
    """JSON can spell a lone surrogate (\\udcff, \\ud800): the system line and the user turns."""
    ws = tmp_path / "ws"
    ws.mkdir()
    script = tmp_path / "s.jsonl"
    script.write_text('{"role": "system", "content": "be \\udcff brief"}\n{"role": "user", "content": "hi \\ud800"}\n')
    r, err = run_argv_bytes(
        [
            "agent",
            "--engine",
            "fake",
            "--tools",
            "builtin",
            "--workspace",
            str(ws),
            "--script",
            str(script),
            "--approve",
            "never",
        ],
        fake_env(tmp_path, ["ok"]),
    )
    assert r.returncode == 0 and "Traceback" not in err, err
    assert utf8_warnings(err) == [
        f"flashmoe: warning: --script {script} line 1 is not UTF-8: undecodable bytes are replaced with U+FFFD",
        f"flashmoe: warning: --script {script} line 2 is not UTF-8: undecodable bytes are replaced with U+FFFD",
    ]
    store = Store(tmp_path / "home" / "logs.db")
    cid = store.latest()
    assert store.get(cid).system == "be \ufffd brief"
    assert [m.content for m in store.messages(cid)][:1] == ["hi \ufffd"]


def test_a_non_utf8_model_path_is_kept_for_opening_and_saved_replaced(tmp_path):
    """A path stays as the bytes name it (it may be a real folder); the log holds it with U+FFFD."""
    r, err = run_argv_bytes(
        ["run", "--engine", "fake", "--timing", "off", "-m", b"/models/\xff", "hi"], fake_env(tmp_path, ["ok"])
    )
    assert r.returncode == 0 and r.stdout == b"ok\n" and "Traceback" not in err, err
    store = Store(tmp_path / "home" / "logs.db")
    cid = store.latest()
    assert store.get(cid).model == "/models/\ufffd"
    assert [m.content for m in store.messages(cid)] == ["hi", "ok"]


def test_the_store_saves_lone_surrogates_as_replacement_characters(tmp_path):
    store = Store(tmp_path / "logs.db")
    cid = store.new_conversation("m\udcff", system="s\ud800")
    mid = store.add_message(cid, "user", "a\udcffb", stats={"message": {"name": "t\udcff"}})
    store.update_message(mid, "c\udcfe", stats={"x": "\udcff"})
    store.set_system(cid, "t\udfff")
    conv = store.get(cid)
    assert (conv.model, conv.system, conv.title) == ("m\ufffd", "t\ufffd", "a\ufffdb")
    [m] = store.messages(cid)
    assert m.content == "c\ufffd"


@pytest.mark.parametrize("kind", ["nested", "fifo", "huge"])
def test_a_config_file_nested_deep_a_fifo_or_huge_is_one_line(tmp_path, kind):
    home = tmp_path / "home"
    home.mkdir()
    path = home / "config.toml"
    if kind == "nested":
        path.write_text("temp = " + "[" * 100_000 + "]" * 100_000 + "\n")
    elif kind == "fifo":
        os.mkfifo(path)  # reading it would block the start-up forever
    else:
        path.write_text("# " + "x" * (2 << 20) + "\n")
    r = run_cli("run", "--engine", "fake", "hi", env={"FLASHMOE_HOME": str(home)}, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"flashmoe: error: {path}: ")
    assert {"nested": "nested too deeply", "fifo": "not a regular file", "huge": "at most"}[kind] in line


def test_an_agent_script_line_nested_deep_is_one_line(tmp_path):
    script = tmp_path / "s.jsonl"
    script.write_text('{"role": "user", "content": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    r = run_cli(
        "agent",
        "--engine",
        "fake",
        "--tools",
        "builtin",
        "--script",
        script,
        "--transcript",
        tmp_path / "t.jsonl",
        env={"FLASHMOE_HOME": str(tmp_path / "home")},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"flashmoe: error: --script {script} line 1: cannot be read (nested too deeply)"
