"""The chat screen: the conversation, and everything typed into it.

The App (app.py) loads the engine and tells this screen when the model is in (model_loaded) or
not (model_failed); the rest is the screen's: the ChatSession, the transcript, the message box,
the turn being generated (every turn, with --tools or not, is a turn of the AgentLoop on a
thread worker, agent_turn.py; approvals ask with ApproveScreen), the live figures and the layer
panel (drawn by a 4 Hz timer from the loop's TurnStats), the slash commands (commands.py runs
them; this screen is the Face they act on).

The workers post their messages straight to this screen; widgets change only in the handlers
below, on the UI thread. Ctrl+C and Ctrl+T, which work over the modals too, are the App's.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from pathlib import Path

from rich.text import Text
from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Static

from ... import commands
from ...agent_cli import ToolOptions
from ...approvers import ModalApprover
from ...commands import CommandError, parse
from ...exit_codes import ExitCode
from ...models import DEMO_NOTE, is_demo
from ...term_safe import safe
from ...summaries import kv_label
from ...units import human_bytes
from ..agent_turn import AgentTurn, Reply
from ..messages import (
    ApprovalRequest,
    ReplyActivity,
    ReplyPrefill,
    ReplyRoundDone,
    ReplyText,
    ReplyTool,
    ReplyTurnEnd,
)
from ..widgets import (
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
from ..widgets.status_bar import rss_bytes
from ..widgets.transcript import ReasoningBlock
from .approve import ApproveScreen

REDRAW_S = 0.25  # the layer panel and the live figures are redrawn at most this often (at 0.1 s,
# drawing the panel's rows took CPU from the engine on 2 cores: benchmarks/log/2026-12-04-chat-app-frames.md)
RSS_EVERY = 10  # redraw ticks between memory readings
PANEL_MIN_COLUMNS = 100  # narrower, the layer panel (48 columns) is hidden until F2 shows it
UNMOUNT_WAIT_S = 5.0  # quitting mid-reply waits this long for the turn to save what it got
KEYS = (
    "Keys: Enter send · Ctrl+J or Alt+Enter new line · Esc or Ctrl+C stop the reply · "
    "Ctrl+C twice or Ctrl+D (empty box) quit · F1 help · F2 layer panel · Ctrl+T reasoning · "
    "Ctrl+P commands"
)


class MainRow(Horizontal):
    """The transcript and the layer panel; it is as wide as the terminal, so its resize is the
    terminal's: the chat screen shows or hides the panel for the new width."""

    def on_resize(self) -> None:
        self.screen.fit_panel()


class ChatScreen(Screen):
    BINDINGS = [  # (under a modal screen, none of these is active: the modal has the keys)
        Binding("escape", "stop", "Stop the reply", show=False, id="flashmoe.stop"),
        Binding("f2", "toggle_layers", "Layers", id="flashmoe.layers"),
        Binding("ctrl+d", "end_of_input", "Quit", show=False, id="flashmoe.eof"),
    ]

    class Ready(Message):
        """The screen is mounted. It bubbles up to the App, which then starts waiting for the
        model: what the wait ends with goes into this screen's widgets."""

    def __init__(
        self, session, *, tools=None, cursor_blink: bool = True, rss=rss_bytes, show_layers: bool | None = None
    ):
        """tools: the ToolOptions the AgentLoop gets (None, or no --tools: plain replies)."""
        super().__init__()
        self.session = session
        self.tools = tools or ToolOptions()
        self.loop = None  # the AgentLoop, built once the model is in (it needs the chat template)
        self.agent_turn: AgentTurn | None = None  # the turn that runs
        self._approval: tuple | None = None  # (reply, ApproveScreen) while a question is open
        self.cursor_blink = cursor_blink
        self._rss = rss
        self._show_layers = show_layers
        self.reply: Reply | None = None
        self._queued: UserMessage | None = None  # typed while loading; sent when the model is in
        self._reply_seq = 0
        self._drawn = None  # the LayerTimings the panel shows
        self._ticks = 0
        self.activity = ""
        self.reasoning_view: bool | None = None  # Ctrl+T: show (True) or hide (False) every reasoning block

    # -- layout --------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        with MainRow(id="main"):
            yield Transcript(id="transcript")
            yield LayerPanel(id="layers")
        yield Static(id="activity")
        yield PromptInput(
            placeholder="Message (Enter sends; /help lists the commands)", cursor_blink=self.cursor_blink, id="prompt"
        )
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
        timing = self.session.options.timing
        self.panel.set_mode(timing)
        self._panel_auto = self._show_layers is None  # shown or hidden by the width until F2 or /timing
        self.panel.display = self._panel_fits() if self._panel_auto else self._show_layers
        self.status.set(rss=self._rss())
        self.transcript.anchor()
        self.transcript.show_history(self.session.history)
        self.set_activity("loading the model…")
        self.set_interval(REDRAW_S, self.redraw)
        self.prompt.focus()
        self.post_message(self.Ready())

    def _panel_fits(self) -> bool:
        """Shown by default with timing on and room beside the transcript (PANEL_MIN_COLUMNS)."""
        return self.session.options.timing != "off" and self.app.size.width >= PANEL_MIN_COLUMNS

    def fit_panel(self) -> None:
        """The terminal was resized (MainRow): show or hide the panel, unless the user chose."""
        if getattr(self, "_panel_auto", False):
            self.panel.display = self._panel_fits()

    def show_panel(self, shown: bool) -> None:
        """F2 or /timing: the user's choice from now on, at any width."""
        self._panel_auto = False
        self.panel.display = shown

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

    # -- the model (the App loads it) ------------------------------------------------------
    def model_loaded(self, info) -> None:
        """The model is in: say what it is, set up the tools, send what was typed meanwhile."""
        name = Path(info.model).name or info.model
        resident = getattr(info, "resident_experts", None)
        self.status.set(
            model=f"{name} ({info.model_type}{', experts resident' if resident else ''})",
            bits=info.bits,
            top_k=info.top_k,
            context_max=getattr(info, "context", None),
        )
        bits = f"{info.bits}-bit" if info.bits else "unquantized"
        self.note(
            f"{name}: {info.model_type}, {info.mode} experts, {info.layers} layers "
            f"({info.moe_layers} with experts), {info.experts} experts, top-{info.top_k}, {bits}, "
            f"expert cache {human_bytes(info.cache_bytes)}"
            + (f" ({info.cache_policy})" if info.cache_policy else "")
            + kv_label(info)
            + f", loaded in {info.load_s:.1f} s\n"
            + (f"Experts resident, not streamed (--allow-resident-experts): {resident}\n" if resident else "")
            + (
                f"Preloading the {info.preloading} most used experts ({human_bytes(info.preloading_bytes)}) "
                f"from {info.usage_file}\n"
                if getattr(info, "preloading", 0)
                else ""
            )
            + (DEMO_NOTE + "\n" if is_demo(info.model) else "")
            + "Type a message and press Enter. /help lists the commands, F1 the keys.",
            title="model",
            before=self._queued,
        )
        if not self._build_loop(info):
            return
        self.set_activity("ready", "dim")
        if self._queued is not None:  # sent from this screen's own queue, in turn with what is typed
            self.call_later(self._send_queued)

    async def _send_queued(self) -> None:
        queued, self._queued = self._queued, None
        if queued is not None and self.is_attached:
            await self.start_reply(queued.text, shown=True)

    def _build_loop(self, info) -> bool:
        """The AgentLoop every turn goes through; False when its tools cannot be set up."""
        from ...agent_cli import make_loop

        app = self.app  # (read here: the approver asks from the worker thread)

        def wanted() -> bool:
            turn = self.agent_turn
            return turn is not None and not turn.stopping() and app.is_running

        approver = ModalApprover(self._ask, wanted)
        try:
            self.loop = make_loop(self.tools, self.session, info.chat_template or "", approver, self._on_event)
        except Exception as e:  # noqa: BLE001  (a bad tool option; run_tui checks them before loading)
            self.app.refuse_messages(f"tools: {e}", ExitCode.USAGE)
            self._queued = None
            self.note(f"Could not set up the tools: {e}", "error", title="error")
            self.set_activity("the tools are not set up: /exit or Ctrl+D quits", "bold red")
            return False
        if self.loop.executor is None:  # no tools
            return True
        names = ", ".join(self.loop.executor.registry.names())
        policy = self.loop.executor.policy
        yolo = " (every call runs without asking)" if policy.mode == "yolo" else ""
        self.note(
            f"Tools: {names}\nmode {policy.mode}{yolo} · workspace {short_path(policy.workspace)}",
            title="tools",
            before=self._queued,
        )
        return True

    def model_failed(self, message: str) -> None:
        """The model did not load: nothing can be sent; quitting is what is left."""
        self._queued = None
        self.status.set(model="not loaded")
        self.note(f"Could not load the model: {message}", "error", title="error")
        self.set_activity("the model is not loaded: /exit or Ctrl+D quits", "bold red")

    # -- sending -------------------------------------------------------------------------
    async def on_prompt_input_submitted(self, m: PromptInput.Submitted) -> None:
        text = m.text
        if not text.strip() or not self.is_attached:  # (not attached: the app is exiting)
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
        if self.app.load_error is not None:
            self.notify("The model is not loaded.", severity="error")
            return
        if self._queued is not None:
            self.notify("A message is already waiting for the model to load.", severity="warning")
            return
        self.prompt.clear()
        if self.app.loaded is None:
            self._queued = UserMessage(text)
            self.transcript.mount(self._queued)
            self.notify("Still loading the model; the message goes when it is ready.")
            return
        await self.start_reply(text)

    async def start_reply(self, text: str, shown: bool = False) -> None:
        """The user's message through the AgentLoop, on a thread worker (agent_turn.py)."""
        if not shown:
            self.transcript.mount(UserMessage(text))
        box = AssistantMessage()
        await self.transcript.mount(box)  # the Markdown widget must be mounted before it is streamed into
        box.mark("streaming")
        self._reply_seq += 1
        turn = self.agent_turn = AgentTurn(self, self.loop, self._reply_seq)
        self.reply = Reply(self._reply_seq, turn, box, box.stream())
        self.transcript.anchor()
        self.set_activity("prefill…", "dim")
        self.run_worker(
            partial(turn.run, text), thread=True, exit_on_error=False, group="reply", name=f"reply {self._reply_seq}"
        )

    def _current(self, reply_id: int) -> Reply | None:
        """The reply a message is about, while it runs and the app is not exiting (from then on
        nothing can be mounted: the messages still queued are dropped)."""
        r = self.reply
        return r if r is not None and r.id == reply_id and self.is_attached else None

    async def on_reply_text(self, m: ReplyText) -> None:
        r = self._current(m.reply_id)
        if r is None:
            return
        thinking = m.kind == "reasoning"
        if not r.stopping:
            self.set_activity(
                "thinking… Ctrl+T shows or hides the reasoning · Esc stops"
                if thinking
                else "generating… Esc stops (the text so far is kept)",
                "dim",
            )
        if r.box is None:
            await self._open_box(r)
        r.text += m.text  # (the AgentLoop saves it, on its thread)
        if thinking:
            await r.box.add_reasoning(m.text, collapsed=self.reasoning_view is False)
            self.transcript.anchor()
            return
        block = r.box.reasoning
        if block is not None and self.reasoning_view is not True:
            block.collapsed = True  # the answer has started
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

    def _engine_failed(self, failed) -> None:
        message = failed.message.strip() or failed.exc_type
        lines = message.splitlines()
        shown = "\n".join(lines[:12] + (["…"] if len(lines) > 12 else []))
        self.note(f"The engine failed ({failed.exc_type}): {shown}", "error", title="error")
        self.notify(
            safe(lines[0] if lines else message), title="Engine error", severity="error", timeout=10, markup=False
        )
        self.set_activity("the engine failed; see the message above", "bold red")

    # -- the turn's messages (agent_turn.py posts them) ------------------------------------------
    def _on_event(self, ev) -> None:  # worker thread: the AgentLoop's on_event
        turn = self.agent_turn
        if turn is not None:
            turn.on_event(ev)

    def _ask(self, call, reason: str, reply) -> bool:  # worker thread: ModalApprover's show
        """Put the approval question up, after the text that came before it."""
        turn = self.agent_turn
        return turn is not None and turn.post(
            ApprovalRequest(turn.reply_id, call.name or "", call.arguments, reason, reply)
        )

    async def _open_box(self, r: Reply) -> None:
        """The next model reply of the turn (after tool results) gets its own box."""
        box = AssistantMessage()
        await self.transcript.mount(box)
        box.mark("streaming")
        r.box, r.stream = box, box.stream()
        self.transcript.anchor()

    async def _close_box(self, r: Reply, state: str) -> None:
        box, r.box = r.box, None
        if box is None:
            return
        await r.stream.stop()
        r.stream = None
        block = box.reasoning
        if block is not None and self.reasoning_view is not True:
            block.collapsed = True
        if not box.text.strip() and block is None:  # a reply that was only tool calls
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
                " · max tokens" if done.reason == "length" else ""
            )
        self.status.set(context_used=done.prompt_tokens + done.generation_tokens, tokens=m.tokens)
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
        if r is None or r.stopping or not self.app.is_running:
            m.reply(None)  # no
            return
        screen = ApproveScreen(m.name, m.arguments, m.reason)

        def answered(value: str | None) -> None:
            m.reply(value)
            if self._approval is not None and self._approval[1] is screen:
                self._approval = None
            if self._current(m.reply_id) is not None and not r.stopping:
                self.set_activity(f"{m.name}: {value or 'no'}", "dim")

        self._approval = (m.reply, screen)
        self.app.push_screen(screen, answered)
        self.set_activity(f"{m.name} needs your approval: y yes · n no · a always", "bold")

    def close_approval(self) -> None:
        """Answer an open question "no" and take the screen away (the turn is being stopped)."""
        if self._approval is None:
            return
        reply, screen = self._approval
        self._approval = None
        reply("no")
        if self.app.screen is screen and not screen.answered:
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
            if end.message:  # the reply ended inside its reasoning
                self.note(end.message, "warning")
            self.set_activity("ready", "dim")
        elif end.status == "cancelled":
            self.set_activity("stopped; the partial reply is kept", "dim")
        elif end.status == "failed" and m.failed is not None:
            self._engine_failed(m.failed)
        else:
            what = {
                "chain-limit": "The tool chain limit is reached",
                "repairs-exhausted": "The model kept writing malformed tool calls",
                "failed": "The reply failed",
                "approval-needed": "A tool call needed approval",
            }.get(end.status, f"The turn ended ({end.status})")
            self.note(f"{what}: {end.message}" if end.message else what, "error", title="error")
            self.set_activity("ready; see the error above", "bold red")

    # -- the timer -----------------------------------------------------------------------
    def redraw(self) -> None:
        """At most 10 times a second: the latest layer timings, the live figures, memory."""
        # The timer can fire once more while the app shuts down and its widgets go away (seen in
        # full test runs: NoMatches for the status bar at teardown): nothing is left to draw then.
        try:
            self._redraw()
        except NoMatches:
            pass

    def _redraw(self) -> None:
        stats = None if self.loop is None else self.loop.stats  # the worker thread writes them
        ev = None if stats is None else stats.step_layers
        if ev is not None and ev is not self._drawn:
            self._drawn = ev
            self.panel.show_timings(ev)
        if self.reply is not None and stats is not None and (stats.steps or stats.tokens):
            # live while the model reasons or writes a tool call too: every token counts
            self.status.set(**stats.running())
        self._ticks += 1
        if self._ticks % RSS_EVERY == 0:
            self.status.set(rss=self._rss())

    # -- stopping --------------------------------------------------------------------------
    def interrupt(self) -> bool:
        """Stop the reply (Esc, Ctrl+C); False when there is none, or it is stopping already."""
        r = self.reply
        if r is None or r.stopping:
            return False
        r.handle.cancel()
        r.stopping = True
        self.close_approval()
        self.set_activity("stopping…", "dim")
        return True

    def action_stop(self) -> None:
        if self.reply is None or self.reply.stopping:
            raise SkipAction()
        self.interrupt()

    async def on_unmount(self) -> None:
        r = self.reply
        if r is not None:  # quitting mid-reply: the turn stops and its loop saves what it got
            r.handle.cancel()
            deadline = time.monotonic() + UNMOUNT_WAIT_S
            while not r.handle.wait(0) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if r.stream is not None:  # end the reply stream's task cleanly
                await r.stream.stop()

    def action_end_of_input(self) -> None:
        """Ctrl+D where the message box does not take it (it quits itself when empty)."""
        if self.prompt.text:
            raise SkipAction()
        self.app.quit_app()

    # -- the view and the commands ---------------------------------------------------------
    def action_toggle_layers(self) -> None:
        """F2, or /timing without a mode."""
        self.show_panel(not self.panel.display)

    def toggle_reasoning(self) -> None:
        """Ctrl+T: show every reasoning block, or (when one is open) hide them all."""
        blocks = list(self.transcript.query(ReasoningBlock))
        show = all(b.collapsed for b in blocks) if blocks else not self.reasoning_view
        self.reasoning_view = show
        for b in blocks:
            b.collapsed = not show
        if not blocks:
            self.notify("Reasoning will be " + ("shown." if show else "hidden."), timeout=2)

    def prefill_prompt(self, text: str) -> None:
        self.prompt.text = text
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.focus()

    # -- slash commands (commands.py runs them; this screen is the Face they act on) ----------
    keys = KEYS
    described = {
        "timing": "/timing [off|step|layer] shows or hides the layer panel (alone: F2) or sets the timing mode"
    }

    def run_slash(self, name: str, arg: str) -> None:
        """A slash command (typed, or from the command palette)."""
        try:
            commands.run(self, name, arg)
        except Exception as e:  # noqa: BLE001  (the session's store failed, say): shown, not fatal
            self.say(f"/{name}: {e}", "error")

    def say(self, text: str, kind: str = "info") -> None:
        """A note in the transcript: info, help, usage or error."""
        note_kind = "error" if kind in ("usage", "error") else "info"
        self.note(text, note_kind, title="help" if kind == "help" else "")

    def busy(self) -> bool:
        return self.reply is not None

    def cleared(self) -> None:
        self.transcript.remove_children()

    def show_timing(self) -> None:
        self.action_toggle_layers()

    def timing_set(self, mode: str) -> None:
        self.panel.set_mode(mode)
        self.show_panel(mode != "off")

    def quit(self) -> None:
        self.app.quit_app()


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
