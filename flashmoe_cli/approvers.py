"""Who says yes to a tool call, for every face: the question's one wording, the answer's one
parser, and the approvers behind `flashmoe agent --approve ask|auto|never` and the line REPL.

The Approver protocol (`interactive`, `ask(call, reason) -> "yes" | "no" | "always"`) is
flashmoe.tools.policy.Approver: the executor that consumes it lives in tools, which never imports
a front end. NonInteractiveApprover (headless runs: nobody can answer, so fail closed) is there
too. The TUI asks in a modal screen, through ModalApprover: its answer goes through `parse_answer`
as well.
"""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import Future, InvalidStateError

from .term_safe import safe

ANSWERS = ("yes", "no", "always")
_WORDS = {"y": "yes", "yes": "yes", "a": "always", "always": "always", "n": "no", "no": "no"}
QUESTION = "Run it? [y/N/a(lways)] "


def parse_answer(text) -> str:
    """What a typed (or picked) answer means: y / yes -> "yes", a / always -> "always", and
    anything else -> "no": an empty line, EOF, a typo, None. Case and blanks do not count."""
    return _WORDS.get(text.strip().lower(), "no") if isinstance(text, str) else "no"


def question(call, reason: str) -> str:
    """The call, why it needs a yes, and QUESTION; escaped for a terminal (the name and the
    arguments are the model's text, the reason quotes them)."""
    args = json.dumps(call.arguments, ensure_ascii=False)
    return safe(f"{call.name}({args})\n  {reason}.") + " " + QUESTION


class LineApprover:
    """Asks y / N / always on a line: `read_line(text)` shows the question and returns what was
    typed. EOF is a no. The REPL reads with prompt-toolkit, `agent --approve ask` from /dev/tty."""

    interactive = True

    def __init__(self, read_line, prefix: str = ""):
        self.read_line = read_line
        self.prefix = prefix

    def ask(self, call, reason: str) -> str:
        try:
            answer = self.read_line(self.prefix + question(call, reason))
        except EOFError:
            return "no"
        return parse_answer(answer)


class TerminalApprover(LineApprover):
    """--approve ask: the question on the controlling terminal."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        super().__init__(self._read_line, prefix="\nflashmoe: ")

    def _read_line(self, text: str) -> str:
        self.writer.write(text)
        self.writer.flush()
        return self.reader.readline()  # "" when the terminal is gone: no

    @classmethod
    def open(cls, path: str = "/dev/tty") -> TerminalApprover | None:
        """On the controlling terminal, or None (said once on stderr): calls that need a yes are refused.

        The terminal is opened twice, to read and to write: "r+" wants a seekable file, which a
        terminal is not (io.UnsupportedOperation)."""
        try:
            reader = open(path, encoding="utf-8", errors="replace")
            writer = open(path, "w", encoding="utf-8", errors="replace")
        except OSError as e:
            print(
                f"flashmoe: warning: --approve ask: no terminal to ask on ({path}: {e.strerror or e}); "
                "tool calls that need approval are refused",
                file=sys.stderr,
            )
            return None
        return cls(reader, writer)


class ModalApprover:
    """Asks a face whose questions are answered on another thread (the TUI's modal screen).

    `show(call, reason, reply)` puts the question up from the tool loop's thread (False: it
    cannot be, a no); the face calls `reply(picked)` once, from any thread, with what was picked
    (None for nothing), and `parse_answer` reads it. `wanted()` is asked before the question and
    every `poll_s` while it waits: once it says False (the turn is stopping, the face is gone)
    the answer is no. `cancel()` answers a pending question no, from any thread, so the loop's
    thread never waits on a question nobody will answer."""

    interactive = True

    def __init__(self, show, wanted=lambda: True, poll_s: float = 0.1):
        self.show, self.wanted, self.poll_s = show, wanted, poll_s
        self.pending: Future | None = None  # the question being asked
        self._lock = threading.Lock()

    def ask(self, call, reason: str) -> str:  # the tool loop's thread
        if not self.wanted():
            return "no"
        future: Future = Future()
        with self._lock:
            self.pending = future
        try:
            if not self.wanted() or not self.show(call, reason, lambda picked: settle(future, picked)):
                return "no"
            while True:
                try:
                    return parse_answer(future.result(timeout=self.poll_s))
                except TimeoutError:
                    if not self.wanted():
                        return "no"
        finally:
            with self._lock:
                if self.pending is future:
                    self.pending = None

    def cancel(self) -> None:
        with self._lock:
            pending = self.pending
        if pending is not None:
            settle(pending, "no")


def settle(future: Future, picked) -> None:
    """Answer a pending question once; a later answer (a late key, a cancel) is ignored."""
    try:
        future.set_result(picked)
    except InvalidStateError:
        pass


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


def approver_for(approve: str, registry):
    """`flashmoe agent --approve ask|auto|never`; ask without a terminal fails closed."""
    from flashmoe.tools.policy import NonInteractiveApprover

    if approve == "auto":
        return AutoApprover(registry)
    if approve == "never":
        return DecliningApprover()
    return TerminalApprover.open() or NonInteractiveApprover()
