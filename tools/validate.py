"""Checking tool calls against the registry and the tools' JSON Schemas, and the repair loop.

Every message here is written for the model: one line saying what is wrong and where.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field
from typing import Any

from flashmoe.tools import safe_schema
from flashmoe.tools.calls import MAX_ARGUMENT_CHARS, ToolCall, argument_problem
from flashmoe.tools.registry import Tool, ToolRegistry

BACKSLASH_QUOTES = "the arguments use backslashes where JSON needs double quotes (a known low-bit quantization failure)"

_validators: weakref.WeakKeyDictionary[Tool, Any] = weakref.WeakKeyDictionary()


def validator_for(tool: Tool):
    """The tool's Draft 2020-12 validator, built once (the schema was checked at registration);
    its patterns are matched with a time limit (safe_schema.py)."""
    v = _validators.get(tool)
    if v is None:
        v = safe_schema.validator(tool.parameters)
        _validators[tool] = v
    return v


def schema_error(tool: Tool, arguments: Any) -> str | None:
    """`$.path: message` for the most relevant schema violation, or None when the arguments fit
    (arguments whose checking cannot finish do not fit)."""
    return safe_schema.first_error(validator_for(tool), arguments)


# A key wrapped in one or two backslashes (optionally before a quote) and followed by a colon:
# {\name\: ...}, {\\name\\: ...}, {\"name\": ...}.
_BACKSLASH_KEY = re.compile(r'(?:^|[{,\s])\\{1,2}"?[A-Za-z_][\w.-]*\\{1,2}"?\s*:')
# Backslash runs standing where a quote would: after { [ , : or space, or before : , } ].
_BACKSLASH_QUOTE = re.compile(r'(?:(?<=[{\[,:\s])|^)\\{1,2}"?|\\{1,2}"?(?=\s*[:,}\]]|\s*$)')


def looks_backslash_quoted(text: str) -> bool:
    return bool(_BACKSLASH_KEY.search(text))


def repair_backslash_quotes(text: str) -> str:
    """Replace backslash runs that stand in for double quotes with double quotes."""
    return _BACKSLASH_QUOTE.sub('"', text)


@dataclass(frozen=True)
class Verdict:
    """ok: the call may run with `arguments`. Otherwise `message` says why not. `repaired` marks a
    call whose arguments were fixed (backslash quotes) and then validated: `arguments` holds the
    fixed version, and the failure is still reported in `message`."""

    ok: bool
    arguments: dict[str, Any] | None
    message: str
    repaired: bool = False
    kind: str | None = None  # unknown-tool, parse, malformed-json, backslash-quotes, not-object, schema


def _decode(text: str) -> tuple[Any, str | None, bool]:
    """(value, error, backslash) for an arguments text."""
    if not text.strip():
        return {}, None, False
    if len(text) > 4 * MAX_ARGUMENT_CHARS:
        return None, f"longer than {4 * MAX_ARGUMENT_CHARS:,} characters", False
    try:
        return json.loads(text), None, False
    except json.JSONDecodeError as e:
        if looks_backslash_quoted(text):
            return None, BACKSLASH_QUOTES, True
        return None, str(e), False
    except RecursionError:
        return None, "the arguments nest too deeply to decode", False
    except (ValueError, OverflowError) as e:  # Python's limit on integer digits
        return None, str(e)[:120], False


def _kind_of(value: Any) -> str:
    return {
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def check_call(call: ToolCall, registry: ToolRegistry) -> Verdict:
    """Whether a parsed call names a known tool and has arguments its schema accepts."""
    tool = registry.get(call.name)
    if call.name is None:
        return Verdict(False, None, f"could not parse the tool call: {call.error or 'no tool name'}", kind="parse")
    if tool is None:
        names = ", ".join(registry.names())
        available = f"available: {names}" if names else "no tools are available"
        return Verdict(False, None, f"unknown tool '{call.name}'; {available}", kind="unknown-tool")
    if call.arguments is not None:
        value: Any = call.arguments
    elif call.arguments_text is not None:
        value, err, backslash = _decode(call.arguments_text)
        if backslash:
            return _backslash_verdict(tool, call.arguments_text)
        if err is not None:
            return Verdict(
                False, None, f"malformed JSON in the arguments for '{tool.name}': {err}", kind="malformed-json"
            )
        if call.error is not None and looks_backslash_quoted(call.raw):
            # The envelope used backslashes for quotes and the parser salvaged the name and
            # arguments: still the low-bit failure, so name it (the call may run repaired).
            return _backslash_verdict(tool, repair_backslash_quotes(call.arguments_text) or "{}")
    else:
        return Verdict(
            False, None, f"could not parse the tool call to '{tool.name}': {call.error or 'no arguments'}", kind="parse"
        )
    if not isinstance(value, dict):
        return Verdict(
            False,
            None,
            f"the arguments for '{tool.name}' must be a JSON object, not {_kind_of(value)}",
            kind="not-object",
        )
    junk = argument_problem(value)
    if junk is not None:
        return Verdict(False, None, f"unusable arguments for '{tool.name}': {junk}", kind="junk")
    problem = schema_error(tool, value)
    if problem is not None:
        return Verdict(False, None, f"invalid arguments for '{tool.name}': {problem}", kind="schema")
    return Verdict(True, value, "")


def _backslash_verdict(tool: Tool, text: str) -> Verdict:
    base = f"malformed JSON in the arguments for '{tool.name}': {BACKSLASH_QUOTES}"
    fixed = repair_backslash_quotes(text)
    try:
        value = json.loads(fixed)
    except json.JSONDecodeError:
        return Verdict(False, None, base, kind="backslash-quotes")
    if not isinstance(value, dict):
        return Verdict(False, None, base, kind="backslash-quotes")
    problem = schema_error(tool, value)
    if problem is not None:
        return Verdict(
            False,
            None,
            f"{base}; with double quotes instead they are still invalid: {problem}",
            kind="backslash-quotes",
        )
    return Verdict(False, value, base, repaired=True, kind="backslash-quotes")


@dataclass(frozen=True)
class RejectedCall:
    """A call that did not pass validation, kept verbatim for logs."""

    raw: str
    name: str | None
    message: str
    turn: int
    repaired: bool = False


@dataclass
class RepairLoop:
    """Bounds how often the model may retry rejected calls within one user turn.

    Each model reply with at least one rejected call uses one repair round (pass the same
    `reply` key for calls from the same reply; without one, each rejection is its own round).
    While rounds are left, the message asks the model to fix the call; the round after the last
    one says to stop, and `exhausted` turns true.
    """

    max_repairs: int = 2
    rounds: int = 0
    turn: int = 0
    rejected: list[RejectedCall] = field(default_factory=list)
    _last_reply: object = field(default=None, repr=False)

    def begin_turn(self) -> None:
        self.turn += 1
        self.rounds = 0
        self._last_reply = None

    @property
    def exhausted(self) -> bool:
        return self.rounds > self.max_repairs

    def record(self, call: ToolCall, message: str, *, repaired: bool = False) -> None:
        """Keep a rejected call for the log without using a round (e.g. one that was repaired and run)."""
        self.rejected.append(RejectedCall(call.raw, call.name, message, self.turn, repaired))

    def reject(self, call: ToolCall, verdict: Verdict | str, *, reply: object = None) -> str:
        """Record a rejected call; the message to send back to the model as its tool result."""
        message = verdict if isinstance(verdict, str) else verdict.message
        self.record(call, message)
        if reply is None or reply != self._last_reply:
            self.rounds += 1
        self._last_reply = reply
        if self.rounds <= self.max_repairs:
            return f"{message}\nFix the call and try again (repair {self.rounds} of {self.max_repairs})."
        return (
            f"{message}\nThe repair limit ({self.max_repairs}) is reached for this turn: "
            "stop calling tools and answer with what you have."
        )
