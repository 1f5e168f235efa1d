"""`flashmoe chat` on a terminal: a Textual app around a ChatSession.

Threads: the engine runs on its own thread; a thread worker per reply iterates the Handle and
posts messages (token text in ~30 ms batches, prefill progress, the end). Per-layer timings and
step figures go into slots that a 10 Hz timer draws, so a fast model never floods the UI. Widgets
change only on the UI thread, in the message handlers below.

With --tools, a reply is a turn of the AgentLoop instead (agent_turn.py): the worker runs
run_turn, tool calls show as collapsed blocks, and calls that need a yes ask with ApproveScreen.
"""
from __future__ import annotations

import logging
import queue
import re
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rich.text import Text
from textual.actions import SkipAction
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Markdown, Static
from textual.worker import get_current_worker

from engine.events import (
    EngineFailed,
    GenerationFinished,
    LayerTimings,
    PrefillProgress,
    StepFinished,
    TokenGenerated,
)

from ..chat import mark_of, resume_hint
from ..cli import DEMO_NOTE, human_bytes, is_demo
from ..commands import CommandError, help_text, parse
from ..exit_codes import ExitCode
from ..term_safe import safe
from .agent_turn import AgentTurn, AppApprover, answer
from .messages import (
    ApprovalRequest,
    EngineLoaded,
    EngineLoadFailed,
    EngineWarning,
    ReplyActivity,
    ReplyDone,
    ReplyFailed,
    ReplyPrefill,
    ReplyRoundDone,
    ReplyText,
    ReplyTool,
    ReplyTurnEnd,
)
from .palette import ChatCommands
from .screens import ApproveScreen, HelpScreen
from .widgets import (
    AssistantMessage,
    KeyHints,
    LayerPanel,
    Note,
    PromptInput,
    StatusBar,
    ToolBlock,
    Transcript,
    UserMessage,
)
from .widgets.status_bar import rss_bytes

TOOL_CALL_MARKUP = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)
BATCH_S = 0.03  # token text is batched this long before the Markdown is updated
REDRAW_S = 0.1  # the layer panel and the live figures are redrawn at most this often
RSS_EVERY = 10  # redraw ticks between memory readings
QUIT_WINDOW_S = 1.0  # two Ctrl+C presses this close together quit
TIMING_MODES = ("off", "step", "layer")
PANEL_MIN_COLUMNS = 100  # narrower, the layer panel (48 columns) is hidden until F2 shows it


class MainRow(Horizontal):
    """The transcript and the layer panel; it is as wide as the terminal, so its resize is the
    terminal's (the app's own Resize handler stops the event)."""

    def on_resize(self) -> None:
        self.app.fit_panel()


@dataclass
class Reply:
    """The reply being generated."""
    id: int
    handle: object  # engine Handle, or the AgentTurn (both have cancel())
    box: AssistantMessage | None  # None between the model replies of a tool-using turn
    stream: object  # textual MarkdownStream (None with box)
    stopping: bool = False
    detail: str = ""  # the finished model reply's figures, for the box's bottom border
    text: str = ""  # the model's text so far, as it wrote it


@dataclass
class Live:
    """Running figures of the current reply: written by its worker thread, read by the timer."""
    decode_steps: int = 0
    decode_ms: float = 0.0
    steps: int = 0
    bytes_read: int = 0
    hits: int = 0
    misses: int = 0


class ChatApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "flashmoe"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [
        Binding("ctrl+c", "ctrl_c", "Stop or quit", show=False, priority=True, id="flashmoe.ctrl_c"),
        Binding("escape", "stop", "Stop the reply", show=False, id="flashmoe.stop"),
        Binding("f1", "help", "Help", id="flashmoe.help"),
        Binding("f2", "toggle_layers", "Layers", id="flashmoe.layers"),
        Binding("ctrl+d", "end_of_input", "Quit", show=False, id="flashmoe.eof"),
    ]

    def __init__(self, session, *, args=None, cursor_blink: bool = True, rss=rss_bytes,
                 show_layers: bool | None = None):
        """args: the parsed `flashmoe chat` options; with --tools, replies go through the AgentLoop."""
        super().__init__()
        self.session = session
        self.args = args
        self.agent = None  # the AgentLoop, built once the model is in (it needs the chat template)
        self.agent_turn: AgentTurn | None = None
        self._approval: tuple | None = None  # (Future, ApproveScreen) while a question is open
        self.engine = session.engine
        self.cursor_blink = cursor_blink
        self._rss = rss
        self._show_layers = show_layers
        self.loaded = None  # ModelLoaded, once the model is in
        self.load_error: str | None = None
        self.reply: Reply | None = None
        self.exit_code = ExitCode.OK
        self._queued: UserMessage | None = None  # typed while loading; sent when the model is in
        self._reply_seq = 0
        self._live = Live()
        self._layer_slot: LayerTimings | None = None  # the latest timings, drawn by the timer
        self._drawn: LayerTimings | None = None
        self._ticks = 0
        self._last_ctrl_c = float("-inf")
        self.activity = ""

    # -- layout --------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        with MainRow(id="main"):
            yield Transcript(id="transcript")
            yield LayerPanel(id="layers")
        yield Static(id="activity")
        yield PromptInput(placeholder="Message (Enter sends; /help lists the commands)",
                          cursor_blink=self.cursor_blink, id="prompt")
        yield KeyHints(id="hints")

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def panel(self) -> LayerPanel:
        return self.query_one(LayerPanel)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    def on_mount(self) -> None:
        # The engine's warnings (a prompt truncated to fit the context) go to stderr elsewhere;
        # here stderr is the screen, so they become notifications.
        self._engine_log = _NotifyHandler(self)
        logging.getLogger("flashmoe").addHandler(self._engine_log)
        logging.getLogger("flashmoe").propagate = False
        timing = self.session.options.timing
        self.panel.set_mode(timing)
        self._panel_auto = self._show_layers is None  # shown or hidden by the width until F2 or /timing
        self.panel.display = self._panel_fits() if self._panel_auto else self._show_layers
        self.status.set(rss=self._rss())
        self.transcript.anchor()
        for m in self.session.history:  # a resumed conversation (-c / --cid)
            if m["role"] == "tool" or (m["role"] == "user" and m["content"].startswith("<tool_response>")):
                self.transcript.mount(ToolBlock.from_history(m))
            elif m["role"] == "user":
                self.transcript.mount(UserMessage(m["content"]))
            elif m["role"] == "assistant":
                content = m["content"]
                text = TOOL_CALL_MARKUP.sub("", content).strip()
                if text == content.strip() and not m.get("tool_calls"):
                    self.transcript.mount(box := AssistantMessage(text=content))
                elif text:  # a reply with tool calls: its text (the calls show as their results)
                    self.transcript.mount(box := AssistantMessage(text=text))
                else:
                    continue
                if mark_of(m):  # stopped, or cut short by a crash, when it was written
                    box.mark(mark_of(m))
        self.set_activity("loading the model…")
        self.set_interval(REDRAW_S, self.redraw)
        import asyncio

        from ..signals import CAUGHT
        try:
            for sig in CAUGHT:  # on the event loop: the app quits cleanly and gives the terminal back
                asyncio.get_running_loop().add_signal_handler(sig, self._terminated, sig)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (some tests)
            pass
        self.run_worker(self._load_engine, thread=True, exit_on_error=False, group="load", name="load model")
        self.prompt.focus()

    def _panel_fits(self) -> bool:
        """Shown by default with timing on and room beside the transcript (PANEL_MIN_COLUMNS)."""
        return self.session.options.timing != "off" and self.size.width >= PANEL_MIN_COLUMNS

    def fit_panel(self) -> None:
        """The terminal was resized (MainRow): show or hide the panel, unless the user chose."""
        if getattr(self, "_panel_auto", False):
            self.panel.display = self._panel_fits()

    def set_activity(self, text: str | Text, style: str = "") -> None:
        """The line above the message box: loading, prefill progress, generating, ready."""
        line = Text(" ") + (Text(safe(text), style=style) if isinstance(text, str) else text)
        self.activity = line.plain.strip()
        self.query_one("#activity", Static).update(line)

    def note(self, text: str, kind: str = "info", title: str = "", before=None) -> Note:
        note = Note(text, kind, title)
        self.transcript.mount(note, before=before)
        self.transcript.anchor()
        return note

    # -- loading -------------------------------------------------------------------------
    def _load_engine(self) -> None:  # worker thread
        try:
            info = self.engine.wait_loaded()
        except BaseException as e:  # shown in the app; quitting then exits with code 3
            self.post_message(EngineLoadFailed(str(e) or type(e).__name__, ExitCode.MODEL))
            return
        self.post_message(EngineLoaded(info))

    async def on_engine_loaded(self, m: EngineLoaded) -> None:
        info = self.loaded = m.info
        name = Path(info.model).name or info.model
        self.status.set(model=f"{name} ({info.model_type})", bits=info.bits, top_k=info.top_k)
        bits = f"{info.bits}-bit" if info.bits else "unquantized"
        self.note(f"{name}: {info.model_type}, {info.mode} experts, {info.layers} layers "
                  f"({info.moe_layers} with experts), {info.experts} experts, top-{info.top_k}, {bits}, "
                  f"expert cache {human_bytes(info.cache_bytes)}"
                  + (f" ({info.cache_policy})" if info.cache_policy else "") + f", loaded in {info.load_s:.1f} s\n"
                  + (DEMO_NOTE + "\n" if is_demo(info.model) else "")
                  + "Type a message and press Enter. /help lists the commands, F1 the keys.", title="model",
                  before=self._queued)
        if self.args is not None and getattr(self.args, "tools", None) and not self._build_agent(info):
            return
        self.set_activity("ready", "dim")
        if self._queued is not None:
            queued, self._queued = self._queued, None
            await self.start_reply(queued.text, shown=True)

    def _build_agent(self, info) -> bool:
        from ..agent_cli import make_agent

        try:
            self.agent = make_agent(self.args, self.session, info.chat_template or "", AppApprover(self),
                                    self._on_agent_event)
        except Exception as e:  # noqa: BLE001  (a bad tool option; run_tui checks them before loading)
            self.load_error = f"tools: {e}"
            self.exit_code = ExitCode.USAGE
            self._queued = None
            self.note(f"Could not set up the tools: {e}", "error", title="error")
            self.set_activity("the tools are not set up: /exit or Ctrl+D quits", "bold red")
            return False
        names = ", ".join(self.agent.executor.registry.names())
        policy = self.agent.executor.policy
        yolo = " (every call runs without asking)" if policy.mode == "yolo" else ""
        self.note(f"Tools: {names}\nmode {policy.mode}{yolo} · workspace {short_path(policy.workspace)}",
                  title="tools", before=self._queued)
        return True

    def on_engine_warning(self, m: EngineWarning) -> None:
        self.notify(safe(m.text), severity="warning", timeout=10, markup=False)

    def on_engine_load_failed(self, m: EngineLoadFailed) -> None:
        self.load_error = m.message
        self.exit_code = m.exit_code
        self._queued = None
        self.status.set(model="not loaded")
        self.note(f"Could not load the model: {m.message}", "error", title="error")
        self.notify(safe(m.message), title="Model failed to load", severity="error", timeout=10, markup=False)
        self.set_activity("the model is not loaded: /exit or Ctrl+D quits", "bold red")

    # -- sending -------------------------------------------------------------------------
    async def on_prompt_input_submitted(self, m: PromptInput.Submitted) -> None:
        text = m.text
        if not text.strip():
            return
        try:
            command = parse(text)
        except CommandError as e:
            self.prompt.clear()
            self.note(str(e), "error")
            return
        if command is not None:
            self.prompt.clear()
            self.run_slash(*command)
            return
        if self.reply is not None:
            self.notify("A reply is still running; Esc stops it.", severity="warning")
            return
        if self.load_error is not None:
            self.notify("The model is not loaded.", severity="error")
            return
        if self._queued is not None:
            self.notify("A message is already waiting for the model to load.", severity="warning")
            return
        self.prompt.clear()
        if self.loaded is None:
            self._queued = UserMessage(text)
            self.transcript.mount(self._queued)
            self.notify("Still loading the model; the message goes when it is ready.")
            return
        await self.start_reply(text)

    async def start_reply(self, text: str, shown: bool = False) -> None:
        transcript = self.transcript
        if not shown:
            transcript.mount(UserMessage(text))
        if self.agent is not None:
            await self.start_agent_turn(text)
            return
        try:
            handle = self.session.send(text)
        except Exception as e:  # a bad template or request: shown, not fatal
            self.note(f"Could not send: {e}", "error")
            return
        box = AssistantMessage()
        await transcript.mount(box)  # the Markdown widget must be mounted before it is streamed into
        box.mark("streaming")
        self._reply_seq += 1
        self.reply = Reply(self._reply_seq, handle, box, Markdown.get_stream(box.markdown))
        self._live = Live()
        transcript.anchor()
        self.set_activity("prefill…", "dim")
        self.run_worker(partial(self._drive, handle, self._reply_seq, self._live), thread=True,
                        exit_on_error=False, group="reply", name=f"reply {self._reply_seq}")

    def _drive(self, handle, reply_id: int, live: Live) -> None:  # worker thread
        worker = get_current_worker()
        batch: list[str] = []
        last = time.monotonic()
        while True:
            if worker.is_cancelled:  # the app is closing
                handle.cancel()
                return
            try:
                ev = handle.get(timeout=BATCH_S)
            except queue.Empty:
                ev = None
            if isinstance(ev, TokenGenerated):
                if ev.text:
                    batch.append(ev.text)
            elif isinstance(ev, LayerTimings):
                self._layer_slot = ev
            elif isinstance(ev, StepFinished):
                live.steps += 1
                live.bytes_read += ev.expert_bytes_read
                live.hits += ev.hits
                live.misses += ev.misses
                if ev.step > 0:  # the first pass holds the prompt's last token; speeds count the rest
                    live.decode_steps += 1
                    live.decode_ms += ev.wall_ms
            elif isinstance(ev, PrefillProgress):
                self.post_message(ReplyPrefill(reply_id, ev.done, ev.total))
            elif isinstance(ev, (GenerationFinished, EngineFailed)):
                if batch:
                    self.post_message(ReplyText(reply_id, "".join(batch)))
                done = ReplyDone(reply_id, ev) if isinstance(ev, GenerationFinished) else ReplyFailed(reply_id, ev)
                self.post_message(done)
                return
            now = time.monotonic()
            if batch and now - last >= BATCH_S:
                self.post_message(ReplyText(reply_id, "".join(batch)))
                batch.clear()
                last = now

    def _current(self, reply_id: int) -> Reply | None:
        r = self.reply
        return r if r is not None and r.id == reply_id else None

    async def on_reply_text(self, m: ReplyText) -> None:
        r = self._current(m.reply_id)
        if r is None:
            return
        if not r.stopping:
            self.set_activity("generating… Esc stops (the text so far is kept)", "dim")
        if r.box is None:
            await self._open_box(r)
        r.text += m.text
        if self.agent_turn is None:  # a tool-using turn saves its text on its own thread
            self.session.stream(m.text)
        await r.stream.write(safe(m.text))

    def on_reply_prefill(self, m: ReplyPrefill) -> None:
        r = self._current(m.reply_id)
        if r is None or r.stopping or m.total <= 0:
            return
        width = 24
        fill = round(width * m.done / m.total)
        bar = Text(" prefill ", style="dim")
        bar.append("━" * fill, style="#5fafd7")
        bar.append("━" * (width - fill), style="#3a3a3a")
        bar.append(f" {m.done}/{m.total} tokens", style="dim")
        self.set_activity(bar)

    async def on_reply_done(self, m: ReplyDone) -> None:
        r = self._current(m.reply_id)
        if r is None:
            return
        done = m.finished
        if done.tail:
            await r.stream.write(safe(done.tail))
        await r.stream.stop()
        self.reply = None
        interrupted = done.reason == "cancelled"
        try:
            self.session.finish(done.text, done, interrupted=interrupted)
        except Exception as e:  # the store failed: say so, keep going
            self.note(f"Could not save the reply: {e}", "error")
        if interrupted:
            r.box.mark("interrupted")
        else:
            detail = f"{done.generation_tokens} tok · {done.generation_tps:.1f} tok/s"
            r.box.mark("done", detail + (" · max tokens" if done.reason == "length" else ""))
        self.status.set(tok_s=done.generation_tps, bytes_per_token=done.bytes_per_token, hit_rate=done.hit_rate)
        self.redraw()
        self.set_activity("stopped; the partial reply is kept" if interrupted else "ready", "dim")

    async def on_reply_failed(self, m: ReplyFailed) -> None:
        r = self._current(m.reply_id)
        if r is None:
            return
        await r.stream.stop()
        self.reply = None
        partial_text = r.text  # the model's text (the box shows it escaped)
        if partial_text:
            r.box.mark("failed")
            try:
                self.session.finish(partial_text, None, interrupted=True)
            except Exception as e:  # the store failed too: say so, keep going
                self.note(f"Could not save the partial reply: {e}", "error")
        else:
            await r.box.remove()
            self.session.unsend()  # nothing answered it: keep the history alternating
        self._engine_failed(m.failed)

    def _engine_failed(self, failed) -> None:
        message = failed.message.strip() or failed.exc_type
        lines = message.splitlines()
        shown = "\n".join(lines[:12] + (["…"] if len(lines) > 12 else []))
        self.note(f"The engine failed ({failed.exc_type}): {shown}", "error", title="error")
        self.notify(safe(lines[0] if lines else message), title="Engine error", severity="error", timeout=10,
                    markup=False)
        self.set_activity("the engine failed; see the message above", "bold red")

    # -- tool use (the AgentLoop) ------------------------------------------------------------
    async def start_agent_turn(self, text: str) -> None:
        box = AssistantMessage()
        await self.transcript.mount(box)
        box.mark("streaming")
        self._reply_seq += 1
        self._live = Live()
        turn = self.agent_turn = AgentTurn(self, self.agent, self._reply_seq, self._live)
        self.reply = Reply(self._reply_seq, turn, box, Markdown.get_stream(box.markdown))
        self.transcript.anchor()
        self.set_activity("prefill…", "dim")
        self.run_worker(partial(turn.run, text), thread=True, exit_on_error=False, group="reply",
                        name=f"reply {self._reply_seq}")

    def _on_agent_event(self, ev) -> None:  # worker thread: the AgentLoop's on_event
        turn = self.agent_turn
        if turn is not None:
            turn.on_event(ev)

    async def _open_box(self, r: Reply) -> None:
        """The next model reply of the turn (after tool results) gets its own box."""
        box = AssistantMessage()
        await self.transcript.mount(box)
        box.mark("streaming")
        r.box, r.stream = box, Markdown.get_stream(box.markdown)
        self.transcript.anchor()

    async def _close_box(self, r: Reply, state: str) -> None:
        box, r.box = r.box, None
        if box is None:
            return
        await r.stream.stop()
        r.stream = None
        if not box.text.strip():  # a reply that was only tool calls
            await box.remove()
        else:
            box.mark(state, r.detail)
        r.detail = ""

    def on_reply_activity(self, m: ReplyActivity) -> None:
        r = self._current(m.reply_id)
        if r is not None and not r.stopping:
            self.set_activity(m.text, "dim")

    def on_reply_round_done(self, m: ReplyRoundDone) -> None:
        r = self._current(m.reply_id)
        if r is None:
            return
        done = m.finished
        if done.reason != "cancelled":
            r.detail = f"{done.generation_tokens} tok · {done.generation_tps:.1f} tok/s" + (
                " · max tokens" if done.reason == "length" else "")
        self.status.set(tok_s=done.generation_tps, bytes_per_token=done.bytes_per_token, hit_rate=done.hit_rate)

    async def on_reply_tool(self, m: ReplyTool) -> None:
        r = self._current(m.reply_id)
        if r is None:
            return
        await self._close_box(r, "done")
        await self.transcript.mount(ToolBlock(m.call, m.result))
        self.transcript.anchor()
        if not r.stopping:
            self.set_activity(f"{m.result.name or 'the tool'}: {m.result.status}; the model goes on…", "dim")

    def on_approval_request(self, m: ApprovalRequest) -> None:
        r = self._current(m.reply_id)
        if r is None or r.stopping or not self.is_running:
            answer(m.future, "no")
            return
        screen = ApproveScreen(m.name, m.arguments, m.reason)

        def answered(value: str | None) -> None:
            answer(m.future, value or "no")
            if self._approval is not None and self._approval[1] is screen:
                self._approval = None
            if self._current(m.reply_id) is not None and not r.stopping:
                self.set_activity(f"{m.name}: {value or 'no'}", "dim")

        self._approval = (m.future, screen)
        self.push_screen(screen, answered)
        self.set_activity(f"{m.name} needs your approval: y yes · n no · a always", "bold")

    def close_approval(self) -> None:
        """Answer an open question "no" and take the screen away (the turn is being stopped)."""
        if self._approval is None:
            return
        future, screen = self._approval
        self._approval = None
        answer(future, "no")
        if self.screen is screen and not screen.answered:
            screen.answered = True
            screen.dismiss("no")

    async def on_reply_turn_end(self, m: ReplyTurnEnd) -> None:
        r = self._current(m.reply_id)
        if r is None:
            return
        end = m.end
        state = {"cancelled": "interrupted", "failed": "failed"}.get(end.status, "done")
        await self._close_box(r, state)
        self.reply = None
        self.agent_turn = None
        self.close_approval()
        self.redraw()
        if end.status == "done":
            self.set_activity("ready", "dim")
        elif end.status == "cancelled":
            self.set_activity("stopped; the partial reply is kept", "dim")
        elif end.status == "failed" and m.failed is not None:
            self._engine_failed(m.failed)
        else:
            what = {"chain-limit": "The tool chain limit is reached", "repairs-exhausted":
                    "The model kept writing malformed tool calls", "failed": "The reply failed",
                    "approval-needed": "A tool call needed approval"}.get(end.status, f"The turn ended ({end.status})")
            self.note(f"{what}: {end.message}" if end.message else what, "error", title="error")
            self.set_activity("ready; see the error above", "bold red")

    # -- the timer -----------------------------------------------------------------------
    def redraw(self) -> None:
        """At most 10 times a second: the latest layer timings, the live figures, memory."""
        ev = self._layer_slot  # only the worker writes the slot, so no update is ever lost
        if ev is not None and ev is not self._drawn:
            self._drawn = ev
            self.panel.show_timings(ev)
        live = self._live
        if self.reply is not None and live.steps:
            changes = {"bytes_per_token": live.bytes_read / live.steps}
            if live.decode_ms > 0:
                changes["tok_s"] = live.decode_steps / live.decode_ms * 1e3
            if live.hits + live.misses:
                changes["hit_rate"] = live.hits / (live.hits + live.misses)
            self.status.set(**changes)
        if self.reply is not None and self.agent_turn is None:
            self.session.save_draft()  # what was shown is saved even while the model stalls
        self._ticks += 1
        if self._ticks % RSS_EVERY == 0:
            self.status.set(rss=self._rss())

    # -- stopping and quitting -------------------------------------------------------------
    def interrupt(self) -> bool:
        r = self.reply
        if r is None or r.stopping:
            return False
        r.handle.cancel()
        r.stopping = True
        self.close_approval()
        self.set_activity("stopping…", "dim")
        return True

    def action_stop(self) -> None:
        if self.reply is None or self.reply.stopping or len(self.screen_stack) > 1:
            raise SkipAction()
        self.interrupt()

    def action_ctrl_c(self) -> None:
        if self.interrupt():
            self._last_ctrl_c = float("-inf")
            return
        if self.reply is None and self.focused is self.prompt and self.prompt.selected_text:
            self.prompt.action_copy()  # Ctrl+C still copies a selection when there is nothing to stop
            return
        now = time.monotonic()
        if now - self._last_ctrl_c <= QUIT_WINDOW_S:
            self.quit_app()
            return
        self._last_ctrl_c = now
        self.notify("Press Ctrl+C again to quit.", timeout=QUIT_WINDOW_S + 1)

    def action_end_of_input(self) -> None:
        if self.prompt.text:
            raise SkipAction()
        self.quit_app()

    def on_prompt_input_end_of_input(self, m: PromptInput.EndOfInput) -> None:
        self.quit_app()

    def quit_app(self) -> None:
        if self.reply is not None:
            self.reply.handle.cancel()  # a turn's pending approval is answered "no" too
        self.exit(int(self.exit_code), return_code=int(self.exit_code))

    def _terminated(self, signum: int) -> None:
        """SIGTERM or SIGHUP: quit as /exit does; the reply so far is saved (on_unmount)."""
        from .. import signals

        signals.note(signum)
        self.quit_app()

    async def on_unmount(self) -> None:
        logging.getLogger("flashmoe").removeHandler(self._engine_log)
        logging.getLogger("flashmoe").propagate = True
        if self.reply is not None:  # quitting mid-reply: end the Markdown stream's task cleanly
            self.reply.handle.cancel()
            if self.agent_turn is None:  # keep what was shown, marked interrupted
                self.session.finish(self.reply.text, None, interrupted=True)
            if self.reply.stream is not None:
                await self.reply.stream.stop()

    async def action_quit(self) -> None:  # Ctrl+Q, and the palette's Quit: same exit code as /exit
        self.quit_app()

    def stop_engine(self) -> None:
        """After the app has exited: stop a running reply and close the engine."""
        if self.reply is not None:
            self.reply.handle.cancel()
        self.engine.close()

    # -- other actions ---------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, (HelpScreen, ApproveScreen)):
            self.push_screen(HelpScreen())

    def action_toggle_layers(self) -> None:
        self._panel_auto = False  # the user's choice from now on, at any width
        self.panel.display = not self.panel.display

    def prefill_prompt(self, text: str) -> None:
        self.prompt.text = text
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()

    def run_slash(self, name: str, arg: str) -> None:
        """A slash command (typed, or from the command palette)."""
        session = self.session
        if name == "help":
            keys = "Keys: Enter send · Ctrl+J or Alt+Enter new line · Esc or Ctrl+C stop the reply · " \
                   "Ctrl+C twice or Ctrl+D (empty box) quit · F1 help · F2 layer panel · Ctrl+P commands"
            self.note(help_text(keys), title="help")
        elif name == "clear":
            if self.reply is not None:
                self.notify("A reply is running; Esc stops it first.", severity="warning")
                return
            session.clear()
            self.transcript.remove_children()
            self.note("New conversation.")
        elif name == "system":
            if not arg:
                self.note(f"System prompt: {session.system}" if session.system else "No system prompt is set.")
                return
            try:
                session.set_system(arg)
            except Exception as e:
                self.note(f"Could not set the system prompt: {e}", "error")
                return
            self.note(f"System prompt set: {arg}")
        elif name == "timing":
            if not arg:
                self.action_toggle_layers()
            elif arg in TIMING_MODES:
                session.options.timing = arg
                self.panel.set_mode(arg)
                self._panel_auto = False
                self.panel.display = arg != "off"
                self.note(f"Timing {arg} from the next reply."
                          + (" Layer timing adds a sync per layer." if arg == "layer" else ""))
            else:
                self.note("usage: /timing [off|step|layer]", "error")
        elif name == "save":
            if not arg:
                self.note("usage: /save PATH", "error")
                return
            try:
                path = session.save(arg)
            except OSError as e:
                self.note(f"Could not save: {e}", "error")
                return
            self.note(f"Saved the conversation to {path}")
        elif name == "exit":
            self.quit_app()


def short_path(path: Path) -> str:
    """A folder as the user thinks of it: relative to the current one, or under ~, or absolute."""
    try:
        cwd = Path.cwd().resolve()
        if path == cwd:
            return ". (the current folder)"
        if path.is_relative_to(cwd):
            return str(path.relative_to(cwd))
        if path.is_relative_to(Path.home()):
            return str(Path("~") / path.relative_to(Path.home()))
    except (OSError, RuntimeError, KeyError):
        pass
    return str(path)


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
    from ..cli import make_engine, open_conversation

    teach_alt_enter()

    session = open_conversation(args, None, model_name=str(args.model or "demo"))  # checks the flags first
    if getattr(args, "tools", None):  # and the tool options (UsageError: exit 2 before any loading)
        from ..agent_cli import DecliningApprover, make_agent

        make_agent(args, session, "", DecliningApprover(), lambda ev: None)
    session.engine = make_engine(args)
    app = ChatApp(session, args=args)
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
