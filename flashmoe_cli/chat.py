"""A conversation with the engine, as the TUI and the line REPL both drive it.

It turns the history into requests, records every message as it happens (the store commits
each one), and keeps the engine's cache of this conversation under the conversation's id, so a
turn only runs its new tokens.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.events import GenerationFinished
from engine.generate import GenerationRequest
from engine.sampling import SamplingParams


@dataclass
class ChatOptions:
    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    timing: str = "step"
    system: str | None = None
    stop: tuple[str, ...] = ()


class ChatSession:
    def __init__(self, engine, store=None, options: ChatOptions | None = None, cid: str | None = None,
                 model_name: str = ""):
        self.engine = engine
        self.store = store
        self.options = options or ChatOptions()
        self.model_name = model_name
        self.system = self.options.system
        self.history: list[dict] = []
        self.cid = cid
        if cid is not None and store is not None:
            conv = store.get(cid)
            if conv is None:
                raise KeyError(cid)
            self.system = conv.system if conv.system is not None else self.system
            self.history = [m.for_template() for m in store.messages(cid)]
        self._key = cid or f"chat-{id(self)}"

    @property
    def session_key(self) -> str:
        """The engine keeps this conversation's cache under this key."""
        return self._key

    @session_key.setter
    def session_key(self, key: str) -> None:
        self._key = key

    def _record(self, role: str, content: str, **kw) -> None:
        if self.store is None:
            return
        if self.cid is None:  # created with its first message, so no empty conversations
            self.cid = self.store.new_conversation(self.model_name, self.system)
        self.store.add_message(self.cid, role, content, **kw)

    def messages(self, extra_system: str | None = None) -> list[dict]:
        system = "\n\n".join(p for p in (self.system, extra_system) if p)
        return ([{"role": "system", "content": system}] if system else []) + self.history

    def add(self, message: dict, done: GenerationFinished | None = None, interrupted: bool = False) -> None:
        """Append any message (user, assistant with tool_calls, tool result) and record it."""
        self.history.append(message)
        extra = {k: v for k, v in message.items() if k not in ("role", "content")}
        stats = None
        if done is not None or extra:
            stats = {k: v for k, v in done.to_dict().items() if k not in ("text", "tail", "event")} if done else {}
            if extra:
                stats["message"] = extra  # tool_calls, name: needed to render the history again
        self._record(message["role"], message["content"], interrupted=interrupted, stats=stats)

    def generate(self, tools: list[dict] | None = None, constraint=None, extra_system: str | None = None):
        """A reply to the history as it stands; returns the engine's Handle."""
        request = GenerationRequest(messages=self.messages(extra_system), tools=tools, constraint=constraint,
                                    max_tokens=self.options.max_tokens, sampling=self.options.sampling,
                                    stop=self.options.stop, timing=self.options.timing)
        return self.engine.submit(request, session=self.session_key)

    def send(self, text: str):
        """Record the user's message and start the reply; returns the engine's Handle."""
        self.history.append({"role": "user", "content": text})
        self._record("user", text)
        request = GenerationRequest(messages=self.messages(), max_tokens=self.options.max_tokens,
                                    sampling=self.options.sampling, stop=self.options.stop,
                                    timing=self.options.timing)
        return self.engine.submit(request, session=self.session_key)

    def send_raw(self, text: str):
        """A prompt without the chat template (`run --raw`); recorded like a turn."""
        self._record("user", text)
        request = GenerationRequest(prompt=text, max_tokens=self.options.max_tokens,
                                    sampling=self.options.sampling, stop=self.options.stop,
                                    timing=self.options.timing)
        return self.engine.submit(request, session=self.session_key)

    def finish(self, text: str, done: GenerationFinished | None = None, interrupted: bool = False) -> None:
        """Record the reply (the partial one too, marked, when it was interrupted)."""
        self.history.append({"role": "assistant", "content": text})
        stats = None
        if done is not None:
            stats = {k: v for k, v in done.to_dict().items() if k not in ("text", "tail", "event")}
        self._record("assistant", text, interrupted=interrupted, stats=stats)

    def unsend(self) -> None:
        """After a failed reply: forget the unanswered user message, in memory and on disk, so
        the history keeps alternating (and a resumed conversation matches what was shown)."""
        if self.history and self.history[-1].get("role") == "user":
            self.history.pop()
            if self.store is not None and self.cid is not None:
                self.store.delete_last(self.cid, "user")

    def clear(self) -> None:
        self.history = []
        self.engine.reset_session(self.session_key)
        self.cid = None
        self._key = f"chat-{id(self)}-{len(self._key)}"

    def set_system(self, text: str | None) -> None:
        self.system = text or None
        if self.store is not None and self.cid is not None:
            self.store.set_system(self.cid, self.system)

    def save(self, path: str | Path) -> Path:
        """The conversation as Markdown, written to a temporary name and renamed."""
        path = Path(path).expanduser()
        out = [f"# flashmoe conversation {self.cid or ''}".rstrip(), ""]
        if self.system:
            out += ["**system**", "", self.system, ""]
        for m in self.history:
            out += [f"**{m['role']}**", "", m["content"], ""]
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text("\n".join(out))
        os.replace(tmp, path)
        return path
