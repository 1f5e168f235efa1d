"""A conversation with the engine, as the TUI and the line REPL both drive it.

It turns the history into requests, records every message as it happens (the store commits
each one), and keeps the engine's cache of this conversation under the conversation's id, so a
turn only runs its new tokens.

A reply is saved while it streams: its row is written, marked incomplete, when the request goes
out; `stream()` updates its text at most every SAVE_EVERY_S (the first text at once); `finish()`
marks it complete. So a process killed mid-reply (even by SIGKILL) leaves what it had shown, up to
the last SAVE_EVERY_S, marked incomplete. When the store fails (a locked or unwritable database)
the conversation goes on unsaved and that is said once.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flashmoe.engine.events import GenerationFinished
from flashmoe.engine.runtime.generate import GenerationRequest
from flashmoe.engine.runtime.sampling import SamplingParams


SAVE_EVERY_S = 0.25
NO_REPLY = "[no reply: flashmoe stopped before it answered]"


class Turn(dict):
    """A message of the history (a plain dict to the chat template) that carries how it ended:
    `mark` "interrupted" (stopped: Esc, Ctrl-C, a signal), "incomplete" (the process died while
    writing it) or "". The front ends show it on a resumed conversation and in /save."""

    def __init__(self, message: dict, mark: str = "") -> None:
        super().__init__(message)
        self.mark = mark


def mark_of(message: dict) -> str:
    return getattr(message, "mark", "")


def is_tool_result(message: dict) -> bool:
    """A tool's result: a "tool" turn, or (templates without one) a user turn in <tool_response>."""
    return message.get("role") == "tool" or (
        message.get("role") == "user" and message.get("content", "").startswith("<tool_response>")
    )


def resumed_history(messages) -> list[dict]:
    """Saved messages as a history the model can continue: a reply that never came (the process
    died before its first token, or before its row was written) becomes a note, so user turns
    never follow each other (tool results sent back as user turns may)."""
    out: list[dict] = []
    for m in messages:
        d = Turn(m.for_template(), "incomplete" if not m.complete else "interrupted" if m.interrupted else "")
        if m.role == "assistant" and not m.complete and not m.content.strip():
            d["content"] = NO_REPLY
        if d["role"] == "user" and out and out[-1]["role"] == "user" and not d["content"].startswith("<tool_response>"):
            out.append({"role": "assistant", "content": NO_REPLY})
        out.append(d)
    return out


def resume_hint(session) -> str | None:
    """The line a chat prints on stderr as it quits: how to come back to what was saved."""
    if session.store is None or session.cid is None:
        return None
    return (
        f"flashmoe: conversation {session.cid} is saved; `flashmoe chat -c` resumes the latest, "
        f"`flashmoe chat --cid {session.cid}` this one"
    )


def say_store_failed(path, e: BaseException) -> None:
    from .store import store_failure

    print(f"flashmoe: warning: the conversation is not saved ({path}: {store_failure(e)})", file=sys.stderr, flush=True)


@dataclass
class ChatOptions:
    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    timing: str = "step"
    system: str | None = None
    stop: tuple[str, ...] = ()
    thinking: str | None = None  # "on" | "off" through the template's switch; None: its default


class ChatSession:
    def __init__(
        self, engine, store=None, options: ChatOptions | None = None, cid: str | None = None, model_name: str = ""
    ):
        self.engine = engine
        self.store = store
        self.options = options or ChatOptions()
        self.model_name = model_name
        self.system = self.options.system
        self.history: list[dict] = []
        self.cid = cid
        self.on_store_error = say_store_failed  # (path, exception): once, then nothing is saved
        self._draft: int | None = None  # the row of the reply being written
        self._draft_text = self._draft_saved = ""
        self._draft_at = 0.0
        if cid is not None and store is not None:
            conv = store.get(cid)
            if conv is None:
                raise KeyError(cid)
            self.system = conv.system if conv.system is not None else self.system
            self.history = resumed_history(store.messages(cid))
        self._key = cid or f"chat-{id(self)}"
        self.template: str | None = None  # the chat template's text (None: the loaded engine's)
        self.on_note = lambda text: print(f"flashmoe: note: {text}", file=sys.stderr, flush=True)
        self._noted_thinking = False

    def _template(self) -> str:
        if self.template is not None:
            return self.template
        return getattr(getattr(self.engine, "loaded_info", None), "chat_template", "") or ""

    def template_kwargs(self) -> dict:
        """enable_thinking (or the template's own name for it) from --thinking / /thinking; the
        first request says once (on_note) when the template has no such switch."""
        from flashmoe.engine.runtime.reasoning import thinking_kwargs

        note = None if self._noted_thinking else self.thinking_note()
        if note:
            self._noted_thinking = True
            self.on_note(note)
        return thinking_kwargs(self.options.thinking, self._template())

    def thinking_note(self) -> str | None:
        """One line when --thinking is set but the chat template has no switch for it."""
        from flashmoe.engine.runtime.reasoning import thinking_switch

        if self.options.thinking is None or thinking_switch(self._template()):
            return None
        return (
            f"--thinking {self.options.thinking}: this model's chat template has no thinking switch "
            "(enable_thinking), so it changes nothing"
        )

    @property
    def session_key(self) -> str:
        """The engine keeps this conversation's cache under this key."""
        return self._key

    @session_key.setter
    def session_key(self, key: str) -> None:
        self._key = key

    def _save(self, method: str, *args, **kw):
        """A store call; when it fails the conversation goes on unsaved (said once)."""
        if self.store is None:
            return None
        try:
            return getattr(self.store, method)(*args, **kw)
        except (sqlite3.Error, OSError) as e:
            path, self.store = self.store.path, None
            self._draft = None
            self.on_store_error(path, e)
            return None

    def _record(self, role: str, content: str, **kw) -> int | None:
        if self.store is not None and self.cid is None:  # created with its first message: none empty
            self.cid = self._save("new_conversation", self.model_name, self.system)
        if self.store is None:
            return None
        return self._save("add_message", self.cid, role, content, **kw)

    # -- the reply being written -------------------------------------------------------------
    def _begin_reply(self) -> None:
        self._draft = self._record("assistant", "", interrupted=True, complete=False)
        self._draft_text = self._draft_saved = ""
        self._draft_at = 0.0

    def stream(self, text: str) -> None:
        """More of the reply, as shown; saved at most every SAVE_EVERY_S (the first piece at once)."""
        self._draft_text += text
        self.save_draft()

    def save_draft(self, force: bool = False) -> None:
        """Write the reply so far if it changed and SAVE_EVERY_S has passed (or `force`)."""
        if self._draft is None or self._draft_text == self._draft_saved:
            return
        now = time.monotonic()
        if not force and self._draft_saved and now - self._draft_at < SAVE_EVERY_S:
            return
        self._save("update_message", self._draft, self._draft_text)
        self._draft_saved, self._draft_at = self._draft_text, now

    def _close_reply(self, content: str, interrupted: bool, stats: dict | None) -> None:
        draft, self._draft = self._draft, None
        if draft is None:
            self._record("assistant", content, interrupted=interrupted, stats=stats)
        else:
            self._save("update_message", draft, content, interrupted=interrupted, stats=stats, complete=True)

    def abandon_reply(self, unsend_if_empty: bool = True) -> None:
        """The engine failed: keep what was written (marked interrupted); with nothing written,
        drop the reply's row and (unsend_if_empty) the user message it answered."""
        if self._draft is None:
            return
        if self._draft_text:
            self.finish(self._draft_text, None, interrupted=True)
        elif unsend_if_empty:
            self.unsend()
        else:
            draft, self._draft = self._draft, None
            self._save("delete_message", draft)

    def messages(self, extra_system: str | None = None) -> list[dict]:
        system = "\n\n".join(p for p in (self.system, extra_system) if p)
        return ([{"role": "system", "content": system}] if system else []) + self.history

    def add(self, message: dict, done: GenerationFinished | None = None, interrupted: bool = False) -> None:
        """Append any message (user, assistant with tool_calls, tool result) and record it."""
        self.history.append(Turn(message, "interrupted") if interrupted else message)
        extra = {k: v for k, v in message.items() if k not in ("role", "content")}
        stats = None
        if done is not None or extra:
            stats = {k: v for k, v in done.to_dict().items() if k not in ("text", "tail", "event")} if done else {}
            if extra:
                stats["message"] = extra  # tool_calls, name: needed to render the history again
        if message["role"] == "assistant":
            self._close_reply(message["content"], interrupted, stats)
        else:
            self._record(message["role"], message["content"], interrupted=interrupted, stats=stats)

    def request(
        self,
        *,
        tools: list[dict] | None = None,
        constraint=None,
        extra_system: str | None = None,
        prompt: str | None = None,
    ) -> GenerationRequest:
        """The one place a GenerationRequest is made: the history as it stands (with the system
        prompt and `extra_system`), or `prompt` sent as is without the chat template (`run --raw`)."""
        o = self.options
        if prompt is not None:
            return GenerationRequest(
                prompt=prompt, max_tokens=o.max_tokens, sampling=o.sampling, stop=o.stop, timing=o.timing
            )
        return GenerationRequest(
            messages=self.messages(extra_system),
            tools=tools,
            constraint=constraint,
            max_tokens=o.max_tokens,
            sampling=o.sampling,
            stop=o.stop,
            timing=o.timing,
            template_kwargs=self.template_kwargs(),
        )

    def generate(
        self,
        tools: list[dict] | None = None,
        constraint=None,
        extra_system: str | None = None,
        *,
        prompt: str | None = None,
        unsend_on_error: bool = False,
    ):
        """A reply to the history as it stands (see `request`); returns the engine's Handle. When
        the engine refuses the request, the reply's row goes, and with `unsend_on_error` the
        user's message it would have answered too."""
        request = self.request(tools=tools, constraint=constraint, extra_system=extra_system, prompt=prompt)
        self._begin_reply()
        try:
            return self.engine.submit(request, session=self.session_key)
        except Exception:  # a bad template or request: the turn did not happen
            self.abandon_reply(unsend_if_empty=unsend_on_error)
            raise

    def send(self, text: str, **request):
        """Record the user's message and start the reply to it (`request`: generate's options);
        returns the engine's Handle."""
        self.history.append({"role": "user", "content": text})
        self._record("user", text)
        return self.generate(**request, unsend_on_error=True)

    def send_raw(self, text: str):
        """A prompt without the chat template (`run --raw`); recorded like a turn."""
        self._record("user", text)
        return self.generate(prompt=text, unsend_on_error=True)

    def finish(self, text: str, done: GenerationFinished | None = None, interrupted: bool = False) -> None:
        """Record the reply (the partial one too, marked, when it was interrupted)."""
        self.add({"role": "assistant", "content": text}, done, interrupted=interrupted)

    def unsend(self) -> None:
        """After a failed reply: forget the unanswered user message, in memory and on disk, so
        the history keeps alternating (and a resumed conversation matches what was shown)."""
        if self._draft is not None:
            draft, self._draft = self._draft, None
            self._save("delete_message", draft)
        if self.history and self.history[-1].get("role") == "user":
            self.history.pop()
            if self.store is not None and self.cid is not None:
                self._save("delete_last", self.cid, "user")

    def clear(self) -> None:
        self.history = []
        self._draft = None
        self.engine.reset_session(self.session_key)
        self.cid = None
        self._key = f"chat-{id(self)}-{len(self._key)}"

    def set_system(self, text: str | None) -> None:
        self.system = text or None
        if self.store is not None and self.cid is not None:
            self._save("set_system", self.cid, self.system)

    def save(self, path: str | Path) -> Path:
        """The conversation as Markdown, written to a temporary name and renamed."""
        path = Path(path).expanduser()
        out = [f"# flashmoe conversation {self.cid or ''}".rstrip(), ""]
        if self.system:
            out += ["**system**", "", self.system, ""]
        for m in self.history:
            who = "tool result" if is_tool_result(m) else m["role"]
            mark = f" ({mark_of(m)})" if mark_of(m) else ""
            out += [f"**{who}**{mark}", "", m["content"], ""]
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text("\n".join(out))
        os.replace(tmp, path)
        return path
