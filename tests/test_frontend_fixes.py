"""What a new user hit in the front ends (issue 13, item 7): each fix, shown by the behaviour it changed.

The TUI's parts are in tests/tui/test_app.py and test_snapshots.py; the line REPL's in
tests/test_repl.py; the command line's here.
"""

from __future__ import annotations

import json
import os

import pytest

from flashmoe.cli import cli
from flashmoe.cli.store import Store
from tests.helpers.cli import run_cli

FAKE = ("--engine", "fake")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMOE_HOME", str(tmp_path / "home"))
    for var in [v for v in os.environ if v.startswith("FLASHMOE_") and v != "FLASHMOE_HOME"]:
        monkeypatch.delenv(var)
    return tmp_path / "home"


# -- a mistyped flag names the right one -------------------------------------------------------
@pytest.mark.parametrize(
    "argv,hint",
    [
        (["run", "--temperature", "0.7", "hi"], "--temperature: did you mean --temp?"),
        (["run", "--max-tokes=4", "hi"], "--max-tokes: did you mean --max-tokens?"),
        (["chat", "--no-tuii"], "--no-tuii: did you mean --no-tui?"),
        (["bench", "speed", "--rouns", "2"], "--rouns: did you mean --rounds?"),
    ],
)
def test_a_mistyped_flag_suggests_the_right_one(home, capsys, argv, hint):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"flashmoe {argv[0]}") and "unrecognized arguments" in last and last.endswith(f"({hint})")


def test_an_unknown_flag_with_nothing_near_says_only_that(home, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--xyzzy", "hi"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("unrecognized arguments: --xyzzy")


def test_the_suggestion_through_the_real_command_line(home):
    r = run_cli("run", *FAKE, "--temperature", "0.7", "hi")
    assert r.returncode == 2 and r.stdout == ""
    assert "did you mean --temp?" in r.stderr.strip().splitlines()[-1]


# -- out-of-range sampling values are refused --------------------------------------------------
@pytest.mark.parametrize(
    "flag,value,why",
    [
        ("--temp", "-1", "must be at least 0"),
        ("--temp", "nan", "must be at least 0"),
        ("--top-p", "0", "must be in (0, 1]"),
        ("--top-p", "1.5", "must be in (0, 1]"),
        ("--min-p", "-0.1", "must be in [0, 1]"),
        ("--min-p", "2", "must be in [0, 1]"),
        ("--repetition-penalty", "0", "must be greater than 0"),
        ("--repetition-penalty", "-1", "must be greater than 0"),
        ("--top-k", "-3", "must be at least 0"),
        ("--temp", "warm", "not a number"),
    ],
)
def test_out_of_range_sampling_flags_are_refused(home, capsys, flag, value, why):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", *FAKE, flag, value, "hi"])
    assert e.value.code == 2
    assert f"argument {flag}: {why}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--temp", "0"),
        ("--temp", "1.5"),
        ("--top-p", "1"),
        ("--min-p", "0"),
        ("--min-p", "1"),
        ("--repetition-penalty", "1.1"),
        ("--top-k", "0"),
    ],
)
def test_in_range_sampling_flags_are_taken(home, flag, value):
    args = cli.parse_args(cli.build_parser(), ["run", *FAKE, flag, value, "hi"])
    assert getattr(args, flag[2:].replace("-", "_")) == float(value)


@pytest.mark.parametrize("name,value", [("TEMP", "-1"), ("TOP_P", "0"), ("MIN_P", "1.5"), ("REPETITION_PENALTY", "0")])
def test_out_of_range_sampling_settings_in_the_environment_are_refused(home, name, value):
    r = run_cli("run", *FAKE, "hi", env={"FLASHMOE_HOME": str(home), f"FLASHMOE_{name}": value})
    assert r.returncode == 2 and r.stdout == ""
    assert f"FLASHMOE_{name}: {name.lower()} = '{value}' is not valid (must be" in r.stderr


def test_out_of_range_sampling_settings_in_the_config_file_are_refused(home):
    home.mkdir(parents=True)
    (home / "config.toml").write_text("temp = -0.5\n")
    r = run_cli("run", *FAKE, "hi", env={"FLASHMOE_HOME": str(home)})
    assert r.returncode == 2 and "temp = -0.5 is not valid (must be at least 0, got -0.5)" in r.stderr
    (home / "config.toml").write_text("temp = 0.7\ntop_p = 0.9\n")
    r = run_cli("run", *FAKE, "hi", env={"FLASHMOE_HOME": str(home), "FLASHMOE_FAKE_REPLIES": '["ok"]'})
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


# -- --json: no per-layer events unless --timing layer -----------------------------------------
@pytest.mark.parametrize("timing,layers", [(None, 0), ("step", 0), ("layer", 3)])
def test_json_has_layer_events_only_with_timing_layer(home, timing, layers):
    flags = ["--timing", timing] if timing else []
    r = run_cli(
        "run",
        *FAKE,
        "--json",
        *flags,
        "hi",
        env={"FLASHMOE_HOME": str(home), "FLASHMOE_FAKE_REPLIES": '["one two three"]'},
    )
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("token") == 3 and kinds[-1] == "done"
    assert kinds.count("layers") == layers


# -- info and verify without a model use the demo, as run does ---------------------------------
@pytest.mark.parametrize("command", ["info", "verify"])
def test_info_and_verify_without_a_model_use_the_demo(home, monkeypatch, model_factory, capsys, command):
    import flashmoe.engine.formats.demo

    model = model_factory("qwen3_moe", 4, converted=True)
    built = []

    def fake_demo(progress=None):  # what resolve_model calls to get (and if need be build) the demo
        built.append(progress)
        return model

    monkeypatch.setattr(flashmoe.engine.formats.demo, "ensure_demo", fake_demo)
    assert cli.main([command]) == 0
    out, err = capsys.readouterr()
    assert len(built) == 1 and built[0] is not None, "the demo is built with a progress bar, like run"
    if command == "info":
        assert f"model: {model}" in out
    else:
        assert f"{model}: all " in err and "match the manifest" in err
    built.clear()
    assert cli.main([command, str(model)]) == 0  # a model given: the demo is not looked at
    assert built == []


def test_info_without_a_model_describes_the_real_demo():
    """One real call: the session's demo (linked from the user's, else built once, ~30 s)."""
    from flashmoe.engine.formats.demo import demo_path

    r = run_cli("info", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["path"] == str(demo_path()) and d["model_type"] == "qwen2_moe" and d["experts"] == 16


# -- logs show: tool results are not the user's ------------------------------------------------
def test_logs_show_labels_tool_results(home, capsys):
    from flashmoe.cli.paths import logs_db

    home.mkdir(parents=True)
    store = Store(logs_db())
    cid = store.new_conversation("demo")
    store.add_message(cid, "user", "what is in notes.txt?")
    store.add_message(
        cid,
        "assistant",
        '<tool_call>{"name": "read_file"}</tool_call>',
        stats={"message": {"tool_calls": [{"name": "read_file"}]}},
    )
    store.add_message(cid, "tool", "buy milk", stats={"message": {"name": "read_file"}})
    store.add_message(cid, "user", "<tool_response>\nbuy milk\n</tool_response>")
    store.add_message(cid, "assistant", "It says: buy milk.")
    store.close()
    assert cli.main(["logs", "show", cid]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("[")]
    assert heads == ["[user]", "[assistant]", "[tool result: read_file]", "[tool result]", "[assistant]"]


# -- a resumed interrupted reply keeps its mark (/save; the TUI's boxes: tests/tui/test_app.py) ------
def test_save_of_a_resumed_conversation_keeps_the_marks(tmp_path):
    from flashmoe.engine.testing import FakeEngine
    from flashmoe.cli.chat import ChatSession

    store = Store(tmp_path / "logs.db")
    cid = store.new_conversation("fake")
    store.add_message(cid, "user", "first")
    store.add_message(cid, "assistant", "stopped half", interrupted=True)
    store.add_message(cid, "user", "second")
    store.add_message(cid, "assistant", "cut by a crash", interrupted=True, complete=False)
    store.add_message(cid, "user", "<tool_response>\nbuy milk\n</tool_response>")
    store.add_message(cid, "assistant", "whole")
    session = ChatSession(FakeEngine(["ok"]), store, cid=cid)
    assert [m["role"] for m in session.messages()] == ["user", "assistant"] * 3  # plain turns to the model
    text = session.save(tmp_path / "out.md").read_text()
    heads = [line for line in text.splitlines() if line.startswith("**")]
    assert heads == [
        "**user**",
        "**assistant** (interrupted)",
        "**user**",
        "**assistant** (incomplete)",
        "**tool result**",
        "**assistant**",
    ]
    # stopped in this process: marked too
    session.send("third")
    session.finish("half of it", None, interrupted=True)
    assert session.save(tmp_path / "out.md").read_text().rstrip().endswith("**assistant** (interrupted)\n\nhalf of it")


# -- the TUI draws fewer frames than Textual's default, unless the user says otherwise ----------
@pytest.mark.parametrize("given,expected", [(None, str(cli.TUI_FPS)), ("45", "45")])
def test_chat_caps_textual_frames_unless_the_user_set_them(monkeypatch, given, expected):
    """At Textual's 60 frames a second the redraws of a streaming reply took CPU from the engine
    (cli.TUI_FPS); cmd_chat sets TEXTUAL_FPS before textual is imported, never over the user's."""
    import types

    import flashmoe.cli.tui.app as tui_app

    seen = {}

    def run_tui(args):
        seen["fps"] = os.environ.get("TEXTUAL_FPS")
        return 0

    monkeypatch.setattr(tui_app, "run_tui", run_tui)
    monkeypatch.setenv("TEXTUAL_FPS", given or "")  # (so that the test's own setting is undone after it)
    if given is None:
        monkeypatch.delenv("TEXTUAL_FPS")
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setattr("sys.stdin", types.SimpleNamespace(isatty=lambda: True))
    monkeypatch.setattr("sys.stdout", types.SimpleNamespace(isatty=lambda: True))
    cli.cmd_chat(types.SimpleNamespace(no_tui=False))
    assert seen["fps"] == expected
