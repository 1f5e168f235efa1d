"""The expert usage file kept across runs, and preloading the hottest experts from it at start."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from flashmoe.engine import GenerationFinished, TokenGenerated
from flashmoe.engine.experts import usage
from flashmoe.engine.runtime.engine import Engine
from flashmoe.engine.runtime.generate import GenerationRequest
from flashmoe.engine.runtime.loader import load
from tests.helpers.cli import run_cli

CHAT = [{"role": "user", "content": "Tell me about café culture in Paris."}]


def _copy(model_factory, tmp_path, arch="qwen3_moe"):
    """A converted tiny MoE of the test's own: usage files land beside it."""
    return shutil.copytree(model_factory(arch, 4, converted=True), tmp_path / "model")


def _turn(path, **kw):
    eng = Engine(path, **kw)
    info = eng.wait_loaded()
    evs = list(eng.submit(GenerationRequest(messages=CHAT, max_tokens=16)))
    store = eng.loaded.store
    asked, steps, misses = store.asked.copy(), store.asked_steps, store.misses_total
    eng.close()
    done = evs[-1]
    assert isinstance(done, GenerationFinished), done
    return info, [e.id for e in evs if isinstance(e, TokenGenerated)], done, (asked, steps, misses)


# -- the file ------------------------------------------------------------------------------


def test_write_read_round_trip_and_older_runs_halve(tmp_path):
    path = tmp_path / usage.FILE
    a = np.array([[3.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    usage.write_usage(path, a, 10)
    counts, tokens = usage.read_usage(path, (2, 3))
    assert tokens == 10 and np.allclose(counts, a)
    b = np.array([[0.0, 4.0, 0.0], [1.0, 0.0, 0.0]])
    usage.write_usage(path, b, usage.HALF_LIFE_TOKENS)  # one half-life of new tokens: the old half
    counts, tokens = usage.read_usage(path, (2, 3))
    assert np.allclose(counts, a / 2 + b) and tokens == 5 + usage.HALF_LIFE_TOKENS
    assert [p.name for p in tmp_path.iterdir()] == [usage.FILE]  # no temporary left behind


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "not JSON"),
        ('{"format": 99, "tokens": 1, "counts": [[1]]}', "format 1"),
        ('{"format": 1, "tokens": 3, "counts": [[1, 2, 3]]}', "this model has 2 x 3"),
        ('{"format": 1, "tokens": 3, "counts": [[1, -2, 3], [0, 0, 0]]}', "at least 0"),
        ('{"format": 1, "counts": [[1, 2, 3], [0, 0, 0]]}', "bad counts or tokens"),
        ("[1, 2]", "format 1"),
    ],
)
def test_a_bad_usage_file_is_refused_naming_it(tmp_path, text, says):
    path = tmp_path / usage.FILE
    path.write_text(text)
    with pytest.raises(usage.UsageError) as e:
        usage.read_usage(path, (2, 3))
    assert str(path) in str(e.value) and says in str(e.value)
    usage.write_usage(path, np.ones((2, 3)), 4)  # a bad file is replaced, not merged
    assert usage.read_usage(path, (2, 3))[1] == 4


def test_a_folder_that_cannot_be_written_keeps_its_usage_under_flashmoe_home(tmp_path, monkeypatch):
    model = tmp_path / "some-model"
    model.mkdir()
    assert usage.usage_path(model) == model / usage.FILE
    monkeypatch.setattr(usage, "_writable", lambda folder: False)
    monkeypatch.setenv("FLASHMOE_HOME", str(tmp_path / "home"))
    where = usage.usage_path(model)
    assert where.parent == tmp_path / "home" / "usage" and where.name.startswith("some-model-")
    assert usage.usage_path(tmp_path / "other" / "some-model") != where  # the path, not the name, keys it


def test_hottest_orders_by_count_and_drops_unused():
    counts = np.array([[0.0, 5.0, 1.0], [7.0, 0.0, 2.0]])
    assert usage.hottest(counts, [3, 5]) == [(5, 0), (3, 1), (5, 2), (3, 2)]


# -- the engine ----------------------------------------------------------------------------


def test_usage_is_written_after_a_run_and_preloaded_by_the_next_with_the_same_tokens(model_factory, tmp_path):
    path = _copy(model_factory, tmp_path)
    info, cold_ids, cold, (asked, steps, cold_misses) = _turn(path, expert_usage=True)
    assert info.preloading == 0 and cold.cache_state == "cold"
    counts, tokens = usage.read_usage(path / usage.FILE, (asked.shape[0], asked.shape[1]))
    assert tokens == steps > 0 and np.allclose(counts, asked, atol=1e-3)  # every fetch counted, once

    info, warm_ids, warm, (_, _, warm_misses) = _turn(path, expert_usage=True)
    lm = load(path, load_tokenizer=False)
    experts = sum(l.num_experts for l in lm.layers)
    slots = lm.store.capacity_bytes // lm.layers[0].expert_bytes
    used = int((counts > 0).sum())
    assert info.preloading == min(used, slots - lm.top_k) > 0
    assert (
        info.usage_file == str(path / usage.FILE)
        and info.preloading_bytes == info.preloading * lm.layers[0].expert_bytes
    )
    assert warm.cache_state == "preloaded"
    assert warm_ids == cold_ids  # what the cache holds never changes the tokens
    # The cold turn read every expert it used on demand; the preloaded one only those the
    # preload left out (the default cache holds every expert here: nothing is evicted).
    assert slots == experts and cold_misses == used
    assert warm_misses == used - info.preloading
    _, off_ids, off, (_, _, off_misses) = _turn(path, expert_usage=False)
    assert off.cache_state == "cold" and off_misses == cold_misses and off_ids == cold_ids


def test_preload_leaves_room_and_a_small_cache_still_gives_the_same_tokens(model_factory, tmp_path):
    path = _copy(model_factory, tmp_path, "olmoe")
    _, ids, _, _ = _turn(path, expert_usage=True)
    lm = load(path, load_tokenizer=False)
    small = 6 * lm.layers[0].expert_bytes  # fewer slots than the run used experts
    info, small_ids, done, _ = _turn(path, expert_usage=True, expert_cache=small)
    assert info.preloading == 6 - lm.top_k  # top_k slots stay free for the first misses
    assert small_ids == ids and done.cache_state == "preloaded"


def test_preload_reads_are_checked_like_any_other(model_factory, tmp_path):
    """A flipped bit in an expert the usage file preloads is the same one-line load error."""
    path = _copy(model_factory, tmp_path)
    _turn(path, expert_usage=True)
    lm = load(path, load_tokenizer=False)
    counts, _ = usage.read_usage(path / usage.FILE, (len(lm.layers), lm.layers[0].num_experts))
    layer, expert = usage.hottest(counts, [l.layer for l in lm.layers])[0]
    info = next(l for l in lm.layers if l.layer == layer)
    ext = info.extents(lm.store.root, expert)[0]
    with open(ext.path, "r+b") as f:
        f.seek(ext.offset + 5)
        b = f.read(1)
        f.seek(ext.offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    eng = Engine(path, expert_usage=True)
    eng.wait_loaded()
    done = list(eng.submit(GenerationRequest(messages=CHAT, max_tokens=4)))[-1]
    eng.close()
    assert not isinstance(done, GenerationFinished)
    assert f"layer {layer} expert {expert}: checksum mismatch" in done.message


# -- the command line -----------------------------------------------------------------------


def test_cli_second_run_says_preloaded_and_a_bad_file_is_one_warning(model_factory, tmp_path):
    path = _copy(model_factory, tmp_path)
    env = {"FLASHMOE_EXPERT_USAGE": "on"}
    first = run_cli("run", "-m", path, "--max-tokens", "8", "hello", env=env)
    assert first.returncode == 0, first.stderr
    assert "cold expert cache" in first.stderr and (path / usage.FILE).is_file()
    second = run_cli("run", "-m", path, "--max-tokens", "8", "hello", env=env)
    assert second.returncode == 0, second.stderr
    assert "preloaded expert cache" in second.stderr and "from the usage file" in second.stderr
    assert second.stdout == first.stdout

    (path / usage.FILE).write_text("{garbage")
    third = run_cli("run", "-m", path, "--max-tokens", "8", "hello", env=env)
    assert third.returncode == 0, third.stderr
    warnings = [l for l in third.stderr.splitlines() if "warning" in l]
    assert len(warnings) == 1 and str(path / usage.FILE) in warnings[0] and "not JSON" in warnings[0]
    assert "Traceback" not in third.stderr and "cold expert cache" in third.stderr
    assert json.loads((path / usage.FILE).read_text())["format"] == usage.FORMAT  # rewritten

    off = run_cli("run", "-m", path, "--max-tokens", "8", "--expert-usage", "off", "hello", env=env)
    assert off.returncode == 0 and "cold expert cache" in off.stderr


def test_benchmarks_that_measure_cold_caches_take_no_usage_flag():
    r = run_cli("bench", "speed", "--expert-usage", "on")
    assert r.returncode == 2 and "--expert-usage" in r.stderr
