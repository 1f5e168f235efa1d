"""Slash commands, shared by the TUI and the line REPL."""
from __future__ import annotations

COMMANDS = {
    "help": "show this help",
    "clear": "start a new conversation",
    "system": "/system TEXT sets the system prompt (no TEXT: show it)",
    "timing": "/timing [off|step|layer] shows the per-layer panel or sets the timing mode",
    "thinking": "/thinking on|off turns the model's reasoning on or off (its chat template's switch)",
    "save": "/save PATH writes the conversation as Markdown",
    "exit": "quit (also /quit, Ctrl-D on an empty line)",
}
ALIASES = {"quit": "exit", "q": "exit", "?": "help"}


class CommandError(Exception):
    """A slash command the user mistyped: shown, never fatal."""


def set_thinking(session, arg: str) -> str:
    """/thinking [on|off]: set it on the session (from the next reply); the line to show.
    Raises CommandError for any other value."""
    from flashmoe.engine.runtime.reasoning import THINKING_CHOICES

    value = arg.strip().lower()
    if not value:
        now = session.options.thinking or "the chat template's default"
        return f"thinking: {now} (/thinking on|off sets it)"
    if value not in THINKING_CHOICES:
        raise CommandError(f"usage: /thinking on|off (not {arg.strip()!r})")
    session.options.thinking = value
    return session.thinking_note() or f"thinking {value} from the next reply"


def parse(line: str) -> tuple[str, str] | None:
    """'/system be brief' -> ('system', 'be brief'); None when the line is not a command."""
    text = line.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    name = ALIASES.get(name.lower(), name.lower())
    if name not in COMMANDS:
        raise CommandError(f"unknown command /{name}; try /help")
    return name, arg.strip()


def help_text(keys: str = "", overrides: dict[str, str] | None = None) -> str:
    """The commands and (keys) the keys; `overrides`: what a command does in this front end."""
    described = COMMANDS | (overrides or {})
    lines = ["Commands:"] + [f"  /{k:<7} {v}" for k, v in described.items()]
    if keys:
        lines += ["", keys]
    return "\n".join(lines)
