"""Exit codes, documented in docs/usage.md and `flashmoe --help`, and the one rule that turns how a
turn ended into one of them (headless `run`, `run --tools`, `flashmoe agent`)."""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1  # generation or tool failure
    USAGE = 2  # bad arguments or configuration
    MODEL = 3  # model load or I/O problem
    TIMEOUT = 4
    APPROVAL = 5  # a tool call needed approval and did not get it (declined, or nobody could answer)
    INTERRUPTED = 130


BY_STATUS = {
    "done": ExitCode.OK,
    "cancelled": ExitCode.INTERRUPTED,
    "timeout": ExitCode.TIMEOUT,
    "approval-needed": ExitCode.APPROVAL,
}  # chain-limit, repairs-exhausted: FAILURE


def exit_code(status: str, *, engine_code: int = ExitCode.FAILURE, refused: bool = False) -> int:
    """The exit code of a turn that ended with `status` (agent.TurnFinished's). "failed" is the
    engine's own code (EngineFailed.exit_code: 1, 2 for a prompt longer than the context, 3 for
    a model file that fails). `refused`: a tool call went without the yes it needed, which makes
    an otherwise good run exit 5. SIGTERM / SIGHUP make it 128 + the signal later (signals.py)."""
    code = engine_code if status == "failed" else BY_STATUS.get(status, ExitCode.FAILURE)
    return ExitCode.APPROVAL if refused and code == ExitCode.OK else code
