"""Tool use from the command line: the shared --tools options, `run --tools` (headless, fails
closed) and `flashmoe agent` (scripted sessions with a JSON-lines transcript)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .argtypes import at_least
from .exit_codes import ExitCode
from .term_safe import for_stream, safe


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
    p.add_argument("--constrain", choices=("off", "tools", "required"), default="off",
                   help="constrained decoding of tool calls: from the call marker on (tools), or the whole "
                        "first reply of each turn must be a call (required)")
    p.add_argument("--max-repairs", type=at_least(0), default=2, metavar="N", help="repair rounds for bad calls (default 2)")
    p.add_argument("--chain-limit", type=at_least(1), default=5, metavar="N",
                   help="rounds of tool calls per user message (default 5)")


def make_agent(args, session, template: str, approver, on_event):
    """An AgentLoop for these options, or a UsageError naming the bad option."""
    from tools.errors import ToolError
    from tools.executor import ToolExecutor
    from tools.parsers import json_tools, parser_for_template
    from tools.policy import Policy
    from tools.runner import CommandRunner, seal_environment

    from .agent import AgentLoop, load_tools
    from .cli import UsageError

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


class AutoApprover:
    """--approve auto: yes to reads and writes the policy asks about; never to commands, which
    need an explicit yes (an --allow rule, or an interactive answer)."""

    interactive = True

    def __init__(self, registry):
        self.registry = registry

    def ask(self, call, reason):
        tool = self.registry.get(call.name or "")
        return "no" if tool is None or tool.risk == "exec" else "yes"


class DecliningApprover:
    """--approve never: every ask is declined and the model is told so; the session goes on."""

    interactive = True

    def ask(self, call, reason):
        return "no"


class TerminalApprover:
    """--approve ask: a y / N / always question on the controlling terminal."""

    interactive = True

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    @classmethod
    def open(cls, path: str = "/dev/tty") -> TerminalApprover | None:
        """On the controlling terminal, or None (said once on stderr): calls that need a yes are refused.

        The terminal is opened twice, to read and to write: "r+" wants a seekable file, which a
        terminal is not (io.UnsupportedOperation)."""
        try:
            reader = open(path, encoding="utf-8", errors="replace")
            writer = open(path, "w", encoding="utf-8", errors="replace")
        except OSError as e:
            print(f"flashmoe: warning: --approve ask: no terminal to ask on ({path}: {e.strerror or e}); "
                  "tool calls that need approval are refused", file=sys.stderr)
            return None
        return cls(reader, writer)

    def ask(self, call, reason):
        args = json.dumps(call.arguments, ensure_ascii=False)
        # the name and arguments are the model's text: escaped for the terminal
        self.writer.write(safe(f"\nflashmoe: {call.name}({args})\n  {reason}.") + " Run it? [y/N/a(lways)] ")
        self.writer.flush()
        answer = self.reader.readline().strip().lower()  # "" when the terminal is gone: no
        return {"y": "yes", "yes": "yes", "a": "always", "always": "always"}.get(answer, "no")


def run_with_tools(args, session, loaded, text: str) -> int:
    """Headless `run --tools`: the answer on stdout, tool activity on stderr; fails closed."""
    from tools.policy import NonInteractiveApprover

    from .agent import TextChunk, ToolCallEvent, ToolResultEvent

    from .reasoning import show_segments

    in_think = [False]  # --show-reasoning: reasoning between '<think>' and '</think>' lines

    def show(ev):
        if isinstance(ev, TextChunk):
            text = show_segments([ev], getattr(args, "show_reasoning", False), in_think)
            sys.stdout.write(for_stream(text, sys.stdout))
            sys.stdout.flush()
        elif isinstance(ev, ToolCallEvent):  # names and arguments are the model's text
            state = "" if ev.valid else f" [invalid: {ev.error}]"
            print(safe(f"flashmoe: tool call {ev.name}({json.dumps(ev.arguments, ensure_ascii=False)}){state}"),
                  file=sys.stderr)
        elif isinstance(ev, ToolResultEvent):
            print(safe(f"flashmoe: {ev.name} -> {ev.status}"), file=sys.stderr)

    loop = make_agent(args, session, loaded.chat_template, NonInteractiveApprover(), show)
    try:
        end = loop.run_turn(text)
    except KeyboardInterrupt:
        loop.cancel()
        return ExitCode.INTERRUPTED
    sys.stdout.write("\n")
    if end.status in ("done",):
        if end.message:  # the reply ended inside its reasoning
            print(f"flashmoe: note: {end.message}", file=sys.stderr)
        return ExitCode.OK
    if end.status == "cancelled":
        return ExitCode.INTERRUPTED
    print(safe(f"flashmoe: error: {end.message or end.status}"), file=sys.stderr)
    return ExitCode.APPROVAL if end.status == "approval-needed" else ExitCode.FAILURE


def read_script(path: str) -> list[dict]:
    """session.jsonl: one {"role": "user"|"system", "content": ...} per line ('-' reads stdin)."""
    from .cli import UsageError

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
    import dataclasses

    from tools.policy import NonInteractiveApprover

    from .agent import RepairEvent, TextChunk, ToolCallEvent, ToolResultEvent, TurnFinished
    from .cli import UsageError, make_engine, open_conversation

    if not args.tools:
        raise UsageError("agent needs --tools (e.g. --tools builtin)")
    turns = read_script(args.script)
    if turns[0]["role"] == "system":
        args.system = turns.pop(0)["content"]
    session = open_conversation(args, None, model_name=str(args.model or "demo"))
    engine = session.engine = make_engine(args)
    transcript = Transcript(args.transcript)
    try:
        loaded = engine.wait_loaded()
        transcript.write(loaded.to_dict() | {"chat_template": None})

        def record(ev):
            if isinstance(ev, TextChunk):
                if ev.kind == "text":
                    sys.stdout.write(for_stream(ev.text, sys.stdout))
                    sys.stdout.flush()
                return
            if hasattr(ev, "to_dict"):
                transcript.write(ev.to_dict())
            else:
                kind = {ToolCallEvent: "tool_call", ToolResultEvent: "tool_result", RepairEvent: "repair",
                        TurnFinished: "turn_end"}[type(ev)]
                transcript.write({"event": kind, **dataclasses.asdict(ev)})
                if isinstance(ev, ToolCallEvent):
                    print(safe(f"flashmoe: tool call {ev.name} {'ok' if ev.valid else 'invalid: ' + str(ev.error)}"),
                          file=sys.stderr)

        approver = {"never": DecliningApprover(), "ask": None}.get(args.approve)
        loop = make_agent(args, session, loaded.chat_template, approver or NonInteractiveApprover(), record)
        if args.approve == "auto":
            loop.executor.approver = AutoApprover(loop.executor.registry)
        elif args.approve == "ask":
            loop.executor.approver = TerminalApprover.open() or loop.executor.approver  # none: fail closed
        for n, turn in enumerate(turns):
            transcript.write({"event": "user", "content": turn["content"], "turn": n})
            end = loop.run_turn(turn["content"])
            sys.stdout.write("\n")
            if end.status == "done" and end.message:  # the reply ended inside its reasoning
                print(safe(f"flashmoe: note: turn {n + 1}: {end.message}"), file=sys.stderr)
            if end.status not in ("done",):
                print(safe(f"flashmoe: error: turn {n + 1}: {end.message or end.status}"), file=sys.stderr)
                return {"approval-needed": ExitCode.APPROVAL, "cancelled": ExitCode.INTERRUPTED}.get(
                    end.status, ExitCode.FAILURE)
        return ExitCode.OK
    finally:
        transcript.close()
        engine.close()
