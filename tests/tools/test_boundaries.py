"""`tools` stays UI- and engine-agnostic."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_ui_or_engine_imports():
    code = ("import sys, tools, tools.registry, tools.builtin, tools.user_tools, tools.parsers, tools.textstate, "
            "tools.validate, tools.policy, tools.runner, tools.executor\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('textual', 'prompt_toolkit', 'rich', 'mlx', "
            "'mlx_lm', 'engine', 'flashmoe_cli')]\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_lazy_top_level_names():
    import tools

    assert tools.ToolExecutor.__name__ == "ToolExecutor"
    assert tools.parser_for_template("<tool_call>").name == "json_tools"
