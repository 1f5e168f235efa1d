"""`flashmoe run`: one reply, no UI. The answer goes to stdout and nothing else does."""
from __future__ import annotations

import json
import queue
import sys
import time

from .chat import SAVE_EVERY_S
from .exit_codes import ExitCode
from .summaries import layer_table, summary
from .term_safe import is_tty, json_line, safe
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
            raise UsageError("no prompt: stdin is not a terminal and is empty (pipe the message in, or run "
                             "`flashmoe chat` in a terminal)")
        raise UsageError("no prompt: give PROMPT or pipe text into stdin")
    return "\n\n".join(parts)


def run(args) -> int:
    from .startup import EngineOptions, make_engine, open_conversation

    text = read_prompt(args.prompt, command=getattr(args, "command", "run"))
    session = open_conversation(args, None, model_name=str(args.model or "demo"))  # checks the flags first
    timeout = getattr(args, "timeout", None)
    deadline = None if timeout is None else time.monotonic() + timeout
    engine = session.engine = make_engine(EngineOptions.from_args(args))
    try:
        loaded = engine.wait_loaded(timeout)
        if loaded is None:
            from .errors import error

            error(f"timed out after {timeout:g} s while loading the model")
            return ExitCode.TIMEOUT
        if getattr(args, "tools", None):
            from .agent_cli import run_with_tools

            return run_with_tools(args, session, loaded, text, deadline)
        handle = session.send_raw(text) if args.raw else session.send(text)
        return _stream(args, loaded, session, handle, deadline)
    finally:
        engine.close()


def _stream(args, loaded, session, handle, deadline: float | None = None) -> int:
    """Write the reply as it comes; record it; the summary goes to stderr."""
    from flashmoe.engine import EngineFailed, GenerationFinished, LayerTimings, PrefillProgress, TokenGenerated

    from .errors import error
    from .reasoning import ReplySplitter, reasoning_cut_note, show_segments

    out = sys.stdout
    shown = safe if is_tty(out) else str  # a terminal never gets the model's control sequences
    lost: list[OSError] = []

    def write(text: str) -> None:
        """stdout, until its reader or terminal goes away: then the reply stops and is saved first."""
        if lost:
            return
        try:
            out.write(text)
            out.flush()
        except OSError as e:  # a closed pipe, or EIO from a terminal that hung up
            lost.append(e)
            handle.cancel()

    def emit_json(d: dict) -> None:
        line = json.dumps(d, ensure_ascii=False)
        write((json_line(line) if is_tty(out) else line) + "\n")

    if args.json:
        emit_json(loaded.to_dict() | {"chat_template": None})
    rows_sum: dict[int, list] = {}
    steps = 0
    interrupted = timed_out = False
    split = ReplySplitter()  # the answer on stdout; reasoning only with --show-reasoning / --json
    shown_reasoning = getattr(args, "show_reasoning", False)
    in_think: list[bool] = [False]
    while True:
        # Ctrl-C (and SIGTERM / SIGHUP, raised as KeyboardInterrupt by signals.py) may arrive while
        # an event is being handled, not only while waiting: either way the reply stops, what was
        # shown is kept and the summary still prints.
        try:
            try:
                wait = SAVE_EVERY_S
                if deadline is not None and not timed_out:
                    wait = min(wait, max(0.0, deadline - time.monotonic()))
                ev = handle.get(timeout=wait)
            except queue.Empty:
                session.save_draft()  # what was shown is saved even while the model stalls
                if deadline is not None and not timed_out and time.monotonic() >= deadline:
                    handle.cancel()  # past the deadline: stop, keep what we have, exit 4
                    timed_out = True
                continue
            if isinstance(ev, TokenGenerated):
                session.stream(ev.text)
                segments = split.feed(ev.text)
                if args.json:  # reasoning text as its own events; the token event carries the answer's
                    for seg in segments:
                        if seg.kind == "reasoning":
                            emit_json({"event": "reasoning", "id": ev.id, "text": seg.text, "step": ev.step})
                    answer = "".join(s.text for s in segments if s.kind == "text")
                    if answer or not segments:
                        emit_json(ev.to_dict() | {"text": answer})
                else:
                    write(shown(show_segments(segments, shown_reasoning, in_think)))
            elif isinstance(ev, PrefillProgress):
                split.prefill(ev.reasoning)
                if args.json:
                    emit_json(ev.to_dict())
            elif isinstance(ev, LayerTimings):
                steps += 1
                for r in ev.rows:
                    acc = rows_sum.setdefault(r.layer, [0.0] * 8)
                    for j, v in enumerate((r.attn_ms, r.route_ms, r.expert_io_ms, r.expert_compute_ms, r.other_ms,
                                           r.hits, r.misses, r.bytes_read)):
                        acc[j] += v
                if args.json and args.timing == "layer":  # a row per layer per token: only when asked
                    emit_json(ev.to_dict())
            elif isinstance(ev, EngineFailed):
                session.abandon_reply()  # a partial reply is kept, marked; none: the turn is undone
                error(ev.message.splitlines()[0])
                return ev.exit_code
            elif isinstance(ev, GenerationFinished):
                break
            elif args.json:
                emit_json(ev.to_dict())
        except KeyboardInterrupt:
            handle.cancel()
            interrupted = True
    done = ev
    session.finish(done.text, done, interrupted=done.reason == "cancelled")
    segments = split.finish(done.tail)
    if args.json:
        for seg in segments:
            if seg.kind == "reasoning":
                emit_json({"event": "reasoning", "id": None, "text": seg.text, "step": None})
        emit_json(done.to_dict())
    else:
        write(shown(show_segments(segments, shown_reasoning, in_think, end=True)) + "\n")
    if split.ended_in_reasoning and done.reason != "cancelled":
        print(f"flashmoe: note: {reasoning_cut_note(done.reason)}", file=sys.stderr)
    if lost:
        raise lost[0]  # saved; cli.main turns it into the exit code (a closed pipe: 0, a hangup: 129)
    if args.timing != "off":
        print(summary(done, loaded), file=sys.stderr)
        if args.timing == "layer" and steps:
            print(layer_table(rows_sum, steps), file=sys.stderr)
    if timed_out:
        error(f"timed out after {args.timeout:g} s; the reply above is partial")
        return ExitCode.TIMEOUT
    return ExitCode.INTERRUPTED if interrupted else ExitCode.OK
