"""Exit codes, documented in the README and `flashmoe --help`."""
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1  # generation or tool failure
    USAGE = 2  # bad arguments or configuration
    MODEL = 3  # model load or I/O problem
    TIMEOUT = 4
    APPROVAL = 5  # a tool call needed approval and did not get it (declined, or nobody could answer)
    INTERRUPTED = 130
