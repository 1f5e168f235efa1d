"""`tools` stays UI- and engine-agnostic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_ui_or_engine_imports():
    mods = ("registry", "builtin", "user_tools", "parsers", "textstate", "validate", "policy", "runner", "executor")
    code = (
        f"import sys, flashmoe.tools, {', '.join('flashmoe.tools.' + m for m in mods)}\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('textual', 'prompt_toolkit', 'rich', 'mlx', "
        "'mlx_lm') or m.startswith(('flashmoe.engine', 'flashmoe.cli'))]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_lazy_top_level_names():
    import flashmoe.tools

    assert flashmoe.tools.ToolExecutor.__name__ == "ToolExecutor"
    assert flashmoe.tools.parser_for_template("<tool_call>").name == "json_tools"
