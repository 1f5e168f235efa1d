"""The slash commands on the chat screen: /help, /clear, /system, /timing, /thinking, /save, /exit.

commands.py parses them for every face; here they act on the chat screen and answer with notes
in its transcript. `run` serves what is typed in the message box and the command palette's entries.
"""
from __future__ import annotations

from ..commands import CommandError, help_text, set_thinking

TIMING_MODES = ("off", "step", "layer")
KEYS = ("Keys: Enter send · Ctrl+J or Alt+Enter new line · Esc or Ctrl+C stop the reply · "
        "Ctrl+C twice or Ctrl+D (empty box) quit · F1 help · F2 layer panel · Ctrl+T reasoning · "
        "Ctrl+P commands")


def run(screen, name: str, arg: str) -> None:
    """Command `name` with its argument text on `screen` (a ChatScreen); commands.parse checked the name."""
    command = COMMANDS.get(name)
    if command is not None:
        command(screen, arg)


def _help(screen, arg: str) -> None:
    screen.note(help_text(KEYS), title="help")


def _clear(screen, arg: str) -> None:
    if screen.reply is not None:
        screen.notify("A reply is running; Esc stops it first.", severity="warning")
        return
    screen.session.clear()
    screen.transcript.remove_children()
    screen.note("New conversation.")


def _system(screen, arg: str) -> None:
    session = screen.session
    if not arg:
        screen.note(f"System prompt: {session.system}" if session.system else "No system prompt is set.")
        return
    try:
        session.set_system(arg)
    except Exception as e:
        screen.note(f"Could not set the system prompt: {e}", "error")
        return
    screen.note(f"System prompt set: {arg}")


def _timing(screen, arg: str) -> None:
    if not arg:
        screen.action_toggle_layers()
    elif arg in TIMING_MODES:
        screen.session.options.timing = arg
        screen.panel.set_mode(arg)
        screen.show_panel(arg != "off")
        screen.note(f"Timing {arg} from the next reply."
                    + (" Layer timing adds a sync per layer." if arg == "layer" else ""))
    else:
        screen.note("usage: /timing [off|step|layer]", "error")


def _thinking(screen, arg: str) -> None:
    try:
        screen.note(set_thinking(screen.session, arg))
    except CommandError as e:
        screen.note(str(e), "error")


def _save(screen, arg: str) -> None:
    if not arg:
        screen.note("usage: /save PATH", "error")
        return
    try:
        path = screen.session.save(arg)
    except OSError as e:
        screen.note(f"Could not save: {e}", "error")
        return
    screen.note(f"Saved the conversation to {path}")


def _exit(screen, arg: str) -> None:
    screen.app.quit_app()


COMMANDS = {"help": _help, "clear": _clear, "system": _system, "timing": _timing, "thinking": _thinking,
            "save": _save, "exit": _exit}
