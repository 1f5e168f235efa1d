"""A turn on the chat screen: one user message through the AgentLoop, on a thread worker.

Every turn goes this way, with --tools or not: without tools the loop's turn is one plain reply,
so the TUI waits on the engine, splits the reply, saves it and counts its figures as headless
`run` and the line REPL do (agent.py, stats.py). AgentLoop.run_turn blocks and calls back on the
worker thread; AgentTurn turns its events into the chat screen's messages: visible text in ~0.1 s
batches (sent by a small flusher thread, so text never waits for the next token), prefill
progress, the end of each model reply, tool calls with their results, the end of the turn; all
posted under one lock, so they arrive in order. The figures (tokens, steps, per-layer timings)
are not posted: they are the loop's TurnStats, which the screen's 4 Hz timer reads, so a fast
model never floods the UI.

Approvals are the loop's approver's (approvers.ModalApprover: the chat screen asks with
ApproveScreen). Cancelling the turn (Esc, Ctrl+C, quitting) answers a pending question "no", so
the worker thread never waits on a screen that is gone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from flashmoe.engine.events import EngineFailed, GenerationFinished, PrefillProgress, TokenGenerated

from ..agent import TextChunk, ToolCallEvent, ToolResultEvent, TurnFinished
from .messages import (
    ReplyActivity,
    ReplyPrefill,
    ReplyRoundDone,
    ReplyTool,
    ReplyTurnEnd,
    text_batches,
)
from .widgets import AssistantMessage

BATCH_S = 0.1  # token text is batched this long before the Markdown is updated (at 0.03 s the
# redraws took CPU from the engine: cli.TUI_FPS)


@dataclass
class Reply:
    """The turn on screen, while it runs."""

    id: int
    handle: AgentTurn  # what stops it (cancel())
    box: AssistantMessage | None  # the model reply being shown; None between the replies of a tool-using turn
    stream: object  # widgets.transcript.ReplyStream (None with box)
    stopping: bool = False
    detail: str = ""  # the finished model reply's figures, for the box's bottom border
    text: str = ""  # the model's text so far, as it wrote it


class AgentTurn:
    """One user message through the AgentLoop. `run` is the thread worker; `cancel` is safe anywhere."""

    def __init__(self, screen, loop, reply_id: int) -> None:
        self.screen = screen  # the chat screen: what the turn posts goes there
        self.loop = loop  # the AgentLoop; its stats are the figures the screen's timer reads
        self.reply_id = reply_id
        self._cancelled = threading.Event()
        self.worker = None
        self._batch: list[tuple[str, str]] = []  # (kind, text): the answer's or the reasoning's
        self._lock = threading.Lock()  # the batch, and the order of what is posted
        self._done = threading.Event()
        self._call: ToolCallEvent | None = None
        self._failed: EngineFailed | None = None
        self._writing = False
        self._ended = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def pending(self):
        """The approval being asked, if any (the loop's approver holds it)."""
        approver = getattr(self.loop.executor, "approver", None)
        return getattr(approver, "pending", None)

    # -- any thread --------------------------------------------------------------------------
    def cancel(self) -> None:
        self._cancelled.set()
        cancel_question = getattr(getattr(self.loop.executor, "approver", None), "cancel", None)
        if cancel_question is not None:
            cancel_question()  # a pending approval is answered "no"
        self.loop.cancel()

    def stopping(self) -> bool:
        """The turn is being stopped: cancelled, or its worker is (the app is closing)."""
        if self.worker is not None and self.worker.is_cancelled:
            self._cancelled.set()
        return self._cancelled.is_set()

    def wait(self, timeout: float) -> bool:
        """Until the worker has ended the turn (and the loop saved it); False when the time ran out."""
        return self._done.wait(timeout)

    # -- the worker thread -------------------------------------------------------------------
    def run(self, text: str) -> None:
        from textual.worker import NoActiveWorker, get_current_worker

        try:
            self.worker = get_current_worker()
        except NoActiveWorker:
            self.worker = None
        flusher = threading.Thread(target=self._flush_every, name=f"flush reply {self.reply_id}", daemon=True)
        flusher.start()
        try:
            self.loop.run_turn(text)  # cancelled before it began: its first event stops it
        except Exception as e:  # noqa: BLE001  (a bug or a bad request: shown in the app, which keeps running)
            self.on_event(TurnFinished("failed", 0, f"{type(e).__name__}: {e}", 1))
        finally:
            if not self._ended:
                self.on_event(TurnFinished("cancelled", 0))
            self._done.set()
            flusher.join()

    def _flush_every(self) -> None:
        while not self._done.wait(BATCH_S):
            self.flush()

    def post(self, message) -> bool:
        """Post `message` after the text that came before it."""
        with self._lock:
            self._flush()
            return self.screen.post_message(message)

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            for m in text_batches(self.reply_id, self._batch):
                self.screen.post_message(m)
            self._batch.clear()

    def on_event(self, ev) -> None:
        """The AgentLoop's on_event (its stats have counted `ev` already)."""
        if self.stopping() and isinstance(ev, (PrefillProgress, TokenGenerated)):
            self.loop.cancel()  # a reply that started after the cancel (between rounds) stops too
        if isinstance(ev, TextChunk):
            if ev.text:
                with self._lock:
                    self._batch.append((ev.kind, ev.text))
        elif isinstance(ev, TokenGenerated):
            if not self._writing:
                self._writing = True
                self.post(ReplyActivity(self.reply_id, "generating… Esc stops (the text so far is kept)"))
        elif isinstance(ev, PrefillProgress):
            self._writing = False
            self.post(ReplyPrefill(self.reply_id, ev.done, ev.total))
        elif isinstance(ev, GenerationFinished):
            self.post(ReplyRoundDone(self.reply_id, ev, self.loop.stats.generated_tokens()))
        elif isinstance(ev, EngineFailed):
            self._failed = ev
        elif isinstance(ev, ToolCallEvent):
            self.flush()  # the reply's text goes before its tool blocks
            self._call = ev
        elif isinstance(ev, ToolResultEvent):
            self.post(ReplyTool(self.reply_id, self._call, ev))
            self._call = None
        elif isinstance(ev, TurnFinished):
            self._ended = True
            self.post(ReplyTurnEnd(self.reply_id, ev, self._failed))
