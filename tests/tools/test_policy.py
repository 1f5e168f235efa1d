"""Policy: sandbox, deny list, modes, deny > ask > allow, approvers."""

from __future__ import annotations

import os

import pytest

from flashmoe.tools.builtin import builtin_tools
from flashmoe.tools.calls import ToolCall
from flashmoe.tools.errors import PathRefused, PolicyError
from flashmoe.tools.policy import NonInteractiveApprover, Policy, Rule, Sandbox, ScriptedApprover, glob_regex
from flashmoe.tools.registry import ToolRegistry


@pytest.fixture
def ws(tmp_path):
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("print(1)\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    (root / ".env").write_text("TOKEN=1\n")
    (root / "sub").mkdir()
    (root / "sub" / ".env.local").write_text("X=1\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("s\n")
    (root / "link_out").symlink_to(outside)
    (root / "file_out").symlink_to(outside / "secret.txt")
    (root / "innocent").symlink_to(root / ".env")
    return root


def tools_for(policy):
    return ToolRegistry(builtin_tools(policy))


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("../outside/secret.txt", "is outside the workspace"),
        ("src/../../outside/secret.txt", "is outside the workspace"),
        ("/etc/passwd", "is outside the workspace"),
        ("~/.ssh/id_rsa", "is outside the workspace"),
        ("link_out/secret.txt", "resolves through a symlink to"),
        ("file_out", "resolves through a symlink to"),
        (".env", "is on the deny list (**/.env*)"),
        ("sub/.env.local", "is on the deny list (**/.env*)"),
        ("innocent", "is on the deny list (**/.env*)"),  # a link to .env
        (".ENV", "is on the deny list (**/.env*)"),
        (".git/config", "is on the deny list (.git/**)"),
        (".git", "is on the deny list (.git/**)"),
        ("sub/.git/HEAD", "is on the deny list (**/.git/**)"),
        ("", "empty path"),
    ],
)
def test_sandbox_refusals(ws, path, fragment):
    sb = Sandbox(ws)
    with pytest.raises(PathRefused) as e:
        sb.resolve(path)
    assert fragment in str(e.value)


def test_sandbox_allows_inside(ws):
    sb = Sandbox(ws)
    assert sb.resolve("src/a.py") == (ws / "src" / "a.py").resolve()
    assert sb.resolve(str(ws / "src" / "a.py")) == (ws / "src" / "a.py").resolve()
    assert sb.resolve("src/../src/new.py") == (ws / "src" / "new.py").resolve()
    assert sb.resolve(".") == ws.resolve()
    assert sb.relative(sb.resolve("src/a.py")) == "src/a.py"


def test_home_ssh_is_denied_even_inside_workspace(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    sb = Sandbox(home)
    with pytest.raises(PathRefused, match=r"deny list \(~/\.ssh/\*\*\)"):
        sb.resolve(".ssh/id_rsa")


def test_exact_refusal_messages(ws):
    sb = Sandbox(ws)
    root = ws.resolve()
    assert sb.check("../x") == f"path '../x' is outside the workspace {root}"
    assert sb.check(".env") == "path '.env' is on the deny list (**/.env*); tools may never read it"
    assert sb.check(".git/config", write=True) == (
        "path '.git/config' is on the deny list (.git/**); tools may never write it"
    )


@pytest.mark.parametrize(
    "pattern, yes, no",
    [
        ("src/**", ["src", "src/a.py", "src/x/y.py"], ["srcs/a.py", "lib/src/a.py"]),
        ("**/.env*", [".env", "a/.env", "a/b/.env.local"], ["env", "a.env"]),
        ("git status*", ["git status", "git status --short"], ["git stash"]),
        ("*.py", ["a.py", "src/a.py"], ["a.pyc"]),
        ("[ab].txt", ["a.txt", "b.txt"], ["c.txt"]),
        ("[!ab].txt", ["c.txt"], ["a.txt"]),
    ],
)
def test_glob(pattern, yes, no):
    rx = glob_regex(pattern)
    assert all(rx.match(s) for s in yes)
    assert not any(rx.match(s) for s in no)


def test_rule_parse():
    r = Rule.parse("run_shell(git status*)", "allow")
    assert (r.tool, r.pattern, r.text) == ("run_shell", "git status*", "run_shell(git status*)")
    assert Rule.parse("read_file", "deny").pattern is None
    with pytest.raises(PolicyError, match="bad allow rule"):
        Rule.parse("run_shell(", "allow")
    with pytest.raises(PolicyError):
        Rule.parse("x", "maybe")  # type: ignore[arg-type]


def decide(policy, name, **args):
    return policy.decide(tools_for(policy)[name], args)


def test_file_tools_refused_through_policy(ws):
    p = Policy(ws, "yolo", dangerously_skip_approvals=True)
    for name, args in [
        ("read_file", {"path": ".env"}),
        ("write_file", {"path": ".git/hooks/pre-commit", "content": ""}),
        ("edit_file", {"path": "../outside/secret.txt", "old_string": "s", "new_string": "t"}),
        ("read_file", {"path": "link_out/secret.txt"}),
        ("list_dir", {"path": ".git"}),
        ("search_files", {"pattern": "x", "path": "../outside"}),
    ]:
        d = decide(p, name, **args)
        assert d.action == "deny", (name, args, d)


def test_modes(ws):
    ask = Policy(ws)
    assert ask.mode == "ask"
    assert decide(ask, "read_file", path="src/a.py").action == "allow"
    d = decide(ask, "write_file", path="src/b.py", content="")
    assert (d.action, d.reason) == ("ask", "write_file(src/b.py) changes files in the workspace")
    d = decide(ask, "run_shell", command="ls")
    assert (d.action, d.explicit, d.reason) == ("ask", True, "run_shell(ls) runs a command and needs an explicit yes")

    ro = Policy(ws, "read-only")
    assert decide(ro, "read_file", path="src/a.py").action == "allow"
    d = decide(ro, "write_file", path="src/b.py", content="")
    assert (d.action, d.reason) == (
        "deny",
        "write_file(src/b.py) is refused: read-only mode allows only tools that read (write_file has risk 'write')",
    )
    assert decide(Policy(ws, "read-only", allow=["run_shell"]), "run_shell", command="ls").action == "deny"

    ww = Policy(ws, "workspace-write")
    assert decide(ww, "write_file", path="src/b.py", content="").action == "allow"
    assert decide(ww, "run_shell", command="ls").action == "ask"  # commands still need a yes

    yolo = Policy(ws, "yolo", dangerously_skip_approvals=True)
    assert decide(yolo, "run_shell", command="rm -rf build").action == "allow"


def test_yolo_needs_the_flag(ws):
    with pytest.raises(PolicyError, match="dangerously_skip_approvals=True"):
        Policy(ws, "yolo")
    with pytest.raises(PolicyError, match="unknown mode 'auto'"):
        Policy(ws, "auto")


def test_deny_beats_ask_beats_allow(ws):
    p = Policy(
        ws,
        "ask",
        allow=["write_file(src/**)", "run_shell(git *)"],
        deny=["write_file(src/secret*)", "run_shell(git push*)"],
        ask=["write_file(src/conf/**)"],
    )
    assert decide(p, "write_file", path="src/x.py", content="").action == "allow"
    d = decide(p, "write_file", path="src/secret.py", content="")
    assert (d.action, d.rule) == ("deny", "write_file(src/secret*)")
    assert d.reason == "write_file(src/secret.py) is refused by the rule deny write_file(src/secret*)"
    assert decide(p, "write_file", path="src/conf/a.toml", content="").action == "ask"
    assert decide(p, "run_shell", command="git status").action == "allow"
    assert decide(p, "run_shell", command="git push origin main").action == "deny"
    # order of arguments does not matter: deny is checked first
    p2 = Policy(ws, "yolo", dangerously_skip_approvals=True, allow=["read_file"], deny=["read_file(src/**)"])
    assert decide(p2, "read_file", path="src/a.py").action == "deny"
    assert decide(p2, "read_file", path="other.txt").action == "allow"


def test_allow_rule_is_on_the_resolved_path(ws):
    p = Policy(ws, "ask", allow=["write_file(src/**)"])
    assert decide(p, "write_file", path="src/../setup.py", content="").action == "ask"
    assert decide(p, "write_file", path=str(ws / "src" / "z.py"), content="").action == "allow"


def test_allow_rule_does_not_cover_chained_commands(ws):
    p = Policy(ws, "ask", allow=["run_shell(git status*)"], deny=["run_shell(rm *)"])
    assert decide(p, "run_shell", command="git status --short").action == "allow"
    for cmd in [
        "git status; rm -rf ~",
        "git status && curl x | sh",
        "git status $(reboot)",
        "git status > f",
        "git status `id`",
        "git status\nrm x",
    ]:
        assert decide(p, "run_shell", command=cmd).action in ("ask", "deny"), cmd
    assert decide(p, "run_shell", command="ls; rm -rf build").action == "deny"
    assert decide(p, "run_shell", command="echo hi && rm x").action == "deny"


def test_ask_rule_applies_even_in_workspace_write_and_yolo(ws):
    p = Policy(ws, "yolo", dangerously_skip_approvals=True, ask=["write_file(*.toml)"])
    assert decide(p, "write_file", path="pyproject.toml", content="").action == "ask"


def test_noninteractive_approver_fails_closed():
    a = NonInteractiveApprover()
    call = ToolCall("run_shell", {"command": "ls"}, "raw")
    assert a.ask(call, "needs a yes") == "no"
    assert a.approval_needed and a.needed == [(call, "needs a yes")]
    assert a.interactive is False


def test_scripted_approver():
    a = ScriptedApprover(["yes", "always"])
    c = ToolCall("x", {}, "raw")
    assert [a.ask(c, "r"), a.ask(c, "r"), a.ask(c, "r")] == ["yes", "always", "no"]


def test_policy_rules_from_constructor_and_add(ws):
    p = Policy(ws)
    p.add_rule("run_shell(make test)", "allow")
    assert decide(p, "run_shell", command="make test").action == "allow"
    assert decide(p, "run_shell", command="make testx").action == "ask"
    assert os.fspath(p.workspace) == os.fspath(ws.resolve())
