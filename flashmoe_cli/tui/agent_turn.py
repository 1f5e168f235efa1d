"""Tool use in the chat screen: one user message through the AgentLoop, on a thread worker.

AgentLoop.run_turn blocks and calls back on that thread; AgentTurn turns its events into the
chat screen's messages (visible text in ~30 ms batches, sent by a small flusher thread so text never
waits for the next token, tool calls with their results, the end of the turn; all posted under
one lock, so they arrive in order) and asks for approvals: it posts an ApprovalRequest and waits on a Future that the modal
screen answers. Cancelling the turn (Esc, Ctrl+C, quitting) answers a pending question "no", so
the worker thread never waits on a screen that is gone.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError

from flashmoe.engine.events import EngineFailed, GenerationFinished, PrefillProgress, TokenGenerated

from ..agent import TextChunk, ToolCallEvent, ToolResultEvent, TurnFinished
from .messages import (
    ApprovalRequest,
    ReplyActivity,
    ReplyPrefill,
    ReplyRoundDone,
    text_batches,
    ReplyTool,
    ReplyTurnEnd,
)
from .reply import BATCH_S  # as the plain reply: text is batched this long

POLL_S = 0.1  # how often a pending approval checks that it is still wanted
ANSWERS = ("yes", "no", "always")


def answer(future: Future, value: str) -> None:
    """Settle a pending approval once; later answers (a late key, a cancel) are ignored."""
    try:
        future.set_result(value)
    except InvalidStateError:
        pass


class AppApprover:
    """The AgentLoop's approver: hands each question to the turn that is running on the chat screen."""

    interactive = True

    def __init__(self, screen) -> None:
        self.screen = screen

    def ask(self, call, reason: str) -> str:  # worker thread
        turn = getattr(self.screen, "agent_turn", None)
        return "no" if turn is None else turn.ask(call, reason)


class AgentTurn:
    """One user message through the AgentLoop. `run` is the thread worker; `cancel` is safe anywhere."""

    def __init__(self, screen, agent, reply_id: int, live) -> None:
        self.screen = screen  # the chat screen: what the turn posts goes there
        self.app = screen.app  # whether the app still runs (an open question is then answered "no")
        self.agent = agent
        self.reply_id = reply_id
        self.live = live  # reply.Live: the running figures the screen's redraw timer reads
        self.cancelled = threading.Event()
        self.pending: Future | None = None  # the approval being asked
        self.worker = None
        self._batch: list[tuple[str, str]] = []  # (kind, text): the answer's or the reasoning's
        self._lock = threading.Lock()  # the batch, and the order of what is posted
        self._done = threading.Event()
        self._call: ToolCallEvent | None = None
        self._failed: EngineFailed | None = None
        self._writing = False
        self._ended = False

    # -- any thread --------------------------------------------------------------------------
    def cancel(self) -> None:
        self.cancelled.set()
        pending = self.pending
        if pending is not None:
            answer(pending, "no")
        self.agent.cancel()

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
            self.agent.run_turn(text)
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

    def _stopping(self) -> bool:
        if self.worker is not None and self.worker.is_cancelled:  # the app is closing
            self.cancelled.set()
        return self.cancelled.is_set()

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
        if self._stopping() and isinstance(ev, (PrefillProgress, TokenGenerated)):
            self.agent.cancel()  # a reply that started after the cancel (between rounds) stops too
        self.live.record(ev)  # tokens, steps, the prefill and layer timings: figures for the timer
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
            self.post(ReplyRoundDone(self.reply_id, ev))
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

    def ask(self, call, reason: str) -> str:
        """Approver.ask, on the worker thread: blocks until the modal is answered or the turn ends."""
        if self._stopping():
            return "no"
        future: Future = Future()
        self.pending = future
        try:
            if self._stopping():
                return "no"
            if not self.post(ApprovalRequest(self.reply_id, call.name or "", call.arguments, reason, future)):
                return "no"  # the app is closing
            while True:
                try:
                    result = future.result(timeout=POLL_S)
                except TimeoutError:
                    if self._stopping() or not self.app.is_running:
                        return "no"
                    continue
                return result if result in ANSWERS else "no"
        finally:
            self.pending = None
