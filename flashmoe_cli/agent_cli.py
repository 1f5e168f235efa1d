"""Tool use from the command line: the shared --tools options, `run --tools` (headless, fails
closed) and `flashmoe agent` (scripted sessions with a JSON-lines transcript)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .approvers import DecliningApprover, approver_for
from .argtypes import at_least
from .exit_codes import ExitCode
from .term_safe import for_stream, safe

# DecliningApprover: the TUI checks the tool options with it, imported from here
__all__ = ["DecliningApprover", "add_tool_options", "make_agent", "cmd_agent"]


def add_tool_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", action="append", default=[], metavar="SPEC",
                   help="tools the model may call: 'builtin' (read_file, list_dir, search_files, write_file, "
                        "edit_file, run_shell), one of those names, or a .py / .json / .yaml tools file "
                        "(repeatable, comma-separated)")
    p.add_argument("--workspace", metavar="DIR", default=".", help="the folder tools may touch (default: .)")
    p.add_argument("--mode", choices=("read-only", "ask", "workspace-write", "yolo"), default="ask",
                   help="permission mode (default ask); yolo needs --dangerously-skip-approvals")
    p.add_argument("--allow", action="append", default=[], metavar="RULE", help="e.g. 'run_shell(git status*)'")
    p.add_argument("--ask", action="append", default=[], metavar="RULE")
    p.add_argument("--deny", action="append", default=[], metavar="RULE", help="deny beats ask beats allow")
    p.add_argument("--dangerously-skip-approvals", action="store_true", help="allow --mode yolo")
    p.add_argument("--pass-env", action="append", default=[], metavar="NAME",
                   help="let commands see this environment variable although its name looks like a secret "
                        "(repeatable; secrets are scrubbed from every command's environment otherwise)")
    p.add_argument("--constrain", choices=("off", "tools", "required"), default="tools",
                   help="constrained decoding of tool calls: from the call marker on (tools, the default: free "
                        "text costs nothing, a call once started is always valid), the whole first reply of each "
                        "turn must be a call (required), or off")
    p.add_argument("--max-repairs", type=at_least(0), default=2, metavar="N", help="repair rounds for bad calls (default 2)")
    p.add_argument("--chain-limit", type=at_least(1), default=5, metavar="N",
                   help="rounds of tool calls per user message (default 5)")


def make_agent(args, session, template: str, approver, on_event):
    """An AgentLoop for these options, or a UsageError naming the bad option."""
    from flashmoe.tools.errors import ToolError
    from flashmoe.tools.executor import ToolExecutor
    from flashmoe.tools.parsers import json_tools, parser_for_template
    from flashmoe.tools.policy import Policy
    from flashmoe.tools.runner import CommandRunner, seal_environment

    from .agent import AgentLoop, load_tools
    from .errors import UsageError

    workspace = Path(args.workspace).expanduser()
    if not workspace.is_dir():
        raise UsageError(f"--workspace {args.workspace}: not a folder")
    # Tool commands are children of this process: keep what they may read of it free of secrets
    # (its /proc environ too), except the variables the user passes on.
    passed = {n: os.environ[n] for n in args.pass_env if n in os.environ}
    seal_environment()
    os.environ.update(passed)
    try:
        policy = Policy(workspace, args.mode, allow=args.allow, ask=args.ask, deny=args.deny,
                        dangerously_skip_approvals=args.dangerously_skip_approvals)
        registry = load_tools(args.tools, policy, CommandRunner(cwd=workspace, pass_env=tuple(args.pass_env)))
    except (ToolError, ValueError) as e:
        raise UsageError(str(e)) from None
    if args.mode == "yolo":
        print("flashmoe: yolo mode: every tool call runs without asking", file=sys.stderr)
    executor = ToolExecutor(registry, policy, approver, max_repairs=args.max_repairs, chain_limit=args.chain_limit)
    parser = parser_for_template(template, fallback=json_tools)
    try:
        return AgentLoop(session, executor, parser, template=template, constrain=args.constrain, on_event=on_event)
    except ValueError as e:
        raise UsageError(str(e)) from None


# Results that mean nobody said yes to the call: the run exits 5 (ExitCode.APPROVAL) at the end.
REFUSED = ("declined", "approval-needed")


def event_dict(ev) -> dict | None:
    """An engine or agent event as the JSON line `--json` and `--transcript` write (None: not written)."""
    import dataclasses

    from .agent import RepairEvent, TextChunk, ToolCallEvent, ToolResultEvent, TurnFinished

    if isinstance(ev, TextChunk):  # the tokens are there already; reasoning is said apart
        return {"event": "reasoning", "text": ev.text} if ev.kind == "reasoning" else None
    if hasattr(ev, "to_dict"):
        return ev.to_dict()
    kind = {ToolCallEvent: "tool_call", ToolResultEvent: "tool_result", RepairEvent: "repair",
            TurnFinished: "turn_end"}[type(ev)]
    return {"event": kind, **dataclasses.asdict(ev)}


class CallReport:
    """Pairs each tool_call event with the result that follows it, so that every face says what
    became of a call: its status (ok, declined, denied, error, timeout, invalid, ...) goes into the
    call's JSON line and onto stderr. `write(d)` takes the JSON lines."""

    def __init__(self, write):
        self.write = write
        self.pending = None
        self.refused: list[str] = []

    def __call__(self, ev) -> None:
        from .agent import ToolCallEvent, ToolResultEvent

        if isinstance(ev, ToolCallEvent):
            self.flush()
            self.pending = ev
            return
        if isinstance(ev, ToolResultEvent) and self.pending is not None:
            call, self.pending = self.pending, None
            self.write(event_dict(call) | {"status": ev.status})
            self.say(call, ev.status)
        d = event_dict(ev)
        if d is not None:
            self.write(d)

    def flush(self) -> None:
        if self.pending is not None:  # a call with no result (the turn was cut short)
            call, self.pending = self.pending, None
            self.write(event_dict(call) | {"status": "not-run"})
            self.say(call, "not-run")

    def say(self, call, status: str) -> None:
        if status in REFUSED:
            self.refused.append(f"{call.name} {status}")
        why = f" ({call.error})" if status != "ok" and call.error else ""
        args = json.dumps(call.arguments, ensure_ascii=False) if call.arguments is not None else call.raw
        args = args if len(args) <= 200 else args[:199] + "…"
        # names, errors and arguments are the model's text: escaped for the terminal
        print(safe(f"flashmoe: tool call {call.name}: {status}{why} {args}"), file=sys.stderr)

    def exit_code(self, code: int) -> int:
        """ExitCode.APPROVAL when a call went without the yes it needed and nothing worse happened."""
        self.flush()
        if not self.refused:
            return code
        n = len(self.refused)
        print(safe(f"flashmoe: error: {n} tool call{'s' if n != 1 else ''} refused for want of approval: "
                   f"{', '.join(self.refused)}"), file=sys.stderr)
        return ExitCode.APPROVAL if code == ExitCode.OK else code


def run_with_tools(args, session, loaded, text: str, deadline: float | None = None) -> int:
    """Headless `run --tools`: the answer on stdout (or, with --json, every event of the agent as
    a JSON line), tool activity and the summary line per reply on stderr; fails closed; --timeout
    stops it with exit 4."""
    import threading
    import time

    from flashmoe.engine.events import GenerationFinished
    from flashmoe.tools.policy import NonInteractiveApprover

    from .agent import TextChunk
    from .summaries import summary
    from .term_safe import is_tty, json_line

    out = sys.stdout

    def emit_json(d: dict) -> None:
        line = json.dumps(d, ensure_ascii=False, default=str)
        out.write((json_line(line) if is_tty(out) else line) + "\n")
        out.flush()

    report = CallReport(emit_json if args.json else (lambda d: None))

    from .reasoning import show_segments

    in_think = [False]  # --show-reasoning: reasoning between a line '<think>' and a line '</think>'

    def show(ev):
        if isinstance(ev, TextChunk) and not args.json:
            out.write(for_stream(show_segments([ev], getattr(args, "show_reasoning", False), in_think), out))
            out.flush()
        report(ev)
        if isinstance(ev, GenerationFinished) and args.timing != "off":
            print(summary(ev, loaded), file=sys.stderr)

    if args.json:
        emit_json(loaded.to_dict() | {"chat_template": None})
    loop = make_agent(args, session, loaded.chat_template, NonInteractiveApprover(), show)
    timed_out = threading.Event()
    timer = None
    if deadline is not None:
        def expire():
            timed_out.set()
            loop.cancel()

        timer = threading.Timer(max(0.0, deadline - time.monotonic()), expire)
        timer.daemon = True
        timer.start()
    try:
        end = loop.run_turn(text)
    except KeyboardInterrupt:
        loop.cancel()
        return ExitCode.INTERRUPTED
    finally:
        if timer is not None:
            timer.cancel()
    if not args.json:
        out.write("\n")
    if timed_out.is_set():
        report.flush()
        print(f"flashmoe: error: timed out after {args.timeout:g} s; the reply above is partial", file=sys.stderr)
        return ExitCode.TIMEOUT
    if end.status == "done":
        if end.message:  # the reply ended inside its reasoning
            print(safe(f"flashmoe: note: {end.message}"), file=sys.stderr)
        return report.exit_code(ExitCode.OK)
    if end.status == "cancelled":
        return ExitCode.INTERRUPTED
    print(safe(f"flashmoe: error: {end.message or end.status}"), file=sys.stderr)
    code = ExitCode.APPROVAL if end.status == "approval-needed" else ExitCode.FAILURE
    return report.exit_code(code)


def read_script(path: str) -> list[dict]:
    """session.jsonl: one {"role": "user"|"system", "content": ...} per line ('-' reads stdin)."""
    from .errors import UsageError

    from .utf8 import decode_bytes, decode_text

    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"--script {path}: cannot read ({e.strerror or e})") from None
    where = "stdin" if path == "-" else f"--script {path}"
    lines = decode_bytes(data, where).splitlines()
    turns = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"--script {path} line {n}: not JSON ({e.msg})") from None
        except (RecursionError, ValueError) as e:  # nesting past the recursion limit, 5,000-digit numbers
            raise UsageError(f"--script {path} line {n}: cannot be read ({'nested too deeply' if isinstance(e, RecursionError) else e})") from None
        if not isinstance(d, dict) or d.get("role") not in ("user", "system") or not isinstance(d.get("content"), str):
            raise UsageError(f'--script {path} line {n}: expected {{"role": "user" or "system", "content": "..."}}')
        if d["role"] == "system" and turns:
            raise UsageError(f"--script {path} line {n}: a system line may only come first")
        d["content"] = decode_text(d["content"], f"{where} line {n}")  # JSON may spell "\udcff"
        turns.append(d)
    if not any(t["role"] == "user" for t in turns):
        raise UsageError(f"--script {path}: no user turns")
    return turns


class Transcript:
    """Every event as a JSON line, written as it happens to OUT.partial, renamed to OUT at the end."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.tmp = self.path.with_name(self.path.name + ".partial") if self.path else None
        self.file = open(self.tmp, "w") if self.tmp else None

    def write(self, d: dict) -> None:
        if self.file:
            self.file.write(json.dumps(d, ensure_ascii=False, default=str) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
            os.replace(self.tmp, self.path)


def cmd_agent(args) -> int:
    """`flashmoe agent`: user turns from a script, every event to the transcript."""
    from flashmoe.tools.policy import NonInteractiveApprover

    from .agent import TextChunk
    from .errors import UsageError
    from .startup import EngineOptions, make_engine, open_conversation

    if not args.tools:
        raise UsageError("agent needs --tools (e.g. --tools builtin)")
    turns = read_script(args.script)
    if turns[0]["role"] == "system":
        args.system = turns.pop(0)["content"]
    session = open_conversation(args, None, model_name=str(args.model or "demo"))
    engine = session.engine = make_engine(EngineOptions.from_args(args))
    transcript = Transcript(args.transcript)
    try:
        loaded = engine.wait_loaded()
        transcript.write(loaded.to_dict() | {"chat_template": None})

        report = CallReport(transcript.write)

        def record(ev):
            if isinstance(ev, TextChunk) and ev.kind == "text":
                sys.stdout.write(for_stream(ev.text, sys.stdout))
                sys.stdout.flush()
            report(ev)

        loop = make_agent(args, session, loaded.chat_template, NonInteractiveApprover(), record)
        loop.executor.approver = approver_for(args.approve, loop.executor.registry)
        for n, turn in enumerate(turns):
            transcript.write({"event": "user", "content": turn["content"], "turn": n})
            end = loop.run_turn(turn["content"])
            sys.stdout.write("\n")
            if end.status == "done" and end.message:  # the reply ended inside its reasoning
                print(safe(f"flashmoe: note: turn {n + 1}: {end.message}"), file=sys.stderr)
            if end.status not in ("done",):
                print(safe(f"flashmoe: error: turn {n + 1}: {end.message or end.status}"), file=sys.stderr)
                return report.exit_code({"approval-needed": ExitCode.APPROVAL, "cancelled": ExitCode.INTERRUPTED}.get(
                    end.status, ExitCode.FAILURE))
        return report.exit_code(ExitCode.OK)
    finally:
        transcript.close()
        engine.close()
