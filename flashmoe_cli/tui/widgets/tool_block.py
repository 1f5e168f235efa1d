"""A tool call in the transcript: one collapsed line ("⚙ read_file · ok · 0.01 s"); opened, the
call's arguments and what the tool sent back to the model."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rich.text import Text
from textual.content import Content
from textual.widgets import Collapsible, Static

from ...term_safe import safe

MAX_LINES = 400  # result lines shown (the model got them all, up to the executor's cap)
MAX_CHARS = 40_000
STATE = {
    "ok": "ok",
    "result": "ok",
    "declined": "declined",
    "denied": "denied",
    "invalid": "invalid",
    "approval-needed": "denied",
    "chain-limit": "denied",
}


def fmt_duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


def clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def arguments_text(call) -> str:
    """The arguments as pretty JSON, or what the model wrote when it could not be decoded."""
    if call is None:
        return "(no call text)"
    if call.arguments is not None:
        return safe(json.dumps(call.arguments, indent=2, ensure_ascii=False))
    return safe(call.raw.strip()) or "(empty call)"


def title_text(call, result) -> str:
    name = (result.name or (call.name if call is not None else None)) or "?"
    status = result.status
    if status == "ok":
        parts = ["ok", fmt_duration(result.duration_s)]
    elif status == "invalid":
        error = (call.error if call is not None else None) or "the call is malformed"
        parts = [f"invalid: {clip(error, 60)}"]
    elif status == "error":
        first = (result.content.strip().splitlines() or ["failed"])[0]
        parts = [f"error: {clip(first, 50)}", fmt_duration(result.duration_s)]
    elif status == "chain-limit":
        parts = ["not run: the chain limit is reached"]
    elif status == "approval-needed":
        parts = ["denied: needs approval"]
    else:  # declined, denied, timeout, ...
        parts = [status]
    if result.exit_code not in (None, 0):
        parts.append(f"exit {result.exit_code}")
    if result.truncated:
        parts.append("truncated")
    return safe(" · ".join([f"⚙ {name}", *parts]))


def result_text(content: str) -> Text:
    lines = content.splitlines()
    shown = "\n".join(lines[:MAX_LINES])[:MAX_CHARS]
    text = Text(safe(shown) or "(no output)")  # a file or a command's output may hold control sequences
    hidden = len(lines) - len(shown.splitlines())
    if hidden > 0:
        text.append(f"\n… {hidden} more lines", style="dim italic")
    return text


class ToolBlock(Collapsible):
    """One tool call and its result, collapsed by default."""

    def __init__(self, call, result, *, title: str | None = None) -> None:
        self.call = call  # flashmoe.cli.agent.ToolCallEvent or None
        self.result = result  # flashmoe.cli.agent.ToolResultEvent
        self.state = STATE.get(result.status, "error")
        self.title_plain = title or title_text(call, result)
        body = (
            []
            if call is None
            else [
                Static(Text("arguments", style="bold"), classes="tool-label"),
                Static(Text(arguments_text(call)), classes="tool-args"),
            ]
        )
        body += [
            Static(Text(f"result · {result.status}", style="bold"), classes="tool-label"),
            Static(result_text(result.content), classes="tool-result"),
        ]
        super().__init__(*body, title=Content(self.title_plain), collapsed=True, classes=f"tool -{self.state}")

    @classmethod
    def from_history(cls, message: dict) -> ToolBlock:
        """A tool result of a resumed conversation (its call is in the assistant message before it)."""
        content = message["content"]
        if message["role"] == "user":  # the Qwen way: <tool_response>...</tool_response> in a user turn
            content = content.removeprefix("<tool_response>").removesuffix("</tool_response>").strip("\n")
        name = message.get("name") or "tool"
        result = SimpleNamespace(
            name=name, ok=True, status="result", content=content, duration_s=0.0, exit_code=None, truncated=False
        )
        return cls(None, result, title=f"⚙ {name} · result")
