"""Messages the worker threads post; only their handlers, on the UI thread, change widgets.

The engine's loading and warnings go to the App (app.py). A reply's progress goes straight to the
chat screen (screens/chat.py), which alone handles it: those messages do not bubble on to the App.
"""
from __future__ import annotations

from textual.message import Message


class EngineLoaded(Message):
    def __init__(self, info) -> None:
        super().__init__()
        self.info = info  # engine.events.ModelLoaded


class EngineLoadFailed(Message):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__()
        self.message = message
        self.exit_code = exit_code


class EngineWarning(Message):
    """A warning the engine logged (a prompt truncated to fit the context)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class ReplyText(Message, bubble=False):
    """A batch of reply text (~30 ms of tokens): the answer's, or (kind "reasoning") the reasoning's."""

    def __init__(self, reply_id: int, text: str, kind: str = "text") -> None:
        super().__init__()
        self.reply_id = reply_id
        self.text = text
        self.kind = kind


def text_batches(reply_id: int, pieces: list[tuple[str, str]]) -> list[ReplyText]:
    """(kind, text) pieces as ReplyText messages, one per run of the same kind, in order."""
    out: list[ReplyText] = []
    for kind, text in pieces:
        if out and out[-1].kind == kind:
            out[-1].text += text
        else:
            out.append(ReplyText(reply_id, text, kind))
    return out


class ReplyPrefill(Message, bubble=False):
    """Prompt processing progress; a newer one replaces a queued one."""

    def __init__(self, reply_id: int, done: int, total: int) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.done = done
        self.total = total

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ReplyPrefill) and message.reply_id == self.reply_id


class ReplyDone(Message, bubble=False):
    def __init__(self, reply_id: int, finished) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.finished = finished  # engine.events.GenerationFinished


class ReplyFailed(Message, bubble=False):
    def __init__(self, reply_id: int, failed) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.failed = failed  # engine.events.EngineFailed


# -- tool use (a reply driven by the AgentLoop) ------------------------------------------------
class ReplyActivity(Message, bubble=False):
    """A line for the activity bar (e.g. the model started writing after its prefill)."""

    def __init__(self, reply_id: int, text: str) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.text = text


class ReplyRoundDone(Message, bubble=False):
    """One model reply of a tool-using turn has finished (more may follow after tool results)."""

    def __init__(self, reply_id: int, finished) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.finished = finished  # engine.events.GenerationFinished


class ReplyTool(Message, bubble=False):
    """A tool call and its result (declined, denied and invalid calls included)."""

    def __init__(self, reply_id: int, call, result) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.call = call  # flashmoe.cli.agent.ToolCallEvent (None if none came before the result)
        self.result = result  # flashmoe.cli.agent.ToolResultEvent


class ReplyTurnEnd(Message, bubble=False):
    """The tool-using turn is over: done, cancelled, failed or stopped by a limit."""

    def __init__(self, reply_id: int, end, failed=None) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.end = end  # flashmoe.cli.agent.TurnFinished
        self.failed = failed  # engine.events.EngineFailed, when the engine failed


class ApprovalRequest(Message, bubble=False):
    """A tool call needs the user's yes; the worker thread waits on `future` for the answer."""

    def __init__(self, reply_id: int, name: str, arguments, reason: str, future) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.name = name
        self.arguments = arguments
        self.reason = reason
        self.future = future  # concurrent.futures.Future[str]: "yes" | "no" | "always"
