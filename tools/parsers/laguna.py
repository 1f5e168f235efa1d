"""Poolside Laguna: GLM-4.7's format (converted checkpoints name it "laguna")."""

from flashmoe.tools.parsers.glm47 import parse_tool_call, tool_call_end, tool_call_start  # noqa: F401

name = "laguna"
