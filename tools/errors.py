"""Errors the tool layer raises for problems a user (or the model) can fix.

Every message is one line, so front ends can print it as is and the agent can send it to the model.
"""

from __future__ import annotations


class ToolError(Exception):
    """Base class for tool-layer errors."""


class ToolDefinitionError(ToolError):
    """A tool definition is unusable: bad name, invalid JSON Schema, duplicate name."""


class ToolFileError(ToolDefinitionError):
    """A user tool file (JSON, YAML or Python) cannot be loaded; the message names the file."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class PolicyError(ToolError):
    """The policy configuration is invalid (unknown mode, bad rule, yolo without the flag)."""


class PathRefused(ToolError):
    """A path argument is outside the workspace or on the deny list."""


class ToolRunError(ToolError):
    """A tool ran and failed in an expected way (file not found, old string not unique, ...)."""
