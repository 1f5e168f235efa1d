"""A long prompt's prefill shows its progress: on a terminal's stderr as one redrawn line (tokens,
tok/s, time left) erased before the answer, as `prefill` JSON events with the time taken so far."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys

from flashmoe.cli.progress import PrefillMeter
from flashmoe.engine.events import PrefillProgress
from tests.helpers.paths import ROOT
from tests.helpers.cli import run_cli

LONG = "word " * 330  # about 1300 tokens of the tiny tokenizer: three chunks of 512


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_meter_draws_speed_and_time_left_and_erases_itself():
    out = Tty()
    meter = PrefillMeter(out)
    meter(PrefillProgress(0, 1000, 0))
    meter(PrefillProgress(250, 1000, 0, "", 2.0))
    assert out.getvalue() == "\r\033[Kprefill 250/1000 tokens | 125 tok/s | 6 s left"
    meter(PrefillProgress(1000, 1000, 0, "", 8.0))
    assert out.getvalue().endswith("6 s left\r\033[K")
    piped = io.StringIO()
    PrefillMeter(piped)(PrefillProgress(250, 1000, 0, "", 2.0))
    assert piped.getvalue() == ""  # not a terminal: the summary line is enough


def test_run_shows_prefill_progress_on_a_terminal_and_only_the_answer_on_stdout(model_factory, tmp_path):
    model = model_factory("qwen3_moe", 4, converted=True)
    master, slave = pty.openpty()
    env = dict(os.environ, FLASHMOE_HOME=str(tmp_path / "home"))
    proc = subprocess.run(
        [sys.executable, "-m", "flashmoe.cli", "run", "-m", str(model), "--max-tokens", "3", "--kernels", "cpu", LONG],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    assert proc.returncode == 0, err
    text = err.decode()
    assert "prefill 512/" in text and "prefill 1024/" in text and " tok/s | " in text and " s left" in text
    assert text.count("\r\033[K") >= 3  # each redraw, and the erase before the answer
    assert b"prefill 512" not in proc.stdout  # the answer's stream has only the answer


def test_run_json_has_prefill_events_with_the_time_so_far(model_factory, tmp_path):
    model = model_factory("qwen3_moe", 4, converted=True)
    r = run_cli("run", "-m", model, "--json", "--max-tokens", "2", LONG, env={"FLASHMOE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    prefill = [e for e in events if e["event"] == "prefill"]
    assert [e["done"] for e in prefill][:3] == [0, 512, 1024] and prefill[-1]["done"] == prefill[-1]["total"]
    assert all(e["elapsed_s"] >= 0 for e in prefill) and prefill[-1]["elapsed_s"] > prefill[1]["elapsed_s"]
