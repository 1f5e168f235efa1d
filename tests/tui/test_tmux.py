"""End to end: the real `flashmoe chat` on a tiny real model, in a private tmux server at 100x30."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLOW = 2.0 if os.environ.get("CI") else 1.0

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


class Tmux:
    def __init__(self, sock: Path, env: dict):
        self.sock, self.env = sock, env

    def __call__(self, *args: str, check: bool = True) -> str:
        out = subprocess.run(
            ["tmux", "-S", str(self.sock), *args], capture_output=True, text=True, env=self.env, timeout=10
        )
        if check and out.returncode:
            raise AssertionError(f"tmux {' '.join(args)}: {out.stderr}")
        return out.stdout

    def pane(self) -> str:
        return self("capture-pane", "-p", "-J", "-t", "main", check=False)

    def until(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout * SLOW
        while True:
            text = self.pane()
            if predicate(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the pane:\n{text}")
            time.sleep(0.1)


def test_chat_tui_end_to_end(model_factory, tmp_path):
    model = model_factory("qwen3_moe", 4, converted=True)
    rc_file = tmp_path / "rc"
    env = dict(os.environ, FLASHMOE_HOME=str(tmp_path / "home"), TERM="xterm-256color")
    # COLUMNS and LINES (pytest-xdist workers export 80x24) would override the pane's size in Textual
    for var in ("FORCE_COLOR", "NO_COLOR", "TEXTUAL_DRIVER", "TMUX", "COLUMNS", "LINES"):
        env.pop(var, None)
    chat = [sys.executable, "-m", "flashmoe.cli", "chat", "-m", str(model), "--max-tokens", "12", "--temp", "0"]
    shell = f"cd {shlex.quote(str(ROOT))} && {shlex.join(chat)}; echo $? > {shlex.quote(str(rc_file))}; sleep 30"
    tmux = Tmux(tmp_path / "sock", env)
    tmux("-f", "/dev/null", "new-session", "-d", "-s", "main", "-x", "100", "-y", "30", shell)
    try:
        tmux.until(lambda t: "Type a message" in t, 60, "the model to load")
        tmux("send-keys", "-t", "main", "-l", "Hello")
        tmux("send-keys", "-t", "main", "M-Enter")  # ESC CR: a new line, not a send
        tmux("send-keys", "-t", "main", "-l", "there")
        tmux("send-keys", "-t", "main", "C-j")
        tmux("send-keys", "-t", "main", "-l", "friend")
        tmux.until(lambda t: re.search(r"│ Hello\s+│\n│ there\s+│\n│ friend", t), 10, "three lines in the box")
        tmux("send-keys", "-t", "main", "Enter")
        rows = re.compile(r"│\s+0\s+[-\d.]+\s+[\d.]+\s+[\d.]+")
        pane = tmux.until(
            lambda t: re.search(r"\d+ tok · [\d.]+ tok/s", t) and rows.search(t) and "ready" in t,
            60,
            "the reply and the layer rows",
        )
        assert re.search(r"│ Hello\s+│[^\n]*\n[^\n]*│ there\s+│[^\n]*\n[^\n]*│ friend", pane), (
            pane
        )  # sent as one message
        assert re.search(r"│\s+1\s+", pane) and "all " in pane, pane
        assert re.search(r"\d+\.\d tok/s ?│", pane), pane  # the status bar has a decode speed
        tmux("send-keys", "-t", "main", "C-c")
        time.sleep(0.2)
        tmux("send-keys", "-t", "main", "C-c")
        deadline = time.monotonic() + 15 * SLOW
        while not (rc_file.exists() and rc_file.read_text().strip()):
            if time.monotonic() > deadline:
                raise AssertionError(f"the app did not quit on Ctrl-C Ctrl-C; the pane:\n{tmux.pane()}")
            time.sleep(0.1)
        assert rc_file.read_text().strip() == "0", tmux.pane()
    finally:
        tmux("kill-server", check=False)
