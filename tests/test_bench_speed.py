"""`flashmoe bench speed` on a tiny streamed model: every figure with its conditions, JSON out."""
import json

import pytest

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def report(model_factory, tmp_path_factory):
    model = model_factory("qwen3_moe", 4, converted=True)
    out = tmp_path_factory.mktemp("bench") / "speed.json"
    r = run_cli("bench", "speed", "-m", model, "--tokens", 6, "--prompt-tokens", 8, "--expert-cache", "1",
                "--kernels", "cpu", "--out", out, timeout=300,
                env={"FLASHMOE_HOME": str(tmp_path_factory.mktemp("home"))})
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(out.read_text()), out


def test_prints_the_conditions_of_every_figure(report):
    stdout, result, _ = report
    assert "4-bit" in result["model_line"] and "K=" in result["model_line"] and "expert cache" in result["model_line"]
    assert "prefetch off" in result["model_line"]
    assert result["machine"] and result["disk"]["random_gbps"] > 0 and result["disk"]["sequential_gbps"] > 0
    lines = [line for line in stdout.splitlines() if line.startswith(("warm", "cold"))]
    assert [line.split()[0] for line in lines] == ["warm", "cold"]
    for line in lines:
        for what in ("prefill 8 tok", "decode 6 tok", "tok/s", "/token read (theory", "hit rate", "io wait",
                     "from the device"):
            assert what in line, (what, line)
    assert "disk limit" in lines[1]


def test_bytes_read_match_the_theory_and_cold_starts_empty(report):
    _, result, _ = report
    warm, cold = result["runs"]
    assert (warm["cache_state"], cold["cache_state"]) == ("warm", "cold")
    for run in (warm, cold):
        assert run["prompt_tokens"] == 8 and run["generated_tokens"] == 6
        assert 0 <= run["hit_rate"] < 1  # the cache holds K experts: some reads every token
        assert run["bytes_per_token"] > 0
        assert run["bytes_per_token"] == pytest.approx(run["theory_bytes_per_token"], rel=0.02)
        assert run["device_bytes_per_token"] is not None and run["device_bytes_per_token"] >= 0
    # the disk limit is the measured random-read rate over the bytes read per token
    assert cold["disk_limit_tps"] == pytest.approx(result["disk"]["random_gbps"] * 1e9 / cold["bytes_per_token"])


def test_json_is_written_whole(report):
    _, _, out = report
    assert not list(out.parent.glob("*.partial"))
