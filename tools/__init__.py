"""Agent tools: registry, tool-call parsers, validation, policy and the runner.

UI- and engine-agnostic: nothing here imports textual, prompt_toolkit, rich or mlx.

    tools.registry     Tool, ToolRegistry
    tools.builtin      read_file, list_dir, search_files, write_file, edit_file, run_shell
    tools.user_tools   load_tool_file (JSON/YAML command tools), load_python_tools
    tools.parsers      parser_for_template() and one module per tool-call format
    tools.textstate    TextState: streamed text -> visible text / reasoning / tool calls
    tools.validate     check_call() -> Verdict, RepairLoop
    tools.policy       Policy (modes, rules, sandbox), Approver, NonInteractiveApprover
    tools.runner       run_command(), ToolResult
    tools.executor     ToolExecutor: validate -> policy -> approve -> run
"""
from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Tool": "tools.registry", "ToolRegistry": "tools.registry", "ToolCall": "tools.calls",
    "ToolExecutor": "tools.executor", "ToolResult": "tools.runner", "Policy": "tools.policy",
    "NonInteractiveApprover": "tools.policy", "TextState": "tools.textstate", "check_call": "tools.validate",
    "parser_for_template": "tools.parsers", "ToolError": "tools.errors",
}


def __getattr__(name: str) -> Any:  # lazy, so `import tools.parsers` stays light
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tools' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
