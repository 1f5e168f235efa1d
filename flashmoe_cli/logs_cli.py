"""`flashmoe logs`: list the saved conversations, show one, or print where they are kept.

Saved text is the model's (and the user's) text: on a terminal it is shown escaped
(term_safe.py), piped it is printed as it was saved.
"""

from __future__ import annotations

import json
import sys
import time

from .exit_codes import ExitCode
from .term_safe import is_tty, safe


def cmd_logs(args) -> int:
    from .errors import UsageError
    from .paths import logs_db
    from .store import open_store

    if args.action == "path":
        print(logs_db())
        return ExitCode.OK
    shown = safe if is_tty(sys.stdout) else str
    store = open_store()
    if args.action == "list":
        convs = store.list(args.count)
        if args.json:
            print(json.dumps([c.__dict__ for c in convs], indent=2))
            return ExitCode.OK
        if not convs:
            print("no saved conversations", file=sys.stderr)
        for c in convs:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.created))
            print(shown(f"{c.id}  {when}  {c.messages:>3} msgs  {c.title or ''}"))
        return ExitCode.OK
    cid = args.cid or store.latest()
    conv = store.get(cid) if cid else None
    if conv is None:
        raise UsageError(f"no conversation {cid!r}" if cid else "no saved conversations")
    msgs = store.messages(cid)
    if args.json:
        print(json.dumps({"conversation": conv.__dict__, "messages": [m.__dict__ for m in msgs]}, indent=2))
        return ExitCode.OK
    print(shown(f"# {conv.id}  model: {conv.model or '?'}"))
    if conv.system:
        print(shown(f"\n[system]\n{conv.system}"))
    for m in msgs:
        # incomplete: the process died while writing it (what it had shown is saved)
        mark = " (incomplete)" if not m.complete else " (interrupted)" if m.interrupted else ""
        print(shown(f"\n[{label(m)}{mark}]\n{m.content}"))
    return ExitCode.OK


def label(m) -> str:
    """Who wrote a message. A tool's result goes back to the model as a "tool" turn, or, for chat
    templates without one, as a user turn wrapped in <tool_response>: neither is the user's."""
    if m.role == "tool" or (m.role == "user" and m.content.startswith("<tool_response>")):
        name = ((m.stats or {}).get("message") or {}).get("name")
        return f"tool result: {name}" if name else "tool result"
    return m.role
