"""ToolExecutor: validate -> policy -> approval -> run, for each tool call of a user turn.

Whatever happens, the caller gets a ToolResult whose `content` can go straight back to the model;
refusals say why and what to do instead. Every call is recorded (CallRecord) for logging.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from flashmoe.tools.calls import ToolCall
from flashmoe.tools.errors import ToolError
from flashmoe.tools.policy import Approver, Decision, NonInteractiveApprover, Policy
from flashmoe.tools.registry import Tool, ToolRegistry
from flashmoe.tools.runner import DEFAULT_MAX_OUTPUT, ToolResult, cap_text, run_deadline
from flashmoe.tools.validate import RejectedCall, RepairLoop, check_call

DEFAULT_TOOL_TIME_LIMIT_S = 120.0


@dataclass(frozen=True)
class CallRecord:
    """One call as it went: for the session log (name, raw text, decision, outcome)."""

    turn: int
    round: int
    name: str | None
    raw: str
    arguments: dict[str, Any] | None
    decision: str | None  # allow / ask:yes / ask:always / ask:no / deny / None (did not get that far)
    status: str
    duration_s: float
    exit_code: int | None
    truncated: bool
    message: str


class ToolExecutor:
    """Runs the tool calls of one user turn at a time (call begin_turn() on each user message).

    `chain_limit` bounds the model replies with tool calls per turn (None: no bound); a UI can
    ask "continue?" when `chain_exhausted` and call extend_chain(). `max_repairs` bounds the
    rounds of rejected calls (see RepairLoop). Calls whose only fault is the backslash-quote
    failure run with the repaired arguments when `accept_repaired` (the result carries a note).
    Tools that do not enforce a time limit of their own (all but commands) run on a worker thread
    and the model hears "timed out" after `time_limit` seconds (the thread cannot be killed; it is
    left to finish in the background, and what it returns then is dropped). With a `deadline`
    (the run's --timeout) no call runs past it: commands are killed there, other tools abandoned.
    """

    def __init__(
        self,
        registry: ToolRegistry,
        policy: Policy,
        approver: Approver | None = None,
        *,
        max_repairs: int = 2,
        chain_limit: int | None = 5,
        max_output: int = DEFAULT_MAX_OUTPUT,
        accept_repaired: bool = True,
        on_record: Callable[[CallRecord], None] | None = None,
        time_limit: float = DEFAULT_TOOL_TIME_LIMIT_S,
    ) -> None:
        self.time_limit = time_limit
        self.registry = registry
        self.policy = policy
        self.approver: Approver = approver if approver is not None else NonInteractiveApprover()
        self.repair = RepairLoop(max_repairs)
        self.chain_limit = chain_limit
        self.max_output = max_output
        self.accept_repaired = accept_repaired
        self.on_record = on_record
        self.records: list[CallRecord] = []
        self.rounds = 0
        self.deadline: float | None = None  # time.monotonic() by which the run ends (`run --timeout`)
        self._grants: set[tuple[str, ...]] = set()
        self.begin_turn()

    # -- turn bookkeeping --------------------------------------------------------------------

    def begin_turn(self) -> None:
        """A new user message: the chain and repair counters start again."""
        self.rounds = 0
        self._limit = self.chain_limit
        self.repair.begin_turn()

    @property
    def turn(self) -> int:
        return self.repair.turn

    @property
    def chain_exhausted(self) -> bool:
        return self._limit is not None and self.rounds >= self._limit

    def extend_chain(self, n: int) -> None:
        """Allow n more rounds of tool calls this turn (after the user said "continue")."""
        if self._limit is not None:
            self._limit = max(self._limit, self.rounds) + n

    @property
    def rejected(self) -> list[RejectedCall]:
        """Every call that failed validation, verbatim."""
        return self.repair.rejected

    @property
    def approval_needed(self) -> bool:
        """A non-interactive approver had to refuse something (headless runs exit with code 5)."""
        return bool(getattr(self.approver, "needed", None))

    # -- execution ---------------------------------------------------------------------------

    def execute(self, call: ToolCall) -> ToolResult:
        """One call as its own round (see execute_round)."""
        return self.execute_round([call])[0]

    def execute_round(self, calls: Iterable[ToolCall]) -> list[ToolResult]:
        """The calls of one model reply, in order; the reply counts once against the chain limit."""
        calls = list(calls)
        if not calls:
            return []
        self.rounds += 1
        over = self._limit is not None and self.rounds > self._limit
        results = []
        for call in calls:
            if over:
                msg = (
                    f"refused: the chain limit is reached ({self._limit} rounds of tool calls for this "
                    "message); answer the user with what you have"
                )
                res = ToolResult(
                    False, msg, error="chain limit reached", status="chain-limit", stop=True, name=call.name
                )
                self._record(call, None, None, res)
            else:
                res = self._one(call)
            results.append(res)
        return results

    @staticmethod
    def _tool_wide(tool: Tool) -> bool:
        """Whether "always" covers every call of the tool: only the built-in file writers, whose
        every call the sandbox already keeps inside the workspace (what workspace-write allows)."""
        return tool.source == "builtin" and tool.risk == "write"

    def _grant_key(self, tool: Tool, arguments: dict[str, Any]) -> tuple[str, ...]:
        # Otherwise "always" covers exactly the call that was shown, every argument of it:
        # approving run_query(db=prod, sql=SELECT ...) must not let another sql run.
        if self._tool_wide(tool):
            return (tool.name,)
        return (tool.name, json.dumps(arguments, sort_keys=True, ensure_ascii=False))

    def grant_scope(self, tool: Tool) -> str:
        """What answering "always" to a call of this tool would allow, for the question."""
        if self._tool_wide(tool):
            return f"always: {tool.name} with any arguments inside the workspace, for the rest of this session"
        return "always: only this exact call (every argument as shown), for the rest of this session"

    def _one(self, call: ToolCall) -> ToolResult:
        verdict = check_call(call, self.registry)
        note = ""
        if not verdict.ok:
            if verdict.repaired and self.accept_repaired and verdict.arguments is not None:
                self.repair.record(call, verdict.message, repaired=True)
                note = (
                    f"[note: {verdict.message}. The call was run with double quotes put back; "
                    "write standard JSON next time.]\n"
                )
            else:
                msg = self.repair.reject(call, verdict, reply=(self.turn, self.rounds))
                res = ToolResult(
                    False, msg, error=verdict.message, status="invalid", stop=self.repair.exhausted, name=call.name
                )
                self._record(call, None, None, res)
                return res
        assert verdict.arguments is not None
        arguments = verdict.arguments
        tool = self.registry[call.name or ""]
        decision = self.policy.decide(tool, arguments)
        label: str = decision.action
        if decision.action == "deny":
            res = ToolResult(
                False, f"refused: {decision.reason}", error=decision.reason, status="denied", name=tool.name
            )
            self._record(call, arguments, label, res)
            return res
        if decision.action == "ask":
            refused, label = self._approve(tool, call, arguments, decision)
            if refused is not None:
                self._record(call, arguments, label, refused)
                return refused
        res = self._run(tool, arguments)
        if note:
            res.content = note + res.content
        self._record(call, arguments, label, res)
        return res

    def _approve(
        self, tool: Tool, call: ToolCall, arguments: dict[str, Any], decision: Decision
    ) -> tuple[ToolResult | None, str]:
        key = self._grant_key(tool, arguments)
        if key in self._grants:
            return None, "ask:granted"
        reason = decision.reason
        if getattr(tool.fn, "risk_undeclared", False):  # a Python tool that said nothing: exec
            from flashmoe.tools.user_tools import DECLARE_RISK_HINT

            reason = f"{reason}; {tool.name} {DECLARE_RISK_HINT}"
        if getattr(self.approver, "interactive", True):
            reason = f"{reason}; {self.grant_scope(tool)}"
        try:
            answer = self.approver.ask(dataclasses.replace(call, arguments=arguments), reason)
        except (EOFError, OSError):
            answer = "no"
        if answer == "always":
            self._grants.add(key)
            return None, "ask:always"
        if answer == "yes":
            return None, "ask:yes"
        if not getattr(self.approver, "interactive", True):
            msg = (
                f"refused: {decision.reason}, and this run is non-interactive, so nobody can approve it. "
                "Do not retry; continue without it or tell the user what needs approval."
            )
            return ToolResult(False, msg, error="approval needed", status="approval-needed", name=tool.name), "ask:no"
        msg = f"the user declined this call ({decision.reason}). Do not retry it; ask the user or try another way."
        return ToolResult(False, msg, error="declined", status="declined", name=tool.name), "ask:no"

    def _call(self, tool: Tool, arguments: dict[str, Any]) -> Any:
        """tool.fn(**arguments), under the wall-clock limit unless the tool keeps its own, and
        never past the run's deadline."""
        if tool.resolved_paths:
            arguments = dict(arguments)
            for arg in tool.path_args:
                if isinstance(arguments.get(arg), str):
                    arguments[arg] = str(self.policy.sandbox.resolve(arguments[arg], write=tool.risk == "write"))
        limit, why = self.time_limit, f"timed out after {self.time_limit:g} s"
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return ToolResult(
                    False,
                    "[not run: the run's time limit (--timeout) is reached]",
                    error="the run's time limit is reached",
                    status="timeout",
                )
            if left < limit:
                limit, why = left, "stopped at the run's time limit (--timeout)"
        if tool.self_limited:
            with run_deadline(self.deadline):
                return tool.fn(**arguments)
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                with run_deadline(self.deadline):  # commands a Python tool runs end in time too
                    box["value"] = tool.fn(**arguments)
            except BaseException as e:  # handed to the caller's thread below
                box["error"] = e

        worker = threading.Thread(
            target=contextvars.copy_context().run, args=(work,), name=f"tool-{tool.name}", daemon=True
        )
        worker.start()
        worker.join(limit)
        if worker.is_alive():
            return ToolResult(False, f"[{tool.name} {why} and was abandoned]", error=why, status="timeout")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _run(self, tool: Tool, arguments: dict[str, Any]) -> ToolResult:
        start = time.monotonic()
        try:
            value = self._call(tool, arguments)
        except ToolError as e:
            msg = str(e)
            return ToolResult(
                False, msg, error=msg, status="error", duration_s=time.monotonic() - start, name=tool.name
            )
        except Exception as e:  # a bug in a user tool: the model hears the error, not a traceback
            msg = f"{tool.name} failed: {type(e).__name__}: {e}"
            return ToolResult(
                False, msg, error=msg, status="error", duration_s=time.monotonic() - start, name=tool.name
            )
        duration = time.monotonic() - start
        if isinstance(value, ToolResult):
            res = dataclasses.replace(value, name=tool.name, duration_s=value.duration_s or duration)
        elif value is None:
            res = ToolResult(True, "(no output)", duration_s=duration, name=tool.name)
        elif isinstance(value, str):
            res = ToolResult(True, value, duration_s=duration, name=tool.name)
        else:
            res = ToolResult(
                True, json.dumps(value, ensure_ascii=False, default=str), duration_s=duration, name=tool.name
            )
        if not res.truncated:
            res.content, res.truncated = cap_text(res.content, self.max_output)
        return res

    def _record(self, call: ToolCall, arguments: dict[str, Any] | None, decision: str | None, res: ToolResult) -> None:
        rec = CallRecord(
            self.turn,
            self.rounds,
            call.name,
            call.raw,
            arguments,
            decision,
            res.status,
            res.duration_s,
            res.exit_code,
            res.truncated,
            res.error or "",
        )
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
