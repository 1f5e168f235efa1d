"""The line REPL (`flashmoe chat --no-tui`), driven through prompt-toolkit's pipe input.

Each test types keys into the pipe ("\r" Enter, "\x1b\r" Alt+Enter, "\x03" Ctrl-C, "\x04" Ctrl-D)
and asserts on the whole transcript: stdout (the replies), stderr (messages and timing), the
requests the FakeEngine received and what the conversation store recorded.
"""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import sys
import time

import pytest
from prompt_toolkit.document import Document
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from flashmoe.engine.testing import FakeEngine
from flashmoe.cli import cli, startup
from flashmoe.cli.exit_codes import ExitCode
from flashmoe.cli.repl import LineRepl, SlashCompleter, run_repl
from tests.helpers.paths import ROOT
from tests.helpers.repl import ALT_ENTER, CTRL_C, CTRL_D, CTRL_R, ENTER, RIGHT, Transcript, chat_args, drive
from tests.helpers.repl import private_home  # noqa: F401 (the autouse fixture `home`)


def user_messages(request):
    return [m["content"] for m in request.messages if m["role"] == "user"]


def latest_messages():
    from flashmoe.cli.store import open_store

    store = open_store()
    return store.messages(store.latest())


# -- the basics ---------------------------------------------------------------------------------
def test_chat_streams_replies_and_quits_on_ctrl_d():
    t = drive("hi" + ENTER + "and again" + ENTER + CTRL_D, FakeEngine(["Hello there.", "Second reply."]))
    assert t.code == ExitCode.OK, t
    assert t.out == "Hello there.\nSecond reply.\n", t
    err = t.err.splitlines()
    assert err[0].startswith("flashmoe chat: fake (fake_moe, packed)") and "/help" in err[0]
    summaries = [line for line in err if line.startswith("prefill ")]
    assert len(summaries) == 2 and all("decode" in s and "hit rate 75%" in s for s in summaries), t
    # the second request carries the whole conversation so far
    last = t.engine.requests[-1].messages
    assert [m["role"] for m in last] == ["user", "assistant", "user"]
    assert [m["content"] for m in last] == ["hi", "Hello there.", "and again"]
    # and the store recorded every message
    assert [(m.role, m.content, m.interrupted) for m in latest_messages()] == [
        ("user", "hi", False),
        ("assistant", "Hello there.", False),
        ("user", "and again", False),
        ("assistant", "Second reply.", False),
    ]


def test_exit_words_and_commands_quit():
    for word in ("exit", "quit", "/exit", "/quit", "  EXIT "):
        t = drive(word + ENTER)
        assert t.code == ExitCode.OK and t.out == "" and t.engine.requests == [], (word, t)


def test_empty_lines_send_nothing():
    t = drive(ENTER + "   " + ENTER + CTRL_D)
    assert t.code == 0 and t.engine.requests == [] and t.out == "", t


def test_alt_enter_inserts_a_newline():
    t = drive("first line" + ALT_ENTER + "second line" + ENTER + CTRL_D)
    assert t.code == 0, t
    assert user_messages(t.engine.requests[0]) == ["first line\nsecond line"]


def test_bracketed_paste_keeps_newlines():
    t = drive("\x1b[200~pasted one\r\npasted two\x1b[201~" + ENTER + CTRL_D)
    assert t.code == 0, t
    assert user_messages(t.engine.requests[0]) == ["pasted one\npasted two"]


# -- slash commands -----------------------------------------------------------------------------
def test_system_changes_the_next_request():
    t = drive("/system" + ENTER + "/system be brief" + ENTER + "/system" + ENTER + "hi" + ENTER + CTRL_D)
    assert t.code == 0, t
    assert "no system prompt" in t.err and "system prompt set" in t.err and "system prompt: be brief" in t.err
    assert t.engine.requests[0].messages[0] == {"role": "system", "content": "be brief"}


def test_system_flag_is_used_and_command_overrides_it():
    t = drive("one" + ENTER + "/system pirate" + ENTER + "two" + ENTER + CTRL_D, None, "-s", "formal")
    first, second = t.engine.requests
    assert first.messages[0] == {"role": "system", "content": "formal"}
    assert second.messages[0] == {"role": "system", "content": "pirate"}


def test_clear_empties_the_history():
    t = drive("hi" + ENTER + "/clear" + ENTER + "fresh" + ENTER + CTRL_D)
    assert t.code == 0 and "started a new conversation" in t.err, t
    assert [m["content"] for m in t.engine.requests[1].messages] == ["fresh"]


def test_save_writes_markdown(tmp_path):
    path = tmp_path / "conv.md"
    t = drive("/system be kind" + ENTER + "hi" + ENTER + f"/save {path}" + ENTER + CTRL_D)
    assert t.code == 0 and f"saved the conversation to {path}" in t.err, t
    md = path.read_text()
    assert md.startswith("# flashmoe conversation")
    assert "**system**\n\nbe kind" in md and "**user**\n\nhi" in md and "**assistant**\n\nHello there." in md


def test_save_problems_are_one_line(tmp_path):
    t = drive("/save" + ENTER + f"/save {tmp_path}/no/such/dir/x.md" + ENTER + CTRL_D)
    assert t.code == 0, t
    assert "usage: /save PATH" in t.err
    assert [line for line in t.err.splitlines() if line.startswith("flashmoe: error:")] == [
        f"flashmoe: error: {tmp_path}/no/such/dir/x.md: No such file or directory"
    ]


def test_unknown_command_is_reported_and_the_repl_goes_on():
    t = drive("/frobnicate now" + ENTER + "hi" + ENTER + CTRL_D)
    assert t.code == 0, t
    assert "unknown command /frobnicate; try /help" in t.err
    assert len(t.engine.requests) == 1 and t.out == "Hello there.\n"


def test_help_lists_commands_and_keys():
    t = drive("/help" + ENTER + "/?" + ENTER + CTRL_D)
    assert t.code == 0, t
    for needle in ("/system", "/timing", "/save", "/clear", "/exit", "Alt+Enter", "Ctrl-R", "Ctrl-D"):
        assert needle in t.err
    assert t.err.count("Commands:") == 2 and t.out == ""


def test_timing_modes():
    keys = (
        "/timing off"
        + ENTER
        + "a"
        + ENTER
        + "/timing layer"
        + ENTER
        + "b"
        + ENTER
        + "/timing"
        + ENTER
        + "/timing fast"
        + ENTER
        + CTRL_D
    )
    t = drive(keys, FakeEngine(["one two three"]))
    assert t.code == 0, t
    assert [r.timing for r in t.engine.requests] == ["off", "layer"]
    assert t.err.count("\nprefill ") == 1  # no summary after the reply with timing off
    # layer mode: the summary, then a per-layer table with every layer (8 in the fake)
    table = t.err.split("per layer over 3 decode steps", 1)[1]
    assert [line.split()[0] for line in table.splitlines()[2:10]] == [str(i) for i in range(8)]
    assert "timing: layer" in t.err  # `/timing` alone shows the mode (and the last table again)
    assert t.err.count("per layer over 3 decode steps") == 2
    assert "/timing: expected off, step or layer, not 'fast'" in t.err


def test_slash_completer():
    def names(text):
        return [c.text for c in SlashCompleter().get_completions(Document(text), None)]

    assert names("/s") == ["/system", "/save"]
    assert names("/ti") == ["/timing"]
    assert names("hello /s") == [] and names("/system x") == []


# -- history --------------------------------------------------------------------------------------
def test_history_persists_between_runs_with_search_and_suggestions(home):
    t = drive("tell me about otters" + ENTER + "/help" + ENTER + CTRL_D)
    assert t.code == 0, t
    assert "tell me about otters" in (home / "history").read_text()
    # second run: Up recalls it; Ctrl-R finds it; a typed prefix + Right accepts the suggestion
    t = drive(["\x1b[A\x1b[A" + ENTER, CTRL_R + "otters", ENTER + ENTER, "tell me a", RIGHT + ENTER, CTRL_D])
    assert t.code == 0, t
    assert [user_messages(r)[-1] for r in t.engine.requests] == ["tell me about otters"] * 3


def test_history_in_an_unwritable_place_only_warns(home, monkeypatch):
    home.mkdir(parents=True)
    (home / "history").mkdir()  # a folder where the file should be
    t = drive("hi" + ENTER + CTRL_D)
    assert t.code == 0 and t.out == "Hello there.\n", t
    assert "flashmoe: warning: history is not saved" in t.err


# -- Ctrl-C ----------------------------------------------------------------------------------------
class Clock:
    def __init__(self, step):
        self.now, self.step = 100.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def test_ctrl_c_clears_the_line_then_twice_on_an_empty_line_quits():
    t = drive("half-typed" + CTRL_C + CTRL_C + CTRL_C, None, clock=Clock(0.2))
    assert t.code == ExitCode.OK, t
    assert t.engine.requests == [] and t.out == ""
    assert t.err.count("press Ctrl-C again to quit") == 1


def test_ctrl_c_twice_but_slowly_does_not_quit():
    t = drive(CTRL_C + CTRL_C + "hi" + ENTER + CTRL_D, None, clock=Clock(2.0))
    assert t.code == ExitCode.OK, t
    assert t.err.count("press Ctrl-C again to quit") == 2 and t.out == "Hello there.\n"


def test_a_line_in_between_disarms_ctrl_c():
    t = drive(CTRL_C + "hi" + ENTER + CTRL_C + "x" + ENTER + CTRL_D, None, clock=Clock(0.1))
    assert t.code == 0 and len(t.engine.requests) == 2, t


class InterruptAfter:
    """A handle that raises KeyboardInterrupt once, after `after` tokens: Ctrl-C while streaming."""

    def __init__(self, handle, after):
        self.handle, self.after, self.seen = handle, after, 0

    def get(self, timeout=None):
        if self.seen == self.after:
            self.seen += 1
            raise KeyboardInterrupt
        ev = self.handle.get(timeout=timeout)
        if type(ev).__name__ == "TokenGenerated":
            self.seen += 1
        return ev

    def cancel(self):
        self.handle.cancel()


class InterruptingEngine(FakeEngine):
    def submit(self, request, session="default"):
        return InterruptAfter(super().submit(request, session), after=3)


def test_ctrl_c_while_streaming_keeps_the_partial_reply():
    words = " ".join(f"w{i}" for i in range(200))
    engine = InterruptingEngine([words, "next answer"], token_delay=0.01)
    t = drive("go" + ENTER + "more" + ENTER + CTRL_D, engine)
    assert t.code == ExitCode.OK, t
    partial, rest = t.out.split("\n[interrupted]\n")
    assert partial.startswith("w0 w1 w2") and len(partial.split()) < 50, t
    assert rest == "next answer\n"
    # the partial reply is history, recorded as interrupted, and sent with the next request
    assert t.engine.requests[1].messages[1] == {"role": "assistant", "content": partial}
    rows = [(m.role, m.content, m.interrupted) for m in latest_messages()]
    assert rows[:2] == [("user", "go", False), ("assistant", partial, True)]
    assert rows[3] == ("assistant", "next answer", False)


def test_line_repl_on_its_own():
    """LineRepl needs only a ChatSession and the loaded-model info; nothing is saved without a store."""
    from flashmoe.cli.chat import ChatSession

    engine = FakeEngine(["a reply"])
    session = ChatSession(engine)
    session.options.timing = "off"
    out, err = io.StringIO(), io.StringIO()
    with create_pipe_input() as inp:
        inp.send_text("question" + ENTER + "/exit" + ENTER)
        repl = LineRepl(session, engine.wait_loaded(), input=inp, output=DummyOutput(), stdout=out, stderr=err)
        assert repl.run() == 0
    assert out.getvalue() == "a reply\n"
    assert session.history == [{"role": "user", "content": "question"}, {"role": "assistant", "content": "a reply"}]
    assert "prefill" not in err.getvalue()


# -- failures ---------------------------------------------------------------------------------------
def test_a_failed_reply_is_one_line_and_the_chat_goes_on():
    class FlakyEngine(FakeEngine):
        def submit(self, request, session="default"):
            self.fail = "out of memory\ntraceback here" if not self.requests else None
            return super().submit(request, session)

    t = drive("first" + ENTER + "second" + ENTER + CTRL_D, FlakyEngine(["fine."]))
    assert t.code == ExitCode.OK, t
    assert "flashmoe: error: out of memory\n" in t.err and "traceback" not in t.err
    assert t.out == "fine.\n"
    # the failed turn's question is not sent again with the next one
    assert [m["content"] for m in t.engine.requests[1].messages] == ["second"]


def test_load_error_exits_3():
    from flashmoe.engine.errors import ModelLoadError

    class Broken(FakeEngine):
        closed = False

        def wait_loaded(self, timeout=None):
            raise ModelLoadError("/models/x", "config.json is missing")

        def close(self):
            self.closed = True

    engine = Broken()
    t = drive("", engine)
    assert t.code == ExitCode.MODEL == 3, t
    assert t.err.count("\n") == 1 and t.err.startswith("flashmoe: error: ") and "config.json is missing" in t.err
    assert engine.closed and t.out == ""


def test_load_error_through_make_engine_exits_3(monkeypatch):
    def boom(args):
        raise RuntimeError("mlx is not installed right")

    monkeypatch.setattr(startup, "make_engine", boom)
    err = io.StringIO()
    code = run_repl(chat_args(), input=None, output=DummyOutput(), stdout=io.StringIO(), stderr=err)
    assert code == 3
    assert err.getvalue().splitlines()[-1] == (
        "flashmoe: error: could not load the model: RuntimeError: mlx is not installed right"
    )


def test_bad_flags_are_a_usage_error_before_loading():
    with pytest.raises(cli.UsageError):  # the sampler refuses it (argparse takes any integer)
        run_repl(chat_args("--seed", "-1"), engine=FakeEngine())
    with pytest.raises(SystemExit):  # out of range: argparse (argtypes.top_p), exit 2
        chat_args("--top-p", "1.5")
    with pytest.raises(SystemExit):  # argparse refuses this one itself (exit 2)
        chat_args("--max-tokens", "0")


# -- picking the REPL ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "term,flags,face",
    [("dumb", [], "repl"), ("", [], "repl"), ("xterm-256color", ["--no-tui"], "repl"), ("xterm-256color", [], "tui")],
)
def test_chat_picks_the_repl_on_a_dumb_terminal_or_with_no_tui(monkeypatch, term, flags, face):
    import types

    from flashmoe.cli import repl

    monkeypatch.setenv("TERM", term)
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(isatty=lambda: True))
    monkeypatch.setattr(sys, "stdout", types.SimpleNamespace(isatty=lambda: True))
    picked = []
    monkeypatch.setattr(repl, "run_repl", lambda args: picked.append("repl") or 0)
    tui = types.ModuleType("flashmoe.cli.tui.app")
    tui.run_tui = lambda args: picked.append("tui") or 0
    monkeypatch.setitem(sys.modules, "flashmoe.cli.tui", types.ModuleType("flashmoe.cli.tui"))
    monkeypatch.setitem(sys.modules, "flashmoe.cli.tui.app", tui)
    args = cli.build_parser().parse_args(["chat", "--engine", "fake", *flags])
    assert cli.cmd_chat(args) == 0 and picked == [face]


# -- a real terminal ------------------------------------------------------------------------------------
@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
@pytest.mark.parametrize("term,flags", [("dumb", []), ("xterm-256color", ["--no-tui"])])
def test_under_a_pseudo_terminal(home, term, flags):
    """`flashmoe chat` in a pty: a reply, Ctrl-C (a real SIGINT) mid-reply, Ctrl-D."""
    import pty

    words = " ".join(f"w{i}" for i in range(300))
    env = dict(
        os.environ,
        TERM=term,
        FLASHMOE_HOME=str(home),
        FLASHMOE_FAKE_DELAY="0.02",
        FLASHMOE_FAKE_REPLIES=f'["Hello from the fake.", "{words}"]',
        PROMPT_TOOLKIT_NO_CPR="1",
    )
    env.pop("FORCE_COLOR", None)
    master, slave = pty.openpty()
    # In its own session the child makes the pty its controlling terminal, so ^C is its SIGINT.
    child = (
        "import fcntl, runpy, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
        "sys.argv[0] = 'flashmoe'; runpy.run_module('flashmoe.cli', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child, "chat", "--engine", "fake", *flags],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    os.close(slave)
    seen, mark = b"", 0  # what the terminal showed; where the last wait's match ended

    def until(needle: bytes, timeout: float = 10.0) -> None:
        """Wait until `needle` appears after the previous match."""
        nonlocal seen, mark
        end = time.monotonic() + timeout
        while needle not in seen[mark:]:
            left = end - time.monotonic()
            assert left > 0, f"waited for {needle!r}; the terminal shows:\n{seen.decode(errors='replace')}"
            if select.select([master], [], [], min(left, 0.1))[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    pass
        mark = seen.index(needle, mark) + len(needle)

    try:
        # the prompt is ready: "> " after a line (dumb), or bracketed paste switched on (full)
        prompt = b"\n> " if term == "dumb" else b"\x1b[?2004h"
        until(b"/help")
        until(prompt)
        os.write(master, b"hi\r")
        until(b"Hello from the fake.")
        until(b"prefill ")
        until(prompt)
        os.write(master, b"go on\r")
        until(b"w5 ")
        os.write(master, b"\x03")
        until(b"[interrupted]")
        until(prompt)
        time.sleep(0.3)  # a ^D typed before the prompt switches the tty to raw mode is the tty's EOF
        os.write(master, b"\x04")
        assert proc.wait(timeout=10) == 0
        assert b"w299" not in seen and b"Traceback" not in seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


# -- tools ---------------------------------------------------------------------------------

WRITE = '<tool_call>\n{"name": "write_file", "arguments": {"path": "todo.txt", "content": "buy milk"}}\n</tool_call>'


@pytest.mark.parametrize("answer,written", [("y", True), ("n", False)])
def test_tool_call_asks_y_n_and_runs_only_on_yes(tmp_path, answer, written):
    ws = tmp_path / "ws"
    ws.mkdir()
    engine = FakeEngine([WRITE, "Done."])
    keys = ["make a todo", ENTER, answer + ENTER, CTRL_D]
    t = drive(keys, engine, "--tools", "builtin", "--workspace", str(ws))
    assert t.code == 0, t
    assert "-> write_file(" in t.err and "Done." in t.out
    assert (ws / "todo.txt").exists() == written, t
    assert ("<- ok" in t.err) == written and (("declined" in t.err) != written), t
    # the tool result went back to the model before its second reply
    assert any("<tool_response>" in m for m in user_messages(engine.requests[-1]))


# -- non-UTF-8 typing ------------------------------------------------------------------------------
def test_non_utf8_bytes_typed_in_a_line_or_system_are_replaced_and_said(home):
    """prompt-toolkit decodes the terminal with surrogate escapes; what is sent and saved is U+FFFD."""
    engine = FakeEngine(["ok"])
    out, err = io.StringIO(), io.StringIO()
    with create_pipe_input() as inp:
        inp.send_bytes(b"/system be \xff brief\rcaf\xe9\r\x04")
        code = run_repl(chat_args(), engine=engine, input=inp, output=DummyOutput(), stdout=out, stderr=err)
    t = Transcript(code, out.getvalue(), err.getvalue(), engine)
    assert code == 0 and "Traceback" not in t.err, t
    assert [l for l in t.err.splitlines() if "UTF-8" in l] == [
        "flashmoe: warning: /system is not UTF-8: undecodable bytes are replaced with U+FFFD",
        "flashmoe: warning: the message is not UTF-8: undecodable bytes are replaced with U+FFFD",
    ]
    assert engine.requests[0].messages == [
        {"role": "system", "content": "be \ufffd brief"},
        {"role": "user", "content": "caf\ufffd"},
    ]
    from flashmoe.cli.store import open_store

    store = open_store()
    assert store.get(store.latest()).system == "be \ufffd brief"
    assert [m.content for m in latest_messages()] == ["caf\ufffd", "ok"]


class Pty:
    """`flashmoe chat --no-tui` on a pseudo-terminal: what it showed, and keys typed into it."""

    def __init__(self, home, replies, delay="0.02"):
        import pty

        env = dict(
            os.environ,
            TERM="xterm-256color",
            FLASHMOE_HOME=str(home),
            FLASHMOE_FAKE_DELAY=delay,
            FLASHMOE_FAKE_REPLIES=json.dumps(replies),
            PROMPT_TOOLKIT_NO_CPR="1",
        )
        env.pop("FORCE_COLOR", None)
        self.master, slave = pty.openpty()
        child = (
            "import fcntl, runpy, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
            "sys.argv[0] = 'flashmoe'; runpy.run_module('flashmoe.cli', run_name='__main__')"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", child, "chat", "--engine", "fake", "--no-tui"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        os.close(slave)
        self.seen, self.mark = b"", 0

    def until(self, needle: bytes, timeout: float = 10.0) -> int:
        """Wait until `needle` appears after the previous match; returns where it starts."""
        end = time.monotonic() + timeout
        while needle not in self.seen[self.mark :]:
            left = end - time.monotonic()
            assert left > 0, f"waited for {needle!r}; the terminal shows:\n{self.seen.decode(errors='replace')}"
            if select.select([self.master], [], [], min(left, 0.1))[0]:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:
                    pass
        at = self.seen.index(needle, self.mark)
        self.mark = at + len(needle)
        return at

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_text_typed_during_a_reply_is_not_echoed_into_it_and_waits_for_the_prompt(home):
    from flashmoe.cli.paths import logs_db
    from flashmoe.cli.store import Store

    words = " ".join(f"w{i}" for i in range(60))
    t = Pty(home, [words, "second answer"])
    try:
        bracketed = b"\x1b[?2004h"  # prompt-toolkit is reading: the prompt is up
        t.until(bracketed)
        t.type(b"hi\r")
        start = t.until(b"w3 ")
        t.type(b"typed ahead")  # while the reply streams
        end = t.until(b"w59")
        t.until(b"prefill ")  # the summary after the reply
        reply = t.seen[start:end]
        assert b"typed" not in reply and b"ahead" not in reply, reply
        t.until(bracketed)
        t.until(b"typed ahead")  # the next prompt shows it, ready to send
        t.type(b" now\r")
        t.until(b"second answer")
        t.until(bracketed)
        time.sleep(0.3)
        t.type(b"\x04")
        assert t.proc.wait(timeout=10) == 0
    finally:
        t.close()
    store = Store(logs_db())  # FLASHMOE_HOME is `home` here too
    users = [m.content for m in store.messages(store.latest()) if m.role == "user"]
    assert users == ["hi", "typed ahead now"]


def test_help_describes_timing_as_the_repl_has_it_no_panel():
    t = drive("/help" + ENTER + CTRL_D)
    assert t.code == 0, t
    timing = next(line for line in t.err.splitlines() if line.strip().startswith("/timing"))
    assert "panel" not in t.err and "per-layer table" in timing, t
    assert [c.display_meta_text for c in SlashCompleter().get_completions(Document("/tim"), None)] == [
        timing.strip().split(None, 1)[1]
    ]


def test_quitting_says_how_to_resume_the_conversation(home):
    from flashmoe.cli.paths import logs_db
    from flashmoe.cli.store import Store

    t = drive("hi" + ENTER + CTRL_D)
    assert t.code == 0, t
    cid = Store(logs_db()).latest()
    assert cid is not None
    assert t.err.splitlines()[-1] == (
        f"flashmoe: conversation {cid} is saved; `flashmoe chat -c` resumes the "
        f"latest, `flashmoe chat --cid {cid}` this one"
    ), t
    t = drive("hi" + ENTER + CTRL_D, None, "--cid", cid)  # resumed: the same id again
    assert t.err.splitlines()[-1].startswith(f"flashmoe: conversation {cid} is saved"), t


@pytest.mark.parametrize("keys,flags", [(CTRL_D, ()), ("hi" + ENTER + CTRL_D, ("-n",))])
def test_nothing_saved_no_resume_hint(keys, flags):
    t = drive(keys, None, *flags)
    assert t.code == 0 and "is saved" not in t.err and "chat -c" not in t.err, t
