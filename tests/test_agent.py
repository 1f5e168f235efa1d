"""The tool loop in scripted sessions and headless runs, on the fake engine and the demo model."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import run_cli

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "notes.txt"}}\n</tool_call>'
SHELL = '<tool_call>\n{"name": "run_shell", "arguments": {"command": "rm -rf /"}}\n</tool_call>'
LOW_BIT = "<tool_call>\n{\\name\\: \\read_file\\, \\arguments\\: {\\path\\: \\notes.txt\\}}\n</tool_call>"


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("hello from the notes\n")
    (ws / ".env").write_text("SECRET=1\n")
    return ws


def agent(tmp_path, workspace, replies, script, *extra):
    (tmp_path / "s.jsonl").write_text("\n".join(json.dumps(t) for t in script) + "\n")
    env = {"FLASHMOE_HOME": str(tmp_path / "home"), "FLASHMOE_FAKE_REPLIES": json.dumps(replies)}
    r = run_cli(
        "agent",
        "--engine",
        "fake",
        "--tools",
        "builtin",
        "--workspace",
        workspace,
        "--script",
        tmp_path / "s.jsonl",
        "--transcript",
        tmp_path / "t.jsonl",
        *extra,
        env=env,
    )
    events = (
        [json.loads(l) for l in (tmp_path / "t.jsonl").read_text().splitlines()]
        if (tmp_path / "t.jsonl").exists()
        else []
    )
    return r, [e for e in events if e["event"] not in ("token", "layers", "step", "prefill")]


def test_scripted_session_transcript(tmp_path, workspace):
    r, events = agent(
        tmp_path,
        workspace,
        [CALL, "Your notes say hello."],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "notes?"}],
        "--approve",
        "auto",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "Your notes say hello."
    assert [e["event"] for e in events] == ["loaded", "user", "done", "tool_call", "tool_result", "done", "turn_end"]
    call, result = events[3], events[4]
    assert call == {
        "event": "tool_call",
        "name": "read_file",
        "arguments": {"path": "notes.txt"},
        "raw": CALL,
        "valid": True,
        "error": None,
        "kind": None,
        "status": "ok",
    }
    assert "flashmoe: tool call read_file: ok" in r.stderr
    assert result["ok"] and result["content"] == "hello from the notes\n"
    assert events[-1]["status"] == "done"


def test_low_bit_quoting_is_repaired_and_named(tmp_path, workspace):
    r, events = agent(tmp_path, workspace, [LOW_BIT, "ok"], [{"role": "user", "content": "notes?"}])
    assert r.returncode == 0, r.stderr
    result = next(e for e in events if e["event"] == "tool_result")
    assert "hello from the notes" in result["content"] and "double quotes" in result["content"]
    repair = next(e for e in events if e["event"] == "repair")
    assert repair["raw"] == LOW_BIT and "backslashes" in repair["message"]


def test_invalid_calls_get_bounded_repairs(tmp_path, workspace):
    bad = '<tool_call>\n{"name": "read_file", "arguments": {"file": "notes.txt"}}\n</tool_call>'
    r, events = agent(
        tmp_path, workspace, [bad, bad, bad, bad], [{"role": "user", "content": "notes?"}], "--max-repairs", "2"
    )
    assert r.returncode == 1
    calls = [e for e in events if e["event"] == "tool_call"]
    assert len(calls) == 3 and not any(c["valid"] for c in calls)  # 1 + 2 repairs, then it stops
    assert "$: 'path' is a required property" in next(e for e in events if e["event"] == "tool_result")["content"]
    assert events[-1]["status"] == "repairs-exhausted"


def test_shell_needs_approval_headless_fails_closed(tmp_path, workspace):
    env = {"FLASHMOE_HOME": str(tmp_path / "home"), "FLASHMOE_FAKE_REPLIES": json.dumps([SHELL, "done"])}
    r = run_cli("run", "--engine", "fake", "--tools", "builtin", "--workspace", workspace, "clean up", env=env)
    assert r.returncode == 5, r.stderr
    assert "approval" in r.stderr and "Traceback" not in r.stderr
    # --approve auto does not run commands either; --approve never declines and goes on
    r2, events = agent(
        tmp_path, workspace, [SHELL, "ok then"], [{"role": "user", "content": "x"}], "--approve", "never"
    )
    assert "declined" in next(e for e in events if e["event"] == "tool_result")["content"]
    assert r2.returncode == 5  # the session went on, but a call needed a yes and did not get one


def test_declined_and_failed_calls_are_never_reported_ok(tmp_path, workspace):
    missing = '<tool_call>\n{"name": "read_file", "arguments": {"path": "nope.txt"}}\n</tool_call>'
    r, events = agent(
        tmp_path, workspace, [SHELL, missing, "giving up"], [{"role": "user", "content": "x"}], "--approve", "never"
    )
    calls = [e for e in events if e["event"] == "tool_call"]
    assert [c["status"] for c in calls] == ["declined", "error"]
    assert [c["valid"] for c in calls] == [True, True]  # they parsed; they did not run
    assert " ok" not in r.stderr.replace("giving up", "")
    assert "flashmoe: tool call run_shell: declined" in r.stderr
    assert "flashmoe: tool call read_file: error" in r.stderr
    assert "1 tool call refused" in r.stderr and r.returncode == 5
    # headless run: the same words on stderr, and exit 5 when a call needed approval
    env = {"FLASHMOE_HOME": str(tmp_path / "home"), "FLASHMOE_FAKE_REPLIES": json.dumps([missing, "sorry"])}
    r = run_cli("run", "--engine", "fake", "--tools", "builtin", "--workspace", workspace, "x", env=env)
    assert r.returncode == 0 and "flashmoe: tool call read_file: error" in r.stderr, r.stderr
    assert " ok" not in r.stderr


def test_constrain_defaults_to_tools_when_tools_are_given():
    from flashmoe.cli.cli import build_parser

    for cmd in (
        ["run", "--tools", "builtin", "x"],
        ["agent", "--tools", "builtin", "--script", "s"],
        ["chat", "--tools", "builtin"],
    ):
        assert build_parser().parse_args(cmd).constrain == "tools"
    assert build_parser().parse_args(["run", "--tools", "builtin", "--constrain", "off", "x"]).constrain == "off"


def run_tools(tmp_path, workspace, replies, *extra, env=None):
    e = {"FLASHMOE_HOME": str(tmp_path / "home"), "FLASHMOE_FAKE_REPLIES": json.dumps(replies), **(env or {})}
    return run_cli("run", "--engine", "fake", "--tools", "builtin", "--workspace", workspace, *extra, "notes?", env=e)


def test_run_with_tools_json_gives_the_agents_events(tmp_path, workspace):
    r = run_tools(tmp_path, workspace, [CALL, "They say hello."], "--json")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]  # every line is JSON
    kinds = [e["event"] for e in events]
    assert kinds[0] == "loaded" and kinds[-1] == "turn_end"
    assert {"token", "tool_call", "tool_result", "done"} <= set(kinds)
    call = next(e for e in events if e["event"] == "tool_call")
    assert call["name"] == "read_file" and call["status"] == "ok"
    assert next(e for e in events if e["event"] == "tool_result")["content"] == "hello from the notes\n"
    assert events[-1]["status"] == "done"


def test_run_with_tools_prints_the_summary_line(tmp_path, workspace):
    r = run_tools(tmp_path, workspace, [CALL, "They say hello."])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "They say hello."
    lines = [l for l in r.stderr.splitlines() if "tok/s" in l]
    assert len(lines) == 2  # one per reply, with its conditions
    for needle in ("decode", "/token read", "hit rate", "K=4", "4-bit"):
        assert needle in lines[-1]
    assert "tok/s" not in run_tools(tmp_path, workspace, [CALL, "x"], "--timing", "off").stderr


def test_run_with_tools_timeout_exits_4(tmp_path, workspace):
    slow = "word " * 200
    r = run_tools(tmp_path, workspace, [CALL, slow], "--timeout", "1.5", env={"FLASHMOE_FAKE_DELAY": "0.05"})
    assert r.returncode == 4, r.stderr
    assert "timed out after 1.5 s" in r.stderr and "Traceback" not in r.stderr
    assert 0 < len(r.stdout.split()) < 200  # the partial answer is kept


def test_env_files_and_escapes_are_refused(tmp_path, workspace):
    calls = [
        '<tool_call>\n{"name": "read_file", "arguments": {"path": ".env"}}\n</tool_call>',
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "../outside.txt"}}\n</tool_call>',
        "ok",
    ]
    r, events = agent(tmp_path, workspace, calls, [{"role": "user", "content": "x"}], "--approve", "auto")
    results = [e for e in events if e["event"] == "tool_result"]
    assert [x["status"] for x in results] == ["denied", "denied"]
    assert "SECRET" not in json.dumps(events)


def test_chain_limit_stops_the_turn(tmp_path, workspace):
    r, events = agent(
        tmp_path, workspace, [CALL] * 10, [{"role": "user", "content": "x"}], "--approve", "auto", "--chain-limit", "3"
    )
    assert r.returncode == 1 and events[-1]["status"] == "chain-limit"
    assert sum(e["event"] == "tool_result" and e["ok"] for e in events) == 3


def test_bad_scripts_are_usage_errors(tmp_path, workspace):
    (tmp_path / "s.jsonl").write_text('{"role": "robot", "content": "x"}\n')
    r = run_cli("agent", "--engine", "fake", "--tools", "builtin", "--script", tmp_path / "s.jsonl")
    assert r.returncode == 2 and "line 1" in r.stderr
    r = run_cli("agent", "--engine", "fake", "--tools", "nonsense", "--script", tmp_path / "s.jsonl")
    assert r.returncode == 2


@pytest.mark.slow
def test_demo_model_session_with_required_calls_completes(tmp_path, workspace):
    """The real demo model, --constrain required, a read_file tool, a temporary workspace."""
    import os

    (tmp_path / "s.jsonl").write_text(json.dumps({"role": "user", "content": "What is in notes.txt?"}) + "\n")
    env = {} if os.environ.get("FLASHMOE_HOME") else {"FLASHMOE_HOME": str(tmp_path / "home")}
    r = run_cli(
        "agent",
        "--tools",
        "read_file",
        "--workspace",
        workspace,
        "--script",
        tmp_path / "s.jsonl",
        "--transcript",
        tmp_path / "t.jsonl",
        "--constrain",
        "required",
        "--max-tokens",
        "64",
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    events = [json.loads(l) for l in (tmp_path / "t.jsonl").read_text().splitlines()]
    calls = [e for e in events if e["event"] == "tool_call"]
    assert calls and calls[0]["valid"] and calls[0]["name"] == "read_file"
    assert events[-1] == {"event": "turn_end", "status": "done", "rounds": 1, "message": "", "exit_code": 0}


def test_bench_tools_reports_rates_and_failure_kinds(tmp_path):
    broken_envelope = "<tool_call>\n{\\name\\: \\list_dir\\, \\arguments\\: {}}\n</tool_call>"
    env = {
        "FLASHMOE_HOME": str(tmp_path / "home"),
        "FLASHMOE_FAKE_REPLIES": json.dumps([CALL, broken_envelope, "no tools for me"]),
    }
    r = run_cli("bench", "tools", "--engine", "fake", "--constrain-modes", "off", "--out", tmp_path / "b.json", env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "b.json").read_text())["results"][0]
    # 8 prompts cycle through: good call, low-bit call (repaired), no call
    assert res["prompts"] == 8 and res["valid_call_rate"] == pytest.approx(6 / 8)
    assert res["repair_rate"] == pytest.approx(3 / 8)
    assert res["failure_kinds"] == {"backslash-quotes": 3, "no-call": 2}
    # every call the model began (the low-bit one, run repaired, counts as not valid)
    assert res["started_calls"] == 6 and res["started_valid_rate"] == pytest.approx(3 / 6)
    assert res["mean_call_chars"] == pytest.approx((3 * len(CALL) + 3 * len(broken_envelope)) / 6)
    assert res["max_string_chars"] == len("notes.txt")
    line = r.stdout.strip().splitlines()[-1]
    for needle in (
        "valid calls 75%",
        "right tool",
        "started calls 6 (50% valid)",
        "mean call",
        "repaired 38%",
        "tok/s",
        "/token read",
        "hit rate",
        "4-bit",
        "K=4",
    ):
        assert needle in line, line
