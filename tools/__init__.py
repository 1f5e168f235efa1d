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

_EXPORTS = {  # name -> the module of this package that defines it
    "Tool": "registry",
    "ToolRegistry": "registry",
    "ToolCall": "calls",
    "ToolExecutor": "executor",
    "ToolResult": "runner",
    "Policy": "policy",
    "NonInteractiveApprover": "policy",
    "TextState": "textstate",
    "check_call": "validate",
    "parser_for_template": "parsers",
    "ToolError": "errors",
}


def __getattr__(name: str) -> Any:  # lazy, so `import flashmoe.tools.parsers` stays light
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
