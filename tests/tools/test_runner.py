"""The command runner: process-group kill on timeout, output cap, scrubbed environment."""

from __future__ import annotations

import os
import sys
import time

import pytest

from flashmoe.tools.runner import CommandRunner, cap_text, is_secret_name, run_command, scrub_env
from tests.helpers.processes import alive, marker, survivors

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")


def wait_gone(pids, limit=3.0):
    end = time.monotonic() + limit
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def test_timeout_kills_the_whole_process_group():
    start = time.monotonic()
    bg, fg = marker(), marker()
    res = run_command(["sh", "-c", f"sleep {bg} & echo $!; echo $$; exec sleep {fg}"], timeout=0.5)
    assert time.monotonic() - start < 5
    pids = [int(x) for x in res.content.split()[:2]]
    assert len(pids) == 2
    assert (res.ok, res.status, res.error) == (False, "timeout", "timed out after 0.5 s")
    assert res.content.endswith("[timed out after 0.5 s; the command and its child processes were killed]")
    assert survivors(bg) == [] and survivors(fg) == []  # (the PIDs it printed may be a namespace's own)


def test_spec_command_shape_is_killed():
    """`sh -c 'sleep 100 & sleep 100'`: both sleeps are seen running, and both are gone after the timeout.
    They are told apart from other processes by a marker in their (inherited) environment."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    import threading
    import uuid

    mark = f"FLASHMOE_TEST_MARK={uuid.uuid4().hex}".encode()
    env = dict(os.environ, FLASHMOE_TEST_MARK=mark.split(b"=")[1].decode())
    box = {}
    t = threading.Thread(
        target=lambda: box.update(res=run_command(["sh", "-c", "sleep 100 & sleep 100"], timeout=1.5, env=env))
    )
    t.start()
    seen: list[int] = []
    end = time.monotonic() + 1.2
    while time.monotonic() < end and len(seen) < 2:
        seen = _marked_sleepers(mark)
        time.sleep(0.02)
    t.join()
    assert len(seen) == 2, seen
    assert box["res"].status == "timeout"
    assert wait_gone(seen) == []


def _marked_sleepers(mark: bytes) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read() != b"sleep\x00100\x00":
                        continue
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark in f.read().split(b"\x00") and alive(int(d)):
                        out.append(int(d))
            except OSError:
                pass
    return out


def test_background_jobs_do_not_outlive_the_call():
    start = time.monotonic()
    m = marker()
    res = run_command(["sh", "-c", f"sleep {m} & echo $!"], timeout=10)
    assert time.monotonic() - start < 5  # did not wait for the background job's pipe
    assert res.ok and res.exit_code == 0
    int(res.content.split()[0])
    assert survivors(m) == []


def test_exit_status_and_output():
    res = run_command(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (res.ok, res.exit_code, res.status) == (False, 3, "error")
    assert res.content == "out\nerr\n[exit code 3]"
    res = run_command(["true"])
    assert (res.ok, res.exit_code, res.content) == (True, 0, "(no output)")


def test_missing_program():
    res = run_command(["definitely-not-a-program-xyz"])
    assert not res.ok and res.content.startswith("cannot run 'definitely-not-a-program-xyz'")


def test_output_cap():
    res = run_command(["sh", "-c", "head -c 5000000 /dev/zero | tr '\\0' a; echo; echo END"], max_output=1000)
    assert res.ok and res.truncated
    head, rest = res.content.split("\n<response clipped: ", 1)
    assert head == "a" * 500
    note, tail = rest.split(">\n", 1)
    assert note.startswith(f"{5000005 - 1000} characters omitted from the middle")
    assert tail.endswith("a\nEND\n") and len(tail) == 500
    small = run_command(["echo", "hi"], max_output=1000)
    assert (small.content, small.truncated) == ("hi\n", False)


def test_cap_text():
    assert cap_text("abc", 10) == ("abc", False)
    text, cut = cap_text("x" * 30, 10)
    assert cut and text.startswith("xxxxx\n<response clipped: 20 characters omitted") and text.endswith(">\nxxxxx")


def test_env_scrubbed():
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "MY_API_TOKEN": "t",
        "DB_PASSWORD": "p",
        "AWS_SECRET_ACCESS_KEY": "a",
        "AWS_ACCESS_KEY_ID": "i",
        "STRIPE_SECRET": "s",
        "OPENAI_API_KEY": "o",
        "github_token": "g",
        "PGPASSWORD": "pg",
        "KEEP_ME": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    res = run_command(["env"], env=env)
    names = {line.split("=", 1)[0] for line in res.content.splitlines() if "=" in line}
    assert "KEEP_ME" in names and "TOKENIZERS_PARALLELISM" in names
    assert not names & {
        "MY_API_TOKEN",
        "DB_PASSWORD",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ACCESS_KEY_ID",
        "STRIPE_SECRET",
        "OPENAI_API_KEY",
        "github_token",
        "PGPASSWORD",
    }
    assert scrub_env({"A_KEY": "1", "B": "2"}) == {"B": "2"}
    assert is_secret_name("HF_TOKEN") and not is_secret_name("KEYBOARD")


def test_env_scrubbed_from_os_environ(monkeypatch):
    monkeypatch.setenv("FLASHMOE_TEST_SECRET", "zzz")
    res = CommandRunner().run(["env"])
    assert "FLASHMOE_TEST_SECRET" not in res.content and "zzz" not in res.content


def test_runner_cwd_and_shell(tmp_path):
    r = CommandRunner(cwd=tmp_path, timeout=5)
    assert r.shell("pwd").content.strip() == str(tmp_path.resolve())
    assert r.shell("sleep 5", timeout=0.2).status == "timeout"
