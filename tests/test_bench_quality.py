"""bench quality: perplexity and KL from a reference per model and K, with what each costs."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.cli import run_cli


def test_bench_quality_table(model_factory, tmp_path):
    four = model_factory("qwen3_moe", 4, converted=True)
    eight = model_factory("qwen3_moe", 8, converted=True)
    text = tmp_path / "text.txt"
    text.write_text("a stream of words that the tiny model scores, one window at a time. " * 30)
    tools = tmp_path / "tools.json"  # what `bench tools --out` writes, for the 8-bit model at K=1
    tools.write_text(
        json.dumps({"results": [{"model": str(eight), "top_k": 1, "constrain": "tools", "valid_call_rate": 0.25}]})
    )
    out = tmp_path / "quality.json"
    r = run_cli(
        "bench",
        "quality",
        "-m",
        eight,
        "-m",
        four,
        "--experts-per-token",
        "2,1",
        "--text",
        text,
        "--tokens",
        "600",
        "--expert-cache",
        "0",
        "--tools",
        tools,
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["tokens"] == 600 and "K=2" in result["reference"]
    rows = {(row["bits"], row["k"]): row for row in result["rows"]}
    assert set(rows) == {(8, 2), (8, 1), (4, 2), (4, 1)}
    assert rows[8, 2]["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference against itself
    assert rows[8, 2]["perplexity"] == pytest.approx(result["reference_scores"]["perplexity"])
    for row in result["rows"]:
        assert row["perplexity"] == pytest.approx(math.exp(-row["mean_logprob"]))
    assert rows[8, 1]["kl"] > 1e-4 and rows[4, 2]["kl"] > 1e-6  # fewer experts, fewer bits: they differ
    # nothing cached: each token reads K experts per layer in every window's prefill, at most
    assert rows[8, 1]["bytes_per_token"] < rows[8, 2]["bytes_per_token"]
    assert rows[4, 2]["bytes_per_token"] < rows[8, 2]["bytes_per_token"]
    assert rows[8, 1]["valid_calls"] == {"tools": 0.25} and rows[8, 2]["valid_calls"] == {}
    assert "1 of 2" in r.stdout and "25% (tools)" in r.stdout


def test_bench_quality_bad_input(model_factory, tmp_path):
    packed = model_factory("qwen3_moe", 4, converted=True)
    bad = tmp_path / "tools.json"
    bad.write_text("{not json")
    r = run_cli("bench", "quality", "-m", packed, "--tools", bad)
    assert r.returncode == 2 and f"--tools {bad}" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("bench", "quality", "-m", packed, "--prefetch", "slots")
    assert r.returncode == 2 and "--prefetch slots" in r.stderr
