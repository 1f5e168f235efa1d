"""Messages the engine worker threads post to the app; the app alone changes widgets."""
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


class ReplyText(Message):
    """A batch of reply text (~30 ms of tokens)."""

    def __init__(self, reply_id: int, text: str) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.text = text


class ReplyPrefill(Message):
    """Prompt processing progress; a newer one replaces a queued one."""

    def __init__(self, reply_id: int, done: int, total: int) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.done = done
        self.total = total

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ReplyPrefill) and message.reply_id == self.reply_id


class ReplyDone(Message):
    def __init__(self, reply_id: int, finished) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.finished = finished  # engine.events.GenerationFinished


class ReplyFailed(Message):
    def __init__(self, reply_id: int, failed) -> None:
        super().__init__()
        self.reply_id = reply_id
        self.failed = failed  # engine.events.EngineFailed
