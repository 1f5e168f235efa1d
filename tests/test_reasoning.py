"""Reasoning is state, not text: a prompt that ends inside an open reasoning block starts the reply
inside it, a call written there is never run, and every face shows the answer apart from it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from flashmoe.engine.runtime.reasoning import open_reasoning, prompt_reasoning, thinking_kwargs, thinking_switch
from tests.helpers.cli import run_cli
from tests.helpers.repl import CTRL_D, ENTER, drive
from tests.helpers.repl import private_home  # noqa: F401 (the autouse fixture `home`: a FLASHMOE_HOME per test)
from tests.helpers.templates import XML_READ, XML_WRITE, deepseek_r1_template, qwen35_template


def render(template: str, messages, gen: bool, **kw) -> str:
    from flashmoe.engine.runtime.tokenizer import _make_environment

    return (
        _make_environment()
        .from_string(template)
        .render(messages=messages, add_generation_prompt=gen, bos_token="", eos_token="", **kw)
    )


USER = [{"role": "user", "content": "hi"}]


# -- deciding from the rendered prompt -----------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, opened",
    [
        ("<|im_start|>assistant\n<think>\n", "<think>"),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", ""),
        ("<｜Assistant｜><think>\n", "<think>"),
        ("<｜Assistant｜></think>", ""),
        ("[INST]q[/INST][THINK]", "[THINK]"),
        ("[THINK]a[/THINK]answer", ""),
        ("<think>old</think> then <|channel>thought", "<|channel>thought"),
        ("<|open|>think<|sep|>", "<|open|>think<|sep|>"),
        ("plain", ""),
    ],
)
def test_open_reasoning(prompt, opened):
    assert open_reasoning(prompt) == opened


def test_only_the_generation_prompt_counts():
    """A system prompt that mentions <think> without closing it opens nothing."""
    bare = "<|im_start|>system\nWrite <think> first.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert prompt_reasoning(bare + "<|im_start|>assistant\n", bare) == ""
    assert prompt_reasoning(bare + "<|im_start|>assistant\n<think>\n", bare) == "<think>"


def test_real_templates_open_reasoning_when_thinking_is_on():
    q = qwen35_template()
    assert prompt_reasoning(render(q, USER, True), render(q, USER, False)) == "<think>"
    off = {"enable_thinking": False}
    assert prompt_reasoning(render(q, USER, True, **off), render(q, USER, False, **off)) == ""
    r1 = deepseek_r1_template()
    assert prompt_reasoning(render(r1, USER, True), render(r1, USER, False)) == "<think>"


def test_engine_reports_the_open_block(tmp_path):
    """engine.generate renders the prompt and says which reasoning block it leaves open."""
    from flashmoe.engine.runtime.generate import GenerationRequest, render_prompt_text
    from flashmoe.engine.runtime.tokenizer import Tokenizer, _make_environment
    from tests.tiny_tokenizer import build_tiny_tokenizer

    tok = Tokenizer(
        build_tiny_tokenizer(), chat_templates={"default": _make_environment().from_string(qwen35_template())}
    )
    loaded = SimpleNamespace(tokenizer=tok)
    ids, opened = render_prompt_text(loaded, GenerationRequest(messages=USER))
    assert ids and opened == "<think>"
    _, opened = render_prompt_text(loaded, GenerationRequest(messages=USER, template_kwargs={"enable_thinking": False}))
    assert opened == ""
    assert render_prompt_text(loaded, GenerationRequest(prompt="x [THINK] y"))[1] == "[THINK]"


def test_thinking_switch_names():
    assert thinking_switch(qwen35_template()) == "enable_thinking"
    assert thinking_switch("{% if thinking %}<think>{% else %}</think>{% endif %}") == "thinking"
    assert thinking_switch(deepseek_r1_template()) is None
    assert thinking_kwargs("off", qwen35_template()) == {"enable_thinking": False}
    assert thinking_kwargs(None, qwen35_template()) == {}
    with pytest.raises(ValueError):
        thinking_kwargs("maybe", "")


# -- end to end through the agent loop --------------------------------------------------------------
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def ds_call(name: str, args: dict) -> str:
    return f"{B}{CB}function{SEP}{name}\n```json\n{json.dumps(args)}\n```{CE}{E}"


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("hello from the notes\n")
    return ws


def agent(tmp_path, workspace, template: str, replies, *extra):
    (tmp_path / "t.jinja").write_text(template)
    (tmp_path / "s.jsonl").write_text(json.dumps({"role": "user", "content": "notes?"}) + "\n")
    env = {
        "FLASHMOE_HOME": str(tmp_path / "home"),
        "FLASHMOE_FAKE_REPLIES": json.dumps(replies),
        "FLASHMOE_FAKE_TEMPLATE": str(tmp_path / "t.jinja"),
    }
    r = run_cli(
        "agent",
        "--engine",
        "fake",
        "--tools",
        "builtin",
        "--workspace",
        workspace,
        "--approve",
        "auto",
        "--script",
        tmp_path / "s.jsonl",
        "--transcript",
        tmp_path / "t.jsonl",
        *extra,
        env=env,
    )
    events = [json.loads(l) for l in (tmp_path / "t.jsonl").read_text().splitlines()]
    return r, events


# The follow-up reply reads the tool result. Qwen3.5's template opens <think> again after a tool
# turn; DeepSeek's renders the results natively and adds no assistant prompt after them, so the
# model opens its own reasoning there.
@pytest.mark.parametrize(
    "template, reply, follow_up",
    [
        (
            qwen35_template,
            f"I could write it: {XML_WRITE} but reading is enough.\n</think>\n\n{XML_READ}",
            "Got it.</think>Your notes say hello.",
        ),
        (
            deepseek_r1_template,
            "Maybe "
            + ds_call("write_file", {"path": "x.txt", "content": "no"})
            + " no.</think>Reading."
            + ds_call("read_file", {"path": "notes.txt"}),
            "<think>Got it.</think>Your notes say hello.",
        ),
    ],
    ids=["qwen3.5", "deepseek-r1"],
)
def test_call_inside_preopened_reasoning_is_not_run(tmp_path, workspace, template, reply, follow_up):
    r, events = agent(tmp_path, workspace, template(), [reply, follow_up])
    assert r.returncode == 0, r.stderr
    calls = [e for e in events if e["event"] == "tool_call"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("read_file", {"path": "notes.txt"})]
    assert not (workspace / "x.txt").exists()
    assert [e["status"] for e in events if e["event"] == "turn_end"] == ["done"]
    assert "".join(r.stdout.split()) in ("Reading.Yournotessayhello.", "Yournotessayhello.")
    assert [e["reasoning"] for e in events if e["event"] == "prefill"][:1] == ["<think>"]


def test_reply_cut_off_inside_reasoning_ends_cleanly(tmp_path, workspace):
    r, events = agent(
        tmp_path, workspace, qwen35_template(), ["Let me " + XML_READ + " think more and more"], "--max-tokens", "6"
    )
    assert r.returncode == 0, r.stderr
    assert not [e for e in events if e["event"] == "tool_call"]
    end = [e for e in events if e["event"] == "turn_end"]
    assert end[0]["status"] == "done" and "ended inside its reasoning" in end[0]["message"]
    assert "ended inside its reasoning" in r.stderr
    assert r.stdout.strip() == ""


def test_thinking_off_closes_the_block(tmp_path, workspace):
    """--thinking off: the Qwen3.5 template closes <think> itself, so the reply's call is a call."""
    r, events = agent(tmp_path, workspace, qwen35_template(), [XML_READ, "ok"], "--thinking", "off")
    assert r.returncode == 0, r.stderr
    assert [e["name"] for e in events if e["event"] == "tool_call"] == ["read_file"]
    assert [e["reasoning"] for e in events if e["event"] == "prefill"][:1] == [""]


def test_thinking_without_a_switch_says_so(tmp_path, workspace):
    r, _ = agent(tmp_path, workspace, deepseek_r1_template(), ["ok"], "--thinking", "off")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stderr.splitlines() if "no thinking switch" in l]
    assert len(lines) == 1, r.stderr


def test_unknown_thinking_value_is_a_usage_error(tmp_path):
    r = run_cli("run", "--engine", "fake", "--thinking", "maybe", "hi", env={"FLASHMOE_HOME": str(tmp_path / "h")})
    assert r.returncode == 2 and "--thinking" in r.stderr
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.toml").write_text('thinking = "sometimes"\n')
    r = run_cli("run", "--engine", "fake", "hi", env={"FLASHMOE_HOME": str(tmp_path / "h")})
    assert r.returncode == 2 and "thinking" in r.stderr


# -- headless ---------------------------------------------------------------------------------------
def run_fake(tmp_path, replies, *args, template: str | None = None):
    env = {"FLASHMOE_HOME": str(tmp_path / "home"), "FLASHMOE_FAKE_REPLIES": json.dumps(replies)}
    if template is not None:
        (tmp_path / "t.jinja").write_text(template)
        env["FLASHMOE_FAKE_TEMPLATE"] = str(tmp_path / "t.jinja")
    return run_cli("run", "--engine", "fake", "-n", *args, "hi", env=env)


def test_run_prints_the_answer_only(tmp_path):
    r = run_fake(tmp_path, ["weighing it up </think>\n\nParis."], template=qwen35_template())
    assert r.returncode == 0, r.stderr
    assert r.stdout == "\n\nParis.\n"
    r = run_fake(tmp_path, ["<think>hm</think>Paris."])  # written by the model, no template
    assert r.stdout == "Paris.\n"


def test_run_show_reasoning(tmp_path):
    r = run_fake(tmp_path, ["weighing it up</think>Paris."], "--show-reasoning", template=qwen35_template())
    assert r.returncode == 0, r.stderr
    assert r.stdout == "<think>\nweighing it up\n</think>\n\nParis.\n"


def test_run_json_reasoning_events(tmp_path):
    r = run_fake(tmp_path, ["weighing it up</think>Paris."], "--json", template=qwen35_template())
    assert r.returncode == 0, r.stderr
    events = [json.loads(l) for l in r.stdout.splitlines()]
    reasoning = "".join(e["text"] for e in events if e["event"] == "reasoning")
    answer = "".join(e["text"] for e in events if e["event"] == "token")
    assert reasoning.strip() == "weighing it up" and answer.strip() == "Paris."
    assert events[-1]["event"] == "done"


def test_run_cut_off_inside_reasoning_says_so(tmp_path):
    r = run_fake(tmp_path, ["one two three four five six"], "--max-tokens", "3", template=qwen35_template())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""
    assert "ended inside its reasoning" in r.stderr and "max-tokens" in r.stderr


# -- the line REPL ------------------------------------------------------------------------------------


def test_repl_sets_reasoning_apart_and_switches_thinking():
    from flashmoe.engine.testing import FakeEngine

    engine = FakeEngine(["weighing</think>Paris.", "Lyon."], chat_template=qwen35_template())
    t = drive("hi" + ENTER + "/thinking off" + ENTER + "again" + ENTER + "/thinking maybe" + ENTER + CTRL_D, engine)
    assert t.code == 0, t
    assert t.out.startswith("<think>\nweighing\n</think>\n\nParis.\n"), t
    assert "Lyon." in t.out and "thinking off from the next reply" in t.err and "usage: /thinking on|off" in t.err
    assert [r.template_kwargs for r in engine.requests] == [{}, {"enable_thinking": False}]


def test_repl_dims_reasoning_on_a_terminal():
    import io

    from flashmoe.cli.repl import LineRepl
    from flashmoe.tools.textstate import Segment

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    repl = SimpleNamespace(out=out, _dim=False, write=out.write)
    LineRepl.show(repl, [Segment("reasoning", "hm"), Segment("text", "Paris.")], end=True)
    assert out.getvalue() == "\x1b[2mhm\x1b[0m\n\nParis."


def test_run_tools_answer_only_and_cut_note(tmp_path, workspace):
    (tmp_path / "t.jinja").write_text(qwen35_template())
    env = {
        "FLASHMOE_HOME": str(tmp_path / "home"),
        "FLASHMOE_FAKE_TEMPLATE": str(tmp_path / "t.jinja"),
        "FLASHMOE_FAKE_REPLIES": json.dumps([f"maybe {XML_READ}</think>\n\nNo call needed."]),
    }
    base = ("run", "--engine", "fake", "-n", "--tools", "builtin", "--workspace", workspace)
    r = run_cli(*base, "hi", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "No call needed." and "tool call" not in r.stderr
    r = run_cli(*base, "--show-reasoning", "hi", env=env)
    assert r.stdout.startswith("<think>\nmaybe <tool_call>") and r.stdout.rstrip().endswith("No call needed.")
    r = run_cli(*base, "--json", "hi", env=env)
    events = [json.loads(l) for l in r.stdout.splitlines()]
    assert "".join(e["text"] for e in events if e["event"] == "reasoning").startswith("maybe <tool_call>")
    r = run_cli(*base, "--max-tokens", "3", "hi", env=env)
    assert r.returncode == 0 and "ended inside its reasoning" in r.stderr, r.stderr
