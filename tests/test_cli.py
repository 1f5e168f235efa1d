"""`flashmoe run/info/verify/convert` as a user runs them: stdout, stderr, exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flashmoe.cli.argtypes import parse_size
from flashmoe.cli.headless import read_prompt
from tests.helpers.paths import ROOT
from tests.helpers.cli import run_cli


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen3_moe", 4, converted=True)


def test_pipe_in_answer_out(model):
    # a process of its own: what a shell pipe really gets on its descriptors
    r = run_cli("run", "-m", model, "--max-tokens", "8", input="hi there\n", process=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and len(r.stdout) > 1
    # stderr: the summary line with its conditions; nothing on stdout but the answer
    summary = r.stderr.strip().splitlines()[-1]
    for needle in ("prefill", "decode 8 tok", "tok/s", "/token read", "hit rate", "K=2", "4-bit", "cold expert cache"):
        assert needle in summary


def test_json_events(model):
    r = run_cli("run", "-m", model, "--json", "--max-tokens", "6", "--raw", "hello")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    assert all("event" in e for e in events)
    tokens = [e for e in events if e["event"] == "token"]
    assert len(tokens) == 6 and all(isinstance(t["id"], int) and isinstance(t["text"], str) for t in tokens)
    done = events[-1]
    assert done["event"] == "done" and done["generation_tokens"] == 6
    assert done["text"] == "".join(t["text"] for t in tokens) + done["tail"]
    assert {"prompt_tps", "generation_tps", "bytes_per_token", "hit_rate"} <= done.keys()


def test_stdin_then_argument():
    class FakeStdin:
        def __init__(self, text):
            self.text = text

        def isatty(self):
            return False

        def read(self):
            return self.text

    assert read_prompt("summarise", FakeStdin("notes\n")) == "notes\n\nsummarise"
    assert read_prompt(None, FakeStdin("only stdin")) == "only stdin"
    assert read_prompt("only arg", FakeStdin("")) == "only arg"
    r = run_cli("chat", "--engine", "fake", input="")  # not a terminal, nothing piped: chat has no PROMPT
    assert r.returncode == 2 and "no prompt" in r.stderr and "PROMPT" not in r.stderr


def test_same_greedy_answer_with_and_without_raw_argument_order(model):
    a = run_cli("run", "-m", model, "--max-tokens", "6", "--json", input="notes\n", env={}).stdout
    b = run_cli("run", "-m", model, "--max-tokens", "6", "--json", "notes").stdout

    def ids(out):
        return [json.loads(l)["id"] for l in out.splitlines() if '"token"' in l]

    assert ids(a) == ids(b)


def test_head_closes_the_pipe_quietly(model):
    cmd = f"{sys.executable} -m flashmoe.cli run -m {model} --max-tokens 300 --timing off 'go' | head -c 5"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
    assert len(r.stdout.encode()) <= 5


def test_ctrl_c_stops_cleanly_with_130(model):
    p = subprocess.Popen(
        [sys.executable, "-m", "flashmoe.cli", "run", "-m", str(model), "--max-tokens", "100000", "go"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    os.set_blocking(p.stdout.fileno(), False)
    deadline = time.time() + 60
    got = b""
    while time.time() < deadline and len(got) < 20:
        got += p.stdout.read() or b""
        time.sleep(0.05)
    assert got, "no output before the deadline"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert b"Traceback" not in err
    assert b"decode" in err  # the summary still tells what was generated


def test_usage_errors_exit_2(model):
    r = run_cli("run", "-m", model, "--top-p", "1.5", "hi", process=True)  # the exit status a shell sees
    assert r.returncode == 2 and "--top-p: must be in (0, 1], got 1.5" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("run", "-m", model, input="")
    assert r.returncode == 2 and "no prompt" in r.stderr
    r = run_cli("run", "-m", model, "--expert-cache", "lots", "hi")
    assert r.returncode == 2 and "not a size" in r.stderr


def test_info(model):
    r = run_cli("info", model, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["model_type"], d["experts"], d["top_k"], d["bits"], d["moe_layers"]) == ("qwen3_moe", 8, 2, 4, 3)
    assert d["bytes_per_token_cold"] == 2 * 3 * d["expert_block_bytes"]
    assert d["expert_bytes"] == 8 * 3 * d["expert_block_bytes"]
    text = run_cli("info", model).stdout
    assert "read per token at 0% hits" in text


def test_parse_size():
    assert parse_size("0") == 0
    assert parse_size("512MB") == 512 << 20
    assert parse_size("2GB") == 2 << 30
    assert parse_size("1.5g") == 3 << 29
