"""`flashmoe chat` on a terminal: the Textual App around the chat screen.

The App owns what outlives the conversation on screen: the engine (waited for on a thread worker
once the chat screen is up; the worker posts EngineLoaded or EngineLoadFailed, and the App tells
the chat screen), the exit code, quitting (Ctrl+Q, Ctrl+C twice, Ctrl+D, /exit, SIGTERM and
SIGHUP), the engine's warnings as notifications, and the app-wide keys (F1 help; Ctrl+C and
Ctrl+T, priority keys that work over the modals too). The conversation is the default screen's:
ChatScreen (screens/chat.py), with its own keys.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from textual.app import App
from textual.binding import Binding

from .. import signals
from ..chat import resume_hint
from ..exit_codes import ExitCode
from ..term_safe import safe
from .messages import EngineLoaded, EngineLoadFailed, EngineWarning
from .palette import ChatCommands
from .agent_turn import Reply
from .screens import ApproveScreen, ChatScreen, HelpScreen
from .widgets import PromptInput, Transcript
from .widgets.status_bar import rss_bytes

QUIT_WINDOW_S = 1.0  # two Ctrl+C presses this close together quit
STOP_WAIT_S = 10.0  # after the app, a running turn gets this long to stop and save before the engine closes


class ChatApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "flashmoe"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [
        Binding("ctrl+c", "ctrl_c", "Stop or quit", show=False, priority=True, id="flashmoe.ctrl_c"),
        Binding("f1", "help", "Help", id="flashmoe.help"),
        Binding("ctrl+t", "toggle_reasoning", "Reasoning", show=False, priority=True, id="flashmoe.reasoning"),
    ]

    def __init__(
        self, session, *, tools=None, cursor_blink: bool = True, rss=rss_bytes, show_layers: bool | None = None
    ):
        """session: the ChatSession, with its engine (still loading); the other options are the
        chat screen's (tools: the ToolOptions of `flashmoe chat`; None, or no --tools: plain
        replies)."""
        super().__init__()
        self.session = session  # the chat screen's, made when the app starts
        self.engine = session.engine
        self._chat_options = dict(tools=tools, cursor_blink=cursor_blink, rss=rss, show_layers=show_layers)
        self._chat: ChatScreen | None = None
        self.loaded = None  # ModelLoaded, once the model is in
        self.load_error: str | None = None  # why nothing can be sent (the model, or the tools)
        self.exit_code = ExitCode.OK
        self._last_ctrl_c = float("-inf")
        session.on_note = lambda text: self.post_message(EngineWarning(text))  # from any thread

    def get_default_screen(self) -> ChatScreen:
        """The first screen on the stack, made as the app starts (so a test may swap the session)."""
        self._chat = ChatScreen(self.session, **self._chat_options)
        return self._chat

    @property
    def chat(self) -> ChatScreen:
        """The conversation's screen: the first on the stack (a modal may be above it)."""
        assert self._chat is not None, "the app has not started"
        return self._chat

    @property
    def reply(self) -> Reply | None:
        """The reply being generated, if any."""
        return None if self._chat is None else self._chat.reply

    @property
    def transcript(self) -> Transcript:
        """The chat screen's transcript (tests/test_hardening_cli.py reads it from the app)."""
        return self.chat.transcript

    def on_mount(self) -> None:
        # The engine's warnings (a prompt truncated to fit the context) go to stderr elsewhere;
        # here stderr is the screen, so they become notifications.
        self._engine_log = _NotifyHandler(self)
        logging.getLogger("flashmoe").addHandler(self._engine_log)
        logging.getLogger("flashmoe").propagate = False
        try:
            for sig in signals.CAUGHT:  # on the event loop: the app quits cleanly and gives the terminal back
                asyncio.get_running_loop().add_signal_handler(sig, self._terminated, sig)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (some tests)
            pass

    # -- loading -------------------------------------------------------------------------
    def on_chat_screen_ready(self, m: ChatScreen.Ready) -> None:
        self.run_worker(self._load_engine, thread=True, exit_on_error=False, group="load", name="load model")

    def _load_engine(self) -> None:  # worker thread
        try:
            info = self.engine.wait_loaded()
        except BaseException as e:  # shown in the app; quitting then exits with code 3
            self.post_message(EngineLoadFailed(str(e) or type(e).__name__, ExitCode.MODEL))
            return
        self.post_message(EngineLoaded(info))

    def on_engine_loaded(self, m: EngineLoaded) -> None:
        self.loaded = m.info
        self.chat.model_loaded(m.info)

    def on_engine_load_failed(self, m: EngineLoadFailed) -> None:
        self.refuse_messages(m.message, m.exit_code)
        self.chat.model_failed(m.message)
        self.notify(safe(m.message), title="Model failed to load", severity="error", timeout=10, markup=False)

    def on_engine_warning(self, m: EngineWarning) -> None:
        self.notify(safe(m.text), severity="warning", timeout=10, markup=False)

    def refuse_messages(self, why: str, exit_code: int) -> None:
        """Nothing can be sent from now on (the model did not load, or the tools are not set up);
        quitting exits with exit_code."""
        self.load_error = why
        self.exit_code = exit_code

    # -- the app's keys (Ctrl+C and Ctrl+T are priority keys: they work over the modals too) ---
    def action_ctrl_c(self) -> None:
        chat = self.chat
        if chat.interrupt():
            self._last_ctrl_c = float("-inf")
            return
        if chat.reply is None and self.focused is chat.prompt and chat.prompt.selected_text:
            chat.prompt.action_copy()  # Ctrl+C still copies a selection when there is nothing to stop
            return
        now = time.monotonic()
        if now - self._last_ctrl_c <= QUIT_WINDOW_S:
            self.quit_app()
            return
        self._last_ctrl_c = now
        self.notify("Press Ctrl+C again to quit.", timeout=QUIT_WINDOW_S + 1)

    def on_prompt_input_end_of_input(self, m: PromptInput.EndOfInput) -> None:  # bubbled up from the box
        self.quit_app()

    def action_help(self) -> None:
        if not isinstance(self.screen, (HelpScreen, ApproveScreen)):
            self.push_screen(HelpScreen())

    def action_toggle_reasoning(self) -> None:
        self.chat.toggle_reasoning()

    async def action_quit(self) -> None:  # Ctrl+Q, and the palette's Quit: same exit code as /exit
        self.quit_app()

    # -- quitting --------------------------------------------------------------------------
    def quit_app(self) -> None:
        if self.reply is not None:
            self.reply.handle.cancel()  # a turn's pending approval is answered "no" too
        code = int(self.exit_code)
        # Exit from the chat screen's queue, between two of its handlers: none is left halfway,
        # about to mount into a transcript that can no longer take widgets once the app exits.
        if self._chat is None or not self._chat.call_later(self.exit, code, return_code=code):
            self.exit(code, return_code=code)

    def _terminated(self, signum: int) -> None:
        """SIGTERM or SIGHUP: quit as /exit does; the reply so far is saved (ChatScreen.on_unmount)."""
        signals.note(signum)
        self.quit_app()

    def on_unmount(self) -> None:
        logging.getLogger("flashmoe").removeHandler(self._engine_log)
        logging.getLogger("flashmoe").propagate = True

    def stop_engine(self) -> None:
        """After the app has exited: stop a running turn, let its loop save what it got, close the engine."""
        if self.reply is not None:
            self.reply.handle.cancel()
            self.reply.handle.wait(STOP_WAIT_S)
        self.engine.close()


class _KeyName(str):
    @property
    def value(self) -> str:
        return str(self)


def teach_alt_enter() -> None:
    """Make ESC CR (what most terminals send for Alt+Enter) the key "alt+enter".

    Textual 8.2.8 reads ESC CR as a plain "enter" (it drops the Alt of keys it maps by table), so
    Alt+Enter would send the message instead of starting a new line. Terminals that speak the
    kitty keyboard protocol send CSI 13;3u, which Textual already reads as alt+enter.
    """
    from textual._ansi_sequences import ANSI_SEQUENCES_KEYS

    ANSI_SEQUENCES_KEYS.setdefault("\x1b\r", (_KeyName("alt+enter"),))  # type: ignore[index]


def run_tui(args) -> int:
    """`flashmoe chat` on a terminal; returns the exit code."""
    from ..agent_cli import ToolOptions
    from ..startup import ConversationOptions, EngineOptions, make_engine, open_conversation

    teach_alt_enter()
    tools = ToolOptions.from_args(args)

    session = open_conversation(
        ConversationOptions.from_args(args), None, model_name=str(args.model or "demo")
    )  # checks the flags first
    if tools.tools:  # and the tool options (UsageError: exit 2 before any loading)
        from ..agent_cli import make_agent
        from ..approvers import DecliningApprover

        make_agent(tools, session, "", DecliningApprover(), lambda ev: None)
    session.engine = make_engine(EngineOptions.from_args(args))
    app = ChatApp(session, tools=tools)
    try:
        app.run()
    finally:
        app.stop_engine()
    hint = resume_hint(session)  # the screen is the shell's again: say how to come back
    if hint:
        print(hint, file=sys.stderr, flush=True)
    return ExitCode.OK if app.return_code is None else app.return_code


class _NotifyHandler(logging.Handler):
    """Engine log records as app messages (post_message is thread-safe and does not wait)."""

    def __init__(self, app: App) -> None:
        super().__init__(logging.WARNING)
        self.app = app

    def emit(self, record: logging.LogRecord) -> None:
        self.app.post_message(EngineWarning(record.getMessage().removeprefix("flashmoe: warning: ")))
