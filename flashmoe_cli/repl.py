"""`flashmoe chat --no-tui` (or TERM=dumb): a prompt-toolkit line REPL.

Enter sends; Alt+Enter (Esc Enter) starts a new line and a bracketed paste keeps its newlines.
History persists in `history_file()`; Ctrl-R searches it, and suggestions from it show in grey
(Right arrow or Ctrl-E accepts one). The reply streams to stdout as it is generated; the timing
summary goes to stderr after it.

Ctrl-C while a reply streams stops it and keeps the partial text (marked "[interrupted]"). At the
prompt Ctrl-C abandons the line; a second Ctrl-C on an empty line within QUIT_WINDOW seconds
quits, and so does Ctrl-D on an empty line. SIGTERM and SIGHUP (signals.py) stop a reply the same
way, and then quit: at the prompt at once, mid-reply once the partial reply is saved.

Tests drive `run_repl(args, engine=FakeEngine(...), input=create_pipe_input(), output=DummyOutput(),
stdout=io.StringIO(), stderr=io.StringIO())`, or `LineRepl` directly.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import termios
except ImportError:  # pragma: no cover  (Windows: no tty echo to switch off)
    termios = None
from prompt_toolkit import PromptSession
from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.enums import DEFAULT_BUFFER
from prompt_toolkit.filters import has_focus
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings

from . import signals
from .chat import resume_hint
from . import commands
from .commands import ALIASES, COMMANDS, CommandError, parse
from .exit_codes import ExitCode
from .line_view import LineView
from .term_safe import safe
from .utf8 import decode_text, scrub

# what asking a stream for its tty settings raises where it is no terminal
_NOT_A_TTY = (AttributeError, ValueError, OSError) + ((termios.error,) if termios else ())

KEYS = """Keys:
  Enter              send                    Alt+Enter (Esc Enter)  new line
  Up / Down          previous / next line    Ctrl-R                 search the history
  Right or Ctrl-E    accept the suggestion   Tab                    complete a /command
  Ctrl-X Ctrl-E      edit in $EDITOR         Ctrl-C                 stop the reply / clear the line
  Ctrl-D             quit (empty line)       Ctrl-C twice           quit"""

# what a command does here, where COMMANDS (shared with the TUI) says otherwise: no panel
REPL_COMMANDS = COMMANDS | {
    "timing": "/timing off|step|layer sets the timing mode; alone, shows it and the last reply's per-layer table",
}
QUIT_WINDOW = 1.5  # seconds between two Ctrl-C on an empty line that quit


class SlashCompleter(Completer):
    """Completes /command names at the start of the line, nothing else."""

    def get_completions(self, document, complete_event):
        text = document.text_before_cursor
        if not text.startswith("/") or " " in text or "\n" in text:
            return
        word = text[1:].lower()
        for name in list(COMMANDS) + [a for a in ALIASES if a.isalpha()]:
            if name.startswith(word):
                yield Completion("/" + name, start_position=-len(text), display_meta=REPL_COMMANDS.get(name, ""))


class Utf8FileHistory(FileHistory):
    """prompt-toolkit decodes the terminal with surrogate escapes, and FileHistory would then fail
    to encode a line typed in another encoding (inside the prompt, a hang): store it with U+FFFD."""

    def store_string(self, string: str) -> None:
        super().store_string(scrub(string))


def open_history(path: Path | None = None, stderr=None) -> History:
    """FileHistory at `path` (default: history_file()), creating its folder; in memory if that fails."""
    if path is None:
        from .paths import history_file

        path = history_file()
    try:
        from .paths import private_file

        private_file(path)  # what the user typed is nobody else's: 0600
        with open(path, "ab"), open(path, "rb"):  # can it be written and read back?
            pass
        return Utf8FileHistory(str(path))
    except OSError as e:
        print(f"flashmoe: warning: history is not saved ({path}: {e.strerror or e})", file=stderr or sys.stderr)
        return InMemoryHistory()


@contextmanager
def no_echo(stream):
    """While a reply streams nothing reads the terminal, so the tty itself would echo what is typed
    into the reply: switch its echo off (ISIG stays, so Ctrl-C still stops the reply). What was
    typed waits in the tty and shows at the next prompt, as type-ahead does in a shell."""
    try:
        fd = stream.fileno()
        old = termios.tcgetattr(fd) if termios is not None and os.isatty(fd) else None
    except _NOT_A_TTY:  # a pipe, a StringIO, a closed stream
        old = None
    if old is None:
        yield
        return
    quiet = list(old)
    quiet[3] &= ~(termios.ECHO | termios.ECHONL)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        try:
            termios.tcsetattr(fd, termios.TCSANOW, old)
        except termios.error:  # the terminal went away
            pass


class LineRepl(LineView):
    """The loop: read a line, run a command or send it, show the turn (as the AgentLoop's
    on_event; line_view.py keeps the order of what is shown). `run()` returns the exit code."""

    def __init__(
        self,
        session,
        loaded,
        *,
        input=None,
        output=None,
        stdout=None,
        stderr=None,
        history: History | None = None,
        clock=time.monotonic,
    ):
        from .agent import AgentLoop

        self.session = session
        self.loop = AgentLoop(session, on_event=self)  # the tool loop instead with use_tools
        super().__init__(loaded, self.loop.stats, lambda: session.options.timing, out=stdout, err=stderr)
        self.clock = clock
        self._armed_at: float | None = None  # when Ctrl-C on an empty line asked to confirm quitting
        self._quit = False  # /exit was run
        self._input, self._output = input, output
        self.prompt = PromptSession(
            message=[("class:prompt", "> ")],
            prompt_continuation=lambda width, line, wrap: [
                ("class:prompt-continuation", "." * max(width - 1, 0) + " ")
            ],
            history=history if history is not None else InMemoryHistory(),
            auto_suggest=AutoSuggestFromHistory(),
            enable_history_search=False,
            completer=SlashCompleter(),
            complete_while_typing=False,
            key_bindings=self._key_bindings(),
            multiline=False,
            enable_open_in_editor=True,
            enable_suspend=True,
            input=input,
            output=output,
        )

    # -- keys ------------------------------------------------------------------------------
    def _key_bindings(self) -> KeyBindings:
        kb = KeyBindings()
        in_line = has_focus(DEFAULT_BUFFER)  # not while Ctrl-R searches

        @kb.add("escape", "enter", filter=in_line)
        def _newline(event):
            event.current_buffer.insert_text("\n")

        return kb

    # -- output ----------------------------------------------------------------------------
    # The REPL runs on a terminal: model and tool text is escaped on the way to it.
    def write(self, text: str) -> None:
        self.out.write(safe(text))
        self.out.flush()
        self.wrote(text)

    _dim = False  # reasoning is being shown

    def show(self, segments, end: bool = False) -> None:
        """Reply text: the answer as it is, reasoning dimmed on a terminal (between '<think>' and
        '</think>' lines elsewhere)."""
        from .reasoning import SHOW_CLOSE, SHOW_OPEN
        from .term_safe import is_tty

        tty = is_tty(self.out)
        for seg in segments:
            if seg.kind not in ("text", "reasoning") or not seg.text:
                continue
            thinking = seg.kind == "reasoning"
            if thinking != self._dim:
                self.out.write(
                    ("\x1b[2m" if tty else SHOW_OPEN) if thinking else ("\x1b[0m\n\n" if tty else SHOW_CLOSE)
                )
                self._dim = thinking
            self.write(seg.text)
        if end and self._dim:
            self.out.write("\x1b[0m" if tty else SHOW_CLOSE.rstrip("\n"))
            self._dim = False
            self.out.flush()

    # -- the loop --------------------------------------------------------------------------
    def banner(self) -> None:
        ld = self.loaded
        model = getattr(ld, "model", "") or "model"
        mode = f" ({ld.model_type}, {ld.mode})" if getattr(ld, "model_type", None) else ""
        self.say(f"flashmoe chat: {model}{mode}. /help lists the commands; Ctrl-D quits.")
        from .models import DEMO_NOTE, is_demo

        if is_demo(getattr(ld, "model", None)):
            self.say(DEMO_NOTE)

    def run(self) -> int:
        self.banner()
        while True:
            line = self.read()
            # after SIGTERM / SIGHUP the reply it stopped is saved: quit with 128 + the signal
            if line is None or not self.handle(line) or signals.received is not None:
                hint = resume_hint(self.session)
                if hint:
                    self.say(hint)
                return signals.exit_code(ExitCode.OK)

    def read(self) -> str | None:
        """The next line; None means quit (Ctrl-D on an empty line, or Ctrl-C twice on one)."""
        while True:
            try:
                line = self.prompt.prompt()
            except EOFError:
                return None
            except KeyboardInterrupt:
                if signals.received is not None:  # SIGTERM / SIGHUP (signals.Terminated): quit now
                    return None
                # prompt-toolkit's own Ctrl-C binding (also in its TERM=dumb prompt) leaves the text
                if self.prompt.default_buffer.text:  # a line was being typed: drop it, stay
                    self._armed_at = None
                    continue
                now = self.clock()
                if self._armed_at is not None and now - self._armed_at <= QUIT_WINDOW:
                    return None
                self._armed_at = now
                self.say("(press Ctrl-C again to quit, or Ctrl-D)")
                continue
            self._armed_at = None
            return line

    def handle(self, line: str) -> bool:
        """Run one line; False means quit."""
        if not line.strip():
            return True
        if line.strip().lower() in ("exit", "quit"):
            return False
        try:
            cmd = parse(line)
        except CommandError as e:
            self.say(str(e))
            return True
        if cmd is not None:
            name, arg = cmd
            if name == "system":  # text, unlike /save's PATH, which keeps its bytes
                arg = decode_text(arg, "/system", self.err)
            self._quit = False
            commands.run(self, name, arg)
            return not self._quit
        line = decode_text(line, "the message", self.err)  # typed bytes that were not UTF-8
        with no_echo(sys.stdin if self._input is None else self._input):  # typing is not echoed into the reply
            self.loop.run_turn(line)  # Ctrl-C stops the reply and keeps what came
        return True

    # -- slash commands (commands.py runs them; this is the Face they act on) ------------------
    keys = KEYS
    described = REPL_COMMANDS

    def say(self, text: str, kind: str = "info") -> None:
        """A line for the user that is not the model's answer (stderr); an error says so."""
        super().say(f"flashmoe: error: {text}" if kind == "error" else text)

    def busy(self) -> bool:
        return False  # commands are read between replies

    def cleared(self) -> None:
        self.stats.last_layers = None

    def show_timing(self) -> None:
        self.say(f"timing: {self.session.options.timing} (/timing off|step|layer sets it)")
        table = self.stats.layer_table()
        if table:
            self.say(table)

    def timing_set(self, mode: str) -> None:
        pass

    def quit(self) -> None:
        self._quit = True

    # -- tools -----------------------------------------------------------------------------
    def use_tools(self, tools) -> None:
        """Route replies through the tool loop (tools: its ToolOptions), asking y / N / always
        before calls that need it."""
        from .agent_cli import make_agent

        self.loop = make_agent(tools, self.session, self.loaded.chat_template, self.approver, self)
        self.stats = self.loop.stats

    @property
    def approver(self):
        """The tool loop's approver: a y / N / always question under the call."""
        from .approvers import LineApprover

        return LineApprover(self._read_answer)

    def _read_answer(self, question: str) -> str:
        self.out.flush()
        try:
            return PromptSession(input=self._input, output=self._output).prompt(question)
        except KeyboardInterrupt:  # Ctrl-C at the question: no
            return ""

    def other(self, ev) -> None:
        from .agent import ToolCallEvent, ToolResultEvent

        if isinstance(ev, ToolCallEvent):
            import json

            state = "" if ev.valid else f"  [invalid: {ev.error}]"
            self.say(f"\n-> {ev.name}({json.dumps(ev.arguments, ensure_ascii=False)}){state}")
        elif isinstance(ev, ToolResultEvent):
            first = (ev.content.strip().splitlines() or [""])[0][:100]
            self.say(f"<- {ev.status}: {first}")

    def stopped(self, end) -> None:
        self.write("[interrupted]\n")


def run_repl(
    args,
    *,
    engine=None,
    input=None,
    output=None,
    stdout=None,
    stderr=None,
    history: History | None = None,
    clock=time.monotonic,
) -> int:
    """`flashmoe chat` as a line REPL. The keyword arguments are for tests (pipe input, DummyOutput)."""
    from .agent_cli import ToolOptions
    from .startup import ConversationOptions, EngineOptions, make_engine, open_conversation

    err = stderr or sys.stderr
    # The flags are checked (UsageError -> exit 2 in cli.main) before any model is loaded.
    session = open_conversation(
        ConversationOptions.from_args(args), engine, model_name=str(getattr(args, "model", None) or "demo")
    )
    try:
        if engine is None:
            print("flashmoe: loading the model...", file=err, flush=True)
            engine = make_engine(EngineOptions.from_args(args))
        session.engine = engine
        loaded = engine.wait_loaded()
    except Exception as e:  # noqa: BLE001  (any load failure is one line and exit 3)
        from flashmoe.engine.errors import FlashMoEError

        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not isinstance(e, (FlashMoEError, OSError)):
            msg = f"could not load the model: {type(e).__name__}: {msg}"
        print(f"flashmoe: error: {msg}", file=err, flush=True)
        if engine is not None:
            engine.close()
        return ExitCode.MODEL
    try:
        if history is None:
            history = open_history(stderr=err)
        repl = LineRepl(
            session, loaded, input=input, output=output, stdout=stdout, stderr=err, history=history, clock=clock
        )
        tools = ToolOptions.from_args(args)
        if tools.tools:
            repl.use_tools(tools)
        return repl.run()
    finally:
        engine.close()
