"""Tool use from the command line: the shared --tools options, `run --tools` (headless, fails
closed) and `flashmoe agent` (scripted sessions with a JSON-lines transcript)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .approvers import approver_for
from .argtypes import at_least


def add_tool_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tools",
        action="append",
        default=[],
        metavar="SPEC",
        help="tools the model may call: 'builtin' (read_file, list_dir, search_files, write_file, "
        "edit_file, run_shell), one of those names, or a .py / .json / .yaml tools file "
        "(repeatable, comma-separated)",
    )
    p.add_argument("--workspace", metavar="DIR", default=".", help="the folder tools may touch (default: .)")
    p.add_argument(
        "--allow-home-workspace",
        action="store_true",
        help="let the workspace be your home folder or a folder above it (refused otherwise: tools "
        "would reach every project and file there)",
    )
    p.add_argument(
        "--mode",
        choices=("read-only", "ask", "workspace-write", "yolo"),
        default="ask",
        help="permission mode (default ask); yolo needs --dangerously-skip-approvals",
    )
    p.add_argument("--allow", action="append", default=[], metavar="RULE", help="e.g. 'run_shell(git status*)'")
    p.add_argument("--ask", action="append", default=[], metavar="RULE")
    p.add_argument("--deny", action="append", default=[], metavar="RULE", help="deny beats ask beats allow")
    p.add_argument("--dangerously-skip-approvals", action="store_true", help="allow --mode yolo")
    p.add_argument(
        "--pass-env",
        action="append",
        default=[],
        metavar="NAME",
        help="let commands see this environment variable although its name looks like a secret "
        "(repeatable; secrets are scrubbed from every command's environment otherwise)",
    )
    p.add_argument(
        "--constrain",
        choices=("off", "tools", "required"),
        default="tools",
        help="constrained decoding of tool calls: from the call marker on (tools, the default: free "
        "text costs nothing, a call once started is always valid), the whole first reply of each "
        "turn must be a call (required), or off",
    )
    p.add_argument(
        "--max-repairs", type=at_least(0), default=2, metavar="N", help="repair rounds for bad calls (default 2)"
    )
    p.add_argument(
        "--chain-limit",
        type=at_least(1),
        default=5,
        metavar="N",
        help="rounds of tool calls per user message (default 5)",
    )


@dataclass
class ToolOptions:
    """What the turn driver needs of the command line (add_tool_options' flags, and run's --raw)."""

    tools: tuple[str, ...] = ()  # --tools SPECs; none: no tools, a turn is one plain reply
    workspace: str = "."
    allow_home_workspace: bool = False
    mode: str = "ask"
    allow: tuple[str, ...] = ()
    ask: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    dangerously_skip_approvals: bool = False
    pass_env: tuple[str, ...] = ()
    constrain: str = "tools"
    max_repairs: int = 2
    chain_limit: int = 5
    raw: bool = False  # `run --raw`: the prompt without the chat template (no tools)

    @classmethod
    def from_args(cls, args) -> "ToolOptions":
        """From the parsed flags of a command (one without tool flags gets the defaults)."""
        if args is None:
            return cls()
        get = lambda name, default: getattr(args, name, default)  # noqa: E731
        return cls(
            tools=tuple(get("tools", None) or ()),
            workspace=get("workspace", "."),
            allow_home_workspace=get("allow_home_workspace", False),
            mode=get("mode", "ask"),
            allow=tuple(get("allow", ())),
            ask=tuple(get("ask", ())),
            deny=tuple(get("deny", ())),
            dangerously_skip_approvals=get("dangerously_skip_approvals", False),
            pass_env=tuple(get("pass_env", ())),
            constrain=get("constrain", "tools"),
            max_repairs=get("max_repairs", 2),
            chain_limit=get("chain_limit", 5),
            raw=get("raw", False),
        )


def make_policy(opts: ToolOptions):
    """The permission policy for these options, or a UsageError naming the bad option. The
    workspace must be a folder, and not $HOME or a folder above it unless --allow-home-workspace
    (started from ~, the default workspace "." is $HOME: every project, start-up file and
    credential would be in reach). FLASHMOE_HOME (conversations, history, caches) is on the deny
    list wherever it is."""
    from flashmoe.tools.errors import ToolError
    from flashmoe.tools.policy import DEFAULT_DENY_PATHS, Policy, literal_glob

    from .errors import UsageError
    from .paths import home as state_home

    workspace = Path(opts.workspace).expanduser()
    if not workspace.is_dir():
        raise UsageError(f"--workspace {opts.workspace}: not a folder")
    ws, user_home = workspace.resolve(), Path.home().resolve()
    if (ws == user_home or user_home.is_relative_to(ws)) and not opts.allow_home_workspace:
        where = "your home folder" if ws == user_home else f"above your home folder {user_home}"
        default = " (the default workspace is the current folder)" if opts.workspace == "." else ""
        raise UsageError(
            f"--workspace {opts.workspace}{default}: {ws} is {where}; tools would reach every project, "
            "start-up file and credential in it. Run from a project folder or give --workspace DIR "
            "(--allow-home-workspace to use it anyway)"
        )
    state = state_home()
    own = {literal_glob(str(p)) + "/**" for p in (state.absolute(), state.resolve())}
    try:
        return Policy(
            workspace,
            opts.mode,
            allow=list(opts.allow),
            ask=list(opts.ask),
            deny=list(opts.deny),
            dangerously_skip_approvals=opts.dangerously_skip_approvals,
            deny_paths=(*DEFAULT_DENY_PATHS, *sorted(own)),
        )
    except (ToolError, ValueError) as e:
        raise UsageError(str(e)) from None


def make_agent(opts: ToolOptions, session, template: str, approver, on_event):
    """An AgentLoop for these options, or a UsageError naming the bad option."""
    from flashmoe.tools.errors import ToolError
    from flashmoe.tools.executor import ToolExecutor
    from flashmoe.tools.parsers import json_tools, parser_for_template
    from flashmoe.tools.runner import CommandRunner, seal_environment

    from .agent import AgentLoop, load_tools
    from .errors import UsageError

    policy = make_policy(opts)
    workspace = Path(opts.workspace).expanduser()
    # Tool commands are children of this process: keep what they may read of it free of secrets
    # (its /proc environ too), except the variables the user passes on.
    passed = {n: os.environ[n] for n in opts.pass_env if n in os.environ}
    seal_environment()
    os.environ.update(passed)
    try:
        registry = load_tools(list(opts.tools), policy, CommandRunner(cwd=workspace, pass_env=tuple(opts.pass_env)))
    except (ToolError, ValueError) as e:
        raise UsageError(str(e)) from None
    if opts.mode == "yolo":
        print("flashmoe: yolo mode: every tool call runs without asking", file=sys.stderr)
    executor = ToolExecutor(registry, policy, approver, max_repairs=opts.max_repairs, chain_limit=opts.chain_limit)
    parser = parser_for_template(template, fallback=json_tools)
    try:
        return AgentLoop(session, executor, parser, template=template, constrain=opts.constrain, on_event=on_event)
    except ValueError as e:
        raise UsageError(str(e)) from None


def make_loop(opts: ToolOptions, session, template: str, approver, on_event):
    """The turn driver for these options: the tool loop with --tools, else the plain reply
    (`run --raw`: the prompt without the chat template)."""
    if opts.tools:
        return make_agent(opts, session, template, approver, on_event)
    from .agent import AgentLoop

    return AgentLoop(session, on_event=on_event, raw=opts.raw)


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
            raise UsageError(
                f"--script {path} line {n}: cannot be read ({'nested too deeply' if isinstance(e, RecursionError) else e})"
            ) from None
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
    """`flashmoe agent`: user turns from a script, the answers on stdout, every event to the transcript."""
    from flashmoe.tools.policy import NonInteractiveApprover

    from .call_report import CallReport
    from .errors import UsageError
    from .json_events import JsonEvents
    from .line_view import Stdout
    from .startup import ConversationOptions, EngineOptions, make_engine, open_conversation

    if not args.tools:
        raise UsageError("agent needs --tools (e.g. --tools builtin)")
    turns = read_script(args.script)
    if turns[0]["role"] == "system":
        args.system = turns.pop(0)["content"]
    session = open_conversation(ConversationOptions.from_args(args), None, model_name=str(args.model or "demo"))
    engine = session.engine = make_engine(EngineOptions.from_args(args))
    transcript = Transcript(args.transcript)
    try:
        loaded = engine.wait_loaded()
        transcript.write(loaded.to_dict() | {"chat_template": None})
        report = CallReport(JsonEvents(transcript.write, layers=args.timing == "layer"))
        out = Stdout(loaded, None, lambda: args.timing, summaries=False)

        def on_event(ev):
            report(ev)
            out(ev)

        loop = make_agent(
            ToolOptions.from_args(args), session, loaded.chat_template, NonInteractiveApprover(), on_event
        )
        loop.executor.approver = approver_for(args.approve, loop.executor.registry)
        out.stats = loop.stats
        for n, turn in enumerate(turns):
            transcript.write({"event": "user", "content": turn["content"], "turn": n})
            out.prefix = f"turn {n + 1}: "
            end = loop.run_turn(turn["content"])
            if end.status != "done":
                break
        return report.exit_code(end)
    finally:
        transcript.close()
        engine.close()
