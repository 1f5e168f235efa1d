"""Issue 12's attacks on the tool layer, each written as the attacker would try it.

The model's side is played by calling the tools, the policy and the runner exactly as the agent
loop does with whatever arguments a model could write; tests/test_attacks_cli.py drives the same
attacks through `flashmoe agent` where they are visible to a user. docs/security.md keeps the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flashmoe.tools.builtin import Builtins, builtin_tools
from flashmoe.tools.calls import ToolCall
from flashmoe.tools.errors import PathRefused, ToolRunError
from flashmoe.tools.executor import ToolExecutor
from flashmoe.tools.parsers import get_parser, parse_calls
from flashmoe.tools.policy import Policy, ScriptedApprover
from flashmoe.tools.registry import Tool, ToolRegistry
from flashmoe.tools.runner import CommandRunner, run_command, scrub_env
from flashmoe.tools.user_tools import load_tool_file

from tests.helpers.processes import marker, survivors


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "notes.txt").write_text("b\na\n")
    (tmp_path / "outside").mkdir()
    return root


def executor_for(policy: Policy, tools, answers=None) -> ToolExecutor:
    return ToolExecutor(ToolRegistry(tools), policy, ScriptedApprover(answers or ["yes"] * 20))


# ---- 1. option injection into command tools -------------------------------------------------------

SORT_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "sort_file",
            "description": "Sort a file's lines.",
            "parameters": {"type": "object", "properties": {"file": {"type": "string"}}, "required": ["file"]},
        },
        "command": ["sort", "{file}"],
        "paths": ["file"],
    }
]


@pytest.mark.parametrize("value", ["-o{out}", "--output={out}", "--files0-from={out}", "-o", "--", "-"])
def test_option_injection_into_a_path_placeholder_is_refused(tmp_path, ws, value):
    out = tmp_path / "outside" / "x"
    (tmp_path / "flashmoe.tools.json").write_text(json.dumps(SORT_TOOL))
    policy = Policy(ws, "yolo", dangerously_skip_approvals=True)
    tools = load_tool_file(tmp_path / "flashmoe.tools.json", CommandRunner(cwd=ws))
    res = executor_for(policy, tools).execute(ToolCall("sort_file", {"file": value.format(out=out)}, "raw"))
    assert not res.ok and res.status == "denied", res.content
    assert "would be read as an option" in res.content
    assert not out.exists()


def test_option_injection_into_a_string_placeholder_is_refused(tmp_path, ws):
    out = tmp_path / "outside" / "x"
    tool = [
        {
            "name": "grep_word",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
            "command": ["grep", "-r", "{word}", "."],
        }
    ]
    (tmp_path / "flashmoe.tools.json").write_text(json.dumps(tool))
    policy = Policy(ws, "yolo", dangerously_skip_approvals=True)
    tools = load_tool_file(tmp_path / "flashmoe.tools.json", CommandRunner(cwd=ws))
    res = executor_for(policy, tools).execute(ToolCall("grep_word", {"word": f"--file={out}"}, "raw"))
    assert res.status == "denied" and "would be read as an option" in res.content


def test_values_after_a_literal_double_dash_may_start_with_a_dash(tmp_path, ws):
    (ws / "-odd.txt").write_text("z\ny\n")
    tool = [
        {
            "name": "sort_file",
            "parameters": {"type": "object", "properties": {"file": {"type": "string"}}, "required": ["file"]},
            "command": ["sort", "--", "{file}"],
            "paths": ["file"],
        }
    ]
    (tmp_path / "flashmoe.tools.json").write_text(json.dumps(tool))
    policy = Policy(ws, "yolo", dangerously_skip_approvals=True)
    tools = load_tool_file(tmp_path / "flashmoe.tools.json", CommandRunner(cwd=ws))
    res = executor_for(policy, tools).execute(ToolCall("sort_file", {"file": "-odd.txt"}, "raw"))
    assert res.ok, res.content
    assert res.content == "y\nz\n"


def test_the_command_gets_the_path_that_was_checked(tmp_path, ws, monkeypatch):
    # `~/x` was checked as $HOME/x but a program without a shell would open ./~/x: the argv now
    # carries the resolved path, so what runs is what the sandbox saw.
    monkeypatch.setenv("HOME", str(ws))
    (ws / "~").mkdir()
    (ws / "~" / "notes.txt").write_text("decoy\n")
    (tmp_path / "flashmoe.tools.json").write_text(json.dumps(SORT_TOOL))
    policy = Policy(ws, "yolo", dangerously_skip_approvals=True)
    tools = load_tool_file(tmp_path / "flashmoe.tools.json", CommandRunner(cwd=ws))
    res = executor_for(policy, tools).execute(ToolCall("sort_file", {"file": "~/notes.txt"}, "raw"))
    assert res.ok and res.content == "a\nb\n", res.content


# ---- 2. code execution through a planted git directory --------------------------------------------


def plant_git_dir(root: Path, marker: Path) -> None:
    """What `git init --bare` leaves, with a config that runs a command on `git status`."""
    (root / "objects").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "heads").mkdir(parents=True, exist_ok=True)
    (root / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "config").write_text(
        f'[core]\n\trepositoryformatversion = 0\n\tbare = true\n\tfsmonitor = "touch {marker}"\n\thooksPath = hooks\n'
    )


def test_planted_bare_repository_cannot_run_code_through_git(tmp_path, ws):
    marker = tmp_path / "outside" / "pwned"
    plant_git_dir(ws, marker)
    policy = Policy(ws, "ask", allow=["run_shell(git status*)"])
    ex = executor_for(policy, builtin_tools(policy), answers=[])
    res = ex.execute(ToolCall("run_shell", {"command": "git status"}, "raw"))
    assert policy.decide(ex.registry["run_shell"], {"command": "git status"}).action == "allow"
    assert not marker.exists(), res.content
    assert "bare repository" in res.content  # git says why it refused to use it


def test_planted_config_cannot_override_a_real_repository(tmp_path, ws):
    marker = tmp_path / "outside" / "pwned"
    subprocess.run(["git", "init", "-q", str(ws)], check=True)
    # Written by someone else before the session (tools cannot write .git): still neutralised.
    with open(ws / ".git" / "config", "a") as f:
        f.write(f'[core]\n\tfsmonitor = "touch {marker}"\n[core]\n\tpager = touch {marker}\n')
    res = run_command(["git", "status"], cwd=ws)
    assert res.ok, res.content
    assert not marker.exists()


@pytest.mark.parametrize(
    "order",
    [
        ("objects/x", "refs/heads/main", "config", "HEAD"),
        ("HEAD", "config", "objects/x", "refs/heads/main"),
        ("sub/HEAD", "sub/refs/x", "sub/objects/info/x", "sub/config"),
    ],
)
def test_writes_that_would_make_a_git_directory_are_refused(tmp_path, ws, order):
    policy = Policy(ws, "workspace-write")
    ex = executor_for(policy, builtin_tools(policy))
    results = [
        ex.execute(ToolCall("write_file", {"path": p, "content": "ref: refs/heads/main\n"}, "raw")) for p in order
    ]
    refused = [r for r in results if not r.ok]
    assert refused, [r.content for r in results]
    assert "git repository" in refused[0].content
    from flashmoe.tools.gitguard import looks_like_git_dir

    assert not looks_like_git_dir(ws) and not looks_like_git_dir(ws / "sub")


@pytest.mark.parametrize("path", [".git", "sub/.git", ".GIT"])
def test_a_dot_git_file_is_refused(ws, path):
    policy = Policy(ws, "workspace-write")
    ex = executor_for(policy, builtin_tools(policy))
    res = ex.execute(ToolCall("write_file", {"path": path, "content": "gitdir: /tmp/evil\n"}, "raw"))
    assert res.status == "denied"


# ---- 4. nothing outlives a tool call --------------------------------------------------------------


def test_children_that_call_setsid_are_killed():
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        print(os.getpid(), flush=True)\n"
        "        os.close(1); os.close(2)\n"
        "        time.sleep(100)\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
    )
    m = marker()  # in its command line: the PID it prints may be a PID namespace's own
    res = run_command([sys.executable, "-c", code, m], timeout=20)
    assert res.ok, res.content
    int(res.content.split()[0])
    assert survivors(m) == [], "a setsid daemon outlived its tool call"


def test_setsid_command_and_nohup_background_jobs_are_killed():
    a, b = marker(), marker()
    res = run_command(
        ["sh", "-c", f"setsid sleep {a} >/dev/null 2>&1 & echo $!; nohup sleep {b} >/dev/null 2>&1 & echo $!"],
        timeout=20,
    )
    pids = [int(x) for x in res.content.split()]
    assert len(pids) == 2 and survivors(a) == [] and survivors(b) == []


def test_timeout_kills_setsid_descendants_too():
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid(); print(os.getpid(), flush=True); time.sleep(100)\n"
        "time.sleep(100)\n"
    )
    m = marker()
    start = time.monotonic()
    res = run_command([sys.executable, "-c", code, m], timeout=1.5)
    assert res.status == "timeout" and time.monotonic() - start < 10
    int(res.content.split()[0])
    assert survivors(m) == []


def test_exit_code_and_signal_pass_through_the_reaper():
    assert run_command(["sh", "-c", "exit 7"]).exit_code == 7
    res = run_command(["sh", "-c", "kill -TERM $$"])
    assert res.exit_code == -15 and "killed by signal 15" in res.content


# ---- 5. no TOCTOU: a component swapped for a symlink after the check ------------------------------


def test_symlink_swapped_in_after_the_check_is_not_followed(tmp_path, ws, monkeypatch):
    (ws / "dir").mkdir()
    outside = tmp_path / "outside"
    b = Builtins(Policy(ws, "workspace-write").sandbox)
    real = b.sandbox.resolve

    def resolve_then_swap(path, **kw):
        p = real(path, **kw)
        (ws / "dir").rename(ws / "dir.old")
        (ws / "dir").symlink_to(outside)  # the race: the checked directory is now a link out
        return p

    monkeypatch.setattr(b.sandbox, "resolve", resolve_then_swap)
    with pytest.raises(PathRefused, match="symlink"):
        b.write_file("dir/x.txt", "owned")
    assert not (outside / "x.txt").exists()


def test_final_component_swapped_for_a_symlink_is_not_followed(tmp_path, ws, monkeypatch):
    target = tmp_path / "outside" / "victim"
    target.write_text("keep\n")
    b = Builtins(Policy(ws, "workspace-write").sandbox)
    real = b.sandbox.resolve

    def resolve_then_swap(path, **kw):
        p = real(path, **kw)
        (ws / "notes.txt").unlink()
        (ws / "notes.txt").symlink_to(target)
        return p

    monkeypatch.setattr(b.sandbox, "resolve", resolve_then_swap)
    with pytest.raises(PathRefused, match="symlink"):
        b.write_file("notes.txt", "owned")
    assert target.read_text() == "keep\n"


def test_reads_do_not_follow_a_swapped_symlink(tmp_path, ws, monkeypatch):
    secret = tmp_path / "outside" / "secret"
    secret.write_text("s3cret\n")
    b = Builtins(Policy(ws, "ask").sandbox)
    real = b.sandbox.resolve

    def resolve_then_swap(path, **kw):
        p = real(path, **kw)
        (ws / "notes.txt").unlink()
        (ws / "notes.txt").symlink_to(secret)
        return p

    monkeypatch.setattr(b.sandbox, "resolve", resolve_then_swap)
    with pytest.raises(PathRefused):
        b.read_file("notes.txt")


def test_writes_through_a_hard_link_to_an_outside_file_are_refused(tmp_path, ws):
    victim = tmp_path / "outside" / "victim"
    victim.write_text("keep\n")
    os.link(victim, ws / "innocent.txt")
    policy = Policy(ws, "workspace-write")
    ex = executor_for(policy, builtin_tools(policy))
    for call in (
        ToolCall("write_file", {"path": "innocent.txt", "content": "owned"}, "raw"),
        ToolCall("edit_file", {"path": "innocent.txt", "old_string": "keep", "new_string": "owned"}, "raw"),
    ):
        res = ex.execute(call)
        assert not res.ok and "hard link" in res.content, res.content
    assert victim.read_text() == "keep\n"


def test_hard_links_inside_the_workspace_may_be_written(ws):
    os.link(ws / "notes.txt", ws / "twin.txt")
    b = Builtins(Policy(ws, "workspace-write").sandbox)
    b.write_file("twin.txt", "new\n")
    assert (ws / "notes.txt").read_text() == "new\n"


def test_symlinks_inside_the_workspace_still_work(ws):
    (ws / "src").mkdir()
    (ws / "src" / "a.py").write_text("x = 1\n")
    (ws / "alias").symlink_to(ws / "src")
    b = Builtins(Policy(ws, "workspace-write").sandbox)
    assert b.read_file("alias/a.py") == "x = 1\n"
    b.write_file("alias/b.py", "y = 2\n")
    assert (ws / "src" / "b.py").read_text() == "y = 2\n"


# ---- 6. junk arguments are refused with a repair round, never a traceback -------------------------

JUNK = {
    "lone surrogate": '{"name": "read_file", "arguments": {"path": "\\ud800.txt"}}',
    "30,000-deep nesting": '{"name": "read_file", "arguments": {"path": ' + "[" * 30000 + "]" * 30000 + "}}",
    "5,000-digit number": '{"name": "read_file", "arguments": {"path": "a", "offset": ' + "9" * 5000 + "}}",
    "huge string": '{"name": "read_file", "arguments": {"path": "' + "a" * 3_000_000 + '"}}',
}


@pytest.mark.parametrize("kind", list(JUNK))
@pytest.mark.parametrize("fmt", ["json_tools", "plain_json", "mistral"])
def test_junk_arguments_get_a_message_and_a_repair_round(ws, kind, fmt):
    body = JUNK[kind]
    raw = {"json_tools": f"<tool_call>\n{body}\n</tool_call>", "plain_json": body, "mistral": f"[TOOL_CALLS][{body}]"}[
        fmt
    ]
    calls = parse_calls(get_parser(fmt), raw, None)
    assert len(calls) == 1
    policy = Policy(ws, "ask")
    ex = executor_for(policy, builtin_tools(policy))
    res = ex.execute(calls[0])
    assert res.status == "invalid" and not res.stop, res.content
    assert len(res.content) < 2000
    json.dumps(res.content).encode("utf-8")  # loggable as it is
    res.content.encode("utf-8")


def test_junk_in_an_openai_arguments_string(ws):
    policy = Policy(ws, "ask")
    ex = executor_for(policy, builtin_tools(policy))
    call = ToolCall.from_openai(
        {"function": {"name": "read_file", "arguments": '{"path": ' + "[" * 30000 + "]" * 30000 + "}"}}
    )
    res = ex.execute(call)
    assert res.status == "invalid" and "nest" in res.content


# ---- 7. read-only tools have limits ---------------------------------------------------------------


def finishes(fn, limit: float):
    box: dict = {}

    def work():
        try:
            box["v"] = fn()
        except Exception as e:
            box["e"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), "the tool hung"
    if "e" in box:
        raise box["e"]
    return box.get("v")


def test_catastrophic_regex_stops_at_its_time_limit(ws):
    (ws / "a.txt").write_text("a" * 60 + "!\n")
    b = Builtins(Policy(ws, "ask").sandbox, time_limit=1.0)
    # (a+)+$ hangs Python's re for hours on this line; the regex engine sees through it
    assert finishes(lambda: b.search_files(r"(a+)+$"), 15) == "notes.txt:2: a"
    # (a|aa)+$ backtracks exponentially in any backtracking engine: the time limit stops it
    out = finishes(lambda: b.search_files(r"(a|aa)+$", glob="a.txt"), 15)
    assert "stopped at the time limit of 1 s in a.txt:1" in out


def test_search_skips_fifos_and_devices(ws):
    os.mkfifo(ws / "pipe")
    (ws / "b.txt").write_text("needle\n")
    b = Builtins(Policy(ws, "ask").sandbox)
    out = finishes(lambda: b.search_files("needle"), 10)
    assert out == "b.txt:1: needle"


def test_read_file_refuses_a_fifo_without_blocking(ws):
    os.mkfifo(ws / "pipe")
    b = Builtins(Policy(ws, "ask").sandbox)
    with pytest.raises(ToolRunError, match="not a regular file"):
        finishes(lambda: b.read_file("pipe"), 10)


def test_every_tool_has_a_wall_clock_limit(ws):
    def slow() -> str:
        """Sleeps."""
        time.sleep(30)
        return "late"

    tool = Tool("slow", "Sleeps.", {"type": "object", "properties": {}}, slow, "read", source="test")
    ex = ToolExecutor(ToolRegistry([tool]), Policy(ws, "ask"), ScriptedApprover([]), time_limit=0.5)
    start = time.monotonic()
    res = ex.execute(ToolCall("slow", {}, "raw"))
    assert time.monotonic() - start < 5
    assert res.status == "timeout" and "0.5 s" in res.content


# ---- 9. secrets do not reach commands --------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "MY_API_TOKEN",
        "TOKEN",
        "GH_TOKEN_FOR_CI",
        "APP_SECRET_VALUE",
        "DB_PASSWORD",
        "OPENAI_API_KEY",
        "KEY",
        "SIGNING_KEY_ID",
        "GITHUB_PAT",
        "DATABASE_URL",
        "AWS_PROFILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AZURE_CLIENT_ID",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "CLOUDSDK_AUTH_ACCESS_TOKEN_FILE",
        "KUBECONFIG",
        "DOCKER_CONFIG",
        "SSH_AUTH_SOCK",
        "NETRC",
    ],
)
def test_secret_variables_are_scrubbed(name):
    assert name not in scrub_env({name: "x", "PATH": "/bin"})


def test_the_allow_list_lets_named_variables_through():
    env = {"MY_API_TOKEN": "x", "PATH": "/bin", "HOME": "/h", "LANG": "C.UTF-8"}
    assert scrub_env(env) == {"PATH": "/bin", "HOME": "/h", "LANG": "C.UTF-8"}
    assert scrub_env(env, allow=["MY_API_TOKEN"])["MY_API_TOKEN"] == "x"


def test_relative_path_entries_are_dropped_from_commands_path(ws):
    env = scrub_env({"PATH": f".:/usr/bin::bin:{ws}"}, workspace=ws)
    assert env["PATH"] == "/usr/bin"


def test_a_command_cannot_read_the_parents_environment_through_proc(tmp_path):
    # The parent is a real process started with a secret in its environment, as a user's shell
    # would start flashmoe; its tool command walks /proc up to init.
    code = (
        "import sys; from tools.runner import run_command, seal_environment\n"
        "seal_environment()\n"
        'cmd = \'p=$$; while [ "$p" -gt 1 ]; do cat /proc/$p/environ; echo; '
        'p=$(sed "s/.*) //" /proc/$p/stat | cut -d" " -f2); done\'\n'
        "print(run_command(['sh', '-c', cmd]).content)\n"
    )
    env = dict(os.environ, ZZ_SERVICE_TOKEN="hunter2-do-not-leak", PYTHONPATH=str(Path(__file__).parents[2]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "PATH=" in out.stdout  # it did read environments
    assert "hunter2-do-not-leak" not in out.stdout


@pytest.mark.parametrize(
    "path",
    [
        "~/.aws/credentials",
        "~/.netrc",
        "~/.git-credentials",
        "~/.config/gh/hosts.yml",
        "~/.docker/config.json",
        "~/.kube/config",
        "~/.ssh/id_ed25519",
        ".aws/credentials",
        ".netrc",
        ".config/gh/hosts.yml",
        ".gnupg/secring.gpg",
        ".pypirc",
        ".npmrc",
    ],
)
def test_credential_files_are_refused_with_the_workspace_at_home(tmp_path, monkeypatch, path):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    full = home / path.removeprefix("~/")
    full.parent.mkdir(parents=True, exist_ok=True)
    full.write_text("secret\n")
    policy = Policy(home, "yolo", dangerously_skip_approvals=True)
    ex = executor_for(policy, builtin_tools(policy))
    res = ex.execute(ToolCall("read_file", {"path": path}, "raw"))
    assert res.status == "denied" and "deny list" in res.content, res.content


# ---- 12. deny rules match what runs; allow prefixes match whole words -----------------------------


@pytest.mark.parametrize(
    "command",
    [
        "rm -rf x",
        "rm\t-f x",
        "/bin/rm -f x",
        "command rm x",
        "env rm x",
        "env -i FOO=1 rm x",
        "'rm' x",
        '"r"m x',
        "\\rm x",
        "FOO=1 rm x",
        "nice -n 5 rm x",
        "nohup rm x",
        "sudo rm x",
        "exec rm x",
        "timeout 5 rm x",
        "sh -c 'rm -f x'",
        'bash -c "ls; rm x"',
        "true && rm x",
        "ls | xargs rm",
        "find . -exec rm {} ;",
        "busybox rm x",
        "ls\nrm x",
        "$(echo rm) x",
        "`echo rm` x",
        "r${X}m x",
        "rm",
    ],
)
def test_deny_rules_catch_every_spelling_of_the_program(ws, command):
    policy = Policy(ws, "yolo", dangerously_skip_approvals=True, deny=["run_shell(rm *)"])
    tool = ToolRegistry(builtin_tools(policy))["run_shell"]
    assert policy.decide(tool, {"command": command}).action == "deny", command


@pytest.mark.parametrize("command", ["ls -l", "echo rm", "grep -r rm .", "git rm --cached x"])
def test_deny_rules_do_not_catch_arguments_that_merely_name_the_program(ws, command):
    policy = Policy(ws, "yolo", dangerously_skip_approvals=True, deny=["run_shell(rm *)"])
    tool = ToolRegistry(builtin_tools(policy))["run_shell"]
    assert policy.decide(tool, {"command": command}).action == "allow", command


@pytest.mark.parametrize(
    "command, allowed",
    [
        ("git status", True),
        ("git status --short", True),
        ("git  status", True),
        ("git statusx", False),
        ("git status; rm -rf ~", False),
        ("./git status", False),
        ("/tmp/git status", False),
        ("git diff", True),
        ("git diff HEAD~1", True),
        ("git diff --output=/tmp/x", False),
        ("git diff --output /tmp/x", False),
        ("git diff --ext-diff", False),
        ("git -c core.pager=sh diff", False),
        ("git diff --no-index /etc/shadow x", False),
    ],
)
def test_allow_prefixes_match_whole_words_and_not_side_effect_options(ws, command, allowed):
    policy = Policy(ws, "ask", allow=["run_shell(git status*)", "run_shell(git diff*)"])
    tool = ToolRegistry(builtin_tools(policy))["run_shell"]
    assert (policy.decide(tool, {"command": command}).action == "allow") is allowed, command


# ---- 13. a user's tool file that is nested absurdly deep, a FIFO, or huge -------------------------


@pytest.mark.parametrize("kind", ["json", "yaml", "fifo", "huge"])
def test_a_tool_file_that_cannot_be_read_is_one_line(tmp_path, kind):
    from flashmoe.tools.errors import ToolFileError

    path = tmp_path / ("flashmoe.tools.yaml" if kind == "yaml" else "flashmoe.tools.json")
    if kind in ("json", "yaml"):
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text(" " * (17 << 20))
    with pytest.raises(ToolFileError) as e:
        finishes(lambda: load_tool_file(path), 10)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)
    assert {"json": "nested too deeply", "yaml": "nested too deeply", "fifo": "not a regular file", "huge": "at most"}[
        kind
    ] in str(e.value)
