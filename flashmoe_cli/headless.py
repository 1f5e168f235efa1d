"""`flashmoe run`: one turn, no UI, through the same AgentLoop as every face (with --tools or
without). The answer goes to stdout and nothing else does."""

from __future__ import annotations

import sys
import time

from .errors import error
from .exit_codes import ExitCode
from .utf8 import decode_bytes, decode_text


def read_prompt(arg: str | None, stdin=None, command: str = "run") -> str:
    """Piped stdin, a blank line, then the argument (either alone is fine)."""
    from .errors import UsageError

    stdin = stdin or sys.stdin
    piped = None
    if stdin is not None and not stdin.isatty():
        buffer = getattr(stdin, "buffer", None)  # bytes, so that non-UTF-8 input is not a traceback
        piped = decode_bytes(buffer.read(), "stdin") if buffer is not None else stdin.read()
    if arg:  # argv is decoded with surrogate escapes: the bytes that were not UTF-8 come back here
        arg = decode_text(arg, "the prompt argument")
    # `echo hi |` ends with a newline the user did not mean as part of the prompt.
    parts = [p for p in (piped.rstrip("\n") if piped else None, arg) if p]
    if not parts:
        if command == "chat":  # chat has no PROMPT argument
            raise UsageError(
                "no prompt: stdin is not a terminal and is empty (pipe the message in, or run "
                "`flashmoe chat` in a terminal)"
            )
        raise UsageError("no prompt: give PROMPT or pipe text into stdin")
    return "\n\n".join(parts)


def run(args) -> int:
    from .startup import ConversationOptions, EngineOptions, make_engine, open_conversation

    text = read_prompt(args.prompt, command=getattr(args, "command", "run"))
    session = open_conversation(
        ConversationOptions.from_args(args), None, model_name=str(args.model or "demo")
    )  # checks the flags first
    timeout = getattr(args, "timeout", None)
    deadline = None if timeout is None else time.monotonic() + timeout
    engine = session.engine = make_engine(EngineOptions.from_args(args))
    try:
        loaded = engine.wait_loaded(timeout)
        if loaded is None:
            error(f"timed out after {timeout:g} s while loading the model")
            return ExitCode.TIMEOUT
        return answer(args, session, loaded, text, deadline)
    finally:
        engine.close()


def answer(args, session, loaded, text: str, deadline: float | None = None) -> int:
    """`run`, with --tools or without: the answer on stdout (or, with --json, every event as a
    JSON line), tool activity and the summary line per reply on stderr; tools fail closed (no
    one can approve); --timeout stops it with exit 4."""
    from flashmoe.tools.policy import NonInteractiveApprover

    from .agent_cli import ToolOptions, make_loop
    from .call_report import CallReport
    from .json_events import JsonEvents
    from .line_view import Stdout

    tools = bool(getattr(args, "tools", None))
    out = Stdout(
        loaded, None, lambda: args.timing, show_reasoning=getattr(args, "show_reasoning", False), json=args.json
    )
    report = CallReport(JsonEvents(out.json_line, layers=args.timing == "layer", turn_end=tools) if args.json else None)

    def on_event(ev):
        report(ev)
        out(ev)

    if args.json:
        out.json_line(loaded.to_dict() | {"chat_template": None})
    loop = make_loop(ToolOptions.from_args(args), session, loaded.chat_template, NonInteractiveApprover(), on_event)
    out.stats, out.on_lost = loop.stats, loop.cancel
    try:
        end = loop.run_turn(text, deadline)
    except KeyboardInterrupt:  # outside a reply (a tool running): the reply before it is saved
        loop.cancel()
        return ExitCode.INTERRUPTED
    if out.lost:
        raise out.lost[0]  # saved; cli.main turns it into the exit code (a closed pipe: 0, a hangup: 129)
    if end.status == "timeout":
        error(f"timed out after {args.timeout:g} s; the reply above is partial")
    return report.exit_code(end)
