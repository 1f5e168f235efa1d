"""Conversations saved as they happen, resumed with -c / --cid, listed by `flashmoe logs`;
settings from defaults < config file < FLASHMOE_* < flags; exit codes; import hygiene."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashmoe.cli.store import Store
from tests.helpers.paths import ROOT
from tests.helpers.cli import run_cli

REPLY = "one two three four five six"


@pytest.fixture
def env(tmp_path):
    return {"FLASHMOE_HOME": str(tmp_path / "home"), "FLASHMOE_FAKE_REPLIES": json.dumps([REPLY])}


def fake(*args, env, input=None):
    return run_cli("run", "--engine", "fake", *args, env=env, input=input)


def test_run_saves_and_continue_resumes(env, tmp_path):
    assert fake("hello there", env=env).stdout.strip() == REPLY
    listing = run_cli("logs", env=env)
    assert listing.returncode == 0 and "hello there" in listing.stdout and " 2 msgs" in listing.stdout
    r = fake("-c", "and again", env=env)
    assert r.returncode == 0
    shown = json.loads(run_cli("logs", "show", "--json", env=env).stdout)
    assert [m["role"] for m in shown["messages"]] == ["user", "assistant", "user", "assistant"]
    assert shown["messages"][2]["content"] == "and again"
    assert shown["messages"][1]["stats"]["generation_tokens"] == 6
    cid = shown["conversation"]["id"]
    fake("a new one", env=env)
    fake("--cid", cid, "third turn", env=env)
    assert len(Store(tmp_path / "home" / "logs.db").messages(cid)) == 6


def test_no_log_and_bad_ids(env, tmp_path):
    fake("-n", "secret", env=env)
    assert "secret" not in run_cli("logs", env=env).stdout
    r = fake("--cid", "nope", "x", env=env)
    assert r.returncode == 2 and "no such conversation" in r.stderr
    r = run_cli("run", "--engine", "fake", "-c", "x", env=dict(env, FLASHMOE_HOME=str(tmp_path / "empty")))
    assert r.returncode == 2 and "no saved conversation" in r.stderr


def tokens(r) -> int:
    return sum(1 for line in r.stdout.splitlines() if json.loads(line)["event"] == "token")


def test_settings_precedence(env, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    assert tokens(fake("--json", "-n", "hi", env=env)) == 6  # default 512
    (home / "config.toml").write_text("max_tokens = 4\ntemp = 0.0\n")
    assert tokens(fake("--json", "-n", "hi", env=env)) == 4
    assert tokens(fake("--json", "-n", "hi", env=dict(env, FLASHMOE_MAX_TOKENS="3"))) == 3
    assert tokens(fake("--json", "-n", "--max-tokens", "2", "hi", env=dict(env, FLASHMOE_MAX_TOKENS="3"))) == 2


@pytest.mark.parametrize(
    "text,message",
    [
        ("max_tokens = ", "config.toml"),
        ("colour = 'red'", "unknown setting 'colour'"),
        ("max_tokens = 'many'", "max_tokens"),
    ],
)
def test_bad_config_is_a_usage_error(env, tmp_path, text, message):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").write_text(text)
    r = fake("hi", env=env)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_bad_environment_is_a_usage_error(env):
    r = fake("hi", env=dict(env, FLASHMOE_TEMP="hot"))
    assert r.returncode == 2 and "FLASHMOE_TEMP" in r.stderr
    r = fake("--prefetch", "hi", env=env)  # a mode is required: the prompt is not taken for one silently
    assert r.returncode == 2 and "--prefetch" in r.stderr and "Traceback" not in r.stderr
    r = fake("hi", env=dict(env, FLASHMOE_PREFETCH="always"))
    assert r.returncode == 2 and "FLASHMOE_PREFETCH" in r.stderr and "off, hint, slots" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("DTYPE", "fp8", "auto, float32, keep"),
        ("KERNELS", "gpu", "auto, mlx, cpu"),
        ("TIMING", "lots", "off, step, layer"),
        ("IO_THREADS", "0", "at least 1"),
        ("MAX_TOKENS", "1.5", "at least 1"),
        ("CACHE_POLICY", "mru", "lfu, lru"),
    ],
)
def test_every_setting_is_checked_before_loading(env, name, value, message):
    r = fake("hi", env=dict(env, **{"FLASHMOE_" + name: value}))
    assert r.returncode == 2 and "FLASHMOE_" + name in r.stderr and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not r.stdout


def test_generation_failure_exits_1(env):
    r = fake("hi", env=dict(env, FLASHMOE_FAKE_FAIL="the model fell over"))
    assert r.returncode == 1 and "the model fell over" in r.stderr and "Traceback" not in r.stderr


def test_timeout_exits_4_and_keeps_the_partial_reply(env):
    r = fake("--timeout", "0.6", "hi", env=dict(env, FLASHMOE_FAKE_DELAY="0.25"))
    assert r.returncode == 4 and "timed out" in r.stderr
    assert r.stdout.strip() and r.stdout.strip() != REPLY and REPLY.startswith(r.stdout.strip())


def test_flashmoe_home_relocates_state(env, tmp_path):
    fake("hello", env=env)
    assert (tmp_path / "home" / "logs.db").exists()
    assert run_cli("logs", "path", env=env).stdout.strip() == str(tmp_path / "home" / "logs.db")


def test_engine_never_imports_ui_packages():
    code = (
        "import sys, flashmoe.engine, flashmoe.engine.runtime.loader, flashmoe.engine.runtime.engine, "
        "flashmoe.engine.runtime.generate, flashmoe.engine.formats.convert, flashmoe.engine.testing; "
        "bad = [m for m in ('textual', 'prompt_toolkit', 'rich') if m in sys.modules]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_headless_start_up_does_not_import_textual(model_factory, tmp_path):
    model = model_factory("qwen3_moe", 4, converted=True)
    code = (
        "import sys; from flashmoe.cli.cli import main; "
        f"rc = main(['run', '-n', '-m', {str(model)!r}, '--max-tokens', '2', 'hi']); "
        "print('UI:', [m for m in ('textual', 'prompt_toolkit') if m in sys.modules]); sys.exit(rc)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "FLASHMOE_HOME": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr
    assert "UI: []" in r.stdout


def test_the_front_end_offers_what_the_engine_takes():
    """The flags offer the engine's own lists (flashmoe.engine.options, which --help and usage
    errors import without MLX), not copies that could drift apart."""
    from flashmoe.engine.experts.store import CACHE_POLICIES
    from flashmoe.engine.runtime.loader import PREFETCH_MODES
    from flashmoe.cli.config import CACHE_POLICY_CHOICES, PREFETCH_CHOICES

    assert set(CACHE_POLICY_CHOICES) == set(CACHE_POLICIES)
    assert set(PREFETCH_CHOICES) == set(PREFETCH_MODES)
    assert CACHE_POLICY_CHOICES is CACHE_POLICIES and PREFETCH_CHOICES is PREFETCH_MODES
