"""ToolExecutor end to end: parse -> validate -> policy -> approval -> run."""

from __future__ import annotations

import pytest

from flashmoe.tools.builtin import register_builtins
from flashmoe.tools.calls import ToolCall
from flashmoe.tools.errors import ToolRunError
from flashmoe.tools.executor import ToolExecutor
from flashmoe.tools.parsers import json_tools
from flashmoe.tools.policy import NonInteractiveApprover, Policy, ScriptedApprover
from flashmoe.tools.registry import Tool, ToolRegistry


@pytest.fixture
def ws(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / ".env").write_text("KEY=1\n")
    return tmp_path


def make(ws, mode="ask", approver=None, **kw):
    rules = {k: kw.pop(k) for k in ("allow", "ask", "deny", "dangerously_skip_approvals") if k in kw}
    policy = Policy(ws, mode, **rules)
    reg = register_builtins(ToolRegistry(), policy)
    return ToolExecutor(reg, policy, approver, **kw)


def call(name, **args):
    return ToolCall(name, args, f"<tool_call>{name}</tool_call>")


def parsed(text):
    (c,) = json_tools.parse_tool_call(text)
    return c


def test_read_runs(ws):
    ex = make(ws)
    res = ex.execute(call("read_file", path="a.txt"))
    assert (res.ok, res.content, res.status, res.name) == (True, "hello\n", "ok", "read_file")
    assert ex.records[-1].decision == "allow" and ex.records[-1].status == "ok"


def test_refusals_are_messages(ws):
    ex = make(ws)
    res = ex.execute(call("read_file", path=".env"))
    assert (res.ok, res.status) == (False, "denied")
    assert res.content == "refused: path '.env' is on the deny list (**/.env*); tools may never read it"
    res = ex.execute(call("write_file", path="../x.txt", content="x"))
    assert res.content == f"refused: path '../x.txt' is outside the workspace {ws.resolve()}"
    assert not (ws.parent / "x.txt").exists()


def test_run_shell_needs_approval_and_headless_fails_closed(ws):
    approver = NonInteractiveApprover()
    ex = make(ws, "workspace-write", approver)
    res = ex.execute(call("run_shell", command="touch made.txt"))
    assert (res.ok, res.status) == (False, "approval-needed")
    assert res.content == (
        "refused: run_shell(touch made.txt) runs a command and needs an explicit yes, and this "
        "run is non-interactive, so nobody can approve it. Do not retry; continue without it or "
        "tell the user what needs approval."
    )
    assert not (ws / "made.txt").exists()
    assert ex.approval_needed and approver.needed[0][0].arguments == {"command": "touch made.txt"}
    # writes are fine in workspace-write without asking
    assert ex.execute(call("write_file", path="w.txt", content="w")).ok
    assert len(approver.needed) == 1


def test_default_approver_is_noninteractive(ws):
    ex = make(ws)
    assert isinstance(ex.approver, NonInteractiveApprover)
    assert ex.execute(call("write_file", path="w.txt", content="w")).status == "approval-needed"
    assert not (ws / "w.txt").exists()


def test_allow_rule_or_yolo_covers_run_shell(ws):
    ex = make(ws, "ask", allow=["run_shell(echo *)"])
    res = ex.execute(call("run_shell", command="echo hi"))
    assert (res.ok, res.content, res.exit_code) == (True, "hi\n", 0)
    assert ex.execute(call("run_shell", command="echo hi; touch x")).status == "approval-needed"
    ex = make(ws, "yolo", dangerously_skip_approvals=True)
    assert ex.execute(call("run_shell", command="echo yolo")).content == "yolo\n"


def test_interactive_answers(ws):
    approver = ScriptedApprover(["no", "yes", "always"])
    ex = make(ws, "ask", approver)
    res = ex.execute(call("run_shell", command="echo 1"))
    assert (res.status, res.content) == (
        "declined",
        "the user declined this call (run_shell(echo 1) runs a command "
        "and needs an explicit yes). Do not retry it; ask the user "
        "or try another way.",
    )
    assert ex.execute(call("run_shell", command="echo 1")).content == "1\n"
    assert ex.execute(call("run_shell", command="echo 2")).content == "2\n"  # "always" for this command
    assert ex.execute(call("run_shell", command="echo 2")).content == "2\n"  # no question asked
    assert len(approver.asked) == 3
    assert ex.execute(call("run_shell", command="echo 3")).status == "declined"  # other commands still ask
    assert [r.decision for r in ex.records] == ["ask:no", "ask:yes", "ask:always", "ask:granted", "ask:no"]


def test_deny_rule_beats_allow_in_executor(ws):
    ex = make(ws, "yolo", dangerously_skip_approvals=True, allow=["write_file"], deny=["write_file(*.cfg)"])
    res = ex.execute(call("write_file", path="x.cfg", content=""))
    assert res.content == "refused: write_file(x.cfg) is refused by the rule deny write_file(*.cfg)"


def test_validation_and_repair_rounds(ws):
    ex = make(ws, max_repairs=2)
    bad = parsed('<tool_call>{"name": "read_file", "arguments": {"path": 1}}</tool_call>')
    msgs = [ex.execute(bad) for _ in range(3)]
    base = "invalid arguments for 'read_file': $.path: 1 is not of type 'string'"
    assert [m.content for m in msgs] == [
        base + "\nFix the call and try again (repair 1 of 2).",
        base + "\nFix the call and try again (repair 2 of 2).",
        base + "\nThe repair limit (2) is reached for this turn: stop calling tools and answer with what you have.",
    ]
    assert [m.stop for m in msgs] == [False, False, True]
    assert all(m.status == "invalid" for m in msgs)
    assert [r.raw for r in ex.rejected] == [bad.raw] * 3
    ex.begin_turn()
    assert ex.execute(bad).content == base + "\nFix the call and try again (repair 1 of 2)."


def test_unknown_tool_message(ws):
    ex = make(ws)
    res = ex.execute(parsed('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'))
    assert res.content.splitlines()[0] == (
        "unknown tool 'bash'; available: read_file, list_dir, search_files, write_file, edit_file, run_shell"
    )


def test_backslash_call_is_repaired_run_and_reported(ws):
    ex = make(ws)
    raw = "<tool_call>\n{\\name\\: \\read_file\\, \\arguments\\: {\\path\\: \\a.txt\\}}\n</tool_call>"
    res = ex.execute(parsed(raw))
    assert res.ok
    assert res.content == (
        "[note: malformed JSON in the arguments for 'read_file': the arguments use backslashes "
        "where JSON needs double quotes (a known low-bit quantization failure). The call was run "
        "with double quotes put back; write standard JSON next time.]\nhello\n"
    )
    assert [(r.raw, r.repaired) for r in ex.rejected] == [(raw, True)]
    assert ex.repair.rounds == 0
    strict = make(ws, accept_repaired=False)
    res = strict.execute(parsed(raw))
    assert res.status == "invalid" and "(a known low-bit quantization failure)" in res.content


def test_chain_limit(ws):
    ex = make(ws, chain_limit=2)
    c = call("read_file", path="a.txt")
    assert ex.execute_round([c, c]) and ex.execute(c).ok
    assert ex.chain_exhausted
    res = ex.execute(c)
    assert (res.status, res.stop) == ("chain-limit", True)
    assert res.content == (
        "refused: the chain limit is reached (2 rounds of tool calls for this message); answer "
        "the user with what you have"
    )
    ex.extend_chain(1)
    assert ex.execute(c).ok
    ex.begin_turn()
    assert not ex.chain_exhausted and ex.execute(c).ok


def test_tool_exceptions_become_results(ws):
    policy = Policy(ws)

    def boom(x: str):
        raise ValueError("bad x")

    def fails(x: str):
        raise ToolRunError("no such thing")

    reg = ToolRegistry(
        [
            Tool("boom", "", {"type": "object", "properties": {"x": {"type": "string"}}}, boom),
            Tool("fails", "", {"type": "object", "properties": {"x": {"type": "string"}}}, fails),
            Tool("data", "", {}, lambda: {"a": [1, "é"]}),
            Tool("big", "", {}, lambda: "y" * 50),
        ]
    )
    ex = ToolExecutor(reg, policy, max_output=20)
    assert ex.execute(call("boom", x="1")).content == "boom failed: ValueError: bad x"
    assert ex.execute(call("fails", x="1")).content == "no such thing"
    assert ex.execute(call("data")).content == '{"a": [1, "é"]}'
    big = ex.execute(call("big"))
    assert big.truncated and big.content.startswith("y" * 10 + "\n<response clipped: 30 characters omitted")


def test_records_and_callback(ws):
    seen = []
    ex = make(ws, on_record=seen.append)
    ex.execute(call("read_file", path="a.txt"))
    ex.execute(call("read_file", path=".env"))
    assert [(r.name, r.status, r.decision, r.turn, r.round) for r in seen] == [
        ("read_file", "ok", "allow", 1, 1),
        ("read_file", "denied", "deny", 1, 2),
    ]
