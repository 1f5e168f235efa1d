"""`flashmoe serve` in a process of its own on a free port of 127.0.0.1, and the requests several
server tests send."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from tests.helpers.paths import ROOT

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
HELLO = [{"role": "user", "content": "Say hello to the world."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        e = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flashmoe.cli", "serve", "--port", str(self.port), *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=e,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"the server exited: {''.join(self.lines)}")
            self.lines.append(line)
            if "serving" in line:
                break
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"

    def _drain(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=60)
