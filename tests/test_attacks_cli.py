"""Issue 12's attacks through `flashmoe agent`, as a user would see them: a scripted model (the fake
engine) writes exactly the calls an attacker wants, and the test checks what happened on disk, in
the process table and in the transcript. The unit-level versions are in tests/tools/test_attacks.py.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.processes import marker, survivors


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def agent(tmp_path, ws, replies, *extra, env=None):
    (tmp_path / "s.jsonl").write_text(json.dumps({"role": "user", "content": "go"}) + "\n")
    e = {"FLASHMOE_HOME": str(tmp_path / "home"), "FLASHMOE_FAKE_REPLIES": json.dumps(replies), **(env or {})}
    r = run_cli(
        "agent",
        "--engine",
        "fake",
        "--workspace",
        ws,
        "--script",
        tmp_path / "s.jsonl",
        "--transcript",
        tmp_path / "t.jsonl",
        *extra,
        env=e,
    )
    assert "Traceback" not in r.stderr, r.stderr
    events = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    return r, [e for e in events if e["event"] == "tool_result"]


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "notes.txt").write_text("b\na\n")
    (tmp_path / "outside").mkdir()
    return root


def test_option_injection_through_a_command_tool(tmp_path, ws):
    out = tmp_path / "outside" / "x"
    (tmp_path / "flashmoe.tools.json").write_text(
        json.dumps(
            [
                {
                    "name": "sort_file",
                    "parameters": {"type": "object", "properties": {"file": {"type": "string"}}, "required": ["file"]},
                    "command": ["sort", "{file}"],
                    "paths": ["file"],
                }
            ]
        )
    )
    r, results = agent(
        tmp_path,
        ws,
        [call("sort_file", file=f"-o{out}"), call("sort_file", file="notes.txt"), "ok"],
        "--tools",
        tmp_path / "flashmoe.tools.json",
        "--allow",
        "sort_file",
    )
    assert r.returncode == 0, r.stderr
    assert not out.exists()
    assert "would be read as an option by sort" in results[0]["content"]
    assert results[1]["ok"] and results[1]["content"] == "a\nb\n"


def test_planted_git_directory_through_the_agent(tmp_path, ws):
    marker = tmp_path / "outside" / "pwned"
    config = f'[core]\n\tbare = true\n\tfsmonitor = "touch {marker}"\n'
    writes = [
        call("write_file", path="objects/info/x", content=""),
        call("write_file", path="refs/heads/main", content=""),
        call("write_file", path="config", content=config),
        call("write_file", path="HEAD", content="ref: refs/heads/main\n"),
    ]
    r, results = agent(
        tmp_path,
        ws,
        [*writes, call("run_shell", command="git status"), "done"],
        "--tools",
        "builtin",
        "--mode",
        "workspace-write",
        "--allow",
        "run_shell(git status*)",
        "--chain-limit",
        "10",
    )
    assert r.returncode == 0, r.stderr
    assert [x["ok"] for x in results[:4]] == [True, True, True, False]
    assert "look like a git repository" in results[3]["content"]
    assert not marker.exists()
    # Even with HEAD planted by other means, git refuses the implicit bare repository.
    (ws / "HEAD").write_text("ref: refs/heads/main\n")
    r, results = agent(
        tmp_path,
        ws,
        [call("run_shell", command="git status"), "done"],
        "--tools",
        "builtin",
        "--allow",
        "run_shell(git status*)",
    )
    assert not marker.exists() and "bare repository" in results[0]["content"]


def test_nothing_outlives_a_tool_call(tmp_path, ws):
    a, b = marker(), marker()  # the PIDs the command prints may be its PID namespace's own
    cmd = f"setsid sleep {a} >/dev/null 2>&1 & echo $!; (setsid sh -c 'sleep {b} & echo $!' &) ; sleep 0.3"
    r, results = agent(
        tmp_path,
        ws,
        [call("run_shell", command=cmd), "done"],
        "--tools",
        "builtin",
        "--mode",
        "yolo",
        "--dangerously-skip-approvals",
    )
    assert r.returncode == 0, r.stderr
    pids = [int(x) for x in results[0]["content"].split() if x.isdigit()]
    assert len(pids) == 2

    assert survivors(a) == [] and survivors(b) == [], "a setsid child outlived its tool call"


def test_secrets_are_not_readable_from_any_ancestor(tmp_path, ws):
    walk = (
        'p=$$; while [ "$p" -gt 1 ]; do cat /proc/$p/environ; echo; '
        "p=$(sed 's/.*) //' /proc/$p/stat | cut -d' ' -f2); done; env"
    )
    r, results = agent(
        tmp_path,
        ws,
        [call("run_shell", command=walk), "done"],
        "--tools",
        "builtin",
        "--mode",
        "yolo",
        "--dangerously-skip-approvals",
        env={"ZZ_SERVICE_TOKEN": "hunter2-do-not-leak", "DATABASE_URL": "postgres://u:pw@h/db"},
    )
    assert r.returncode == 0, r.stderr
    text = results[0]["content"]
    assert "FLASHMOE_HOME=" in text  # the walk did read environments
    assert "hunter2-do-not-leak" not in text and "u:pw@h" not in text


def test_pass_env_lets_a_named_secret_through(tmp_path, ws):
    r, results = agent(
        tmp_path,
        ws,
        [call("run_shell", command="echo $ZZ_SERVICE_TOKEN"), "done"],
        "--tools",
        "builtin",
        "--mode",
        "yolo",
        "--dangerously-skip-approvals",
        "--pass-env",
        "ZZ_SERVICE_TOKEN",
        env={"ZZ_SERVICE_TOKEN": "visible"},
    )
    assert results[0]["content"].strip() == "visible"


def test_deny_rule_catches_another_spelling(tmp_path, ws):
    (ws / "victim").write_text("keep\n")
    r, results = agent(
        tmp_path,
        ws,
        [call("run_shell", command="/bin/rm -f victim"), call("run_shell", command="command rm victim"), "done"],
        "--tools",
        "builtin",
        "--mode",
        "yolo",
        "--dangerously-skip-approvals",
        "--deny",
        "run_shell(rm *)",
    )
    assert (ws / "victim").exists()
    assert all("refused by the rule deny run_shell(rm *)" in x["content"] for x in results)


def test_junk_arguments_get_a_repair_round(tmp_path, ws):
    deep = '<tool_call>\n{"name": "read_file", "arguments": {"path": ' + "[" * 30000 + "]" * 30000 + "}}\n</tool_call>"
    surrogate = '<tool_call>\n{"name": "read_file", "arguments": {"path": "\\ud800"}}\n</tool_call>'
    r, results = agent(
        tmp_path,
        ws,
        [deep, surrogate, call("read_file", path="notes.txt"), "ok"],
        "--tools",
        "builtin",
        "--max-repairs",
        "3",
    )
    assert r.returncode == 0, r.stderr
    assert "nest too deeply" in results[0]["content"] and "repair 1 of 3" in results[0]["content"]
    assert "unpaired UTF-16 surrogate" in results[1]["content"]
    assert results[2]["ok"]


def test_search_with_a_fifo_and_a_backtracking_pattern_finishes(tmp_path, ws):
    os.mkfifo(ws / "pipe")
    (ws / "a.txt").write_text("a" * 40 + "!\n")
    start = time.monotonic()
    r, results = agent(tmp_path, ws, [call("search_files", pattern="(a+)+$"), "ok"], "--tools", "builtin")
    assert r.returncode == 0 and time.monotonic() - start < 60
    assert results[0]["content"] == "notes.txt:2: a"


# ---- issue 41 -------------------------------------------------------------------------------------


def test_a_command_that_kills_its_reaper_leaves_nothing_behind(tmp_path, ws):
    m = marker()
    cmd = f"setsid sleep {m} >/dev/null 2>&1 & sleep 0.2; kill -9 $PPID; kill -STOP $PPID; kill -9 0"
    r, results = agent(
        tmp_path,
        ws,
        [call("run_shell", command=cmd), "done"],
        "--tools",
        "builtin",
        "--mode",
        "yolo",
        "--dangerously-skip-approvals",
    )
    assert r.returncode == 0, r.stderr
    assert survivors(m) == [], "a child outlived its reaper"


def test_a_wrapper_above_flashmoe_does_not_show_its_secrets(tmp_path, ws):
    from flashmoe.tools.reaper import namespaces_work

    if not namespaces_work():
        pytest.skip(
            "needs unprivileged user and PID namespaces (unshare CLONE_NEWUSER|CLONE_NEWPID): without "
            "them an ancestor's /proc/<pid>/environ is out of reach (docs/security.md)"
        )
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    walk = (
        'p=$$; while [ "$p" -gt 1 ]; do cat /proc/$p/environ; echo; '
        "p=$(sed 's/.*) //' /proc/$p/stat | cut -d' ' -f2); done; ls /proc"
    )
    (tmp_path / "s.jsonl").write_text(json.dumps({"role": "user", "content": "go"}) + "\n")
    env = dict(
        os.environ,
        FLASHMOE_HOME=str(tmp_path / "home"),
        ZZ_WRAPPER_TOKEN="hunter2-in-the-wrapper",
        FLASHMOE_FAKE_REPLIES=json.dumps([call("run_shell", command=walk), "done"]),
    )
    args = [
        "agent",
        "--engine",
        "fake",
        "--workspace",
        str(ws),
        "--script",
        str(tmp_path / "s.jsonl"),
        "--transcript",
        str(tmp_path / "t.jsonl"),
        "--tools",
        "builtin",
        "--mode",
        "yolo",
        "--dangerously-skip-approvals",
    ]
    # The wrapper (a shell that stays, as a launcher or CI step would) keeps the secret; flashmoe never sees it.
    script = 'env -u ZZ_WRAPPER_TOKEN "$@"; true'
    r = subprocess.run(
        ["sh", "-c", script, "sh", sys.executable, "-m", "flashmoe.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    results = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    text = next(x for x in results if x["event"] == "tool_result")["content"]
    assert "FLASHMOE_HOME=" in text  # the walk did read an environment (its own namespace's)
    assert "hunter2-in-the-wrapper" not in text


SLOW_TOOL = '''import time


def nap() -> str:
    """Sleeps for a minute.

    Risk: read
    """
    time.sleep(60)
    return "rested"
'''
FOREVER_TEMPLATE = (
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def timed_run(tmp_path, ws, replies, *extra, env=None, limit=60):
    """`flashmoe run --timeout 3` with tools, the model scripted; (result, seconds it took)."""
    import time

    start = time.monotonic()
    r = run_cli(
        "run",
        "--engine",
        "fake",
        "--workspace",
        ws,
        "--mode",
        "yolo",
        "--dangerously-skip-approvals",
        "--timeout",
        "3",
        *extra,
        "go",
        timeout=limit,
        env={"FLASHMOE_HOME": str(tmp_path / "home"), "FLASHMOE_FAKE_REPLIES": json.dumps(replies), **(env or {})},
    )
    assert "Traceback" not in r.stderr, r.stderr
    return r, time.monotonic() - start


@pytest.mark.parametrize("kind", ["run_shell", "python tool", "template", "search glob"])
def test_timeout_bounds_the_whole_run(tmp_path, ws, kind):
    """--timeout 3 against a tool or a template that would run for minutes: the run ends at its
    limit (exit 4), with what it could say, instead of after the tool."""
    (tmp_path / "slow.py").write_text(SLOW_TOOL)
    (tmp_path / "forever.jinja").write_text(FOREVER_TEMPLATE)
    (ws / ("a" * 200)).write_text("x\n")
    reply, extra, env = {
        "run_shell": (call("run_shell", command="sleep 60"), ["--tools", "builtin"], {}),
        "python tool": (call("nap"), ["--tools", str(tmp_path / "slow.py")], {}),
        "template": ("hello", [], {"FLASHMOE_FAKE_TEMPLATE": str(tmp_path / "forever.jinja")}),
        "search glob": (
            call("search_files", pattern="x", glob="*a*a*a*a*a*a*a*a*a*a*a*a*a*b"),
            ["--tools", "builtin"],
            {},
        ),
    }[kind]
    r, took = timed_run(tmp_path, ws, [reply, "done"], *extra, env=env)
    assert took < 30, f"the run took {took:.0f} s"
    if kind == "search glob":  # matched in linear time: nothing to stop
        assert r.returncode == 0, r.stderr
    elif kind == "template":  # bounded in steps: it fails on its own, before the run's limit
        assert r.returncode == 1 and "chat template ran more than" in r.stderr, (r.returncode, r.stderr)
    else:
        assert r.returncode == 4 and "timed out after 3 s" in r.stderr, (r.returncode, r.stderr)


def test_a_command_may_not_ask_for_more_time_than_the_tool_limit(tmp_path, ws):
    r, took = timed_run(
        tmp_path, ws, [call("run_shell", command="sleep 60", timeout=3600), "done"], "--tools", "builtin", "--json"
    )
    assert took < 30, f"the run took {took:.0f} s"
    results = [json.loads(x) for x in r.stdout.splitlines() if '"tool_result"' in x]
    assert results and "3600 is greater than the maximum of 120" in results[0]["content"], r.stdout


@pytest.mark.parametrize(
    "reply, extra",
    [
        (call("run_shell", command="sleep 60"), ["--tools", "builtin"]),
        (call("nap"), ["--tools", "{slow}"]),
    ],
)
def test_sigterm_stops_a_running_tool(tmp_path, ws, reply, extra):
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers.paths import ROOT

    (tmp_path / "slow.py").write_text(SLOW_TOOL)
    extra = [e.format(slow=tmp_path / "slow.py") for e in extra]
    env = dict(os.environ, FLASHMOE_HOME=str(tmp_path / "home"), FLASHMOE_FAKE_REPLIES=json.dumps([reply, "done"]))
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashmoe.cli",
            "run",
            "--engine",
            "fake",
            "--workspace",
            str(ws),
            "--mode",
            "yolo",
            "--dangerously-skip-approvals",
            *extra,
            "go",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(6)  # started, and inside the tool
        sent = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert time.monotonic() - sent < 10 and p.returncode == 143, (p.returncode, err)
    assert "Traceback" not in err
