"""Slash commands, shared by the TUI and the line REPL: their names and help (COMMANDS), the
parser, and one implementation of each (`run(face, name, arg)`), acting on the face through the
small Face interface below, so that a face says only how it shows things.
"""

from __future__ import annotations

from typing import Protocol

from flashmoe.engine.options import TIMING_MODES

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


class Face(Protocol):
    """What a command needs of the face it runs in (the line REPL; the TUI's chat screen can be one)."""

    session: object  # the ChatSession
    keys: str  # the face's keys, for /help
    described: dict[str, str]  # what a command does in this face, where COMMANDS says otherwise

    def say(self, text: str, kind: str = "info") -> None:
        """A line for the user. kind: info; help (the /help text); usage (a mistyped command); error
        (the command failed)."""

    def busy(self) -> bool:
        """A reply is running (/clear waits for it)."""

    def cleared(self) -> None:
        """After /clear: forget what the face shows of the old conversation."""

    def show_timing(self) -> None:
        """/timing alone: the REPL says the mode and the last reply's per-layer table; the TUI toggles its panel."""

    def timing_set(self, mode: str) -> None:
        """After /timing MODE set the session's mode: a face with a layer panel follows it."""

    def quit(self) -> None:
        """/exit."""


def run(face: Face, name: str, arg: str) -> None:
    """Command `name` (as `parse` gave it) with its argument text, on `face`."""
    HANDLERS[name](face, arg)


def _help(face: Face, arg: str) -> None:
    face.say(help_text(face.keys, face.described), "help")


def _clear(face: Face, arg: str) -> None:
    if face.busy():
        face.say("a reply is running; stop it first", "usage")
        return
    face.session.clear()
    face.cleared()
    face.say("started a new conversation")


def _system(face: Face, arg: str) -> None:
    s = face.session
    if arg:
        s.set_system(arg)
        face.say("system prompt set")
    else:
        face.say(f"system prompt: {s.system}" if s.system else "no system prompt (set one: /system TEXT)")


def _timing(face: Face, arg: str) -> None:
    if not arg:
        face.show_timing()
        return
    mode = arg.lower()
    if mode not in TIMING_MODES:
        face.say(f"/timing: expected off, step or layer, not {arg!r}", "usage")
        return
    face.session.options.timing = mode
    face.timing_set(mode)
    face.say(f"timing: {mode}" + (" (per-layer breakdown; adds syncs)" if mode == "layer" else ""))


def _thinking(face: Face, arg: str) -> None:
    try:
        face.say(set_thinking(face.session, arg))
    except CommandError as e:
        face.say(str(e), "usage")


def _save(face: Face, arg: str) -> None:
    if not arg:
        face.say("usage: /save PATH", "usage")
        return
    try:
        path = face.session.save(arg)
    except OSError as e:
        face.say(f"{arg}: {e.strerror or e}", "error")
    else:
        face.say(f"saved the conversation to {path}")


def _exit(face: Face, arg: str) -> None:
    face.quit()


HANDLERS = {
    "help": _help,
    "clear": _clear,
    "system": _system,
    "timing": _timing,
    "thinking": _thinking,
    "save": _save,
    "exit": _exit,
}
